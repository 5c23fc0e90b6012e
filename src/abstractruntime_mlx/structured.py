"""Structured output: what a caller asks for (a JSON Schema, a pydantic model, OpenAI's
``response_format``) and how an answer is checked against it. Pure: no MLX, no I/O.

The edges turn each accepted form into one ``ResponseFormat``:

    ResponseFormat.from_call(response_schema={"type": "object", ...})      # generate(...)
    ResponseFormat.from_call(response_model=Weather)                       # a pydantic model
    ResponseFormat.from_openai({"type": "json_schema", "json_schema": {...}})  # the HTTP body

The engine compiles ``ResponseFormat.schema`` to a grammar (``engine.grammar``); whoever gets the
text back calls ``parse_answer`` (JSON, then the schema, then the pydantic model when one was
given), which raises ``StructuredOutputInvalid`` naming what is wrong.

Every schema passes the same limits first, whichever edge it came from (``MAX_SCHEMA_BYTES``,
``MAX_SCHEMA_NODES``, ``MAX_SCHEMA_DEPTH``): they are checked without recursion and stop at the
first one crossed, so a schema of any size or depth is refused in microseconds with
``ResponseSchemaTooLarge``. Within them, checking against the metaschema costs up to about
half a second and compiling the grammar about a tenth; async callers run both through
``run_schema_work``, a small pool of its own, so that neither the event loop nor the threads
other requests need wait for them.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Final, Literal, ParamSpec, TypeVar

import jsonschema
from pydantic import BaseModel, ValidationError

from .errors import InvalidRequest, InvalidResponseSchema, ResponseSchemaTooLarge, StructuredOutputInvalid
from .json_values import JSONObject, JSONValue

FormatKind = Literal["json_schema", "json_object"]

MAX_SCHEMA_BYTES: Final = 128 * 1024
"""The longest response schema accepted: bytes of its compact JSON (non-ASCII escaped)."""
MAX_SCHEMA_NODES: Final = 4096
"""The most JSON values (objects, arrays, strings, numbers, ...) one response schema may hold.
Checking it against the metaschema costs up to about 0.1 ms per value."""
MAX_SCHEMA_DEPTH: Final = 32
"""How deep objects and arrays may nest in a response schema (the schema itself is level 1).
The metaschema check recurses about ten frames per level; this keeps it far from Python's limit."""
SCHEMA_WORKERS: Final = 2
"""Threads that check and compile schemas for async callers (``run_schema_work``)."""

ANY_OBJECT: Final[Mapping[str, JSONValue]] = {"type": "object"}
"""The schema of OpenAI's ``{"type": "json_object"}``: any JSON object."""

