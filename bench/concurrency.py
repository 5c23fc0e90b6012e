"""Concurrency benchmark: our MLX provider against the bare library and its peers.

    python bench/concurrency.py                  # tiny + ~27M model, c = 1, 2, 4, 8 (~7 min on 2 cores)
    python bench/concurrency.py --quick          # tiny model only, c = 1, 4 (~20-40 s)
    python bench/concurrency.py --models tiny    # the tiny model alone, c = 1, 2, 4, 8
    python bench/concurrency.py --json out.json  # also write every figure
    python bench/concurrency.py --targets ours,raw --models small --concurrency 1,8 --repeats 3
    python bench/concurrency.py --client --models tiny --repeats 8  # client-side mode (bench/client_side.py)
    # on a GPU: random bf16 Qwen3-0.6B / 4B shapes, 64 requests at every concurrency
    python bench/concurrency.py --models 0.6b,4b --concurrency 1,16,32,64 --requests 64 --repeats 2

In ONE process, on the same random-weight checkpoints (``bench/_models.py``: the package's
tiny dense model and a 27M-parameter qwen3) and the same prompts (distinct 40-80-token user
messages rendered through the chat template with thinking off; greedy; 64 new tokens), each
concurrency c sends N requests (``--requests-per-slot`` x c: 2c on the tiny model, c on the
27M one; or a fixed ``--requests N`` at every c) from a pool of c client threads, repeated
``--repeats`` times with fresh prompts, to the targets below. ``--models 0.6b,4b`` builds
random-weight bf16 checkpoints of those models' shapes (``bench/_models.py``: vocabulary 151936,
the tiny tokenizer padded to it), meant for a GPU. The providers' batch size is the largest c.

- ``forward``: the pure-forward ceiling (``bench/forward.py``): waves of c rows, prefilled
  untimed, then 64 decode steps of ``argmax(model(y[:, None], cache))`` with ``mx.async_eval``
  and one sync at the end; every other target's tok/s is also printed as its share of it;
- ``raw``: mlx-vlm's ``BatchGenerator`` driven directly on the main thread, all N prompts
  inserted at once, ``completion_batch_size = c``, greedy, no detokenisation; the admission
  gate is re-opened every step as our engine does, so a finished row is back-filled at once.
  The limit. Its TTFT counts from the common insert, so second-wave rows include the first
  wave's decode;
- ``raw_lm``: mlx-lm's ``BatchGenerator`` driven the same way (token ids in, no embeddings);
- ``stream_generate``: ``mlx_lm.stream_generate`` on one long-lived worker thread, requests
  served one at a time in arrival order (a lock, in effect): the single-request reference;
- ``ours``: ``abstractruntime_mlx.create_llm("mlx", mlx_batching=True, mlx_max_batch_size=C,
  speculation=False)`` (C: the largest concurrency, or ``--max-batch``), ``generate(stream=True)``;
- ``ours_batch``: the same with ``mlx_single_lane=False`` (a lone request decodes in upstream's
  batch step too): the single-request lane's before;
- ``ours_vlm``: ours with ``mlx_text_lane=False`` (every batch in mlx-vlm's loop): the text
  lane's before;
- ``ours_bucketed``: ours with ``mlx_prefill_buckets=True`` (prompt chunks padded to a few
  lengths, those shapes warmed at load);
- ``ours_unfused``: ours with ``mlx_fused_decode_attention=False`` (upstream's masked decode
  attention; on CUDA the kernel's before, elsewhere the same as ours);
- ``ours_cudnn``: ours with ``mlx_prefill_attention_ops=False`` (prompt chunks' attention in
  cuDNN, a plan built per new shape; on CUDA the plain-ops prefill's before, elsewhere the same
  as ours);
- ``ours_idle_rows`` / ``ours_compact_rows``: ours with ``mlx_idle_finished_rows=True`` /
  ``False`` (the own loop's finished rows idle until half the batch has finished, or are
  dropped at once; by default they idle on CUDA only);
- ``ours_separate_proj``: ours with ``mlx_fused_projections=False`` (the text lane's model
  keeps upstream's separate q/k/v and gate/up matmuls: the fused projections' before);
- ``abstractcore``: AbstractCore's MLX provider with the same options (``speculation=False``);
- ``mlx_lm.server``: a ``python -m mlx_lm.server`` subprocess on loopback, OpenAI chat
  requests streamed with httpx (``max_tokens``, ``temperature: 0``,
  ``chat_template_kwargs: {enable_thinking: false}``).

All targets are loaded and warmed up (every batch width once) first; then every repeat runs
every target once, in a rotating order, so a slow spell of a shared machine hits all alike.
Aggregate tok/s is the completion tokens of a point's runs over their summed wall time (first
submit to last completion). Two TTFTs, both from the moment the request is handed over:
to the first token (raw loop; ``stream_generate``; the providers' own
``metadata.execution.ttft_s``) and to the first chunk carrying text, as the client sees it
(mlx-lm's streaming detokenizer holds text back to word boundaries, so this depends on the
output text too). Both are taken on the client's thread for every target (``stream_generate``'s
worker hands each event over, as a server's would). A target that cannot load is skipped with
the reason printed.

Per-step profile, per point: decode steps, wall ms per step, and for our provider the split of
the worker's step (its engine counters, ``Engine.step_profile``): time inside the backend's step
(upstream bookkeeping, graph building and device waits), time handling the step's tokens
(detokenising, stop strings, delivery), the rest (admission, cancels), and the worker thread's
CPU time per step (the remainder of the wall time it waited on the device). With NVML present
(``nvidia-ml-py``), the GPU's mean utilisation during the point is sampled every 20 ms.

First-seen shapes, per point and target (``bench/shapes.py``): the (batch, length) of every call
of the checkpoint's language model goes into one process-wide set; printed is how many were new
during the point's runs (prefills / decode steps) and how many it used. The providers' queues
(``mlx_max_queue_size``, ours and AbstractCore's) hold every request of the busiest point.

``--py-spy DIR`` adds, after each point's measured runs, one more run per target under py-spy
(``bench/pyspy.py``; native frames, not counted in the figures): the raw profile goes to DIR and
the log lists the busiest thread's functions by inclusive share of its samples.

``--client`` switches to the client-side mode (``bench/client_side.py``): N distinct chat
requests from c client threads, each request's time split into before submit (template,
tokenisation, controls), queue, prefill, decode and delivery, ours against ``stream_generate``
at c = 1 and against mlx-lm's batch loop fed as requests arrive at c > 1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import platform
import queue
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import _models  # bench/_models.py (``python bench/X.py`` puts bench/ first on sys.path)
import client_side
from client_side import _fmt
from forward import ForwardLoop
from shapes import ShapeLog, Window

MAX_TOKENS = 64
MAX_BATCH = 8  # the providers' mlx_max_batch_size; main() sets it to the largest concurrency
QUEUE_SIZE = 32  # the providers' mlx_max_queue_size; main() sizes it to the most requests of a point
SERIAL_TARGETS = ("stream_generate", "mlx_lm.server")  # one request at a time
# Ours with one option changed (the module docstring says what each measures).
OURS_VARIANTS: dict[str, dict[str, Any]] = {
    "ours_batch": {"mlx_single_lane": False},
    "ours_vlm": {"mlx_text_lane": False},
    "ours_bucketed": {"mlx_prefill_buckets": True},
    "ours_unfused": {"mlx_fused_decode_attention": False},
    "ours_cudnn": {"mlx_prefill_attention_ops": False},
    "ours_idle_rows": {"mlx_idle_finished_rows": True},
    "ours_compact_rows": {"mlx_idle_finished_rows": False},
    "ours_separate_proj": {"mlx_fused_projections": False},
}
TARGETS = ("forward", "raw", "raw_lm", "stream_generate", "ours", *OURS_VARIANTS, "abstractcore", "mlx_lm.server")
FLOORS = {  # ours / X: the floor each ratio should reach, per concurrency (None = any)
    "forward": {32: 0.6, 64: 0.6},
    "raw": {None: 0.95, 16: 1.0, 32: 1.3, 64: 1.3},
    "raw_lm": {None: 0.95, 4: 1.0, 8: 1.0, 16: 1.0, 32: 1.3, 64: 1.3},
    "stream_generate": {1: 1.0},
    "ours_batch": {1: 1.0, None: 0.95},
    "ours_vlm": {None: 1.0},
    "abstractcore": {1: 1.2, 4: 1.0, 8: 1.0, 16: 1.3, 32: 1.3, 64: 1.3},
    "mlx_lm.server": {1: 1.1, 4: 1.0, 8: 1.0},
}
SHAPES = ShapeLog()  # every forward input shape this process has run (bench/shapes.py)

WORDS = (
    "the model reads a long request about rivers cities music planets gardens engines "
    "history language weather bridges markets forests oceans trains libraries and "
    "mountains while every answer should stay short clear kind careful useful honest "
    "quick simple bright quiet green small large old new first last next other"
).split()


# --- results ---------------------------------------------------------------------------


@dataclass
class Request:
    tokens: int = 0
    ttft_s: float | None = None  # to the first chunk carrying text, seen by the client
    token_ttft_s: float | None = None  # to the first token (where the target exposes it)
    start: float = 0.0
    end: float = 0.0


@dataclass
class Point:
    model: str
    target: str
    concurrency: int
    requests: int
    completion_tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float | None  # first text chunk (client)
    ttft_p95_ms: float | None
    token_ttft_p50_ms: float | None = None  # first token
    token_ttft_p95_ms: float | None = None
    error: str | None = None
    # per-step profile (see the module docstring); None where the target does not expose it
    steps: int | None = None
    step_ms: float | None = None
    backend_ms: float | None = None
    tokens_ms: float | None = None
    other_ms: float | None = None
    cpu_ms: float | None = None
    gpu_util: float | None = None
    # forward input shapes (bench/shapes.py): first seen in this process during this point's
    # runs (prefills: length > 1; decode steps: length 1), and all it used
    new_prefill_shapes: int | None = None
    new_decode_shapes: int | None = None
    shapes_used: int | None = None
    forward_share: float | None = None  # tok/s over the forward target's at this point
    run_tok_s: list[float] = field(default_factory=list)  # per repeat, in repeat order


@dataclass
class Profile:
    """Step counters summed over a point's runs."""

    steps: int = 0
    step_s: float = 0.0
    backend_s: float | None = None
    tokens_s: float | None = None
    cpu_s: float | None = None
    gpu_util: list[float] | None = None

    def add(self, other: Profile) -> Profile:
        def plus(a: float | None, b: float | None) -> float | None:
            return None if a is None or b is None else a + b

        util = None if self.gpu_util is None or other.gpu_util is None else self.gpu_util + other.gpu_util
        return Profile(
            self.steps + other.steps,
            self.step_s + other.step_s,
            plus(self.backend_s, other.backend_s),
            plus(self.tokens_s, other.tokens_s),
            plus(self.cpu_s, other.cpu_s),
            util,
        )


