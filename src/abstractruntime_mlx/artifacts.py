"""Model artifacts on disk, without loading weights.

- ``resolve_model_path(name)``: a local directory, or a snapshot already in the Hugging Face
  cache (offline: nothing is ever downloaded here). Missing → ``ModelNotFound`` whose
  message names the command that fetches it.
- ``read_safetensors_headers(path)``: the JSON headers of ``*.safetensors`` files (8-byte
  little-endian length + JSON); tensor data is never read.
- ``detect_mtp(path)``: embedded MTP weights (tensor keys under ``mtp.``) and companion MTP
  heads (a checkpoint whose ``model_type`` ends with ``_mtp``).
- ``model_fingerprint(path)``: a bounded identity of a checkpoint (file sizes, header
  hashes, small config/tokenizer files) for cache keys.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Final

from .errors import InvalidRequest, ModelNotFound
from .json_values import object_at

DOWNLOAD_COMMAND: Final = "abstractruntime-mlx models download {name}"
MAX_HEADER_BYTES: Final = 100 * 1024 * 1024
"""A safetensors header larger than this is treated as corrupt (upstream uses the same bound)."""

MTP_KEY_PREFIX: Final = "mtp."
HEAD_MODEL_TYPE_SUFFIX: Final = "_mtp"
COMPANION_SUFFIX: Final = "-MTP"
_QUANT_SUFFIX = re.compile(
    r"^(?P<base>.+?)(?P<suffix>-(?:\d+(?:\.\d+)?bit|bf16|fp16|fp8|mxfp4|nvfp4|q\d\w*)(?:-.*)?)$",
    re.IGNORECASE,
)
_CONFIG_MTP_LAYER_KEYS: Final = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_layers")
_FINGERPRINT_SMALL_FILES: Final = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
    "model.safetensors.index.json",
)


# --------------------------------------------------------------------------- resolution


def looks_like_path(name: str) -> bool:
    """A name that can only be a filesystem path (not a ``org/repo`` hub id)."""
    return name.startswith(("/", "./", "../", "~")) or name in (".", "..") or "\\" in name


def resolve_model_path(name: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The local directory of ``name``: itself if it is a directory, else its cached hub snapshot.

    Never downloads. ``cache_dir`` overrides the Hugging Face cache location (default: the
    ``HF_HUB_CACHE`` resolution of ``huggingface_hub``). Raises ``ModelNotFound``.
    """
    text = str(name).strip()
    if not text:
        raise ModelNotFound("no model name given", details={"model": text})
    local = Path(text).expanduser()
    if local.is_dir():
        return local.resolve()
    if isinstance(name, Path) or looks_like_path(text) or local.exists():
        raise ModelNotFound(f"model directory {text!r} does not exist (or is not a directory)", details={"model": text})
    snapshot = hub_snapshot(text, cache_dir=cache_dir)
    if snapshot is None:
        raise ModelNotFound(
            f"model {text!r} is not on this machine (not a local directory, not in the Hugging Face cache); "
            f"download it with `{DOWNLOAD_COMMAND.format(name=text)}`",
            details={"model": text, "command": DOWNLOAD_COMMAND.format(name=text)},
        )
    return snapshot


def hub_snapshot(repo_id: str, *, cache_dir: str | Path | None = None) -> Path | None:
    """The cached snapshot directory of ``repo_id`` (offline lookup), or ``None``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        found = snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None
    path = Path(str(found))
    return path if path.is_dir() else None


def hub_repo_id(path: Path) -> str | None:
    """``org/name`` when ``path`` is a snapshot inside a Hugging Face cache, else ``None``."""
    parent = path.parent
    if parent.name != "snapshots" or not parent.parent.name.startswith("models--"):
        return None
    parts = parent.parent.name.removeprefix("models--").split("--")
    return "/".join(parts) if len(parts) == 2 and all(parts) else None


# --------------------------------------------------------------------------- headers


def safetensors_files(path: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a checkpoint directory (sorted), or ``[path]`` for a file."""
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted(p for p in root.glob("*.safetensors") if p.is_file())


