"""Opening a file only when it is this process's own: a regular file, not a link of any kind.

The SSD tier's shards and checksums and the run lock files live in directories that other
processes could write into. A path there may have become a symlink, a hard link to some other
file, a directory or a FIFO. ``open_owned`` opens the path without following a symlink
(``O_NOFOLLOW``) and without waiting for a FIFO's writer (``O_NONBLOCK``), then checks the open
descriptor (``fstat``: no race between the check and the use): a regular file, owned by this
process's effective user, with one name (``st_nlink == 1``). Anything else is refused with
``NotOwnedFile`` before a byte is read or written, so a file is never truncated before the
check (open without ``O_TRUNC`` and truncate the returned descriptor).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["NotOwnedFile", "open_owned", "owned_fault", "read_owned"]


class NotOwnedFile(OSError):
    """``path`` is not a regular file of this process's own; ``why`` says what it is."""

    def __init__(self, path: str | os.PathLike[str], why: str) -> None:
        super().__init__(errno.EPERM, f"{path} {why}")
        self.path = str(path)
        self.why = why


def owned_fault(info: os.stat_result) -> str | None:
    """Why a file with this stat is not a private regular file; None when it is."""
    if stat.S_ISLNK(info.st_mode):
        return "is a symlink"
    if stat.S_ISDIR(info.st_mode):
        return "is a directory"
    if stat.S_ISFIFO(info.st_mode):
        return "is a FIFO"
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by this process (uid {os.geteuid()})"
    if info.st_nlink != 1:
        return f"has {info.st_nlink} hard links"
    return None


def open_owned(path: str | os.PathLike[str], flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor on ``path``, opened with ``flags`` (``O_CREAT`` may be among them, ``O_TRUNC``
    may not: truncate after the check). Raises ``NotOwnedFile`` when the path is a symlink, a
    directory, a FIFO or another non-regular file, another user's file or a file with more than
    one hard link; other ``OSError``s (missing, no permission) as ``os.open`` raises them."""
    if flags & os.O_TRUNC:
        raise ValueError("open_owned never truncates before its check; truncate the descriptor it returns")
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            # ELOOP: a symlink under O_NOFOLLOW; EISDIR: a directory opened for writing;
            # ENXIO: a FIFO opened for writing with no reader.
            try:
                fault = owned_fault(os.lstat(path)) or "cannot be opened"
            except OSError:
                fault = "cannot be opened"
            raise NotOwnedFile(path, fault) from exc
        raise
    try:
        found = owned_fault(os.fstat(fd))
        if found is not None:
            raise NotOwnedFile(path, found)
        os.set_blocking(fd, True)  # a regular file: O_NONBLOCK only guarded the open
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_owned(path: Path, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of ``path`` read through ``open_owned`` (``NotOwnedFile`` / ``OSError``)."""
    fd = open_owned(path)
    with os.fdopen(fd, "rb") as handle:
        return handle.read(max_bytes)
