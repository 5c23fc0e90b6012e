"""The SSD tier: private single-writer namespaces, identity, flush at unload, restore in a later process."""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine.cache import prefix_cache, upstream

SYSTEM = "You are a careful assistant who answers briefly. " * 12
TURN_1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Question 0: what does a cache keep?"}]

# Run in a separate process: one conversation turn (or two) on a disk-backed cache, JSON out.
CHILD = textwrap.dedent(
    """
    import json, sys
    from abstractruntime_mlx import create_llm
    from abstractruntime_mlx.errors import MLXRuntimeError
    model, disk, messages, hold = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "hold"
    try:
        llm = create_llm("mlx", model=model, mlx_batching=True, speculation=False, mlx_cache_disk_path=disk)
    except MLXRuntimeError as exc:
        print(json.dumps({"error": exc.code, "message": exc.message, "details": exc.details}))
        sys.exit(0)
    r = llm.generate("", messages=messages, prompt_cache_key="disk", max_output_tokens=8, thinking=False)
    out = {"tokens": r.token_ids, "usage": r.usage, "prompt_cache": r.metadata["prompt_cache"],
           "stats": llm.get_prompt_cache_stats()}
    print(json.dumps(out), flush=True)
    if hold:
        sys.stdin.readline()  # keep the namespace owned until the parent says so
    llm.unload_model(llm.model)
    """
)


def child(model, disk, messages, *, hold=False):
    args = [sys.executable, "-c", CHILD, str(model), str(disk), json.dumps(messages), "hold" if hold else "run"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if hold:
        return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def turn_2(first_content):
    return TURN_1 + [
        {"role": "assistant", "content": first_content},
        {"role": "user", "content": "Question 1: and why?"},
    ]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["dense_model", "hybrid_model"])
def test_flush_at_unload_and_restore_in_a_second_process(request, make_llm, model_name, tmp_path):
    model = request.getfixturevalue(model_name)
    disk = tmp_path / "cache"
    llm = make_llm(model, mlx_batching=True, speculation=False, mlx_cache_disk_path=str(disk))
    first = llm.generate("", messages=TURN_1, prompt_cache_key="disk", max_output_tokens=8, thinking=False)
    plain = llm.generate("", messages=turn_2(first.content), max_output_tokens=8, thinking=False)
    stats = llm.get_prompt_cache_stats()
    assert stats["disk"]["enabled"] is True and stats["disk"]["path"].startswith(str(disk))
    namespace = Path(stats["disk"]["path"])
    assert llm.unload_model(llm.model)
    # flushed at unload: the snapshot files, the identity marker, a private directory
    assert list(namespace.glob("*.safetensors"))
    assert json.loads((namespace / prefix_cache.IDENTITY_FILE).read_text())["schema"] == prefix_cache.SCHEMA
    assert (disk.stat().st_mode & 0o777) == 0o700 and (namespace.stat().st_mode & 0o777) == 0o700

    later = child(model, disk, turn_2(first.content))
    cache = later["prompt_cache"]
    assert later["tokens"] == plain.token_ids  # greedy identity across processes
    assert cache["cached_tokens"] >= 0.9 * first.usage["prompt_tokens"] - prefix_cache.BLOCK_SIZE
    assert cache["apc"]["disk_hits"] > 0
    assert later["stats"]["disk"]["files"] > 0


@pytest.mark.slow
def test_second_live_process_on_one_path_gets_a_typed_error(make_llm, dense_model, tmp_path):
    disk = tmp_path / "cache"
    owner = child(dense_model, disk, TURN_1, hold=True)
    try:
        line = owner.stdout.readline()
        assert json.loads(line)["prompt_cache"]["outcome"] == "miss"
        with pytest.raises(errors.PromptCacheLocked) as info:
            make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
        assert info.value.code == "prompt_cache_locked" and info.value.http_status == 409
        assert str(disk) in str(info.value) and info.value.details["path"].startswith(str(disk))
    finally:
        owner.stdin.write("\n")
        owner.stdin.flush()
        owner.wait(60)
    # the owner left: the path is free again, and what it wrote is intact
    llm = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
    assert llm.get_prompt_cache_stats()["disk"]["files"] > 0


