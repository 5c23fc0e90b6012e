"""The SSD tier: private single-writer namespaces, identity, flush at unload, restore in a later process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from abstractruntime_mlx import errors
from abstractruntime_mlx.engine import prefix_cache

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
    return TURN_1 + [{"role": "assistant", "content": first_content}, {"role": "user", "content": "Question 1: and why?"}]


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
