"""Who watches a served call: the metrics, and the ledger when ``serve --ledger`` is on.

Every generating route (chat, responses, completions) starts its call through
``begin_call(request, ...)``, which returns one ``CallObserver`` for the ``ProviderPump`` of
that call. The pump reports to it, in order: phase events (``progress``, any thread, only
when ``wants_progress``), streamed chunks (``chunk``) or the one result (``result``), then
``ended(error)`` exactly once (``None`` on success). Observers never raise into the call: a
failing observer is logged and the call goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from starlette.requests import Request

from ..json_values import JSONObject
from ..request import GenerationRequest
from ..results import GenerationChunk, GenerationResult

log = logging.getLogger(__name__)

SESSION_HEADER = "x-session-affinity"
"""The header naming a client's session (the remote client sends a run's session id in it)."""


class CallObserver(Protocol):
    """Receives what one served call produces (see the module docstring for the order)."""

    @property
    def wants_progress(self) -> bool: ...

    def progress(self, event: JSONObject) -> None: ...

    def chunk(self, chunk: GenerationChunk) -> None: ...

    def result(self, result: GenerationResult) -> None: ...

    def ended(self, error: BaseException | None) -> None: ...


class Observers:
    """Several observers as one; each one's failure is logged and kept from the others."""

    def __init__(self, members: Sequence[CallObserver]) -> None:
        self._members = tuple(members)

    @property
    def wants_progress(self) -> bool:
        return any(m.wants_progress for m in self._members)

    def progress(self, event: JSONObject) -> None:
        for member in self._members:
            if member.wants_progress:
                _safely(member.progress, event)

    def chunk(self, chunk: GenerationChunk) -> None:
        for member in self._members:
            _safely(member.chunk, chunk)

    def result(self, result: GenerationResult) -> None:
        for member in self._members:
            _safely(member.result, result)

    def ended(self, error: BaseException | None) -> None:
        for member in self._members:
            _safely(member.ended, error)


T = TypeVar("T")


def _safely(method: Callable[[T], None], argument: T) -> None:
    try:
        method(argument)
    except Exception:  # noqa: BLE001 - watching a call must never fail the call
        log.warning("a call observer failed; the call goes on", exc_info=True)


async def begin_call(
    request: Request, *, route: str, model: str, call: GenerationRequest, stream: bool, asked_model: str | None = None
) -> Observers:
    """The observers of one call to ``model`` (the pool's name of the model, ``asked_model`` however
    the request spelled it) on ``route`` (``chat``, ``responses``, ``completions``).

    Also names the model on the request's state, so the metrics middleware can label the
    errors this request answers with. With a ledger, the call's run and STARTED step are
    written before this returns (on a thread), so its phase events follow them.
    """
    from .metrics import ServerMetrics
    from .serve_ledger import ServedHttp, ServeLedger

    request.state.served_model = model
    members: list[CallObserver] = []
    metrics = getattr(request.app.state, "metrics", None)
    if isinstance(metrics, ServerMetrics):
        members.append(metrics.meter(model=model, route=route))
    ledger = getattr(request.app.state, "serve_ledger", None)
    if isinstance(ledger, ServeLedger):
        members.append(
            await ledger.begin(
                route=route,
                model=model,
                call=call,
                stream=stream,
                session=request.headers.get(SESSION_HEADER),
                http=ServedHttp(method=request.method, route=request.url.path, asked_model=asked_model),
            )
        )
    return Observers(members)