def read_safetensors_header(file: str | Path) -> dict[str, object]:
    """The JSON header of one safetensors file (reads 8 + header-length bytes, no tensor data)."""
    raw = _header_bytes(Path(file))
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad_checkpoint(Path(file), "header is not valid JSON") from exc
    if not isinstance(header, dict):
        raise _bad_checkpoint(Path(file), "header is not a JSON object")
    return header


def read_safetensors_headers(path: str | Path) -> dict[str, dict[str, object]]:
    """``{file name: header}`` for every ``*.safetensors`` file of ``path`` (a dir or a file).

    Raises ``InvalidRequest`` (code ``invalid_request``) naming the file if a header is corrupt.
    """
    return {file.name: read_safetensors_header(file) for file in safetensors_files(path)}


def tensor_names(headers: Mapping[str, Mapping[str, object]]) -> list[str]:
    """All tensor names in ``headers`` (the ``__metadata__`` entry excluded)."""
    return [key for header in headers.values() for key in header if key != "__metadata__"]


def _header_bytes(file: Path) -> bytes:
    try:
        with file.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise _bad_checkpoint(file, "shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            size = file.stat().st_size
            if length > MAX_HEADER_BYTES or length > size - 8:
                raise _bad_checkpoint(file, f"header length {length} is impossible for a {size}-byte file")
            raw = handle.read(length)
    except OSError as exc:
        raise _bad_checkpoint(file, f"cannot be read ({exc})") from exc
    if len(raw) != length:
        raise _bad_checkpoint(file, "truncated header")
    return raw


def _bad_checkpoint(file: Path, problem: str) -> InvalidRequest:
    return InvalidRequest(f"{file} is not a valid safetensors file: {problem}", details={"path": str(file)})


# --------------------------------------------------------------------------- config / MTP


def read_config(path: str | Path) -> dict[str, object] | None:
    """``config.json`` of a checkpoint directory, ``None`` when absent. Corrupt → ``InvalidRequest``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"{file} is not valid JSON ({exc})", details={"path": str(file)}) from exc
    if not isinstance(config, dict):
        raise InvalidRequest(f"{file} is not a JSON object", details={"path": str(file)})
    return config


def model_type(config: Mapping[str, object] | None) -> str | None:
    if not config:
        return None
    value = config.get("model_type")
    return value if isinstance(value, str) else None


def is_mtp_head(path: str | Path) -> bool:
    """True when ``path`` is a companion MTP head (its ``model_type`` ends with ``_mtp``)."""
    kind = model_type(read_config(path))
    return bool(kind and kind.endswith(HEAD_MODEL_TYPE_SUFFIX))


def is_mtp_key(name: str) -> bool:
    """An embedded MTP tensor: ``mtp.*`` (or ``<prefix>.mtp.*`` in a wrapped VLM checkpoint)."""
    return name.startswith(MTP_KEY_PREFIX) or f".{MTP_KEY_PREFIX}" in name


def config_mtp_layers(config: Mapping[str, object] | None) -> int:
    """MTP layers the config declares (top level or ``text_config``), 0 when none."""
    for block in (config or {}, object_at(config or {}, "text_config")):
        for key in _CONFIG_MTP_LAYER_KEYS:
            value = block.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def companion_candidates(name: str) -> list[str]:
    """Conventional companion-head names for ``name``: ``<name>-MTP`` and, for a quantized
    name such as ``org/Model-27B-4bit``, ``org/Model-27B-MTP-4bit``."""
    out = [f"{name}{COMPANION_SUFFIX}"]
    head, _, leaf = name.rpartition("/")
    match = _QUANT_SUFFIX.match(leaf)
    if match:
        inserted = f"{match['base']}{COMPANION_SUFFIX}{match['suffix']}"
        out.append(f"{head}/{inserted}" if head else inserted)
    return out


def detect_mtp(
    path: str | Path,
    *,
    name: str | None = None,
    head: str | Path | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, object]:
    """What MTP evidence a checkpoint directory carries (headers and configs only).

    ``name`` is the name the model was asked for (hub id or path; derived from a cache
    snapshot path when omitted); ``head`` names a companion head explicitly. Returns::

        {"model_type": str|None,
         "num_weight_files": int,      # *.safetensors files found
         "is_head": bool,              # path itself is a companion head (model_type *_mtp)
         "embedded": bool,             # tensor keys under mtp. present
         "num_mtp_keys": int,
         "config_mtp_layers": int,     # layers the config declares (0: none declared)
         "companion": str|None,        # name of the companion head (explicit or found)
         "companion_path": str|None,   # its local directory when present
         "head_present": bool|None,    # True: weights here; False: named but not local; None: unknown
         "verified": bool}             # embedded weights, or a companion head named/found
    """
    root = Path(path)
    config = read_config(root)
    kind = model_type(config)
    headers = read_safetensors_headers(root)
    keys = tensor_names(headers)
    num_mtp = sum(1 for key in keys if is_mtp_key(key))
    embedded = num_mtp > 0
    companion: str | None = None
    companion_path: Path | None = None
    if head is not None:
        companion = str(head)
        companion_path = _local_head(companion, cache_dir=cache_dir, require_head_type=False)
    elif not embedded:
        for candidate in _conventional_heads(root, name=name):
            found = _local_head(candidate, cache_dir=cache_dir, require_head_type=True)
            if found is not None:
                companion, companion_path = candidate, found
                break
    if embedded:
        head_present: bool | None = True
    elif companion is not None:
        head_present = companion_path is not None and bool(safetensors_files(companion_path))
    else:
        head_present = None
    return {
        "model_type": kind,
        "num_weight_files": len(headers),
        "is_head": bool(kind and kind.endswith(HEAD_MODEL_TYPE_SUFFIX)),
        "embedded": embedded,
        "num_mtp_keys": num_mtp,
        "config_mtp_layers": config_mtp_layers(config),
        "companion": companion,
        "companion_path": str(companion_path) if companion_path is not None else None,
        "head_present": head_present,
        "verified": embedded or companion is not None,
    }


def _conventional_heads(root: Path, *, name: str | None) -> Iterable[str]:
    seen: set[str] = set()
    repo = hub_repo_id(root)
    for base in (name, repo):
        if not base or looks_like_path(base) or Path(base).expanduser().is_dir():
            continue
        for candidate in companion_candidates(base):
            if candidate not in seen:
                seen.add(candidate)
                yield candidate
    for candidate in companion_candidates(root.name):
        sibling = str(root.parent / candidate)
        if repo is None and sibling not in seen:
            seen.add(sibling)
            yield sibling


def _local_head(name: str, *, cache_dir: str | Path | None, require_head_type: bool) -> Path | None:
    try:
        found = resolve_model_path(name, cache_dir=cache_dir)
    except ModelNotFound:
        return None
    if require_head_type and not is_mtp_head(found):
        return None
    return found


# --------------------------------------------------------------------------- fingerprint


def model_fingerprint(path: str | Path) -> str:
    """``sha256:<hex>`` over file sizes, safetensors header hashes and small config/tokenizer
    files (and the hub revision when ``path`` is a cache snapshot).

    Bounded: tensor data is not hashed, so an in-place edit of tensor values that keeps every
    size and header is not detected; treat local checkpoints as immutable.
    """
    root = Path(path)
    digest = hashlib.sha256()
    if hub_repo_id(root) is not None:
        digest.update(f"revision:{root.name}\n".encode())
    for file in safetensors_files(root):
        header_hash = hashlib.sha256(_header_bytes(file)).hexdigest()
        digest.update(f"tensor:{file.name}:{file.stat().st_size}:{header_hash}\n".encode())
    for name in _FINGERPRINT_SMALL_FILES:
        file = root / name
        if file.is_file():
            digest.update(f"file:{name}:{hashlib.sha256(file.read_bytes()).hexdigest()}\n".encode())
    return f"sha256:{digest.hexdigest()}"


def size_on_disk(source: str) -> int | None:
    """Bytes of the files under ``source`` (a directory, or a repo id in the Hugging Face cache); None if unknown."""
    path = Path(source).expanduser()
    if not path.is_dir():
        found = hub_snapshot(source)
        if found is None:
            return None
        path = Path(found)
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())  # stat follows the cache's links
    except OSError:
        return None