DEFAULT_NAME: Final = "StructuredOutput"
PROMPTED_PREFIX: Final = "Answer with one JSON value only"


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """The structured answer one call asks for.

    ``schema`` is a JSON Schema (checked against its metaschema at the edge); ``schema_hash``
    names it in metadata and keys the grammar cache; ``model`` is the caller's pydantic class
    (local calls only: the parsed answer is an instance of it).
    """

    kind: FormatKind
    schema: Mapping[str, JSONValue]
    name: str = DEFAULT_NAME
    schema_hash: str = ""
    model: type[BaseModel] | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls,
        schema: object,
        *,
        kind: FormatKind = "json_schema",
        name: object = None,
        model: type[BaseModel] | None = None,
    ) -> ResponseFormat:
        if not isinstance(schema, Mapping) or not schema:
            raise InvalidResponseSchema("the response schema must be a non-empty JSON object")
        checked = _checked_schema(schema)
        label = name.strip() if isinstance(name, str) and name.strip() else DEFAULT_NAME
        return cls(kind=kind, schema=checked, name=label, schema_hash=schema_hash(checked), model=model)

    @classmethod
    def from_call(
        cls,
        *,
        response_model: object = None,
        response_schema: object = None,
        response_format: object = None,
        name: object = None,
    ) -> ResponseFormat | None:
        """The ``generate(...)`` / node edge: at most one of the three forms (None: free text)."""
        given = [
            n
            for n, v in (
                ("response_model", response_model),
                ("response_schema", response_schema),
                ("response_format", response_format),
            )
            if v is not None
        ]
        if len(given) > 1:
            raise InvalidRequest(
                f"give one of response_model, response_schema, response_format (got {', '.join(given)})"
            )
        if response_model is not None:
            if not (isinstance(response_model, type) and issubclass(response_model, BaseModel)):
                raise InvalidRequest("response_model must be a pydantic BaseModel subclass")
            return cls.build(
                response_model.model_json_schema(), name=name or response_model.__name__, model=response_model
            )
        if response_schema is not None:
            return cls.build(response_schema, name=name)
        if response_format is not None:
            return cls.from_openai(response_format)
        return None

    @classmethod
    def from_openai(cls, value: object) -> ResponseFormat | None:
        """OpenAI's ``response_format``: ``{"type": "json_schema", "json_schema": {"name", "schema"}}``,
        ``{"type": "json_object"}`` or ``{"type": "text"}`` (None: free text)."""
        if not isinstance(value, Mapping):
            raise InvalidRequest("response_format must be an object with a 'type'")
        kind = value.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.build(ANY_OBJECT, kind="json_object", name="json_object")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, Mapping):
                raise InvalidResponseSchema(
                    "response_format.json_schema must be an object holding 'schema'", path="/json_schema"
                )
            return cls.build(spec.get("schema"), name=spec.get("name"))
        raise InvalidRequest(f"response_format.type must be 'json_schema', 'json_object' or 'text' (got {kind!r})")

    def to_openai(self) -> JSONObject:
        """The wire form sent to a server (OpenAI's ``response_format``)."""
        if self.kind == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": dict(self.schema), "strict": True}}


def schema_hash(schema: Mapping[str, JSONValue]) -> str:
    """A short stable name of a schema: sha256 of its canonical JSON (16 hex digits)."""
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def parse_answer(
    text: str, fmt: ResponseFormat, *, mode: str, attempts: int = 1, finish_reason: str | None = None
) -> JSONValue | BaseModel:
    """The parsed answer of ``text``: JSON that the schema accepts, as the pydantic model when the
    caller gave one. Raises ``StructuredOutputInvalid`` saying why not."""
    error = answer_error(text, fmt)
    if error is not None:
        hint = " (the output cap cut the answer: raise max_output_tokens)" if finish_reason == "length" else ""
        details: JSONObject = {"mode": mode, "attempts": attempts, "error": error}
        if finish_reason is not None:
            details["finish_reason"] = finish_reason
        raise StructuredOutputInvalid(f"the answer is not valid {fmt.name} JSON: {error}{hint}", details=details)
    value: JSONValue = json.loads(_strip_fence(text))
    if fmt.model is not None:
        return fmt.model.model_validate(value)
    return value


def answer_error(text: str, fmt: ResponseFormat) -> str | None:
    """Why ``text`` is no valid answer (None: it is one)."""
    try:
        value = json.loads(_strip_fence(text))
    except json.JSONDecodeError as exc:
        return f"not JSON ({exc.msg} at character {exc.pos})"
    problem = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(dict(fmt.schema)).iter_errors(value))
    if problem is not None:
        where = problem.json_path if problem.path else "$"
        return f"{where}: {problem.message}"
    if fmt.model is not None:
        try:
            fmt.model.model_validate(value)
        except ValidationError as exc:
            return f"{fmt.model.__name__}: {exc.errors()[0]['msg']}"
    return None


def prompted_instruction(fmt: ResponseFormat) -> str:
    """The system text that asks a model for the answer in prose (servers that cannot constrain)."""
    schema = json.dumps(dict(fmt.schema), ensure_ascii=False, sort_keys=True)
    return f"{PROMPTED_PREFIX}, no prose and no code fence, valid against this JSON Schema:\n{schema}"


