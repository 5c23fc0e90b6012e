"""One driver per run: a lock on a run tree that the operating system or the database releases
when its holder dies.

    with run_lock.acquire(ledger, run_id):      # RunLocked when another live process holds it
        ...                                     # start / answer / tick the run and its child runs

The lock is taken on the root of the run tree ``run_id`` belongs to, so a subflow's or an
agent's child run is covered by whoever drives its root (the same process ticks them all) and a
resume named after a child conflicts with the root's driver. It never waits: a held lock is
refused at once with ``RunLocked`` naming the holder.

- SQLite: ``flock(LOCK_EX | LOCK_NB)`` on ``<ledger file>.locks/<sha256 of the root run id>.lock``
  (directory 0700, file 0600). The file is opened only when it is a private regular file
  (``owned_files.open_owned``: not a symlink, a hard link, a directory or a FIFO; this user's),
  else ``RunLockUnsafe``; nothing is truncated before that check. The holder writes its pid,
  host, command and start time into the file; it empties the file when it lets go. The kernel drops
  the lock when the holder's process dies, however it dies. Lock files are never deleted
  (deleting one while another process has it open would let two processes lock two different
  files of the same name).
- PostgreSQL: ``pg_try_advisory_lock(key)``, ``key`` the first 8 bytes of the root run id's
  sha256 as a signed 64-bit integer, on a connection of its own (autocommit, not pooled) kept
  open while the run is driven; its ``application_name`` names the holder
  (``abstractruntime-mlx pid=... host=... COMMAND``, cut at 63 bytes). The server drops the lock
  when that connection ends.

Other databases have no such lock here and are refused with a ``LedgerError``.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import os
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from sqlalchemy import URL, Connection, create_engine, text
from sqlalchemy.pool import NullPool

from ..errors import LedgerError, RunLocked, RunLockUnsafe
from ..json_values import JSONObject
from ..owned_files import NotOwnedFile, open_owned, read_owned
from .errors import wrap_db_errors

if TYPE_CHECKING:
    from .store import Ledger

__all__ = ["RunLock", "acquire", "advisory_key", "lock_path", "root_run_id"]

_MAX_TREE_DEPTH: Final = 256
_MAX_HOLDER_BYTES: Final = 4096
_PG_APPLICATION_NAME_BYTES: Final = 63  # NAMEDATALEN - 1: PostgreSQL cuts longer names


class RunLock:
    """A held run lock. ``release()`` (or leaving ``with``) lets it go; releasing twice is a no-op."""

    def __init__(self, run_id: str, where: str, holder: JSONObject, release: Callable[[], None]) -> None:
        self.run_id = run_id
        """The root run id the lock is on."""
        self.where = where
        """The lock file, or ``postgresql advisory lock KEY``."""
        self.holder = holder
        """What this process wrote about itself (pid, host, command, acquired_at)."""
        self._release: Callable[[], None] | None = release

    @property
    def held(self) -> bool:
        return self._release is not None

    def release(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"RunLock({self.run_id!r}, {self.where!r}, held={self.held})"


def acquire(ledger: Ledger, run_id: str, *, command: str | None = None) -> RunLock:
    """Lock the run tree ``run_id`` belongs to (its root; ``run_id`` itself when the ledger does
    not have it yet, as for a run about to start) and return the held lock.

    Raises ``RunLocked`` when another holder has it, in this process or another one, with the
    holder's pid, host and command. ``command`` says what this process does (default: the
    program name and its leading arguments, no option values).
    """
    root = root_run_id(ledger, run_id)
    holder: JSONObject = {
        "run_id": root,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": command or _command_line(),
        "acquired_at": dt.datetime.now(dt.UTC).isoformat(),
    }
    url = ledger.database_url
    backend = url.get_backend_name()
    if backend == "sqlite":
        return _lock_file(lock_path(url, root), root, holder)
    if backend == "postgresql":
        return _lock_advisory(url, root, holder)
    raise LedgerError(
        f"cannot lock run {root} on a {backend} ledger: one driver per run is enforced with a file lock on "
        "SQLite and an advisory lock on PostgreSQL only; use one of those to run flows"
    )


def root_run_id(ledger: Ledger, run_id: str) -> str:
    """The root of the run tree ``run_id`` belongs to (``run_id`` when it has no parent or is not stored)."""
    current = run_id
    for _ in range(_MAX_TREE_DEPTH):
        run = ledger.load_run(current)
        parent = run.get("parent_run_id") if run is not None else None
        if not isinstance(parent, str) or not parent:
            return current
        current = parent
    return current


def _command_line() -> str:
    """The program name and its arguments up to the first option: what this process does,
    without option values (an ``--answer`` may be private)."""
    argv = sys.argv or [""]
    words = [Path(argv[0]).name or "python"]
    for arg in argv[1:]:
        if arg.startswith("-"):
            break
        words.append(arg)
    return " ".join(words)[:200]


def _describe(holder: JSONObject) -> str:
    if "pid" in holder:
        return (
            f"pid {holder.get('pid')} on host {holder.get('host', '?')} running `{holder.get('command', '?')}` "
            f"since {holder.get('acquired_at', '?')}"
        )
    if holder.get("application_name"):
        return (
            f"{holder['application_name']!r} (PostgreSQL backend pid {holder.get('backend_pid', '?')}, "
            f"client {holder.get('client_addr') or 'local socket'})"
        )
    return "a process that left no description (it may be letting go right now)"


def _locked(run_id: str, where: str, holder: JSONObject) -> RunLocked:
    return RunLocked(
        f"run {run_id} is being driven by another process: {_describe(holder)}. One driver per run: "
        "wait for it to finish or stop it, then try again",
        details={"run_id": run_id, "lock": where, "holder": holder},
    )


# --------------------------------------------------------------------------------------
# SQLite: a file lock beside the ledger
# --------------------------------------------------------------------------------------


def lock_path(url: URL, run_id: str) -> Path:
    """``<ledger file>.locks/<sha256(run_id)>.lock`` for a SQLite ledger URL."""
    database = url.database or ""
    if database.startswith("file:"):  # a URI filename: file:/path?mode=ro
        database = database.removeprefix("file:").split("?", 1)[0]
    if not database or database == ":memory:":
        raise LedgerError(
            f"an in-memory SQLite ledger has no file to lock runs beside ({url.render_as_string(hide_password=True)})"
        )
    ledger_file = Path(database).expanduser().resolve()
    digest = hashlib.sha256(run_id.encode("utf-8")).hexdigest()
    return ledger_file.with_name(ledger_file.name + ".locks") / f"{digest}.lock"


def _lock_file(path: Path, run_id: str, holder: JSONObject) -> RunLock:
    directory = path.parent
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise LedgerError(f"cannot create the run lock directory {directory}: {exc}") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise LedgerError(f"the run lock directory {directory} is not a directory (a symlink?); remove it")
    try:
        fd = open_owned(path, os.O_RDWR | os.O_CREAT)
    except NotOwnedFile as exc:
        raise RunLockUnsafe(
            f"the run lock file {path} {exc.why}; it was left as it is. Remove it (no driver of run {run_id} "
            "can be running through it) and try again",
            details={"run_id": run_id, "lock": str(path), "reason": exc.why},
        ) from exc
    except OSError as exc:
        raise LedgerError(f"cannot open the run lock file {path}: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise _locked(run_id, str(path), _read_holder(path)) from None
    except OSError as exc:
        os.close(fd)
        raise LedgerError(f"cannot lock the run lock file {path}: {exc}") from exc
    try:
        body = (json.dumps(holder) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, body, 0)
    except OSError:
        pass  # the description is diagnostics; the flock is the lock

    def release() -> None:
        try:
            os.ftruncate(fd, 0)  # a later reader must not take a gone holder for a live one
        except OSError:
            pass
        os.close(fd)  # closing the only descriptor drops the flock

    return RunLock(run_id, str(path), holder, release)


def _read_holder(path: Path) -> JSONObject:
    try:
        raw = read_owned(path, _MAX_HOLDER_BYTES)
        data = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# --------------------------------------------------------------------------------------
# PostgreSQL: a session advisory lock on a connection of its own
# --------------------------------------------------------------------------------------


def advisory_key(run_id: str) -> int:
    """The signed 64-bit advisory lock key of a run: the first 8 bytes of sha256(run_id)."""
    return int.from_bytes(hashlib.sha256(run_id.encode("utf-8")).digest()[:8], "big", signed=True)


def _application_name(holder: JSONObject) -> str:
    name = f"abstractruntime-mlx pid={holder['pid']} host={holder['host']} {holder['command']}"
    return name.encode("utf-8")[:_PG_APPLICATION_NAME_BYTES].decode("utf-8", "ignore")


_HOLDER_SQL: Final = text(
    """
    SELECT a.pid, a.application_name, CAST(a.client_addr AS text), a.backend_start
    FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = CAST(:hi AS oid) AND l.objid = CAST(:lo AS oid)
    """
)


def _lock_advisory(url: URL, run_id: str, holder: JSONObject) -> RunLock:
    key = advisory_key(run_id)
    where = f"postgresql advisory lock {key}"
    shown = url.render_as_string(hide_password=True)
    # Not the ledger's pool: the connection stays checked out for the whole run, one per run.
    engine = create_engine(url, poolclass=NullPool, connect_args={"application_name": _application_name(holder)})
    conn: Connection | None = None
    found = None
    try:
        with wrap_db_errors(f"lock run {run_id} on {shown}"):
            conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
            got = bool(conn.scalar(text("SELECT pg_try_advisory_lock(:key)"), {"key": key}))
            if not got:
                found = conn.execute(_HOLDER_SQL, {"hi": (key >> 32) & 0xFFFFFFFF, "lo": key & 0xFFFFFFFF}).first()
    except BaseException:
        if conn is not None:
            conn.close()
        engine.dispose()
        raise
    assert conn is not None
    if not got:
        conn.close()
        engine.dispose()
        incumbent: JSONObject = {}
        if found is not None:
            backend_pid, application_name, client_addr, backend_start = found
            incumbent = {
                "backend_pid": backend_pid,
                "application_name": application_name,
                "client_addr": client_addr,
                "backend_start": backend_start.isoformat() if backend_start is not None else None,
            }
        raise _locked(run_id, where, incumbent)
    held = conn

    def release() -> None:
        try:
            held.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": key})
        except Exception:  # noqa: BLE001 - a dead connection has released the lock already
            pass
        finally:
            try:
                held.close()
            finally:
                engine.dispose()

    return RunLock(run_id, where, holder, release)