def test_symlinked_or_world_readable_directories_are_refused(make_llm, dense_model, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(errors.PromptCachePathUnsafe) as info:
        make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(link))
    assert "symlink" in str(info.value) and info.value.details["path"] == str(link)
    assert info.value.http_status == 400
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(errors.PromptCachePathUnsafe) as info:
        make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(shared))
    assert "chmod 700" in str(info.value)


def test_disk_tier_needs_the_batching_lane(make_llm, dense_model, tmp_path):
    with pytest.raises(errors.InvalidControls) as info:
        make_llm(dense_model, mlx_batching=False, mlx_cache_disk_path=str(tmp_path / "c"))
    assert info.value.field == "mlx_cache_disk_path"


@pytest.mark.slow
def test_changed_weights_never_reuse(make_llm, dense_model, tmp_path):
    import mlx.core as mx

    model = tmp_path / "model"
    shutil.copytree(dense_model, model)
    disk = tmp_path / "cache"
    llm = make_llm(str(model), mlx_batching=True, mlx_cache_disk_path=str(disk))
    first = llm.generate("", messages=TURN_1, prompt_cache_key="disk", max_output_tokens=8, thinking=False)
    llm.unload_model(llm.model)
    before = child(model, disk, turn_2(first.content))
    assert before["prompt_cache"]["cached_tokens"] > 0  # same weights: reused
    weights = next(model.glob("*.safetensors"))
    tensors = mx.load(str(weights))
    mx.save_safetensors(str(weights), tensors, metadata={"format": "mlx", "edited": "1"})
    after = child(model, disk, turn_2(first.content))
    assert after["prompt_cache"]["cached_tokens"] == 0
    assert after["prompt_cache"]["apc"]["disk_hits"] == 0
    assert after["stats"]["disk"]["namespace"] != before["stats"]["disk"]["namespace"]


