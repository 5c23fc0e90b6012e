"""The tools a call offers and its ``tool_choice``, checked once at the edge. Pure: no MLX, no I/O.

A tool is OpenAI's ``{"type": "function", "function": {"name", "description"?, "parameters"?}}``
or AbstractCore's flat ``{"name", "description"?, "parameters"?}``. ``tool_choice``:

- ``"auto"`` (the default): the model may answer or call; calls are read from its text;
- ``"none"``: no tools reach the chat template and nothing is read as a call;
- ``"required"``: the answer is exactly one call of one of the tools;
- ``{"type": "function", "function": {"name": N}}`` (or ``{"name": N}``): exactly one call of N.

The last two are enforced by the grammar engine (``engine.grammar``): ``call_schema`` is the
JSON Schema of the call object the model's format writes, arguments matching the tool's
``parameters``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

from .errors import InvalidTools
from .json_values import JSONObject, JSONValue
from .model_output import ToolFormat

ChoiceMode = Literal["none", "auto", "required", "function"]

MAX_TOOLS: Final = 128
"""Most tools one call may offer (OpenAI's limit)."""
_TOOL_NAME: Final = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_DEFS_KEYS: Final = ("$defs", "definitions")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ChoiceMode = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        """The answer must be a call (``required`` or a named function)."""
        return self.mode in ("required", "function")

    def to_openai(self) -> JSONValue:
        if self.mode == "function":
            return {"type": "function", "function": {"name": self.name}}
        return self.mode


AUTO: Final = ToolChoice()


def tool_name(tool: Mapping[str, object]) -> str:
    """The function name of a checked tool."""
    spec = tool.get("function")
    name = (spec if isinstance(spec, Mapping) else tool).get("name")
    assert isinstance(name, str)
    return name


def tool_parameters(tool: Mapping[str, object]) -> Mapping[str, object]:
    """The ``parameters`` schema of a checked tool (any object when it gives none)."""
    spec = tool.get("function")
    params = (spec if isinstance(spec, Mapping) else tool).get("parameters")
    return params if isinstance(params, Mapping) and params else {"type": "object"}


def check_tools(tools: object, *, field: str = "tools") -> tuple[JSONObject, ...]:
    """``tools`` as given, each checked: a function tool with a valid, unique name and an
    object ``parameters`` schema; anything else raises ``InvalidTools`` naming where."""
    if tools is None:
        return ()
    if not isinstance(tools, (list, tuple)):
        raise InvalidTools(f"{field} must be a list of tool objects", field=field)
    if len(tools) > MAX_TOOLS:
        raise InvalidTools(f"{field} holds {len(tools)} tools; at most {MAX_TOOLS} are accepted", field=field)
    seen: set[str] = set()
    out: list[JSONObject] = []
    for index, tool in enumerate(tools):
        where = f"{field}.{index}"
        if not isinstance(tool, Mapping):
            raise InvalidTools(f"{where} must be a tool object", field=where)
        kind = tool.get("type", "function")
        if kind != "function":
            raise InvalidTools(
                f"{where}.type must be 'function' (got {kind!r}); only function tools are served", field=f"{where}.type"
            )
        spec = tool.get("function", tool)
        at = f"{where}.function" if "function" in tool else where
        if not isinstance(spec, Mapping):
            raise InvalidTools(f"{at} must be an object with 'name' and 'parameters'", field=at)
        name = spec.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidTools(
                f"{at}.name must be 1 to 64 letters, digits, '_', '-' or '.' (got {name!r})", field=f"{at}.name"
            )
        if name in seen:
            raise InvalidTools(f"{at}.name {name!r} is offered twice", field=f"{at}.name")
        seen.add(name)
        params = spec.get("parameters")
        if params is not None and not _is_object_schema(params):
            raise InvalidTools(f"{at}.parameters must be a JSON Schema of an object", field=f"{at}.parameters")
        description = spec.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidTools(f"{at}.description must be a string", field=f"{at}.description")
        out.append(dict(tool))
    return tuple(out)


def parse_tool_choice(
    value: object, tools: Sequence[Mapping[str, object]], *, field: str = "tool_choice"
) -> ToolChoice:
    """The ``tool_choice`` of a call offering ``tools`` (``None``: ``auto``)."""
    if value is None:
        return AUTO
    names = [tool_name(t) for t in tools]
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise InvalidTools(f"{field} must be 'none', 'auto', 'required' or a function (got {value!r})", field=field)
        if value == "required" and not tools:
            raise InvalidTools(f"{field} 'required' needs tools to choose from; none were offered", field=field)
        return ToolChoice(mode=value)  # type: ignore[arg-type]  # one of the three, checked above
    if isinstance(value, Mapping):
        kind = value.get("type", "function")
        spec = value.get("function", value)
        name = spec.get("name") if isinstance(spec, Mapping) else None
        if kind != "function" or not isinstance(name, str):
            raise InvalidTools(f'{field} must be {{"type": "function", "function": {{"name": ...}}}}', field=field)
        if name not in names:
            offered = ", ".join(names) or "none"
            raise InvalidTools(
                f"{field} names tool {name!r}, which is not among the tools offered ({offered})",
                field=f"{field}.function.name",
            )
        return ToolChoice(mode="function", name=name)
    raise InvalidTools(f"{field} must be a string or an object", field=field)


def call_schema(tools: Sequence[Mapping[str, object]], choice: ToolChoice, fmt: ToolFormat) -> JSONObject:
    """The JSON Schema of the one call ``choice`` forces, as ``fmt`` writes it: ``name`` then
    ``arguments`` (Llama 3: ``parameters``). Each tool's ``$defs`` move to the root, where its
    ``$ref``s point."""
    assert choice.forced
    chosen = [t for t in tools if choice.mode == "required" or tool_name(t) == choice.name]
    arguments_key = "parameters" if fmt == "llama3" else "arguments"
    defs: dict[str, JSONValue] = {}
    options: list[JSONValue] = []
    for tool in chosen:
        params = dict(tool_parameters(tool))
        for key in _DEFS_KEYS:
            moved = params.pop(key, None)
            if isinstance(moved, Mapping):
                for def_name, definition in moved.items():
                    ref = f"{key}/{def_name}"
                    if ref in defs and json.dumps(defs[ref], sort_keys=True) != json.dumps(definition, sort_keys=True):
                        raise InvalidTools(
                            f"tools define {key} {def_name!r} differently; the forced call needs one meaning",
                            field="tools",
                        )
                    defs[ref] = definition
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool_name(tool)}, arguments_key: params},  # type: ignore[dict-item]
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema: JSONObject = dict(options[0]) if len(options) == 1 else {"anyOf": options}  # type: ignore[arg-type]
    for ref, definition in defs.items():
        key, _, def_name = ref.partition("/")
        section = schema.setdefault(key, {})
        assert isinstance(section, dict)
        section[def_name] = definition
    return schema


def _is_object_schema(params: object) -> bool:
    if not isinstance(params, Mapping):
        return False
    kind = params.get("type", "object")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)
