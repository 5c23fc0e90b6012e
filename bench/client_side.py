"""Client-side mode of ``bench/concurrency.py`` (``--client``): the time of a request as the
client that sent it sees it, split into where it went.

Every target gets the same N distinct chat messages, sent from a pool of c client threads the
way a user sends them: the client thread holds only the message text, and whatever turns it
into token ids (chat template, tokenisation, control resolution) runs on that thread, inside
the request's time. Greedy, 64 new tokens. Per request, seven moments are taken:

    call        the client thread starts the request (it has the message text)
    submit      the request is handed to the serving thread
    admit       the serving thread takes it into a batch (its prefill begins)
    first       the first token comes out of the forward
    finish      the last token comes out of the forward
    first_seen  the client thread holds the first chunk carrying text
    end         the client thread holds the whole answer

and the request's time (end - call) is split into: ``before_submit`` (on the client thread:
``controls``, ``template``, ``tokenise``, and the rest), ``queue`` (waiting for admission: a free
slot, a burst gap, the worker finishing its step), ``prefill`` (admission to the first token:
the prompt's forward, and in a batch whatever else that step did), ``decode`` (first to last
token) and ``delivery`` (the last token to the client thread returning). Everything but
``decode`` is the request's time outside the decode steps.

Targets:

- ``ours``: ``create_llm("mlx", ..., mlx_batching=True)``, ``generate(stream=True)`` on the client
  thread, as a user calls it; the moments are the engine request's own timestamps
  (``submitted_at``, ``started_at``, ``first_token_at``, ``finished_at``) and the sub-parts of
  ``before_submit`` come from timing the provider's control resolution, template rendering and
  tokenisation on the calling thread; ``ours_batch``: the same with ``mlx_single_lane=False``;
  ``ours_no_gap``: the same with ``mlx_burst_gap_ms=0`` (a lone request starts at once);
- ``stream_generate``: the client renders the chat template and tokenises, then hands the ids
  to one long-lived worker thread running ``mlx_lm.stream_generate`` one request at a time,
  which hands every text segment back (as a server's worker would);
- ``lm_loop``: the client renders and tokenises, then hands the ids to one worker thread that
  owns mlx-lm's ``BatchGenerator`` (``completion_batch_size = c``), inserts requests as they
  arrive (what is queued is inserted before each step), detokenises each row with mlx-lm's
  streaming detokenizer and hands every text segment back: mlx-lm's batch loop the way a
  server runs it, not fed all prompts at once.
"""

from __future__ import annotations

import contextlib
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from shapes import ShapeLog, Window  # bench/shapes.py

CLIENT_TARGETS = ("ours", "ours_batch", "ours_no_gap", "stream_generate", "lm_loop")
PHASES = ("before_submit", "queue", "prefill", "decode", "delivery")
SUBPHASES = ("controls", "template", "tokenise")  # parts of before_submit, where measured


class ChatPrompt(Protocol):
    text: str


# --- one request's moments -------------------------------------------------------------------


@dataclass
class Phases:
    """The moments of one request (``time.perf_counter`` seconds) and its token count."""

    call: float
    submit: float = 0.0
    admit: float = 0.0
    first: float = 0.0
    finish: float = 0.0
    first_seen: float | None = None
    end: float = 0.0
    tokens: int = 0
    parts: dict[str, float] = field(default_factory=dict)  # sub-parts of before_submit, seconds

    def split_ms(self) -> dict[str, float]:
        """Where the request's time went, in ms; the phases add up to ``total``."""
        out = {
            "before_submit": self.submit - self.call,
            "queue": self.admit - self.submit,
            "prefill": self.first - self.admit,
            "decode": self.finish - self.first,
            "delivery": self.end - self.finish,
            "total": self.end - self.call,
        }
        out.update(self.parts)
        return {k: v * 1000.0 for k, v in out.items()}