@pytest.mark.slow
def test_damaged_cache_files_are_a_miss_not_a_crash(make_llm, dense_model, tmp_path, caplog):
    disk = tmp_path / "cache"
    llm = make_llm(dense_model, mlx_batching=True, mlx_cache_disk_path=str(disk))
    first = llm.generate("", messages=TURN_1, prompt_cache_key="disk", max_output_tokens=8, thinking=False)
    plain = llm.generate("", messages=turn_2(first.content), max_output_tokens=8, thinking=False)
    namespace = Path(llm.get_prompt_cache_stats()["disk"]["path"])
    llm.unload_model(llm.model)
    files = sorted(namespace.glob("*.safetensors"))
    assert files
    for i, path in enumerate(files):
        data = path.read_bytes()
        # one truncated in its tensor data, the others with a garbage header
        path.write_bytes(data[: len(data) // 2] if i == 0 else b"\xff" * 64)
    later = child(dense_model, disk, turn_2(first.content))
    assert later["tokens"] == plain.token_ids
    assert later["prompt_cache"]["outcome"] in {"miss", "partial"}


def cache_on_disk(make_llm, model, disk):
    """One keyed turn written to the SSD tier and flushed by unload; the uncached greedy answer of the next turn."""
    llm = make_llm(model, mlx_batching=True, speculation=False, mlx_cache_disk_path=str(disk))
    first = llm.generate("", messages=TURN_1, prompt_cache_key="disk", max_output_tokens=8, thinking=False)
    plain = llm.generate("", messages=turn_2(first.content), max_output_tokens=8, thinking=False)
    namespace = Path(llm.get_prompt_cache_stats()["disk"]["path"])
    assert llm.unload_model(llm.model)
    return first, plain, namespace


def leading_shard(namespace):
    """The shard holding the prefix's first blocks (segment 0), with its checksum sidecar."""
    from mlx_vlm.apc import _read_safetensors_metadata

    shards = [p for p in namespace.glob("shard_*.safetensors") if _read_safetensors_metadata(p)["segment_index"] == "0"]
    assert len(shards) == 1 and upstream.sidecar_of(shards[0]).is_file()
    return shards[0]


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["dense_model", "hybrid_model"])
def test_bytes_changed_in_place_are_a_counted_miss(request, make_llm, model_name, tmp_path, caplog):
    model = request.getfixturevalue(model_name)
    disk = tmp_path / "cache"
    first, plain, namespace = cache_on_disk(make_llm, model, disk)
    files = sorted(p for p in namespace.glob("*.safetensors"))  # KV block shards (dense), checkpoints (hybrid)
    assert files and all(upstream.sidecar_of(p).is_file() for p in files)
    for path in files:  # 4 KB flipped in place inside the tensor data: same size, same name
        size = path.stat().st_size
        header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
        offset = header_end + (size - header_end) // 2 - 2048
        assert header_end <= offset and offset + 4096 <= size
        with open(path, "r+b") as handle:
            handle.seek(offset)
            damaged = bytes(b ^ 0xFF for b in handle.read(4096))
            handle.seek(offset)
            handle.write(damaged)
        assert path.stat().st_size == size

    llm = make_llm(model, mlx_batching=True, speculation=False, mlx_cache_disk_path=str(disk))  # a restart
    with caplog.at_level(logging.WARNING, logger=upstream.__name__):
        later = llm.generate(
            "", messages=turn_2(first.content), prompt_cache_key="disk", max_output_tokens=8, thinking=False
        )
        again = llm.generate(
            "", messages=turn_2(first.content), prompt_cache_key="disk", max_output_tokens=8, thinking=False
        )
    cache = later.metadata["prompt_cache"]
    assert later.token_ids == plain.token_ids  # greedy identity with the uncached answer
    assert cache["outcome"] == "miss" and cache["cached_tokens"] == 0
    assert cache["apc"]["disk_corrupt"] == len(files) and cache["apc"]["disk_hits"] == 0
    assert again.token_ids == plain.token_ids and again.metadata["prompt_cache"]["apc"]["disk_corrupt"] == 0
    stats = llm.get_prompt_cache_stats()
    assert stats["counters"]["disk_corrupt"] == len(files) and stats["disk"]["corrupt_files"] == len(files)
    # each discarded with its checksum, and said once
    for path in files:
        assert not path.exists() and not upstream.sidecar_of(path).exists()
        warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
        assert len(warnings) == 1 and "does not match its checksum" in warnings[0]


@pytest.mark.parametrize("when", ["before_start", "while_running"])
def test_a_symlinked_shard_is_never_followed(make_llm, dense_model, tmp_path, when):
    disk = tmp_path / "cache"
    first, plain, namespace = cache_on_disk(make_llm, dense_model, disk)
    shard = leading_shard(namespace)
    original = shard.read_bytes()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / shard.name
    target.write_bytes(original)  # a valid shard: it matches the sidecar left in the namespace

    def swap():
        shard.unlink()
        shard.symlink_to(target)

    if when == "before_start":
        swap()
    llm = make_llm(dense_model, mlx_batching=True, speculation=False, mlx_cache_disk_path=str(disk))
    if when == "while_running":
        assert llm.get_prompt_cache_stats()["disk"]["blocks_indexed"] > 0
        swap()
    later = llm.generate(
        "", messages=turn_2(first.content), prompt_cache_key="disk", max_output_tokens=8, thinking=False
    )
    cache = later.metadata["prompt_cache"]
    assert later.token_ids == plain.token_ids
    assert cache["cached_tokens"] == 0 and cache["apc"]["disk_hits"] == 0
    assert llm.get_prompt_cache_stats()["counters"]["disk_corrupt"] == 1
    # the link is gone, what it pointed at is untouched
    assert not os.path.lexists(shard) and target.read_bytes() == original


def test_the_upstream_methods_the_ssd_tier_overrides_are_still_there(tmp_path):
    """mlx-vlm is pinned below 0.8; a release that renames or reshapes one of these fails here, loudly."""
    from mlx_vlm.apc import DiskBlockStore

    for name, parameters in upstream.UPSTREAM_HOOKS.items():
        assert hasattr(DiskBlockStore, name), (
            f"mlx-vlm's DiskBlockStore no longer has {name}; see engine/cache/upstream.py"
        )
        found = tuple(inspect.signature(getattr(DiskBlockStore, name)).parameters)
        assert found == parameters, f"DiskBlockStore.{name}{found} changed; engine/cache/upstream.py overrides it"
    store = upstream.VerifiedDiskStore(tmp_path, namespace="hooks")
    try:
        for name in upstream.UPSTREAM_STATE:
            assert hasattr(store, name), f"DiskBlockStore no longer has {name}; engine/cache/upstream.py reads it"
    finally:
        store.close()


def put_at(path, kind, other):
    """A directory, a FIFO, a symlink to ``other`` or a hard link to ``other`` where ``path`` was."""
    if os.path.lexists(path):
        path.unlink()
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink":
        path.symlink_to(other)
    else:
        os.link(other, path)


@pytest.mark.parametrize("when", ["before_start", "while_running"])
@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink", "hardlink"])
def test_a_checksum_that_is_not_a_private_regular_file_is_a_counted_miss(make_llm, dense_model, tmp_path, kind, when):
    """A directory made the load raise IsADirectoryError, a FIFO hung it: now each is a miss,
    counted, the shard skipped and the prompt prefilled; a linked file is never written."""
    disk = tmp_path / "cache"
    first, plain, namespace = cache_on_disk(make_llm, dense_model, disk)
    shard = leading_shard(namespace)
    sidecar = upstream.sidecar_of(shard)
    other = tmp_path / "elsewhere.sha256"
    recorded = sidecar.read_bytes()
    other.write_bytes(recorded)  # the right checksum: only what the name is makes it unusable
    if when == "before_start":
        put_at(sidecar, kind, other)
    llm = make_llm(dense_model, mlx_batching=True, speculation=False, mlx_cache_disk_path=str(disk))
    if when == "while_running":
        assert llm.get_prompt_cache_stats()["disk"]["blocks_indexed"] > 0
        put_at(sidecar, kind, other)
    later = llm.generate(
        "", messages=turn_2(first.content), prompt_cache_key="disk", max_output_tokens=8, thinking=False
    )
    assert later.token_ids == plain.token_ids
    assert (
        later.metadata["prompt_cache"]["cached_tokens"] == 0
    )  # the leading shard is skipped: nothing after it is a prefix
    assert llm.get_prompt_cache_stats()["counters"]["disk_corrupt"] == 1
    assert not os.path.lexists(shard)
    assert other.read_bytes() == recorded  # what a link pointed at is never written


@pytest.mark.parametrize("kind", ["directory", "fifo", "hardlink"])
def test_a_shard_that_is_not_a_private_regular_file_is_a_counted_miss(make_llm, dense_model, tmp_path, kind):
    disk = tmp_path / "cache"
    first, plain, namespace = cache_on_disk(make_llm, dense_model, disk)
    shard = leading_shard(namespace)
    original = shard.read_bytes()
    other = tmp_path / "elsewhere.safetensors"
    other.write_bytes(original)  # a valid shard: it matches the sidecar left in the namespace
    llm = make_llm(dense_model, mlx_batching=True, speculation=False, mlx_cache_disk_path=str(disk))
    assert llm.get_prompt_cache_stats()["disk"]["blocks_indexed"] > 0
    put_at(shard, kind, other)
    later = llm.generate(
        "", messages=turn_2(first.content), prompt_cache_key="disk", max_output_tokens=8, thinking=False
    )
    assert later.token_ids == plain.token_ids
    assert later.metadata["prompt_cache"]["cached_tokens"] == 0
    assert llm.get_prompt_cache_stats()["counters"]["disk_corrupt"] == 1
    assert other.read_bytes() == original  # a hard link's other name keeps its bytes
