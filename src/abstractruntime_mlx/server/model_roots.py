"""Which model directories a client may make the server read: those under its model roots.

``POST /acore/models/load`` and ``GET /v1/models/execution-capabilities`` take a model name
from the network. Without a rule any host directory would do, and the errors would tell
the caller what exists and where it resolves. So a name reaches the filesystem only
through ``ModelRoots.resolve``:

- a Hugging Face repo id (``org/name``) resolves to its snapshot in the Hugging Face cache
  (offline; nothing is downloaded), which is always a root;
- any other name is a directory, absolute (``/models/qwen``) or relative to a root
  (``qwen``); after symlinks are resolved it must lie inside one of the roots.

``name_of`` gives the one name a resolved model is known by (what responses and metrics say).

A name that does not resolve inside a root fails with the same ``ModelNotFound`` whether
or not the path exists, naming neither what it points at nor where it resolves.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..artifacts import DOWNLOAD_COMMAND, hub_snapshot, looks_like_path
from ..errors import ModelNotFound


def hub_cache_dir() -> Path:
    """The Hugging Face cache this process reads (``HF_HUB_CACHE`` / ``HF_HOME`` resolution)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


@dataclass(frozen=True, slots=True)
class ModelRoots:
    """The directories models may be loaded from (resolved, symlinks followed)."""

    roots: tuple[Path, ...]

    @classmethod
    def with_hub_cache(cls, extra: Iterable[str | os.PathLike[str]] = ()) -> ModelRoots:
        """The Hugging Face cache plus ``extra`` (``serve --model-root DIR``)."""
        paths = [hub_cache_dir(), *(Path(p).expanduser() for p in extra)]
        unique: dict[Path, None] = {}
        for path in paths:
            unique[path.resolve()] = None
        return cls(tuple(unique))

    def contains(self, path: Path) -> bool:
        return any(path == root or path.is_relative_to(root) for root in self.roots)

    def resolve(self, name: str, *, field: str = "model") -> str:
        """What to hand the model factory for ``name``: a repo id in the cache or a directory inside a root.

        Raises ``ModelNotFound`` (404); for a path outside the roots the message says only that.
        """
        text = name.strip()
        if not text:
            raise ModelNotFound(f"{field} is empty", details={"field": field})
        if not looks_like_path(text):
            for root in self.roots:
                inside = self._directory(root / text)
                if inside is not None:
                    return str(inside)
            if hub_snapshot(text) is not None:
                return text
            if "/" in text and text.count("/") == 1 and ".." not in text:
                command = DOWNLOAD_COMMAND.format(name=text)
                raise ModelNotFound(
                    f"model {text!r} is not on this machine; download it with `{command}`",
                    details={"field": field, "model": text, "command": command},
                )
        else:
            inside = self._directory(Path(text).expanduser())
            if inside is not None:
                return str(inside)
        raise ModelNotFound(
            f"{field} {text!r} is not a model this server can load: it loads only repo ids in its "
            "Hugging Face cache and directories under its model roots (serve --model-root DIR)",
            details={"field": field},
        )

    def name_of(self, source: str) -> str:
        """The name a model ``resolve`` returned goes by: a repo id as is, a directory relative to
        the first root holding it (``qwen/7b`` for ``ROOT/qwen/7b``), so that every spelling of one
        model (``qwen//7b``, ``/models/./qwen/7b``, its absolute path) gives one name."""
        if not looks_like_path(source):
            return source
        path = Path(source)
        for root in self.roots:
            if path != root and path.is_relative_to(root):
                return path.relative_to(root).as_posix()
        return source

    def _directory(self, candidate: Path) -> Path | None:
        try:
            resolved = candidate.resolve(strict=True)
            return resolved if self.contains(resolved) and resolved.is_dir() else None
        except (OSError, RuntimeError, ValueError):  # missing, a loop, too long, a NUL byte
            return None
