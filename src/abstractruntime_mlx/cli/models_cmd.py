"""``abstractruntime-mlx models``: download, list, remove and build models.

    abstractruntime-mlx models download NAME [--head NAME] [--revision REV]
    abstractruntime-mlx models list [--dir DIR ...] [--cache-dir DIR] [--json]
    abstractruntime-mlx models rm NAME [--dir DIR ...] [--cache-dir DIR] [--yes]
    abstractruntime-mlx models path NAME [--cache-dir DIR]
    abstractruntime-mlx models tiny PATH --kind dense|hybrid-mtp|vision|dense-long|hybrid-companion [--seed N] [--force]

``list`` shows the Hugging Face cache's models and the model folders under each ``--dir``
(and ``$ABSTRACTRUNTIME_MLX_MODEL_DIRS``, ``os.pathsep``-separated), with size and kind, as
a table (``--json``: one object per model). ``rm`` removes a cached model (every revision,
through ``huggingface_hub``'s cache deletion) or a local model folder, after confirmation
(``--yes``, or ``y`` at the prompt on a terminal). Downloads use
``huggingface_hub.snapshot_download`` (its own progress bars); everything else is offline.
Failures are one line (``error: [code] message``), as every command's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final, Literal, TypedDict

from .. import artifacts
from ..errors import InvalidRequest, ModelNotFound, UpstreamError
from .args import help_handler, integer
from .terminal import printable

TINY_KINDS = ("dense", "hybrid-mtp", "vision", "dense-long", "hybrid-companion")
MODEL_DIRS_ENV: Final = "ABSTRACTRUNTIME_MLX_MODEL_DIRS"

ModelKind = Literal["text", "text+mtp", "vision", "vision+mtp", "mtp-head", "not-a-model"]


class CachedModel(TypedDict):
    """One model of the Hugging Face cache, as ``models list --json`` prints it."""

    name: str
    source: Literal["hf-cache"]
    kind: ModelKind
    size_on_disk: int
    path: str | None  # the newest revision's snapshot
    revisions: list[str]  # newest first
    refs: list[str]


class LocalModel(TypedDict):
    """One model folder under a ``--dir``, as ``models list --json`` prints it."""

    name: str  # its path relative to the --dir it was found in
    source: Literal["local"]
    kind: ModelKind
    size_on_disk: int
    path: str


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("models", help="download, list, remove or build models")
    parser.set_defaults(handler=help_handler(parser))
    actions = parser.add_subparsers(dest="models_command", metavar="ACTION")

    download = actions.add_parser("download", help="download a model (and optionally its MTP head) from the hub")
    download.add_argument("name", help="Hugging Face repo id, e.g. mlx-community/Qwen3.5-4B-4bit")
    download.add_argument("--head", default=None, help="companion MTP head repo id to download as well")
    download.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    download.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    download.set_defaults(handler=_download)

    listing = actions.add_parser("list", help="list the cached and local models with size and kind")
    listing.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    listing.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="DIR",
        help=f"a folder of model folders (repeatable; also ${MODEL_DIRS_ENV})",
    )
    listing.add_argument("--json", action="store_true", help="one JSON object per model instead of the table")
    listing.set_defaults(handler=_list)

    remove = actions.add_parser("rm", help="remove a cached model (every revision) or a local model folder")
    remove.add_argument("name", help="a cached repo id, a model folder's name under a --dir, or its path")
    remove.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    remove.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="DIR",
        help=f"a folder of model folders (repeatable; also ${MODEL_DIRS_ENV})",
    )
    remove.add_argument("--yes", action="store_true", help="remove without asking")
    remove.set_defaults(handler=_rm)

    where = actions.add_parser("path", help="print the local directory of a model (offline)")
    where.add_argument("name", help="a local directory or a cached Hugging Face repo id")
    where.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    where.add_argument("--json", action="store_true", help='print {"name": ..., "path": ...}')
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
        raise ModelNotFound(
            f"{name} is not a model on the Hugging Face hub: {_first_line(exc)}", details={"model": name}
        ) from exc
    except GatedRepoError as exc:
        raise UpstreamError(
            f"{name} is gated; log in with `hf auth login` and accept its terms ({_first_line(exc)})"
        ) from exc
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as exc:
        raise UpstreamError(f"downloading {name} failed: {_first_line(exc)}") from exc


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of what the hub library says (its messages add request ids and hints)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _list(args: argparse.Namespace) -> int:
    rows: list[CachedModel | LocalModel] = [
        *list_cached_models(cache_dir=args.cache_dir),
        *list_local_models(model_dirs(args.dir)),
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        _print_table(rows)
    return 0


def model_dirs(given: Iterable[str], environ: Mapping[str, str] = os.environ) -> list[Path]:
    """The ``--dir`` folders, then those of ``$ABSTRACTRUNTIME_MLX_MODEL_DIRS``; each must exist."""
    named = [*given, *(p for p in environ.get(MODEL_DIRS_ENV, "").split(os.pathsep) if p.strip())]
    out: list[Path] = []
    for name in named:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise InvalidRequest(f"--dir {name!r} is not a directory", details={"field": "--dir"})
        if path.resolve() not in out:
            out.append(path.resolve())
    return out


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
        newest = revisions[0].snapshot_path if revisions else None
        rows.append(
            {
                "name": repo.repo_id,
                "source": "hf-cache",
                "kind": model_kind(newest) if newest is not None else "not-a-model",
                "size_on_disk": repo.size_on_disk,
                "path": str(newest) if newest is not None else None,
                "revisions": [r.commit_hash for r in revisions],
                "refs": sorted(ref for r in revisions for ref in r.refs),
            }
        )
    return rows


def list_local_models(dirs: Iterable[Path]) -> list[LocalModel]:
    """The model folders in ``dirs``: each one itself when it is a model, else its children and
    grandchildren that are (``org/name`` layouts, as LM Studio keeps them)."""
    rows: list[LocalModel] = []
    for root in dirs:
        for folder in _model_folders(root):
            rows.append(
                {
                    "name": folder.name if folder == root else str(folder.relative_to(root)),
                    "source": "local",
                    "kind": model_kind(folder),
                    "size_on_disk": _folder_bytes(folder),
                    "path": str(folder),
                }
            )
    return rows


def _is_model_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / "config.json").is_file()


def _model_folders(root: Path) -> list[Path]:
    if _is_model_folder(root):
        return [root]
    found: list[Path] = []
    for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if _is_model_folder(child):
            found.append(child)
        else:
            found.extend(sorted(g for g in child.iterdir() if _is_model_folder(g)))
    return found


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def model_kind(path: Path) -> ModelKind:
    """What a checkpoint folder holds, from its config and weight headers (no tensor is read)."""
    try:
        config = artifacts.read_config(path)
    except InvalidRequest:
        return "not-a-model"
    if config is None:
        return "not-a-model"
    kind = artifacts.model_type(config) or ""
    if kind.endswith(artifacts.HEAD_MODEL_TYPE_SUFFIX):
        return "mtp-head"
    vision = "vision_config" in config
    try:
        mtp = bool(artifacts.detect_mtp(path)["embedded"])
    except InvalidRequest:
        mtp = False
    if vision:
        return "vision+mtp" if mtp else "vision"
    return "text+mtp" if mtp else "text"


def _print_table(rows: list[CachedModel | LocalModel]) -> None:
    from rich.console import Console
    from rich.table import Table

    if not rows:
        print("no models: none in the Hugging Face cache, and no --dir given (models download NAME fetches one)")
        return
    table = Table(box=None, pad_edge=False)
    for column, justify in (
        ("NAME", "left"),
        ("KIND", "left"),
        ("SIZE", "right"),
        ("SOURCE", "left"),
        ("PATH", "left"),
    ):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(
            printable(row["name"]),
            row["kind"],
            _human(row["size_on_disk"]),
            row["source"],
            printable(row["path"] or ""),
        )
    # Piped or redirected, lines are as long as their paths (a terminal's width would cut them).
    width = None if sys.stdout.isatty() else 100_000
    Console(file=sys.stdout, highlight=False, width=width).print(table)


def _human(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def _rm(args: argparse.Namespace) -> int:
    target = find_removable(args.name, cache_dir=args.cache_dir, dirs=model_dirs(args.dir))
    what = f"{target.name} ({_human(target.size_on_disk)}, {target.path})"
    if not args.yes and not _confirmed(f"remove {what}? [y/N] "):
        raise InvalidRequest(f"not removed: {what}; pass --yes to remove it", details={"field": "--yes"})
    target.remove()
    print(f"removed {printable(what)}")
    return 0


class Removable:
    """A model ``models rm`` can remove: a whole cached repo, or a local model folder."""

    def __init__(self, name: str, path: str, size_on_disk: int, *, cache_dir: str | None = None, cached: bool) -> None:
        self.name = name
        self.path = path
        self.size_on_disk = size_on_disk
        self._cache_dir = cache_dir
        self._cached = cached

    def remove(self) -> None:
        if not self._cached:
            shutil.rmtree(self.path)
            return
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(self._cache_dir)
        hashes = [
            r.commit_hash
            for repo in info.repos
            if repo.repo_id == self.name and repo.repo_type == "model"
            for r in repo.revisions
        ]
        info.delete_revisions(*hashes).execute()
        repo_dir = Path(self.path)
        if repo_dir.is_dir():  # a repo with no revision left keeps only empty refs: drop it too
            shutil.rmtree(repo_dir)


def find_removable(name: str, *, cache_dir: str | None, dirs: Iterable[Path]) -> Removable:
    """The cached repo ``name``, the model folder ``name`` under one of ``dirs``, or the model
    folder at path ``name``; ``ModelNotFound`` otherwise (never any other directory)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        info = scan_cache_dir(cache_dir)
        for repo in info.repos:
            if repo.repo_type == "model" and repo.repo_id == name:
                return Removable(name, str(repo.repo_path), repo.size_on_disk, cache_dir=cache_dir, cached=True)
    except CacheNotFound:
        pass
    for row in list_local_models(dirs):
        if name in (row["name"], row["path"]):
            return Removable(row["name"], row["path"], row["size_on_disk"], cached=False)
    path = Path(name).expanduser()
    if artifacts.looks_like_path(name) and _is_model_folder(path):
        return Removable(path.name, str(path.resolve()), _folder_bytes(path), cached=False)
    raise ModelNotFound(
        f"{name!r} is neither a model in the Hugging Face cache nor a model folder (with a config.json) under --dir",
        details={"model": name},
    )


def _confirmed(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    print(question, end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def _path(args: argparse.Namespace) -> int:
    path = artifacts.resolve_model_path(args.name, cache_dir=args.cache_dir)
    print(json.dumps({"name": args.name, "path": str(path)}) if args.json else path)
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from ..testing.tiny import build_from_cli

    result = build_from_cli(args.path, args.kind, args.seed, force=args.force)
    print(result if result is not None else args.path)
    return 0
