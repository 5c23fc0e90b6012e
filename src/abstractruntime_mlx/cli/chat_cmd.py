"""``abstractruntime-mlx chat [MODEL]``: a conversation with a model in the terminal.

    abstractruntime-mlx chat mlx-community/Qwen3.5-4B-4bit
    echo "Explain TTL caches." | abstractruntime-mlx chat ./my-model
    abstractruntime-mlx chat --remote http://127.0.0.1:8080

MODEL is what ``serve --model`` and ``run --model`` take (a checkpoint directory or a Hugging
Face repo id already cached); it loads once, in this process, on the scheduled lane the flow
nodes use. Without MODEL: the embedded tiny model ``run`` uses (random weights). With
``--remote URL`` the conversation goes to a running ``serve`` instead; MODEL then names one of
its models (default: the first it serves).

On a terminal: a ``>>>`` prompt with line editing and a history (readline; ``--history FILE``,
default ``$XDG_STATE_HOME/abstractruntime-mlx/chat_history``, ``~/.local/state/...``), replies
streamed as they are generated, slash commands (``chat_session.HELP``), Ctrl-C stopping the
reply and not the chat, Ctrl-D or ``/exit`` leaving. Stdin not a terminal: each line is a turn
(or a command), answered on stdout; the command exits at the end of the input, with status 1
when a turn failed. After each reply one line on stderr: prompt tokens, how many of them the
prompt cache restored, TTFT and decode speed (``--no-stats``: none).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from .args import integer, number

if TYPE_CHECKING:
    from .chat_session import ChatSession, StreamOpener

HISTORY_FILE: Final = "abstractruntime-mlx/chat_history"
HISTORY_LENGTH: Final = 1000
PROMPT: Final = ">>> "
COMMANDS: Final = ("/system", "/thinking", "/clear", "/stats", "/exit", "/help")


@dataclass(frozen=True, slots=True)
class ChatSettings:
    model: str | None  # None: the embedded tiny model (local), the server's first model (remote)
    remote: str | None = None
    api_key: str | None = None
    system: str | None = None
    thinking: bool | str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    history: Path | None = None
    show_stats: bool = True


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal (a REPL; or one answer per stdin line)",
        description="Load MODEL once and chat with it: streamed replies, slash commands (/help), "
        "prefix reuse across turns. Stdin not a terminal: one answer per line.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="checkpoint directory or cached Hugging Face repo id (default: the "
        "embedded tiny model; with --remote: the server's first model)",
    )
    parser.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="chat with a running 'abstractruntime-mlx serve' at URL instead of loading MODEL here",
    )
    parser.add_argument(
        "--api-key", default=None, help="the server's API key, with --remote (default: $ABSTRACTRUNTIME_MLX_API_KEY)"
    )
    parser.add_argument("--system", default=None, metavar="TEXT", help="the system prompt (/system changes it)")
    parser.add_argument(
        "--thinking",
        default=None,
        metavar="MODE",
        help="on, off, auto or a level: minimal, low, medium, high, xhigh (default: auto, the model's own)",
    )
    parser.add_argument(
        "--max-tokens",
        type=integer,
        default=None,
        metavar="N",
        help="cap on each reply's tokens (default 1024, or what the context leaves)",
    )
    parser.add_argument(
        "--temperature", type=number, default=None, metavar="T", help="sampling temperature (default 0: greedy)"
    )
    parser.add_argument(
        "--history",
        default=None,
        metavar="FILE",
        help=f"readline history file (default $XDG_STATE_HOME/{HISTORY_FILE})",
    )
    parser.add_argument(
        "--stats",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after each reply, a line of figures on stderr (default: on)",
    )
    parser.set_defaults(handler=_chat)


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ChatSettings:
    from ..controls import normalize_thinking
    from .serve_cmd import API_KEY_ENV

    return ChatSettings(
        model=args.model,
        remote=args.remote,
        api_key=args.api_key or environ.get(API_KEY_ENV) or None,
        system=args.system or None,
        thinking=normalize_thinking(args.thinking, field="--thinking"),
        max_output_tokens=args.max_tokens,
        temperature=args.temperature,
        history=Path(args.history).expanduser() if args.history else default_history_path(environ),
        show_stats=args.stats,
    )


def default_history_path(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_STATE_HOME/abstractruntime-mlx/chat_history`` (``~/.local/state/...``)."""
    return Path(environ.get("XDG_STATE_HOME") or "~/.local/state").expanduser() / HISTORY_FILE


