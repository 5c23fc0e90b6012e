"""The ledger's errors, all ``LedgerError`` (code ``ledger_error``, HTTP 500), and the one place
SQLAlchemy exceptions are translated.

    LedgerError
    ├── DuplicateEvent        a unique key was already taken (outside the idempotent paths)
    ├── LedgerSchemaError     the database was made by a newer/unknown schema, or by someone else
    ├── LedgerWriteFailed     the progress writer could not commit; rows are not durable
    └── LedgerTimeout         flush()/stop() ran out of time before the rows were committed

The subclasses keep the parent's ``code`` so the wire contract stays ``ledger_error``; the
class tells in-process callers what happened.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from ..errors import LedgerError

__all__ = [
    "DuplicateEvent",
    "LedgerError",
    "LedgerSchemaError",
    "LedgerTimeout",
    "LedgerWriteFailed",
    "wrap_db_errors",
]


class DuplicateEvent(LedgerError):
    """A row with the same unique key (idempotency key, run/seq, run id) already exists."""


class LedgerSchemaError(LedgerError):
    """The database's schema is not one this code can read and write."""


class LedgerWriteFailed(LedgerError):
    """The progress writer failed to commit; ``details["unwritten_rows"]`` rows are not durable."""


class LedgerTimeout(LedgerError):
    """A flush or stop did not finish within its timeout; the rows may still be committed later."""


_UNIQUE_MARKERS = ("unique constraint", "duplicate key", "duplicate entry")


def _is_unique_violation(exc: IntegrityError) -> bool:
    orig = exc.orig
    if getattr(orig, "pgcode", None) == "23505" or getattr(orig, "sqlstate", None) == "23505":
        return True
    text = str(orig if orig is not None else exc).lower()
    return any(marker in text for marker in _UNIQUE_MARKERS)


@contextmanager
def wrap_db_errors(action: str) -> Iterator[None]:
    """Translate SQLAlchemy exceptions raised inside the block, chained with ``from exc``.

    A unique-key ``IntegrityError`` becomes ``DuplicateEvent``; any other ``SQLAlchemyError``
    (other integrity errors included) becomes ``LedgerError``. ``action`` says what was being
    done (``"append step"``) and starts the message.
    """
    try:
        yield
    except IntegrityError as exc:
        detail = str(exc.orig if exc.orig is not None else exc)
        if _is_unique_violation(exc):
            raise DuplicateEvent(f"{action}: duplicate key ({detail})") from exc
        raise LedgerError(f"{action}: integrity error ({detail})") from exc
    except SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc)
        raise LedgerError(f"{action}: database error ({type(exc).__name__}: {detail})") from exc