class _Parts(threading.local):
    """Per-thread sums of the timed sub-parts of the request being prepared on that thread."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}


_PARTS = _Parts()


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _PARTS.sums[name] = _PARTS.sums.get(name, 0.0) + time.perf_counter() - t0

    return wrapper


@contextlib.contextmanager
def provider_parts_timed() -> Iterator[None]:
    """Time the provider's control resolution, template rendering and tokenisation per thread."""
    from abstractruntime_mlx.provider import mlx_provider

    # (the owner, the name there, the part it is counted in): the provider module's own
    # names, so the provider's calls go through the timed wrappers
    spots = (
        (mlx_provider.MLXProvider, "resolve_controls", "controls"),
        (mlx_provider, "render_prompt", "template"),
        (mlx_provider, "_encode_within_context", "tokenise"),
    )
    saved = [getattr(owner, name) for owner, name, _ in spots]
    for (owner, name, part), fn in zip(spots, saved):
        setattr(owner, name, _timed(part, fn))
    try:
        yield
    finally:
        for (owner, name, _), fn in zip(spots, saved):
            setattr(owner, name, fn)


# --- targets ------------------------------------------------------------------------------------


@dataclass
class StepCounters:
    """A serving thread's cumulative step counters: steps, their wall time, the part spent in the
    upstream step (``BatchGenerator.next`` or our backend's step) and the part handling its tokens
    (detokenising, stop checks, delivery)."""

    steps: int = 0
    step_s: float = 0.0
    upstream_s: float = 0.0
    tokens_s: float = 0.0

    def minus(self, other: StepCounters) -> StepCounters:
        return StepCounters(
            self.steps - other.steps,
            self.step_s - other.step_s,
            self.upstream_s - other.upstream_s,
            self.tokens_s - other.tokens_s,
        )

    def plus(self, other: StepCounters) -> StepCounters:
        return StepCounters(
            self.steps + other.steps,
            self.step_s + other.step_s,
            self.upstream_s + other.upstream_s,
            self.tokens_s + other.tokens_s,
        )


class ClientSideTarget:
    """A target served to ``c`` client threads, one ``call`` per chat message."""

    name = ""

    def counters(self) -> StepCounters | None:
        """Cumulative step counters of the serving thread (None: not measured for this target)."""
        return None

    def setup(self, path: Path, max_batch: int, queue_size: int) -> None: ...

    def teardown(self) -> None: ...

    def call(self, prompt: ChatPrompt, max_tokens: int, c: int) -> Phases:
        raise NotImplementedError

    def run(self, prompts: list[ChatPrompt], c: int, max_tokens: int) -> tuple[list[Phases], float]:
        with ThreadPoolExecutor(max_workers=c, thread_name_prefix=f"client-{self.name}") as pool:
            t0 = time.perf_counter()
            futures = [pool.submit(self.call, p, max_tokens, c) for p in prompts]
            got = [f.result() for f in futures]
        return got, max(p.end for p in got) - t0


class OursClient(ClientSideTarget):
    """Our provider's ``generate(stream=True)``, called on the client thread."""

    def __init__(self, name: str, **options: Any) -> None:
        self.name = name
        self.options = options  # the provider's options besides the bench's own
        self.llm: Any = None

    def setup(self, path: Path, max_batch: int, queue_size: int) -> None:
        from abstractruntime_mlx import create_llm

        if self.options:
            path = _alias(path, f"client-{self.name}")  # one resident model per directory
        self.llm = create_llm(
            "mlx",
            model=str(path),
            mlx_batching=True,
            mlx_max_batch_size=max_batch,
            mlx_max_queue_size=queue_size,
            speculation=False,
            **self.options,
        )

    def counters(self) -> StepCounters | None:
        p = self.llm._engine.step_profile()  # the engine's own step counters
        return StepCounters(int(p["num_steps"]), float(p["step_s"]), float(p["backend_s"]), float(p["tokens_s"]))

    def call(self, prompt: ChatPrompt, max_tokens: int, c: int) -> Phases:
        _PARTS.sums = {}
        got = Phases(call=time.perf_counter())
        stream = self.llm.generate(
            prompt.text, stream=True, thinking=False, temperature=0, max_output_tokens=max_tokens
        )
        got.parts = dict(_PARTS.sums)
        last = None
        for chunk in stream:
            if chunk.content and got.first_seen is None:
                got.first_seen = time.perf_counter()
            last = chunk
        got.end = time.perf_counter()
        request = stream._submitted.request  # the engine request: its own timestamps
        got.submit, got.admit = request.submitted_at, request.started_at
        got.first, got.finish = request.first_token_at, request.finished_at
        got.tokens = int((last.usage or {}).get("completion_tokens") or 0) if last is not None else 0
        return got

    def teardown(self) -> None:
        if self.llm is not None:
            with contextlib.suppress(Exception):
                self.llm.unload_model(self.llm.model)
            self.llm = None