class GpuSampler:
    """Mean GPU utilisation (NVML) while a run lasts; inert without NVML or a GPU."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.handle: Any = None
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.nvml = pynvml

    @contextlib.contextmanager
    def sample(self, into: list[float]) -> Any:
        if self.handle is None:
            yield
            return
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    into.append(float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
                stop.wait(self.interval_s)

        thread = threading.Thread(target=loop, name="nvml-sampler", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


GPU = GpuSampler()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    if len(values) == 1:
        return values[0]
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarise(
    model: str,
    target: str,
    c: int,
    reqs: list[Request],
    wall: float,
    profile: Profile | None = None,
    shapes: Window | None = None,
    run_tok_s: list[float] | None = None,
) -> Point:
    tokens = sum(r.tokens for r in reqs)
    ttft = [r.ttft_s * 1000 for r in reqs if r.ttft_s is not None]
    tok = [r.token_ttft_s * 1000 for r in reqs if r.token_ttft_s is not None]
    extra: dict[str, Any] = {}
    if profile is not None and profile.steps:
        per = 1000.0 / profile.steps
        extra = {
            "steps": profile.steps,
            "step_ms": round(profile.step_s * per, 3),
            "backend_ms": None if profile.backend_s is None else round(profile.backend_s * per, 3),
            "tokens_ms": None if profile.tokens_s is None else round(profile.tokens_s * per, 3),
            "cpu_ms": None if profile.cpu_s is None else round(profile.cpu_s * per, 3),
        }
        if profile.backend_s is not None and profile.tokens_s is not None:
            extra["other_ms"] = round((profile.step_s - profile.backend_s - profile.tokens_s) * per, 3)
    if profile is not None and profile.gpu_util:
        extra["gpu_util"] = round(statistics.mean(profile.gpu_util), 1)
    if shapes is not None:
        extra.update(
            new_prefill_shapes=shapes.new_prefill, new_decode_shapes=shapes.new_decode, shapes_used=len(shapes.used)
        )
    return Point(
        model=model,
        target=target,
        concurrency=c,
        requests=len(reqs),
        completion_tokens=tokens,
        wall_s=round(wall, 4),
        tok_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        ttft_p50_ms=_round(_pct(ttft, 0.5)),
        ttft_p95_ms=_round(_pct(ttft, 0.95)),
        token_ttft_p50_ms=_round(_pct(tok, 0.5)),
        token_ttft_p95_ms=_round(_pct(tok, 0.95)),
        run_tok_s=run_tok_s or [],
        **extra,
    )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# --- prompts ---------------------------------------------------------------------------


@dataclass
class Prompt:
    text: str
    ids: list[int]


class PromptBook:
    """Distinct prompts per (concurrency, index), the same for every target."""

    def __init__(self, tokenizer: Any, seed: int = 0) -> None:
        self.tok = tokenizer
        self.seed = seed

    def _text(self, key: str) -> str:
        rng = random.Random(f"{self.seed}:{key}")
        goal = rng.randint(40, 80)
        words = [f"Request {key}:"]
        while len(self.tok.encode(" ".join(words), add_special_tokens=False)) < goal:
            words.append(rng.choice(WORDS))
        while len(self.tok.encode(" ".join(words), add_special_tokens=False)) > goal and len(words) > 2:
            words.pop()
        return " ".join(words)

    def prompt(self, key: str) -> Prompt:
        text = self._text(key)
        rendered = self.tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, enable_thinking=False
        )
        return Prompt(text, list(self.tok.encode(rendered, add_special_tokens=False)))

    def batch(self, tag: str, c: int, n: int) -> list[Prompt]:
        return [self.prompt(f"{tag}-c{c}-{i}") for i in range(n)]


# --- client-driven targets ---------------------------------------------------------------


class ClientTarget:
    """A target driven by a pool of ``c`` client threads, one ``call`` per request."""

    name = ""
    skip_reason: str | None = None
    last_profile: Profile | None = None  # of the last run, where the target exposes one

    def setup(self, path: Path) -> None: ...

    def call(self, prompt: Prompt, max_tokens: int) -> Request:
        raise NotImplementedError

    def teardown(self) -> None: ...

    def counters(self) -> Profile | None:
        """Cumulative step counters (None: the target has none)."""
        return None

    def run(self, prompts: list[Prompt], c: int, max_tokens: int = MAX_TOKENS) -> tuple[list[Request], float]:
        before = self.counters()
        with ThreadPoolExecutor(max_workers=c, thread_name_prefix=f"client-{self.name}") as pool:
            t0 = time.perf_counter()
            futures = [pool.submit(self.call, p, max_tokens) for p in prompts]
            reqs = [f.result() for f in futures]
        wall = max(r.end for r in reqs) - t0
        after = self.counters()
        if before is not None and after is not None:
            self.last_profile = Profile(
                after.steps - before.steps,
                after.step_s - before.step_s,
                _minus(after.backend_s, before.backend_s),
                _minus(after.tokens_s, before.tokens_s),
                _minus(after.cpu_s, before.cpu_s),
            )
        return reqs, wall


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


class StreamGenerateTarget(ClientTarget):
    """mlx-lm ``stream_generate`` on one worker thread that never exits (MLX thread state)."""

    name = "stream_generate"

    def setup(self, path: Path) -> None:
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(str(path))
        self.steps, self.step_s, self.cpu_s = 0, 0.0, 0.0
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name="stream-generate-worker", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        import mlx_lm

        while True:
            job = self.jobs.get()
            if job is None:
                return
            prompt, max_tokens, out = job
            try:
                n, first = 0, False
                t0, c0 = time.perf_counter(), time.thread_time()
                for response in mlx_lm.stream_generate(self.model, self.tokenizer, prompt.ids, max_tokens=max_tokens):
                    # Each event is handed to the client, which takes the time (as ours): a
                    # consumer on another thread waits its turn for the interpreter alike.
                    if n == 0:
                        out.put(("token", None))
                    if response.finish_reason != "stop" or response.token not in self.tokenizer.eos_token_ids:
                        n += 1
                    if response.text and not first:
                        first = True
                        out.put(("text", None))
                self.steps += n
                self.step_s += time.perf_counter() - t0
                self.cpu_s += time.thread_time() - c0
                out.put(("done", n))
            except BaseException as exc:  # noqa: BLE001
                out.put(("error", exc))

    def call(self, prompt: Prompt, max_tokens: int) -> Request:
        req = Request(start=time.perf_counter())
        out: queue.Queue = queue.Queue()
        self.jobs.put((prompt, max_tokens, out))
        while True:
            kind, value = out.get()
            if kind == "token":
                req.token_ttft_s = time.perf_counter() - req.start
            elif kind == "text":
                req.ttft_s = time.perf_counter() - req.start
            elif kind == "error":
                raise value
            else:
                req.tokens = value
                break
        req.end = time.perf_counter()
        return req

    def counters(self) -> Profile | None:
        return Profile(self.steps, self.step_s, cpu_s=self.cpu_s)

    def teardown(self) -> None:
        # The worker parks on the queue forever: a thread that ran MLX work must not exit.
        self.model = self.tokenizer = None


class ProviderTarget(ClientTarget):
    """``create_llm(...).generate(stream=True)``: ours or AbstractCore's."""

    def __init__(self, name: str, factory: Callable[[Path], Any]) -> None:
        self.name = name
        self.factory = factory
        self.llm: Any = None

    def setup(self, path: Path) -> None:
        self.llm = self.factory(path)

    def counters(self) -> Profile | None:
        engine = getattr(self.llm, "_engine", None)  # ours: the engine's step counters
        if engine is None:
            return None
        p = engine.step_profile()
        return Profile(p["num_steps"], p["step_s"], p["backend_s"], p["tokens_s"], p["cpu_s"])

    def call(self, prompt: Prompt, max_tokens: int) -> Request:
        req = Request(start=time.perf_counter())
        last = None
        n_text = 0
        for chunk in self.llm.generate(
            prompt.text, stream=True, thinking=False, temperature=0, max_output_tokens=max_tokens
        ):
            if getattr(chunk, "content", None) or getattr(chunk, "reasoning", None):
                n_text += 1
                if req.ttft_s is None:
                    req.ttft_s = time.perf_counter() - req.start
            last = chunk
        req.end = time.perf_counter()
        usage = getattr(last, "usage", None) or {}
        req.tokens = int(usage.get("completion_tokens") or usage.get("output_tokens") or n_text)
        execution = (getattr(last, "metadata", None) or {}).get("execution") or {}
        if execution.get("ttft_s") is not None:  # the engine's submit -> first token
            req.token_ttft_s = float(execution["ttft_s"])
        return req

    def teardown(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.unload_model(self.llm.model)
            self.llm = None


def ours_factory(path: Path, **options: Any) -> Any:
    from abstractruntime_mlx import create_llm

    return create_llm(
        "mlx",
        model=str(path),
        mlx_batching=True,
        mlx_max_batch_size=MAX_BATCH,
        mlx_max_queue_size=QUEUE_SIZE,
        speculation=False,
        **options,
    )


def _alias(path: Path, tag: str) -> Path:
    """The checkpoint under a second directory of file links: one process holds one resident
    model per directory, so a second provider with other options needs its own."""
    alias = path.parent / f"{path.name}-{tag}"
    alias.mkdir(exist_ok=True)
    for file in path.iterdir():
        link = alias / file.name
        if not link.exists():
            link.symlink_to(file.resolve())
    return alias


def abstractcore_factory(path: Path) -> Any:
    import warnings

    from abstractcore import create_llm

    # AbstractCore warns on every length-truncated answer; all of ours are.
    warnings.filterwarnings("ignore", message="Output truncated", category=RuntimeWarning)
    return create_llm(
        "mlx",
        model=str(path),
        mlx_batching=True,
        mlx_max_batch_size=MAX_BATCH,
        mlx_max_queue_size=QUEUE_SIZE,
        speculation=False,
    )


def _die_with_parent() -> None:
    """In the server child: get SIGTERM when the benchmark dies, however it dies (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerTarget(ClientTarget):
    """``python -m mlx_lm.server`` on loopback, streamed OpenAI chat completions."""

    name = "mlx_lm.server"

    def setup(self, path: Path) -> None:
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.NamedTemporaryFile(prefix="mlx_lm_server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlx_lm.server",
                "--model",
                str(path),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        self.base = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=32))
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm.server exited with {self.proc.returncode}; log: {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if self.client.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlx_lm.server not ready after 120 s; log: {self.log.name}")
            time.sleep(0.2)

    def call(self, prompt: Prompt, max_tokens: int) -> Request:
        body = {
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "chat_template_kwargs": {"enable_thinking": False},
        }
        req = Request(start=time.perf_counter())
        n_text = 0
        usage: dict[str, Any] = {}
        with self.client.stream("POST", self.base + "/v1/chat/completions", json=body) as resp:
            resp.raise_for_status()
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue  # ": keepalive" comments and blank lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning") or delta.get("reasoning_content"):
                        n_text += 1
                        if req.ttft_s is None:
                            req.ttft_s = time.perf_counter() - req.start
        req.end = time.perf_counter()
        req.tokens = int(usage.get("completion_tokens") or n_text)
        return req

    def teardown(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(Exception):
            self.log.close()
            os.unlink(self.log.name)


# --- the raw upstream loop -------------------------------------------------------------------


class RawLoopTarget:
    """mlx-vlm ``BatchGenerator`` driven on this thread: the ceiling for a batching provider."""

    name = "raw"
    skip_reason: str | None = None
    last_profile: Profile | None = None

    def setup(self, path: Path) -> None:
        import mlx_vlm

        self.model, self.processor = mlx_vlm.load(str(path))
        self.lm = getattr(self.model, "language_model", self.model)
        tok = self.processor.tokenizer if hasattr(self.processor, "tokenizer") else self.processor
        eos = getattr(tok, "eos_token_ids", None)
        if eos is None:
            eos = tok.eos_token_id
        self.eos = {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}

    def _kwargs(self, ids: list[int]) -> dict[str, Any]:
        import mlx.core as mx

        if not hasattr(self.model, "get_input_embeddings"):
            return {}
        out = self.model.get_input_embeddings(mx.array([ids]), None)
        return {k: v for k, v in out.to_dict().items() if v is not None}

    def run(self, prompts: list[Prompt], c: int, max_tokens: int = MAX_TOKENS) -> tuple[list[Request], float]:
        from mlx_vlm.generate.ar import BatchGenerator

        gen = BatchGenerator(
            self.lm,
            self.processor,
            completion_batch_size=c,
            prefill_batch_size=c,
            prefill_step_size=256,
            compute_logprobs=False,
            greedy_sampling=True,
        )
        t0 = time.perf_counter()
        uids = gen.insert(
            [p.ids for p in prompts],
            max_tokens=[max_tokens] * len(prompts),
            prompt_kwargs=[self._kwargs(p.ids) for p in prompts],
        )
        reqs = {uid: Request(start=t0) for uid in uids}
        steps, c0 = 0, time.thread_time()
        while gen.has_work:
            # Re-open the admission gate as the engine does (else a freed slot waits for all).
            gen.prefill_batch_size = max(1, c - len(gen._generation_batch))
            _, responses = gen.next()
            steps += 1
            now = time.perf_counter()
            for r in responses:
                req = reqs[r.uid]
                if req.token_ttft_s is None:
                    req.token_ttft_s = now - t0
                if not (r.finish_reason == "stop" and r.token in self.eos):
                    req.tokens += 1
                if r.finish_reason is not None:
                    req.end = now
        gen.close()
        out = [reqs[u] for u in uids]
        wall = max(r.end for r in out) - t0
        self.last_profile = Profile(steps, wall, cpu_s=time.thread_time() - c0)
        return out, wall

    def teardown(self) -> None:
        import mlx.core as mx

        self.model = self.processor = self.lm = None
        mx.clear_cache()


class RawLmLoopTarget:
    """mlx-lm's ``BatchGenerator`` driven on this thread, token ids in, greedy."""

    name = "raw_lm"
    skip_reason: str | None = None
    last_profile: Profile | None = None

    def setup(self, path: Path) -> None:
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(str(path))
        self.eos = {int(e) for e in self.tokenizer.eos_token_ids}

    def run(self, prompts: list[Prompt], c: int, max_tokens: int = MAX_TOKENS) -> tuple[list[Request], float]:
        from mlx_lm.generate import BatchGenerator

        gen = BatchGenerator(
            self.model,
            max_tokens=max_tokens,
            stop_tokens=[[e] for e in self.eos],
            completion_batch_size=c,
            prefill_batch_size=c,
            prefill_step_size=256,
        )
        t0 = time.perf_counter()
        uids = gen.insert([p.ids for p in prompts], max_tokens=[max_tokens] * len(prompts))
        reqs = {uid: Request(start=t0) for uid in uids}
        done: set[int] = set()
        steps, c0 = 0, time.thread_time()
        while len(done) < len(uids):
            _, responses = gen.next()
            steps += 1
            now = time.perf_counter()
            for r in responses:
                req = reqs[r.uid]
                if req.token_ttft_s is None:
                    req.token_ttft_s = now - t0
                if not (r.finish_reason == "stop" and r.token in self.eos):
                    req.tokens += 1
                if r.finish_reason is not None:
                    req.end = now
                    done.add(r.uid)
        gen.close()
        out = [reqs[u] for u in uids]
        wall = max(r.end for r in out) - t0
        self.last_profile = Profile(steps, wall, cpu_s=time.thread_time() - c0)
        return out, wall

    def teardown(self) -> None:
        import mlx.core as mx

        self.model = self.tokenizer = None
        mx.clear_cache()


class ForwardTarget:
    """The pure-forward ceiling (bench/forward.py): decode steps of the model alone, B = c."""

    name = "forward"
    skip_reason: str | None = None
    last_profile: Profile | None = None

    def __init__(self) -> None:
        self.loop = ForwardLoop()

    def setup(self, path: Path) -> None:
        self.loop.setup(path)

    def run(self, prompts: list[Prompt], c: int, max_tokens: int = MAX_TOKENS) -> tuple[list[Request], float]:
        c0 = time.thread_time()
        tokens, seconds, steps = self.loop.run(prompts, c, max_tokens)
        rows = tokens // max_tokens
        out = [Request(tokens=max_tokens, start=0.0, end=seconds) for _ in range(rows)]
        self.last_profile = Profile(steps, seconds, cpu_s=time.thread_time() - c0)
        return out, seconds

    def teardown(self) -> None:
        self.loop.teardown()


# --- driver ----------------------------------------------------------------------------------


def make_target(name: str) -> Any:
    if name == "forward":
        return ForwardTarget()
    if name == "raw":
        return RawLoopTarget()
    if name == "raw_lm":
        return RawLmLoopTarget()
    if name == "stream_generate":
        return StreamGenerateTarget()
    if name == "ours":
        return ProviderTarget("ours", ours_factory)
    if name in OURS_VARIANTS:
        options = OURS_VARIANTS[name]
        return ProviderTarget(name, lambda path: ours_factory(_alias(path, name.replace("_", "-")), **options))
    if name == "abstractcore":
        return ProviderTarget("abstractcore", abstractcore_factory)
    if name == "mlx_lm.server":
        return ServerTarget()
    raise SystemExit(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")


def profile_run(target: Any, prompts: list[Any], c: int, path: Path, log: Callable[[str], None]) -> None:
    """One unmeasured run of ``target`` under py-spy (``bench/pyspy.py``); logs where its
    busiest thread's samples went."""
    import pyspy

    with pyspy.record(path):
        target.run(prompts, c)
    thread, total, shares = pyspy.busiest_thread(path)
    log(f"  py-spy {path.name}: {thread}, {total} samples; inclusive share by function:")
    for share, fn in shares:
        log(f"    {100 * share:5.1f}%  {fn}")


def bench_model(
    label: str,
    path: Path,
    targets: list[str],
    concs: list[int],
    per_slot: int,
    repeats: int,
    log: Callable[[str], None],
    warmup_tokens: int = MAX_TOKENS,
    requests: int | None = None,
    serial_max_c: int | None = None,
    py_spy: Path | None = None,
) -> list[Point]:
    """``py_spy``: after a point's measured runs, one more run per target under py-spy (not
    counted in the figures), its profile written there and its busiest thread summarised."""
    from transformers import AutoTokenizer

    book = PromptBook(AutoTokenizer.from_pretrained(str(path)))
    # Distinct prompts for every repeat too: mlx_lm.server keeps a prefix cache.
    count = {c: requests if requests else per_slot * c for c in concs}
    sets = {c: [book.batch(f"m{r}", c, count[c]) for r in range(repeats)] for c in concs}
    n_prompt = [len(p.ids) for runs in sets.values() for ps in runs for p in ps]
    shape = f"{requests} per point" if requests else f"{per_slot} x c per point"
    log(
        f"[{label}] prompts: {len(n_prompt)} requests ({repeats} repeat(s) of {shape}), "
        f"{min(n_prompt)}-{max(n_prompt)} prompt tokens (mean {statistics.mean(n_prompt):.0f})"
    )
    points: list[Point] = []
    live: dict[str, Any] = {}
    log(f"[{label}] forward input shapes recorded from: {', '.join(SHAPES.watch(path)) or 'no model class found'}")

    def measured(name: str, c: int) -> bool:  # serial targets only up to --serial-max-c
        return name not in SERIAL_TARGETS or serial_max_c is None or c <= serial_max_c

    try:
        for name in targets:
            target = make_target(name)
            t_setup = time.perf_counter()
            try:
                target.setup(path)
                # Warm up every batch width once (first-use compilation, allocator growth).
                for c in concs:
                    if measured(name, c):
                        target.run(book.batch(f"warm-{name}", c, c), c, warmup_tokens)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is skipped, with why
                reason = f"{type(exc).__name__}: {exc}"
                log(f"[{label}] {name}: SKIPPED, setup failed: {reason}")
                for c in concs:
                    points.append(Point(label, name, c, 0, 0, 0.0, 0.0, None, None, error=reason))
                with contextlib.suppress(Exception):
                    target.teardown()
                continue
            live[name] = target
            log(f"[{label}] {name}: ready in {time.perf_counter() - t_setup:.1f}s (setup + warm-up)")
        # Interleaved: every repeat runs every target once (in a rotating order), so a slow
        # spell of this shared 2-core machine hits all targets alike.
        for c in concs:
            names = [n for n in live if measured(n, c)]
            runs: dict[str, tuple[list[Request], float]] = {n: ([], 0.0) for n in names}
            per_run: dict[str, list[float]] = {n: [] for n in names}
            profiles: dict[str, Profile | None] = {}
            shapes: dict[str, Window] = {n: Window() for n in names}
            failed: dict[str, str] = {}
            for r, prompts in enumerate(sets[c]):
                k = r % len(names) if names else 0
                for name in names[k:] + names[:k]:
                    if name in failed:
                        continue
                    util: list[float] = []
                    try:
                        with GPU.sample(util), SHAPES.window() as seen:
                            got, took = live[name].run(prompts, c)
                        shapes[name] = shapes[name].add(seen)
                    except Exception as exc:  # noqa: BLE001
                        traceback.print_exc()
                        failed[name] = f"{type(exc).__name__}: {exc}"
                        continue
                    reqs, wall = runs[name]
                    runs[name] = (reqs + got, wall + took)
                    per_run[name].append(round(sum(q.tokens for q in got) / took, 2) if took > 0 else 0.0)
                    prof = live[name].last_profile
                    if prof is not None:
                        prof = Profile(
                            prof.steps,
                            prof.step_s,
                            prof.backend_s,
                            prof.tokens_s,
                            prof.cpu_s,
                            util if GPU.handle else None,
                        )
                        prev = profiles.get(name)
                        profiles[name] = prof if prev is None else prev.add(prof)
            if py_spy is not None:
                for name in (n for n in names if n not in failed):
                    profile_run(live[name], sets[c][0], c, py_spy / f"{label.split()[0]}-{name}-c{c}.txt", log)
            for name in names:
                if name in failed:
                    point = Point(label, name, c, 0, 0, 0.0, 0.0, None, None, error=failed[name])
                else:
                    point = summarise(
                        label,
                        name,
                        c,
                        *runs[name],
                        profile=profiles.get(name),
                        shapes=shapes[name],
                        run_tok_s=per_run[name],
                    )
                points.append(point)
                log(
                    f"[{label}] {name:16s} c={c}: {point.tok_s:8.1f} tok/s  TTFT p50/p95 first token "
                    f"{_fmt(point.token_ttft_p50_ms)}/{_fmt(point.token_ttft_p95_ms)} ms, first text "
                    f"{_fmt(point.ttft_p50_ms)}/{_fmt(point.ttft_p95_ms)} ms  ({point.completion_tokens} tokens in "
                    f"{point.wall_s:.2f}s)  step {_fmt(point.step_ms, '.2f')} ms (backend "
                    f"{_fmt(point.backend_ms, '.2f')}, tokens {_fmt(point.tokens_ms, '.2f')}, cpu "
                    f"{_fmt(point.cpu_ms, '.2f')}) x {point.steps or '-'}  gpu {_fmt(point.gpu_util)}%  new shapes "
                    f"prefill/decode {_fmt(point.new_prefill_shapes, 'd')}/{_fmt(point.new_decode_shapes, 'd')} of "
                    f"{_fmt(point.shapes_used, 'd')} used"
                )
    finally:
        for target in live.values():
            with contextlib.suppress(Exception):
                target.teardown()
        SHAPES.unwatch()
    ceiling = {p.concurrency: p.tok_s for p in points if p.target == "forward" and not p.error and p.tok_s}
    for p in points:
        if p.concurrency in ceiling and not p.error:
            p.forward_share = round(p.tok_s / ceiling[p.concurrency], 3)
    order = {n: i for i, n in enumerate(targets)}
    points.sort(key=lambda p: (order.get(p.target, 99), p.concurrency))
    return points


def ratios(points: list[Point]) -> list[dict[str, Any]]:
    by = {(p.model, p.target, p.concurrency): p for p in points}
    out = []
    for p in points:
        if p.target != "ours" or p.error:
            continue
        for ref, floors in FLOORS.items():
            q = by.get((p.model, ref, p.concurrency))
            if q is None or q.error or not q.tok_s:
                continue
            floor = floors.get(p.concurrency, floors.get(None))
            value = p.tok_s / q.tok_s
            # Repeat by repeat: the targets of one repeat run back to back, so a slow spell of a
            # shared machine weighs on both sides of each ratio.
            per_run = sorted(a / b for a, b in zip(p.run_tok_s, q.run_tok_s) if b > 0)
            out.append(
                {
                    "model": p.model,
                    "concurrency": p.concurrency,
                    "versus": ref,
                    "ratio": round(value, 3),
                    "target": floor,
                    "meets": None if floor is None else value >= floor,
                    "runs": [round(x, 3) for x in per_run],
                }
            )
    return out


def print_tables(points: list[Point], rs: list[dict[str, Any]]) -> None:
    for model in dict.fromkeys(p.model for p in points):
        print(f"\n## {model}\n")
        print(
            "| target | c | tok/s | share of forward | TTFT p50 ms (first token) | TTFT p95 ms (first token) | TTFT "
            "p50 ms (first text) | TTFT p95 ms (first text) | tokens | wall s | new shapes prefill/decode (used) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for p in points:
            if p.model != model:
                continue
            if p.error:
                print(f"| {p.target} | {p.concurrency} | skipped: {p.error} | | | | | | | | |")
                continue
            print(
                f"| {p.target} | {p.concurrency} | {p.tok_s:.1f} | {_fmt(p.forward_share, '.2f')} | "
                f"{_fmt(p.token_ttft_p50_ms)} | {_fmt(p.token_ttft_p95_ms)} | {_fmt(p.ttft_p50_ms)} | "
                f"{_fmt(p.ttft_p95_ms)} | {p.completion_tokens} | {p.wall_s:.2f} | "
                f"{_fmt(p.new_prefill_shapes, 'd')}/{_fmt(p.new_decode_shapes, 'd')} ({_fmt(p.shapes_used, 'd')}) |"
            )
        shares = [p for p in points if p.model == model and p.forward_share is not None and p.target != "forward"]
        if shares:
            concs = sorted({p.concurrency for p in shares})
            print("\nshare of the pure-forward ceiling (tok/s over the `forward` target's, same process, same c)\n")
            print("| target | " + " | ".join(f"c={c}" for c in concs) + " |")
            print("|---|" + "---|" * len(concs))
            for name in dict.fromkeys(p.target for p in shares):
                cells = [
                    next((f"{p.forward_share:.2f}" for p in shares if p.target == name and p.concurrency == c), "-")
                    for c in concs
                ]
                print(f"| {name} | " + " | ".join(cells) + " |")
        profiled = [p for p in points if p.model == model and p.steps]
        if profiled:
            print(
                "\nper-step profile (ms per decode step; backend = inside the backend's step: upstream "
                "bookkeeping, graph building, device waits; tokens = our per-token host work; cpu = worker "
                "thread CPU time; gpu = NVML utilisation)\n"
            )
            print("| target | c | steps | step ms | backend ms | tokens ms | other ms | cpu ms | gpu % |")
            print("|---|---|---|---|---|---|---|---|---|")
            for p in profiled:
                print(
                    f"| {p.target} | {p.concurrency} | {p.steps} | {_fmt(p.step_ms, '.2f')} | "
                    f"{_fmt(p.backend_ms, '.2f')} | {_fmt(p.tokens_ms, '.2f')} | "
                    f"{_fmt(p.other_ms, '.2f')} | {_fmt(p.cpu_ms, '.2f')} | {_fmt(p.gpu_util)} |"
                )
        mine = [r for r in rs if r["model"] == model]
        if mine:
            concs = sorted({r["concurrency"] for r in mine})
            refs = [t for t in FLOORS if any(r["versus"] == t for r in mine)]
            print(
                "\nours / X (aggregate tok/s; `!` = below target; then the median and range of the repeats' ratios)\n"
            )
            print("| ours / | " + " | ".join(f"c={c}" for c in concs) + " |")
            print("|---|" + "---|" * len(concs))
            for ref in refs:
                cells = []
                for c in concs:
                    r = next((r for r in mine if r["versus"] == ref and r["concurrency"] == c), None)
                    if r is None:
                        cells.append("-")
                    else:
                        mark = "" if r["meets"] is None else (" ok" if r["meets"] else " !")
                        tgt = "" if r["target"] is None else f" (>= {r['target']})"
                        runs = r["runs"]
                        spread = (
                            f"; {statistics.median(runs):.2f} ({runs[0]:.2f}-{runs[-1]:.2f})" if len(runs) > 1 else ""
                        )
                        cells.append(f"{r['ratio']:.2f}{tgt}{mark}{spread}")
                print(f"| {ref} | " + " | ".join(cells) + " |")


def bench_client(
    label: str,
    path: Path,
    targets: list[str],
    concs: list[int],
    requests: int,
    repeats: int,
    log: Callable[[str], None],
) -> list[client_side.ClientPoint]:
    """The client-side mode (bench/client_side.py) on this script's prompts."""
    from transformers import AutoTokenizer

    book = PromptBook(AutoTokenizer.from_pretrained(str(path)))
    log(
        f"[{label}] client-side mode: {requests} distinct chat requests per "
        f"point, {repeats} repeat(s), {MAX_TOKENS} greedy tokens"
    )
    log(f"[{label}] forward input shapes recorded from: {', '.join(SHAPES.watch(path)) or 'no model class found'}")
    try:
        return client_side.bench_client(
            label,
            path,
            targets,
            concs,
            lambda tag, c, n: list(book.batch(tag, c, n)),
            lambda c: requests,
            repeats,
            MAX_TOKENS,
            log,
            max_batch=MAX_BATCH,
            queue_size=QUEUE_SIZE,
            shapes=SHAPES,
        )
    finally:
        SHAPES.unwatch()


def machine() -> dict[str, Any]:
    import mlx.core as mx

    info: dict[str, Any] = {
        "date": _dt.date.today().isoformat(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mlx_device": str(mx.default_device()),
    }
    with contextlib.suppress(Exception):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    from importlib.metadata import version

    for dist in ("mlx", "mlx-lm", "mlx-vlm", "abstractcore", "abstractruntime-mlx"):
        with contextlib.suppress(Exception):
            info[dist] = version(dist)
    return info


def _per_model(spec: str, defaults: dict[str, int]) -> dict[str, int]:
    """``"tiny=5,small=1"`` or a bare ``"3"`` (every model) over ``defaults``."""
    out = dict(defaults)
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if value:
            out[key.strip()] = int(value)
        elif key.strip():
            out = {k: int(key) for k in out}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model only, c = 1 and 4")
    ap.add_argument(
        "--models", default=None, help="comma list of: tiny, small, 0.6b, 4b (default tiny,small; --quick: tiny)"
    )
    ap.add_argument(
        "--targets",
        default=None,
        help=f"comma list of: {', '.join(TARGETS)} (default: all); with --client: "
        f"{', '.join(client_side.CLIENT_TARGETS)} (default ours,stream_generate,lm_loop)",
    )
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,2,4,8; --quick: 1,4; --client: 1,4,8)")
    ap.add_argument(
        "--client",
        action="store_true",
        help="client-side mode (bench/client_side.py): N distinct chat requests from c client threads, each request's "
        "time split into before submit, queue, prefill, decode and delivery (default 16 requests per point)",
    )
    ap.add_argument(
        "--requests-per-slot",
        default="tiny=2,small=1",
        help="N = this x c requests per run, per model (tiny=2,small=1)",
    )
    ap.add_argument(
        "--requests",
        type=int,
        default=None,
        help="a fixed N requests per run at every concurrency (instead of per slot)",
    )
    ap.add_argument(
        "--serial-max-c",
        type=int,
        default=None,
        help="measure stream_generate and mlx_lm.server only up to this concurrency",
    )
    ap.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="the providers' mlx_max_batch_size (default: the largest concurrency)",
    )
    ap.add_argument(
        "--repeats",
        default=None,
        help="runs per point, per model (tiny=5,small=2; --client: tiny=3,small=1); figures pool all runs",
    )
    ap.add_argument(
        "--model-dir", default=None, help="where to build/reuse the checkpoints (default: a temporary directory)"
    )
    ap.add_argument("--json", dest="json_out", default=None, help="write machine, points and ratios here")
    ap.add_argument(
        "--py-spy",
        dest="py_spy",
        default=None,
        metavar="DIR",
        help="after each point, profile one more run per target with py-spy (native frames) into DIR",
    )
    args = ap.parse_args(argv)

    global MAX_BATCH, QUEUE_SIZE
    if args.py_spy and args.client:
        raise SystemExit("--py-spy profiles the serving targets; it does not apply to --client")
    models = (args.models or ("tiny" if args.quick else "tiny,small")).split(",")
    default_concs = "1,4,8" if args.client else "1,4" if args.quick else "1,2,4,8"
    concs = [int(c) for c in (args.concurrency or default_concs).split(",")]
    MAX_BATCH = args.max_batch or max(concs)
    if max(concs) > MAX_BATCH:
        raise SystemExit(f"concurrency above the providers' batch size ({MAX_BATCH}) is not measured here")
    default_repeats = "tiny=3,small=1" if args.client else "tiny=5,small=2"
    repeats = _per_model(args.repeats or default_repeats, {"tiny": 5, "small": 2, "0.6b": 1, "4b": 1})
    per_slot = _per_model(args.requests_per_slot, {"tiny": 2, "small": 1, "0.6b": 1, "4b": 1})
    requests = args.requests or (16 if args.client else None)
    # The providers' queues hold a whole point: every request of the busiest point may wait at once.
    most = requests or max(per_slot.get(m, 1) for m in models) * max(concs)
    QUEUE_SIZE = max(32, most)
    known = client_side.CLIENT_TARGETS if args.client else TARGETS
    default_targets = "ours,stream_generate,lm_loop" if args.client else ",".join(TARGETS)
    targets = [t.strip() for t in (args.targets or default_targets).split(",") if t.strip()]
    for t in targets:
        if t not in known:
            raise SystemExit(f"unknown target {t!r}; choose from {', '.join(known)}")

    def log(msg: str) -> None:
        print(msg, flush=True)

    info = machine()
    log("machine: " + json.dumps(info))
    scratch = contextlib.ExitStack()
    root = (
        Path(args.model_dir)
        if args.model_dir
        else Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="bench-conc-")))
    )
    builders = {
        "tiny": lambda: _models.tiny(root / "tiny"),
        "small": lambda: _models.small_model(root / "small"),
        "0.6b": lambda: _models.shaped_model(root / "qwen3-0.6b-shape", "0.6b"),
        "4b": lambda: _models.shaped_model(root / "qwen3-4b-shape", "4b"),
    }
    points: list[Point] = []
    client_points: list[client_side.ClientPoint] = []
    t0 = time.perf_counter()
    with scratch:
        for label in models:
            if label not in builders:
                raise SystemExit(f"unknown model {label!r}; choose from {', '.join(builders)}")
            t_build = time.perf_counter()
            path = builders[label]()
            params = _models.num_parameters(path)
            log(
                f"[{label}] {path} ({params / 1e6:.1f}M parameters; built or "
                f"found in {time.perf_counter() - t_build:.1f}s)"
            )
            name = f"{label} ({params / 1e6:.1f}M)"
            # The ~27M model is compute-bound on this CPU: a short warm-up reaches every code path.
            warm = 8 if label == "small" else MAX_TOKENS
            if args.client:
                client_points += bench_client(name, path, targets, concs, requests, repeats[label], log)
            else:
                points += bench_model(
                    name,
                    path,
                    targets,
                    concs,
                    per_slot[label],
                    repeats[label],
                    log,
                    warm,
                    args.requests,
                    args.serial_max_c,
                    Path(args.py_spy) if args.py_spy else None,
                )
    rs = ratios(points)
    print_tables(points, rs)
    client_side.print_client(client_points)
    elapsed = time.perf_counter() - t0
    print(
        f"\ntotal {elapsed:.0f}s; command: python bench/concurrency.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    if args.json_out:
        payload = {
            "machine": info,
            "settings": {
                "max_tokens": MAX_TOKENS,
                "concurrency": concs,
                "requests_per_slot": per_slot,
                "requests": requests,
                "repeats": repeats,
                "max_batch_size": MAX_BATCH,
                "max_queue_size": QUEUE_SIZE,
                "models": models,
                "targets": targets,
                "client": args.client,
            },
            "points": [asdict(p) for p in points],
            "client_points": [asdict(p) for p in client_points],
            "ratios": rs,
            "elapsed_s": round(elapsed, 1),
        }
        Path(args.json_out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    import signal

    # SIGTERM unwinds like Ctrl-C, so the server subprocess and engines are torn down.
    def _on_sigterm(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _on_sigterm)
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # MLX's per-thread state on the providers' parked worker threads can abort a normal
    # interpreter shutdown ("terminate called without an active exception"); the figures
    # are already out, so leave without it.
    os._exit(code)
