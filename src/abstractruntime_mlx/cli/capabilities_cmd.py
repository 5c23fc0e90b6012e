"""``abstractruntime-mlx capabilities MODEL``: execution capabilities as JSON, no weights loaded."""

from __future__ import annotations

import argparse
import json
import os


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "capabilities",
        help="describe MTP support and concurrency of a model without loading it (JSON)",
    )
    parser.add_argument("model", help="a local checkpoint directory or a Hugging Face repo id")
    parser.add_argument("--provider", default="mlx", help="provider name (default: mlx)")
    parser.add_argument("--head", default=None, help="companion MTP head (repo id or directory)")
    parser.add_argument("--cache-dir", default=None, help="Hugging Face cache directory (default: HF_HUB_CACHE)")
    parser.add_argument("--json", action="store_true", help="accepted for symmetry: the output is JSON already")
    parser.set_defaults(handler=_capabilities)


def _capabilities(args: argparse.Namespace) -> int:
    from .. import policy
    from ..capabilities import get_execution_capabilities

    report = get_execution_capabilities(
        args.model,
        provider=args.provider,
        head=args.head,
        policy_path=policy.config_path(os.environ),
        cache_dir=args.cache_dir,
    )
    print(json.dumps(report, indent=2))
    return 0
