"""mlx-lm vs mlx-vlm BatchGenerator on the same tiny checkpoint (the engine's build-on decision)."""

import tempfile
import time

import mlx.core as mx
import mlx_lm
import mlx_vlm
from mlx_lm.generate import BatchGenerator as LmBG
from mlx_vlm.generate.ar import BatchGenerator as VlmBG

from abstractruntime_mlx.testing import tiny_model

path = str(tiny_model(tempfile.mkdtemp() + "/tiny-dense", kind="dense"))
lm_model, lm_tok = mlx_lm.load(path)
vm, vp = mlx_vlm.load(path)
tok = vp.tokenizer if hasattr(vp, "tokenizer") else vp
prompts = [tok.encode(f"Explain cache number {i} with some words " * 3) for i in range(8)]
N = 64


def run_lm(B):
    g = LmBG(
        lm_model,
        max_tokens=N,
        completion_batch_size=B,
        prefill_batch_size=B,
        stop_tokens=[[e] for e in lm_tok.eos_token_ids],
    )
    t = time.perf_counter()
    g.insert(prompts[:B], max_tokens=[N] * B)
    n = 0
    done = set()
    while len(done) < B:
        for x in g.next_generated():
            n += 1
            if x.finish_reason:
                done.add(x.uid)
    dt = time.perf_counter() - t
    g.close()
    return n / dt


def run_vlm(B):
    g = VlmBG(
        vm.language_model,
        vp,
        max_tokens=N,
        completion_batch_size=B,
        prefill_batch_size=B,
        greedy_sampling=True,
        compute_logprobs=False,
    )
    kw = [
        {k: v for k, v in vm.get_input_embeddings(mx.array([p]), None).to_dict().items() if v is not None}
        for p in prompts[:B]
    ]
    t = time.perf_counter()
    g.insert(prompts[:B], max_tokens=[N] * B, prompt_kwargs=kw)
    n = 0
    while g.has_work:
        _, r = g.next()
        n += len(r)
    dt = time.perf_counter() - t
    g.close()
    return n / dt


for B in (1, 4, 8):
    for f in (run_lm, run_vlm):
        f(B)
    lm = max(run_lm(B) for _ in range(3))
    vl = max(run_vlm(B) for _ in range(3))
    print(
        f"B={B}: mlx-lm BatchGenerator {lm:.0f} tok/s, mlx-vlm "
        f"BatchGenerator {vl:.0f} tok/s, ratio vlm/lm {vl / lm:.2f}"
    )