def check_schema_limits(schema: object) -> None:
    """Raise ``ResponseSchemaTooLarge`` when ``schema`` holds more than ``MAX_SCHEMA_NODES``
    values or nests deeper than ``MAX_SCHEMA_DEPTH``. No recursion, and it stops at the first
    limit crossed: cheap on any input. (``MAX_SCHEMA_BYTES`` needs the JSON text: ``ResponseFormat.build``.)"""
    # Each container visited: (index of its parent here, its key there); a pointer is built
    # from it only when a limit is crossed.
    parents: list[tuple[int, str]] = [(-1, "")]
    stack: list[tuple[object, int, int]] = [(schema, 1, 0)]  # (container, depth, index in parents)
    nodes = 1
    while stack:
        value, depth, at = stack.pop()
        members = (
            value.items()
            if isinstance(value, Mapping)
            else enumerate(value)
            if isinstance(value, (list, tuple))
            else ()
        )
        for key, child in members:
            nodes += 1
            if nodes > MAX_SCHEMA_NODES:
                raise ResponseSchemaTooLarge(
                    f"the response schema holds more than {MAX_SCHEMA_NODES} values (objects, arrays, strings, "
                    f"numbers ...); the limit is max_schema_nodes={MAX_SCHEMA_NODES}",
                    limit="max_schema_nodes",
                    maximum=MAX_SCHEMA_NODES,
                )
            if isinstance(child, (Mapping, list, tuple)):
                parents.append((at, str(key)))
                if depth + 1 > MAX_SCHEMA_DEPTH:
                    where = _pointer(parents, len(parents) - 1)
                    raise ResponseSchemaTooLarge(
                        f"the response schema nests deeper than {MAX_SCHEMA_DEPTH} levels at '{where}'; "
                        f"the limit is max_schema_depth={MAX_SCHEMA_DEPTH} (use $defs and $ref for deep structures)",
                        limit="max_schema_depth",
                        maximum=MAX_SCHEMA_DEPTH,
                        path=where,
                    )
                stack.append((child, depth + 1, len(parents) - 1))


P = ParamSpec("P")
T = TypeVar("T")

_schema_pool = ThreadPoolExecutor(max_workers=SCHEMA_WORKERS, thread_name_prefix="abstractruntime-mlx-schema")


async def run_schema_work(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on the schema threads: off the event loop, and never more than
    ``SCHEMA_WORKERS`` at once, so many large schemas wait for each other, not for other requests.
    Cancelling the await drops work that has not started."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_schema_pool, functools.partial(fn, *args, **kwargs))


def _pointer(parents: list[tuple[int, str]], at: int) -> str:
    """The JSON pointer of container ``at`` (keys cut to 64 characters: it goes into a message)."""
    keys: list[str] = []
    while at > 0:
        at, key = parents[at]
        keys.append(key[:64].replace("~", "~0").replace("/", "~1"))
    return "".join(f"/{key}" for key in reversed(keys))


def _checked_schema(schema: Mapping[str, object]) -> JSONObject:
    check_schema_limits(schema)
    try:
        text = json.dumps(dict(schema), allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidResponseSchema(f"the response schema is not JSON: {exc}") from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise ResponseSchemaTooLarge(
            f"the response schema is {len(text)} bytes of JSON; the limit is max_schema_bytes={MAX_SCHEMA_BYTES}",
            limit="max_schema_bytes",
            maximum=MAX_SCHEMA_BYTES,
        )
    plain: JSONValue = json.loads(text)  # a plain JSON copy
    if not isinstance(plain, dict):
        raise InvalidResponseSchema("the response schema must be a JSON object")
    try:
        jsonschema.Draft202012Validator.check_schema(plain)
    except jsonschema.exceptions.SchemaError as exc:
        pointer = "".join(f"/{part}" for part in exc.path)
        raise InvalidResponseSchema(
            f"the response schema is not a valid JSON Schema at '{pointer or '/'}': {exc.message}", path=pointer
        ) from None
    return plain


def _strip_fence(text: str) -> str:
    """Models asked in prose often wrap JSON in a Markdown fence; constrained output never does."""
    stripped = text.strip()
    if stripped.startswith("```") and stripped.endswith("```"):
        inner = stripped[3:-3]
        return inner.split("\n", 1)[1] if "\n" in inner else inner
    return stripped