def _alias(path: Path, tag: str) -> Path:
    """The checkpoint under a second directory of links: one resident model per directory."""
    alias = path.parent / f"{path.name}-{tag}"
    alias.mkdir(exist_ok=True)
    for file in path.iterdir():
        link = alias / file.name
        if not link.exists():
            link.symlink_to(file.resolve())
    return alias


@dataclass
class _Job:
    ids: list[int]
    max_tokens: int
    width: int
    phases: Phases
    out: queue.SimpleQueue[str | None] = field(default_factory=queue.SimpleQueue)  # None: the end
    detokenizer: Any = None


class _WorkerClient(ClientSideTarget):
    """A target whose client renders and tokenises, then hands the ids to one worker thread."""

    def setup(self, path: Path, max_batch: int, queue_size: int) -> None:
        import mlx_lm

        loaded = mlx_lm.load(str(path))
        self.model, self.tokenizer = loaded[0], loaded[1]
        self.eos = {int(e) for e in self.tokenizer.eos_token_ids}
        self.inbox: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        # The worker parks on its inbox when the target is done: a thread that ran MLX work
        # must not exit (MLX's per-thread state aborts the interpreter otherwise).
        threading.Thread(target=self._serve, name=f"{self.name}-worker", daemon=True).start()

    def _serve(self) -> None:
        raise NotImplementedError

    def call(self, prompt: ChatPrompt, max_tokens: int, c: int) -> Phases:
        got = Phases(call=time.perf_counter())
        t0 = got.call
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}],
            add_generation_prompt=True,
            tokenize=False,
            enable_thinking=False,
        )
        t1 = time.perf_counter()
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        t2 = time.perf_counter()
        got.parts = {"template": t1 - t0, "tokenise": t2 - t1}
        job = _Job(ids, max_tokens, c, got)
        got.submit = time.perf_counter()
        self.inbox.put(job)
        while True:
            segment = job.out.get()
            if segment is None:
                break
            if segment and got.first_seen is None:
                got.first_seen = time.perf_counter()
        got.end = time.perf_counter()
        return got

    def teardown(self) -> None:
        import mlx.core as mx

        self.model = None
        mx.clear_cache()


class StreamGenerateClient(_WorkerClient):
    """``mlx_lm.stream_generate``, one request at a time, on one worker thread."""

    name = "stream_generate"

    def _serve(self) -> None:
        import mlx_lm

        while True:
            job = self.inbox.get()
            got = job.phases
            got.admit = time.perf_counter()
            for response in mlx_lm.stream_generate(self.model, self.tokenizer, job.ids, max_tokens=job.max_tokens):
                now = time.perf_counter()
                if not got.first:
                    got.first = now
                got.finish = now
                if response.finish_reason != "stop" or response.token not in self.eos:
                    got.tokens += 1
                job.out.put(response.text)
            job.out.put(None)