def _chat(args: argparse.Namespace) -> int:
    return chat(settings_from_args(args))


def chat(settings: ChatSettings) -> int:
    """Open the model, then the REPL on stdin: interactive on a terminal, else line by line."""
    from .chat_session import ChatSession

    with opened_model(settings) as (opener, name):
        session = ChatSession(
            open_stream=opener,
            model=name,
            system=settings.system,
            thinking=settings.thinking,
            max_output_tokens=settings.max_output_tokens,
            temperature=settings.temperature,
            show_stats=settings.show_stats,
        )
        if sys.stdin.isatty():
            return interactive(session, settings.history)
        return run_lines(session, sys.stdin)


@contextlib.contextmanager
def opened_model(settings: ChatSettings) -> Iterator[tuple[StreamOpener, str]]:
    """``(open_stream, model name)`` for the session: a provider loaded here (unloaded at the
    end), or a client of ``--remote``."""
    if settings.remote is not None:
        from ..errors import ModelNotFound
        from ..remote_client import RemoteClient

        with RemoteClient(settings.remote, api_key=settings.api_key, model=settings.model, max_retries=0) as client:
            name = settings.model
            if name is None:
                served = client.list_models()
                if not served:
                    raise ModelNotFound(
                        f"the server at {settings.remote} has no model loaded; name one (chat MODEL --remote URL)"
                    )
                name = str(served[0]["id"])
                client.model = name
            yield (lambda request: client.generate_request(request, stream=True)), name
        return
    from ..nodes.llm_node import DEFAULT_PROVIDER_OPTIONS
    from ..provider import create_llm
    from .load_progress import showing_load
    from .run_cmd import default_model_path

    model = settings.model or default_model_path()
    with showing_load(model):
        llm = create_llm("mlx", model=model, **DEFAULT_PROVIDER_OPTIONS)
    try:
        yield (lambda request: llm.generate_request(request, stream=True)), model
    finally:
        llm.unload_model()


def run_lines(session: ChatSession, lines: Iterable[str]) -> int:
    """Each line a turn or a command; 1 when one failed (each failure is one ``error:`` line)."""
    from .chat_session import Exit

    failed = False
    for line in lines:
        try:
            session.handle(line)
        except Exit:
            break
        except Exception as exc:  # noqa: BLE001 - every failure is one line, the chat goes on
            _report(exc)
            failed = True
    return 1 if failed else 0


def interactive(session: ChatSession, history: Path | None) -> int:
    """The ``>>>`` prompt: readline editing and history; Ctrl-C at the prompt clears the line,
    Ctrl-D leaves."""
    from .chat_session import Exit

    print(f"chatting with {session.model}; /help for commands, Ctrl-D or /exit to leave", file=sys.stderr)
    with _readline(history):
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                print(file=sys.stderr)
                return 0
            except KeyboardInterrupt:
                print(file=sys.stderr)
                continue
            try:
                session.handle(line)
            except Exit:
                return 0
            except Exception as exc:  # noqa: BLE001 - every failure is one line, the chat goes on
                _report(exc)


def _report(exc: BaseException) -> None:
    from .main import error_line

    print(error_line(exc), file=sys.stderr, flush=True)


@contextlib.contextmanager
def _readline(history: Path | None) -> Iterator[None]:
    """readline for ``input()``: the history file read before, written after (private, the
    last ``HISTORY_LENGTH`` lines), TAB completing the slash commands."""
    try:
        import readline
    except ImportError:  # a Python built without readline: plain input()
        yield
        return
    readline.set_history_length(HISTORY_LENGTH)
    readline.set_completer(_complete_command)
    readline.parse_and_bind("tab: complete")
    if history is not None and history.is_file():
        try:
            readline.read_history_file(history)
        except OSError as exc:
            print(f"warning: the chat history {str(history)!r} was not read: {exc.strerror or exc}", file=sys.stderr)
    try:
        yield
    finally:
        if history is not None:
            try:
                history.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                readline.write_history_file(history)
                history.chmod(0o600)
            except OSError as exc:
                print(
                    f"warning: the chat history was not saved to {str(history)!r}: {exc.strerror or exc}",
                    file=sys.stderr,
                )


def _complete_command(text: str, state: int) -> str | None:
    matches = [c for c in COMMANDS if c.startswith(text)] if text.startswith("/") else []
    return matches[state] if state < len(matches) else None
