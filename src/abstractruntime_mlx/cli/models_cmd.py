"""``abstractruntime-mlx models``: download, list and build models.

    abstractruntime-mlx models download NAME [--head NAME] [--revision REV]
    abstractruntime-mlx models list [--cache-dir DIR]
    abstractruntime-mlx models path NAME [--cache-dir DIR]
    abstractruntime-mlx models tiny PATH --kind dense|hybrid-mtp|vision|dense-long|hybrid-companion [--seed N] [--force]

Downloads use ``huggingface_hub.snapshot_download`` (its own progress bars); everything else
is offline.
"""

from __future__ import annotations

import argparse
import json
from typing import TypedDict

from .. import artifacts
from ..errors import ModelNotFound, UpstreamError
from .args import help_handler, integer

TINY_KINDS = ("dense", "hybrid-mtp", "vision", "dense-long", "hybrid-companion")


class CachedModel(TypedDict):
    """One model of the Hugging Face cache, as ``models list`` prints it."""

    name: str
    size_on_disk: int
    path: str | None  # the newest revision's snapshot
    revisions: list[str]  # newest first
    refs: list[str]


def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser("models", help="download, list or build models")
    parser.set_defaults(handler=help_handler(parser))
    actions = parser.add_subparsers(dest="models_command", metavar="ACTION")

    download = actions.add_parser("download", help="download a model (and optionally its MTP head) from the hub")
    download.add_argument("name", help="Hugging Face repo id, e.g. mlx-community/Qwen3.5-4B-4bit")
    download.add_argument("--head", default=None, help="companion MTP head repo id to download as well")
    download.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    download.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    download.set_defaults(handler=_download)

    listing = actions.add_parser("list", help="list the models in the Hugging Face cache (JSON)")
    listing.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    listing.set_defaults(handler=_list)

    where = actions.add_parser("path", help="print the local directory of a model (offline)")
    where.add_argument("name", help="a local directory or a cached Hugging Face repo id")
    where.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    where.set_defaults(handler=_path)

    tiny = actions.add_parser("tiny", help="build a tiny random-weight model for tests and demos")
    tiny.add_argument("path", help="output directory")
    tiny.add_argument("--kind", required=True, choices=TINY_KINDS)
    tiny.add_argument("--seed", type=integer, default=0)
    tiny.add_argument("--force", action="store_true", help="replace a non-empty directory (default: refuse it)")
    tiny.set_defaults(handler=_tiny)


def _download(args: argparse.Namespace) -> int:
    for name in [args.name] + ([args.head] if args.head else []):
        path = _snapshot_download(name, revision=args.revision if name == args.name else None, cache_dir=args.cache_dir)
        print(f"{name}: {path}")
    return 0


def _snapshot_download(name: str, *, revision: str | None, cache_dir: str | None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return str(snapshot_download(name, revision=revision, cache_dir=cache_dir))
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as exc:
        raise ModelNotFound(f"{name} is not a model on the Hugging Face hub: {exc}", details={"model": name}) from exc
    except GatedRepoError as exc:
        raise UpstreamError(f"{name} is gated; log in with `hf auth login` and accept its terms: {exc}") from exc
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise UpstreamError(f"downloading {name} failed: {exc}") from exc


def _list(args: argparse.Namespace) -> int:
    print(json.dumps(list_cached_models(cache_dir=args.cache_dir), indent=2))
    return 0


def list_cached_models(*, cache_dir: str | None = None) -> list[CachedModel]:
    """Cached hub models (empty when the cache directory does not exist)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
    except CacheNotFound:
        return []
    rows: list[CachedModel] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revisions = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        rows.append(
            {
                "name": repo.repo_id,
                "size_on_disk": repo.size_on_disk,
                "path": str(revisions[0].snapshot_path) if revisions else None,
                "revisions": [r.commit_hash for r in revisions],
                "refs": sorted(ref for r in revisions for ref in r.refs),
            }
        )
    return rows


def _path(args: argparse.Namespace) -> int:
    print(artifacts.resolve_model_path(args.name, cache_dir=args.cache_dir))
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from ..testing.tiny import build_from_cli

    result = build_from_cli(args.path, args.kind, args.seed, force=args.force)
    print(result if result is not None else args.path)
    return 0