class LmLoopClient(_WorkerClient):
    """mlx-lm's ``BatchGenerator`` on one worker thread, fed requests as they arrive."""

    name = "lm_loop"
    stats = StepCounters()  # written by the worker only

    def counters(self) -> StepCounters | None:
        s = self.stats
        return StepCounters(s.steps, s.step_s, s.upstream_s, s.tokens_s)

    def _serve(self) -> None:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        stream = mx.new_stream(mx.default_device())
        gen: Any = None
        width = 0
        live: dict[int, _Job] = {}
        while True:
            jobs = [] if live else [self.inbox.get()]  # idle: wait for work
            with contextlib.suppress(queue.Empty):
                while True:
                    jobs.append(self.inbox.get_nowait())
            if jobs and (gen is None or (not live and jobs[0].width != width)):
                if gen is not None:
                    gen.close()
                width = jobs[0].width
                gen = BatchGenerator(
                    self.model,
                    max_tokens=jobs[0].max_tokens,
                    stop_tokens=[[e] for e in self.eos],
                    completion_batch_size=width,
                    prefill_batch_size=width,
                    prefill_step_size=256,
                    stream=stream,
                )
            t0 = time.perf_counter()
            if jobs:
                uids = gen.insert([j.ids for j in jobs], max_tokens=[j.max_tokens for j in jobs])
                now = time.perf_counter()
                for uid, job in zip(uids, jobs):
                    job.phases.admit = now  # queued in the loop; its prefill starts at a next step
                    job.detokenizer = self.tokenizer.detokenizer
                    live[uid] = job
            t1 = time.perf_counter()
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                job = live[r.uid]
                got = job.phases
                if not got.first:
                    got.first = now
                got.finish = now
                if not (r.finish_reason == "stop" and r.token in self.eos):
                    got.tokens += 1
                    job.detokenizer.add_token(r.token)
                if r.finish_reason is not None:
                    job.detokenizer.finalize()
                job.out.put(job.detokenizer.last_segment)
                if r.finish_reason is not None:
                    job.out.put(None)
                    del live[r.uid]
            t3 = time.perf_counter()
            stats = self.stats
            stats.steps += 1
            stats.step_s += t3 - t0
            stats.upstream_s += now - t1
            stats.tokens_s += t3 - now


def make_client_target(name: str) -> ClientSideTarget:
    if name == "ours":
        return OursClient("ours")
    if name == "ours_batch":
        return OursClient("ours_batch", mlx_single_lane=False)
    if name == "ours_no_gap":
        return OursClient("ours_no_gap", mlx_burst_gap_ms=0)
    if name == "stream_generate":
        return StreamGenerateClient()
    if name == "lm_loop":
        return LmLoopClient()
    raise SystemExit(f"unknown client-side target {name!r}; choose from {', '.join(CLIENT_TARGETS)}")


# --- a point's figures ------------------------------------------------------------------------------


@dataclass
class ClientPoint:
    model: str
    target: str
    concurrency: int
    requests: int
    completion_tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float | None  # call -> first chunk carrying text, on the client thread
    ms: dict[str, float]  # mean per request of each phase (PHASES, SUBPHASES, total, outside_decode)
    decode_ms_per_token: float | None
    run_tok_s: list[float] = field(default_factory=list)  # per repeat, in repeat order
    # forwards per run (bench/shapes.py): prefills (or prefill chunks), decode steps, and the
    # (batch, length) shapes first seen in this process during the point
    prefill_calls: float | None = None
    decode_calls: float | None = None
    new_shapes: int | None = None
    # the serving thread's steps (StepCounters), ms per step, where measured
    step_ms: float | None = None
    upstream_ms: float | None = None
    tokens_ms: float | None = None


def summarise_client(
    model: str,
    target: str,
    c: int,
    runs: list[tuple[list[Phases], float]],
    shapes: Window | None = None,
    steps: StepCounters | None = None,
) -> ClientPoint:
    reqs = [p for got, _ in runs for p in got]
    wall = sum(w for _, w in runs)
    tokens = sum(p.tokens for p in reqs)
    splits = [p.split_ms() for p in reqs]
    keys = [*PHASES, *SUBPHASES, "total"]
    ms = {k: round(statistics.mean(s.get(k, 0.0) for s in splits), 3) for k in keys if any(k in s for s in splits)}
    ms["outside_decode"] = round(ms["total"] - ms["decode"], 3)
    if "before_submit" in ms:
        ms["other_before_submit"] = round(ms["before_submit"] - sum(ms.get(k, 0.0) for k in SUBPHASES), 3)
    per_token = [s["decode"] / (p.tokens - 1) for p, s in zip(reqs, splits) if p.tokens > 1]
    ttft = sorted((p.first_seen - p.call) * 1000 for p in reqs if p.first_seen is not None)
    return ClientPoint(
        model=model,
        target=target,
        concurrency=c,
        requests=len(reqs),
        completion_tokens=tokens,
        wall_s=round(wall, 4),
        tok_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        ttft_p50_ms=round(statistics.median(ttft), 2) if ttft else None,
        ms=ms,
        decode_ms_per_token=round(statistics.mean(per_token), 3) if per_token else None,
        run_tok_s=[round(sum(p.tokens for p in got) / w, 2) if w > 0 else 0.0 for got, w in runs],
        prefill_calls=None if shapes is None else round(shapes.prefill_calls / len(runs), 1),
        decode_calls=None if shapes is None else round(shapes.decode_calls / len(runs), 1),
        new_shapes=None if shapes is None else len(shapes.new),
        **_per_step(steps),
    )


