"""The Core policy: the MTP default stored in AbstractCore's own config file.

The file is shared with AbstractCore (same path resolution, same schema), so a change made
with ``abstractcore config set-default``, the Gateway console or
``abstractruntime-mlx config set-default`` is seen by both.

- Path: ``$ABSTRACTCORE_CONFIG_FILE``, else ``$ABSTRACTCORE_CONFIG_DIR/abstractcore.json``,
  else ``~/.abstractcore/config/abstractcore.json``. Only ``config_path`` reads the environment.
- Key: ``capability_defaults.routes["input.text"].options.speculation``. ``output.text`` is an
  alias of the same setting; writes are stored under ``input.text``; reads check
  ``output.text`` then ``input.text`` (as AbstractCore does) and skip rows whose
  ``source`` is ``"not_configured"``.
- Values: ``false`` (off), an object (native MTP), or absent (no policy: inherit).
- Thinking: ``options.thinking`` of the same row (``true``/``false`` or a level string; absent:
  inherit), the policy level of the thinking control.
- Missing file: the fresh-install seed ``{"mode": "native_mtp", "num_draft_tokens": 2,
  "require_acceleration": false}`` applies. Reading never writes; ``ensure_seeded`` creates
  the file with the seed only when it does not exist, and ``set_default_speculation`` starts
  from the seed when it has to create the file. An existing file is never reseeded.
- Re-read when it changes: reads are cached by the file's stat stamp
  ``(inode, mtime_ns, ctime_ns, size)``, so a per-request read costs one ``stat``.
- A corrupt file raises ``PolicyError`` naming the path and the key; never a silent default.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Final, Literal

from .controls import ControlLevel, SpeculationControl, ThinkingValue, normalize_speculation, normalize_thinking
from .errors import InvalidControls, PolicyError
from .json_values import parse_ascii_int

CONFIG_FILE_ENV: Final = "ABSTRACTCORE_CONFIG_FILE"
CONFIG_DIR_ENV: Final = "ABSTRACTCORE_CONFIG_DIR"
CONFIG_FILE_NAME: Final = "abstractcore.json"
DEFAULT_CONFIG_DIR: Final = Path("~/.abstractcore/config")

TEXT_ROUTE_STORAGE_KEY: Final = "input.text"
TEXT_ROUTE_ALIAS: Final = "output.text"
TEXT_ROUTE_READ_ORDER: Final[tuple[str, ...]] = (TEXT_ROUTE_ALIAS, TEXT_ROUTE_STORAGE_KEY)
CAPABILITY_DEFAULTS_VERSION: Final = 1

SEED_SPECULATION: Final = SpeculationControl(mode="native_mtp", num_draft_tokens=2, require_acceleration=False)
SEED_MARKER: Final = "abstractruntime-mlx/speculation-v1"

SpeculationSetting = Literal["inherit", "off"] | int


def config_path(env: Mapping[str, str] = os.environ) -> Path:
    """Where the Core config file is (the only function here that reads the environment)."""
    explicit = env.get(CONFIG_FILE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    directory = env.get(CONFIG_DIR_ENV)
    base = Path(directory).expanduser() if directory else DEFAULT_CONFIG_DIR.expanduser()
    return base / CONFIG_FILE_NAME


@dataclass(frozen=True)
class PolicySnapshot:
    """What the policy file says now.

    ``speculation`` is the policy (``None``: no policy, inherit); ``source`` is ``"file"`` when
    the file holds a value, ``"absent"`` when the file exists without one, ``"seed"`` when
    the file does not exist and the fresh-install seed applies.
    """

    path: Path
    exists: bool
    speculation: SpeculationControl | None
    source: Literal["file", "absent", "seed"]
    capability_defaults: Mapping[str, object] | None
    thinking: ThinkingValue = None

    @property
    def controls(self) -> ControlLevel:
        """The policy level of the precedence chain."""
        return ControlLevel(speculation=self.speculation, thinking=self.thinking)

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "path": str(self.path),
            "exists": self.exists,
            "speculation": None if self.speculation is None else self.speculation.to_wire(),
            "speculation_source": self.source,
            "capability_defaults": copy.deepcopy(dict(self.capability_defaults))
            if self.capability_defaults is not None
            else None,
        }
        if self.thinking is not None:
            out["thinking"] = self.thinking
        return out


def read_policy(path: str | Path | None = None) -> PolicySnapshot:
    """Read the policy file (cached by stat stamp). ``path=None`` uses ``config_path()``."""
    resolved = Path(path).expanduser() if path is not None else config_path()
    try:
        stamp = resolved.stat()
    except FileNotFoundError:
        return PolicySnapshot(
            path=resolved, exists=False, speculation=SEED_SPECULATION, source="seed", capability_defaults=None
        )
    except OSError as exc:
        raise PolicyError(
            f"cannot read the Core policy file {resolved}: {exc}", details={"path": str(resolved)}
        ) from exc
    return _read_cached(str(resolved), stamp.st_ino, stamp.st_mtime_ns, stamp.st_ctime_ns, stamp.st_size)


def read_speculation_policy(path: str | Path | None = None) -> SpeculationControl | None:
    """The configured MTP policy: a ``SpeculationControl`` (off or native MTP) or ``None``.

    Missing file → the fresh-install seed (native MTP, depth 2, optional acceleration).
    Cheap enough to call per request. Raises ``PolicyError`` on a corrupt file.
    """
    return read_policy(path).speculation


def read_policy_controls(path: str | Path | None = None) -> ControlLevel:
    """What the Core policy says about speculation and thinking (the ``policy`` level)."""
    return read_policy(path).controls


def ensure_seeded(path: str | Path | None = None) -> bool:
    """Create the file with the fresh-install seed if it does not exist; True when created.

    An existing file is never touched (not even when it lacks a speculation key).
    """
    resolved = Path(path).expanduser() if path is not None else config_path()
    if resolved.exists():
        return False
    return _write_atomic(resolved, _seed_document(), exclusive=True)


def set_default_speculation(
    route: str, value: SpeculationSetting, path: str | Path | None = None
) -> SpeculationControl | None:
    """Change only the MTP policy of the text route; return the policy now in force.

    ``value``: ``"off"`` writes ``false``; an int N >= 1 writes
    ``{"mode": "native_mtp", "num_draft_tokens": N, "require_acceleration": false}``;
    ``"inherit"`` removes the key (it does not restore the seed). Every other option of the
    route and every other key of the file are preserved. The write is atomic (temp file +
    ``os.replace``). A missing file is created from the seed first; a corrupt file is refused
    with ``PolicyError`` rather than overwritten.
    """
    canonical = canonical_route(route)
    setting = _setting_to_wire(value)
    resolved = Path(path).expanduser() if path is not None else config_path()
    if resolved.exists():
        document = _load_document(resolved)
    else:
        document = _seed_document()
    defaults = _child_object(document, "capability_defaults", resolved, "capability_defaults", create=True)
    defaults.setdefault("version", CAPABILITY_DEFAULTS_VERSION)
    routes = _child_object(defaults, "routes", resolved, "capability_defaults.routes", create=True)
    row = _child_object(routes, canonical, resolved, f"capability_defaults.routes.{canonical}", create=True)
    options = _child_object(row, "options", resolved, f"capability_defaults.routes.{canonical}.options", create=True)
    if setting is _INHERIT:
        options.pop("speculation", None)
    else:
        options["speculation"] = setting
    # output.text names the same setting: a value stored under the alias would shadow ours.
    alias = routes.get(TEXT_ROUTE_ALIAS)
    if isinstance(alias, dict) and isinstance(alias.get("options"), dict):
        alias["options"].pop("speculation", None)
    _write_atomic(resolved, document)
    return read_speculation_policy(resolved)


def canonical_route(route: str) -> str:
    """``output.text`` and ``input.text`` are one stored setting, kept under ``input.text``."""
    key = route.strip().lower()
    if key in TEXT_ROUTE_READ_ORDER:
        return TEXT_ROUTE_STORAGE_KEY
    raise InvalidControls(
        f"speculation is a text-route setting; route must be {TEXT_ROUTE_ALIAS!r} or {TEXT_ROUTE_STORAGE_KEY!r}",
        field="route",
        value=route,
    )


def parse_speculation_setting(text: str) -> SpeculationSetting:
    """Parse a CLI/console value: ``"inherit"``, ``"off"`` or a depth N >= 1."""
    word = text.strip().lower()
    if word == "inherit":
        return "inherit"
    if word == "off":
        return "off"
    depth = parse_ascii_int(word)
    if depth is not None and depth >= 1:
        return depth
    raise InvalidControls("speculation must be 'inherit', 'off' or a depth >= 1", field="speculation", value=text)


# --------------------------------------------------------------------------- internals

_INHERIT: Final = object()


def _setting_to_wire(value: object) -> object:
    """The JSON value to store for a ``SpeculationSetting``, or ``_INHERIT`` (remove the key)."""
    if value == "inherit" and isinstance(value, str):
        return _INHERIT
    if value == "off" and isinstance(value, str):
        return False
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidControls(
            "speculation must be 'inherit', 'off' or an integer depth >= 1", field="speculation", value=value
        )
    return SpeculationControl(mode="native_mtp", num_draft_tokens=value, require_acceleration=False).to_wire()


def _seed_document() -> dict[str, object]:
    return {
        "capability_defaults": {
            "version": CAPABILITY_DEFAULTS_VERSION,
            "routes": {TEXT_ROUTE_STORAGE_KEY: {"options": {"speculation": SEED_SPECULATION.to_wire()}}},
            "seeded": SEED_MARKER,
        }
    }


@lru_cache(maxsize=16)
def _read_cached(path: str, inode: int, mtime_ns: int, ctime_ns: int, size: int) -> PolicySnapshot:
    resolved = Path(path)
    document = _load_document(resolved)
    raw_defaults = document.get("capability_defaults")
    if raw_defaults is None:
        return PolicySnapshot(path=resolved, exists=True, speculation=None, source="absent", capability_defaults=None)
    if not isinstance(raw_defaults, dict):
        raise _corrupt(resolved, "capability_defaults", "must be an object")
    speculation, found = _speculation_from_defaults(raw_defaults, resolved)
    return PolicySnapshot(
        path=resolved,
        exists=True,
        speculation=speculation,
        source="file" if found else "absent",
        capability_defaults=raw_defaults,
        thinking=_thinking_from_defaults(raw_defaults, resolved),
    )


def _speculation_from_defaults(defaults: dict[str, object], path: Path) -> tuple[SpeculationControl | None, bool]:
    for where, options in _text_route_options(defaults, path):
        if "speculation" not in options:
            continue
        try:
            return normalize_speculation(options["speculation"], field=f"{where}.options.speculation"), True
        except InvalidControls as exc:
            raise _corrupt(path, exc.field or f"{where}.options.speculation", exc.message) from exc
    return None, False


def _thinking_from_defaults(defaults: dict[str, object], path: Path) -> ThinkingValue:
    for where, options in _text_route_options(defaults, path):
        if "thinking" not in options:
            continue
        try:
            return normalize_thinking(options["thinking"], field=f"{where}.options.thinking")
        except InvalidControls as exc:
            raise _corrupt(path, exc.field or f"{where}.options.thinking", exc.message) from exc
    return None


def _text_route_options(defaults: dict[str, object], path: Path) -> list[tuple[str, dict[str, object]]]:
    """``(where, options)`` of the text-route rows in read order (rows not configured skipped)."""
    routes = defaults.get("routes")
    if routes is None:
        return []
    if not isinstance(routes, dict):
        raise _corrupt(path, "capability_defaults.routes", "must be an object")
    found: list[tuple[str, dict[str, object]]] = []
    for key in TEXT_ROUTE_READ_ORDER:
        row = routes.get(key)
        if row is None:
            continue
        where = f"capability_defaults.routes.{key}"
        if not isinstance(row, dict):
            raise _corrupt(path, where, "must be an object")
        if row.get("source") == "not_configured":
            continue
        options = row.get("options")
        if options is None:
            continue
        if not isinstance(options, dict):
            raise _corrupt(path, f"{where}.options", "must be an object")
        found.append((where, options))
    return found


def _load_document(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError(f"cannot read the Core policy file {path}: {exc}", details={"path": str(path)}) from exc
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PolicyError(
            f"the Core policy file {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})",
            details={"path": str(path), "key": None},
        ) from exc
    if not isinstance(document, dict):
        raise _corrupt(path, "(root)", "must be a JSON object")
    return document


def _child_object(parent: dict[str, object], key: str, path: Path, where: str, *, create: bool) -> dict[str, object]:
    child = parent.get(key)
    if child is None and create:
        child = parent[key] = {}
    if not isinstance(child, dict):
        raise _corrupt(path, where, "must be an object")
    return child


def _corrupt(path: Path, key: str, problem: str) -> PolicyError:
    return PolicyError(
        f"the Core policy file {path} is invalid at {key}: {problem}; fix it or set it with "
        f"`abstractruntime-mlx config set-default output.text --speculation 2|off|inherit`",
        details={"path": str(path), "key": key},
    )


def _write_atomic(path: Path, document: Mapping[str, object], *, exclusive: bool = False) -> bool:
    """Write ``document`` as the whole file, atomically; False when ``exclusive`` and it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json.dumps(document, indent=2, ensure_ascii=False) + "\n"
    mode = None
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        pass
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(tmp_name, mode)
        if exclusive:
            # Never replace a file that appeared meanwhile (another process seeded it).
            os.link(tmp_name, path)
            os.unlink(tmp_name)
        else:
            os.replace(tmp_name, path)
    except FileExistsError:
        os.unlink(tmp_name)
        return False
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return True
