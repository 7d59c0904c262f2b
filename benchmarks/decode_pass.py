"""The 16-decode pass on SmolLM2: pass time and the share spent in attention, per backend and dtype.

16 sequences are prefilled with ``--context`` tokens each; then decode passes (16 tokens, one per
sequence) run with the attention backends interleaved pass by pass on the same runner and KV cache
(``torch`` = the PyTorch reference, ``cpu`` = the C++ operator), so both see the same machine load.
Reports the median pass time per backend, and from ``torch.profiler`` (3 passes each) the share of
the pass's wall time spent inside the attention call (KV write included), marked with
``record_function("fuseserve::attention")``.

``python -m benchmarks.decode_pass [--dtypes float32,bfloat16] [--passes 20] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fuseserve.config import EngineConfig
from fuseserve.model_source import resolve_model
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount, assign_block_ids
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.attention import get_backend
from fuseserve.worker.model_runner import ModelRunner

LABEL = "fuseserve::attention"


class Marked:
    """Wraps a backend so each attention call shows up in the profiler under ``LABEL``."""

    def __init__(self, backend):
        self.inner = backend
        self.name = backend.name

    def prepare(self, batch, block_size):
        return self.inner.prepare(batch, block_size)

    def forward(self, *args, **kwargs):
        with record_function(LABEL):
            return self.inner.forward(*args, **kwargs)


def measure(model: str, dtype: str, num_seqs: int, context: int, passes: int) -> dict:
    src = resolve_model(model)
    cfg = EngineConfig(kv_cache_memory="512MiB", dtype=dtype)
    runner = ModelRunner(src.path, src.config, src.eos_token_ids(), cfg, progress=False)
    backends = {name: Marked(get_backend(name)) for name in ("torch", "cpu")}
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    step = 0
    blocks = BlockAccount(runner.info.num_blocks, runner.info.block_size, False)  # the scheduler's allocator
    for sid in range(num_seqs):  # prefill, one sequence per pass
        ids = torch.randint(0, runner.vocab_size, (context,), generator=gen).tolist()
        chunk = SeqChunk(sid, 0, context, ids, sample=True, params=params, prompt_len=context)
        plan = StepPlan(step, [chunk])
        assign_block_ids(blocks, plan)
        runner.step(plan)
        step += 1
    pos = [context] * num_seqs

    def decode() -> float:
        nonlocal step
        plan = StepPlan(step, [SeqChunk(s, pos[s], 1, [], sample=True) for s in range(num_seqs)])
        assign_block_ids(blocks, plan)
        t0 = time.perf_counter()
        runner.step(plan)
        elapsed = time.perf_counter() - t0
        step += 1
        for s in range(num_seqs):
            pos[s] += 1
        return elapsed

    times: dict[str, list[float]] = {name: [] for name in backends}
    for b in backends.values():  # warm-up
        runner.use_backend(b)
        decode()
    for _ in range(passes):
        for name, b in backends.items():
            runner.use_backend(b)
            times[name].append(decode())
    result = {"dtype": str(runner.dtype).split(".")[-1], "num_seqs": num_seqs, "context": context}
    for name, b in backends.items():
        runner.use_backend(b)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                decode()
        wall = time.perf_counter() - t0
        attn = sum(e.cpu_time_total for e in prof.key_averages() if e.key == LABEL) / 1e6
        top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:6]
        result[name] = {
            "pass_s_median": statistics.median(times[name]),
            "pass_s_all": times[name],
            "attention_share": attn / wall,
            "profiled_wall_s": wall,
            "top_self_cpu": {e.key: e.self_cpu_time_total / 1e6 for e in top},
        }
    result["speedup"] = result["torch"]["pass_s_median"] / result["cpu"]["pass_s_median"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    records = []
    for dtype in a.dtypes.split(","):
        r = measure(a.model, dtype, a.num_seqs, a.context, a.passes)
        r["threads"] = torch.get_num_threads()
        records.append(r)
        print(
            f"{r['dtype']:>9}: 16-decode pass torch {r['torch']['pass_s_median'] * 1e3:.1f} ms "
            f"(attention {r['torch']['attention_share']:.0%}) -> cpu {r['cpu']['pass_s_median'] * 1e3:.1f} ms "
            f"(attention {r['cpu']['attention_share']:.0%}), {r['speedup']:.2f}x",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