def _per_step(steps: StepCounters | None) -> dict[str, float]:
    if steps is None or not steps.steps:
        return {}
    per = 1000.0 / steps.steps
    return {
        "step_ms": round(steps.step_s * per, 3),
        "upstream_ms": round(steps.upstream_s * per, 3),
        "tokens_ms": round(steps.tokens_s * per, 3),
    }


def run_ratios(a: ClientPoint, b: ClientPoint) -> list[float]:
    """a's tok/s over b's, repeat by repeat (the targets of one repeat run back to back, so a slow
    spell of a shared machine weighs on both sides of each ratio)."""
    return sorted(x / y for x, y in zip(a.run_tok_s, b.run_tok_s) if y > 0)


def bench_client(
    label: str,
    path: Path,
    targets: list[str],
    concs: list[int],
    prompts: Callable[[str, int, int], list[ChatPrompt]],
    requests: Callable[[int], int],
    repeats: int,
    max_tokens: int,
    log: Callable[[str], None],
    *,
    max_batch: int,
    queue_size: int,
    shapes: ShapeLog | None = None,
) -> list[ClientPoint]:
    """Every target at every concurrency, ``repeats`` times in a rotating order; ``prompts(tag, c, n)``
    gives n distinct chat messages."""
    live: dict[str, ClientSideTarget] = {}
    points: list[ClientPoint] = []
    shapes = shapes or ShapeLog()
    with provider_parts_timed():
        try:
            for name in targets:
                target = make_client_target(name)
                t0 = time.perf_counter()
                target.setup(path, max_batch, queue_size)
                for c in concs:  # warm every width once
                    target.run(prompts(f"cwarm-{name}", c, c), c, max_tokens)
                live[name] = target
                log(f"[{label}] client {name}: ready in {time.perf_counter() - t0:.1f}s (setup + warm-up)")
            for c in concs:
                runs: dict[str, list[tuple[list[Phases], float]]] = {n: [] for n in live}
                seen: dict[str, Window] = {n: Window() for n in live}
                stepped: dict[str, StepCounters | None] = {n: StepCounters() for n in live}
                for r in range(repeats):
                    batch = prompts(f"client{r}", c, requests(c))
                    names = list(live)
                    k = r % len(names)
                    for name in names[k:] + names[:k]:
                        before = live[name].counters()
                        with shapes.window() as window:
                            runs[name].append(live[name].run(batch, c, max_tokens))
                        after = live[name].counters()
                        seen[name] = seen[name].add(window)
                        so_far = stepped[name]
                        if before is None or after is None or so_far is None:
                            stepped[name] = None
                        else:
                            stepped[name] = so_far.plus(after.minus(before))
                for name in live:
                    point = summarise_client(label, name, c, runs[name], seen[name], stepped[name])
                    points.append(point)
                    m = point.ms
                    log(
                        f"[{label}] client {name:16s} c={c}: {point.tok_s:8.1f} tok/s  TTFT p50 "
                        f"{_fmt(point.ttft_p50_ms)} ms  per request ms: before submit {m['before_submit']:.2f}, "
                        f"queue {m['queue']:.2f}, prefill {m['prefill']:.2f}, decode {m['decode']:.2f}, delivery "
                        f"{m['delivery']:.2f}; per run {_fmt(point.prefill_calls)} prefill and "
                        f"{_fmt(point.decode_calls)} decode forwards; step {_fmt(point.step_ms, '.3f')} ms "
                        f"(upstream {_fmt(point.upstream_ms, '.3f')}, tokens {_fmt(point.tokens_ms, '.3f')})"
                    )
        finally:
            for target in live.values():
                with contextlib.suppress(Exception):
                    target.teardown()
    return points


