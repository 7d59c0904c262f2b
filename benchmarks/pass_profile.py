"""Where a pass's time goes: a decode pass and a mixed pass on SmolLM2, stage by stage, with MFU.

The runner (``ModelRunner``, the pipeline's and the worker's) is given ``--num-seqs`` sequences
prefilled with ``--context`` random tokens each; then two pass shapes are timed, interleaved:

- **decode**: one token per sequence (``num_seqs`` tokens);
- **mixed**: the same decode tokens plus one prompt chunk of a new sequence filling the token budget
  (``--budget`` tokens in all), the SplitFuse pass of a loaded engine.

Per shape: the median pass time, split into the stages of ``ModelRunner.step_pass`` (prepare: plan →
ragged batch and attention metadata; forward: the model; logits; sample: the sampler; the rest:
bookkeeping), tokens/s, and MFU = tokens/s x matmul FLOPs per token / the fp32 GEMM peak measured
in this run (best of six 0.5-s samples of a 1024^3 matmul). ``--profile`` adds ``torch.profiler``'s
self CPU time grouped into matmuls, attention, KV write, element-wise and other ops.

``--engine KEY=VALUE`` (repeatable) sets ``EngineConfig`` fields (``compile=false``, ...);
``--variants compiled:2,eager:2,python:2,unfused:2,eager:1`` alternates the compiled and eager forward
(eager: the decoder layers as one C++ call where ``layer_stack`` applies; python: eager with the layers
in Python; unfused: python with ATen's element-wise ops instead of ``cpu_fused``'s) and torch's
thread count pass by pass on the one runner, so every variant sees the same machine load.

``python -m benchmarks.pass_profile [--passes 12] [--profile] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks.metrics import model_flops_per_token
from benchmarks.offline_peers import gemm_flops
from fuseserve.config import EngineConfig
from fuseserve.kernels import cpu_fused, cpu_stack
from fuseserve.model_source import resolve_model
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount, assign_block_ids
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.model_runner import ModelRunner

GROUPS = (  # profiler op name fragments → group (first match wins)
    ("attention", ("paged_attention", "fuseserve_cpu")),
    ("kv write", ("index_put", "index_copy")),
    ("matmul", ("addmm", "aten::mm", "matmul", "linear", "mkldnn", "onednn", "bmm")),
    ("compiled region", ("CompiledFunction", "Torch-Compiled", "inductor", "cpp_fused", "kernel_cpp")),
    ("element-wise", ("mul", "add", "silu", "rsqrt", "pow", "mean", "cat", "neg", "copy_", "to", "index")),
)


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return text


class PassBench:
    """A runner with ``num_seqs`` prefilled sequences; builds and times decode and mixed passes."""

    def __init__(self, model: str, num_seqs: int, context: int, budget: int, engine: dict):
        src = resolve_model(model)
        self.flops_per_token = model_flops_per_token(src.config)
        cfg = EngineConfig(**{"kv_cache_memory": "1GiB", "dtype": "float32", **engine})
        t0 = time.perf_counter()
        self.runner = ModelRunner(src.path, src.config, src.eos_token_ids(), cfg, progress=False)
        self.load_s = time.perf_counter() - t0
        self.params = SamplingParams(temperature=0.0, ignore_eos=True)
        self.gen = torch.Generator().manual_seed(0)
        self.blocks = BlockAccount(self.runner.info.num_blocks, self.runner.info.block_size, False)
        self.num_seqs, self.context, self.budget = num_seqs, context, budget
        self.step_id = 0
        self.next_seq = num_seqs
        self.pos = {}
        per_pass = max(1, budget // context)
        for first in range(0, num_seqs, per_pass):  # prefill, whole prompts packed into passes
            sids = range(first, min(num_seqs, first + per_pass))
            self._run([self._prompt_chunk(sid, context, context) for sid in sids])
            self.pos.update(dict.fromkeys(sids, context))

    def _prompt_chunk(self, sid: int, n: int, prompt_len: int) -> SeqChunk:
        ids = torch.randint(0, self.runner.vocab_size, (n,), generator=self.gen).tolist()
        return SeqChunk(sid, 0, n, ids, sample=n == prompt_len, params=self.params, prompt_len=prompt_len)

    def _run(self, chunks: list[SeqChunk]) -> None:
        plan = StepPlan(self.step_id, chunks)
        assign_block_ids(self.blocks, plan)
        self.step_id += 1
        self.runner.step(plan)

    def plan(self, shape: str) -> StepPlan:
        """The next pass of ``shape`` (decode or mixed); block ids assigned, positions advanced."""
        chunks = [SeqChunk(s, self.pos[s], 1, [], sample=True) for s in range(self.num_seqs)]
        if shape == "mixed":
            n = self.budget - self.num_seqs  # a new prompt's first chunk fills the budget
            chunks.append(self._prompt_chunk(self.next_seq, n, n + self.context))
            free = [self.next_seq - 1] if self.next_seq > self.num_seqs else []
            self.next_seq += 1
        else:
            free = []
        plan = StepPlan(self.step_id, chunks, free_seq_ids=free)
        for sid in free:
            self.blocks.release(sid)
        assign_block_ids(self.blocks, plan)
        self.step_id += 1
        for s in range(self.num_seqs):
            self.pos[s] += 1
        return plan

    def timed_pass(self, shape: str) -> dict:
        """Run one pass of ``shape`` stage by stage (the stages of ``ModelRunner.step_pass``)."""
        r = self.runner
        plan = self.plan(shape)
        t0 = time.perf_counter()
        with torch.inference_mode():
            r.free(plan.free_seq_ids)
            batch, sampling_chunks = r.prepare(plan)
            metadata = r.backend.prepare(batch, r.block_size)
            t1 = time.perf_counter()
            hidden, logits = r.forward_batch(batch, metadata)
            t2 = time.perf_counter()
            r.seq_table.computed(plan.chunks)
            states = [r.seqs[c.seq_id].sampling for c in sampling_chunks]
            out = r.sampler(logits, states, inplace=True)  # as ModelRunner.step_pass
            ids = out.token_ids.tolist()
            t3 = time.perf_counter()
            for i, c in enumerate(sampling_chunks):
                r.seq_table.sampled(c.seq_id, ids[i])
                r.seqs[c.seq_id].sampling.output_token_ids.append(ids[i])
            t4 = time.perf_counter()
        return {
            "tokens": batch.num_tokens,
            "total": t4 - t0,
            "prepare": t1 - t0,
            "forward+logits": t2 - t1,
            "sample": t3 - t2,
            "postprocess": t4 - t3,
        }


def group_profile(prof) -> dict[str, float]:
    """Self CPU seconds per op group (``GROUPS``) of a ``torch.profiler`` run."""
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.key.startswith("ProfilerStep") or e.key.startswith("fuseserve::"):
            continue
        name = next((g for g, keys in GROUPS if any(k in e.key for k in keys)), "other ops")
        out[name] = out.get(name, 0.0) + e.self_cpu_time_total / 1e6
    return out


def measure(a: argparse.Namespace) -> dict:
    engine = dict(kv.split("=", 1) for kv in a.engine)
    engine = {k: _value(v) for k, v in engine.items()}
    bench = PassBench(a.model, a.num_seqs, a.context, a.budget, engine)
    peak = max(gemm_flops(torch.float32) for _ in range(6))
    shapes = ("decode", "mixed")
    for s in shapes:  # warm-up (and compilation, when on)
        for _ in range(2):
            bench.timed_pass(s)
    compiled = bench.runner.compiled
    variants = (
        a.variants.split(",")
        if a.variants
        else [f"{'compiled' if compiled else 'eager'}:{torch.get_num_threads()}"]
    )
    runs: dict[tuple[str, str], list[dict]] = {(v, s): [] for v in variants for s in shapes}

    def use(variant: str) -> None:
        mode, threads = variant.split(":")
        torch.set_num_threads(int(threads))
        bench.runner.compiled = compiled if mode == "compiled" else None
        cpu_fused.ENABLED = mode != "unfused"  # unfused: eager with ATen's element-wise ops
        cpu_stack.ENABLED = mode not in ("unfused", "python")  # python: eager, layers not in one C++ call

    for v in variants:  # warm-up of each variant
        use(v)
        bench.timed_pass("decode")
    for _ in range(a.passes):  # variants alternate pass by pass: the same machine load for each
        for v in variants:
            use(v)
            for s in shapes:
                runs[v, s].append(bench.timed_pass(s))
    peak = max(peak, *(gemm_flops(torch.float32) for _ in range(6)))
    result = {
        "engine": engine,
        "threads": torch.get_num_threads(),
        "gemm_peak_flops": peak,
        "load_s": bench.load_s,
        "num_seqs": a.num_seqs,
        "context": a.context,
        "budget": a.budget,
    }
    result["compile_s"] = bench.runner.compile_s
    for v in variants:
        for s in shapes:
            rec = {k: statistics.median(r[k] for r in runs[v, s]) for k in runs[v, s][0]}
            rec["tokens_per_s"] = rec["tokens"] / rec["total"]
            rec["mfu"] = rec["tokens_per_s"] * bench.flops_per_token / peak
            result[f"{s} {v}"] = rec
    if a.profile:
        use(variants[-1])
        from torch.profiler import ProfilerActivity, profile

        for s in shapes:
            t0 = time.perf_counter()
            s = f"{s} {variants[-1]}"
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    bench.timed_pass(s.split()[0])
            wall = time.perf_counter() - t0
            groups = group_profile(prof)
            result[s]["profile_wall_s"] = wall
            result[s]["profile_groups_s"] = groups
            top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
            result[s]["profile_top_ops_s"] = {e.key: e.self_cpu_time_total / 1e6 for e in top}
    return result


def print_result(r: dict) -> None:
    print(
        f"engine {r['engine'] or '{}'}, compile {r['compile_s']:.1f} s, fp32 GEMM peak {r['gemm_peak_flops'] / 1e9:.0f} "
        f"GFLOP/s, load {open('/proc/loadavg').read().split()[0]}",
        flush=True,
    )
    for s in [k for k in r if k.startswith(("decode ", "mixed "))]:
        x = r[s]
        stages = ", ".join(
            f"{k} {x[k] * 1e3:.1f}" for k in ("prepare", "forward+logits", "sample", "postprocess")
        )
        print(
            f"  {s:>16} pass ({x['tokens']:.0f} tokens): {x['total'] * 1e3:.1f} ms = {stages} ms; "
            f"{x['tokens_per_s']:.0f} tok/s, MFU {x['mfu']:.1%}",
            flush=True,
        )
        if "profile_groups_s" in x:
            wall = x["profile_wall_s"]
            parts = sorted(x["profile_groups_s"].items(), key=lambda kv: -kv[1])
            print("    profile (self CPU / wall): " + ", ".join(f"{k} {v / wall:.0%}" for k, v in parts))
            for k, v in x["profile_top_ops_s"].items():
                print(f"      {v / wall:6.1%}  {k}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--variants",
        default=None,
        help="MODE:THREADS, comma-separated, alternated pass by pass (compiled:2,eager:2,python:2,unfused:2,eager:1); "
        "the last one is profiled",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    r = measure(a)
    print_result(r)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