def _fmt(x: float | int | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


# --- tables ------------------------------------------------------------------------------------------

ROWS = (
    ("before submit (client thread)", "before_submit"),
    ("  controls", "controls"),
    ("  template", "template"),
    ("  tokenise", "tokenise"),
    ("  rest (request objects, submit)", "other_before_submit"),
    ("queue (to admission)", "queue"),
    ("prefill (admission to first token)", "prefill"),
    ("decode (first to last token)", "decode"),
    ("delivery (last token to client)", "delivery"),
    ("total", "total"),
    ("outside decode", "outside_decode"),
)


def reference_for(c: int) -> str:
    """What ours is held against at c: ``stream_generate`` alone, the mlx-lm loop under load."""
    return "stream_generate" if c == 1 else "lm_loop"


def print_client(points: list[ClientPoint]) -> None:
    for model in dict.fromkeys(p.model for p in points):
        mine = [p for p in points if p.model == model]
        print(f"\n## {model}: client-side mode (N distinct chat requests from c client threads)\n")
        print(
            "| target | c | requests | tok/s | TTFT p50 ms (client) | before submit | queue | "
            "prefill | decode | delivery | outside decode | decode ms/token | prefill / decode "
            "forwards per run | new shapes | step ms (upstream / tokens) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for p in mine:
            m = p.ms
            print(
                f"| {p.target} | {p.concurrency} | {p.requests} | {p.tok_s:.1f} | {_fmt(p.ttft_p50_ms)} | "
                f"{m['before_submit']:.2f} | {m['queue']:.2f} | {m['prefill']:.2f} | {m['decode']:.2f} | "
                f"{m['delivery']:.2f} | {m['outside_decode']:.2f} | {_fmt(p.decode_ms_per_token, '.3f')} | "
                f"{_fmt(p.prefill_calls)} / {_fmt(p.decode_calls)} | {_fmt(p.new_shapes, 'd')} | "
                f"{_fmt(p.step_ms, '.2f')} ({_fmt(p.upstream_ms, '.2f')} / {_fmt(p.tokens_ms, '.2f')}) |"
            )
        by = {(p.target, p.concurrency): p for p in mine}
        for c in sorted({p.concurrency for p in mine}):
            ours = by.get(("ours", c))
            ref_name = reference_for(c)
            ref = by.get((ref_name, c))
            if ours is None or ref is None:
                continue
            each = run_ratios(ours, ref)
            spread = (
                f"median of the {len(each)} repeats' {statistics.median(each):.2f} ({each[0]:.2f}-{each[-1]:.2f})"
                if each
                else "-"
            )
            print(
                f"\nc={c}: ours against `{ref_name}`, mean ms per request (tok/s "
                f"ratio: pooled {ours.tok_s / ref.tok_s:.2f}, {spread})\n"
            )
            print(f"| phase | ours | {ref_name} | ours - {ref_name} |")
            print("|---|---|---|---|")
            for title, key in ROWS:
                a, b = ours.ms.get(key), ref.ms.get(key)
                diff = "-" if a is None or b is None else f"{a - b:+.2f}"
                print(f"| {title} | {_fmt(a, '.2f')} | {_fmt(b, '.2f')} | {diff} |")
            for variant in sorted(t for t, cc in by if cc == c and t.startswith("ours_")):
                each = run_ratios(by[(variant, c)], ref)
                median = (
                    f", median of the repeats' {statistics.median(each):.2f} ({each[0]:.2f}-{each[-1]:.2f})"
                    if each
                    else ""
                )
                print(
                    f"\n{variant} against `{ref_name}` at c={c}: tok/s ratio pooled "
                    f"{by[(variant, c)].tok_s / ref.tok_s:.2f}{median}"
                )
