"""Forward throughput (tokens/s) of fuseserve's model code vs ``transformers`` on the same weights.

One prompt chunk of N tokens per pass (N = 64, 256, 512 by default), best of ``--repeats``, both
measured side by side in one run. ``python -m benchmarks.forward_throughput [--model M]``.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--sizes", default="64,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from fuseserve.config import EngineConfig
    from fuseserve.model_source import resolve_model
    from fuseserve.sampling_params import SamplingParams
    from fuseserve.scheduler.block_accounting import BlockAccount, assign_block_ids
    from fuseserve.types import SeqChunk, StepPlan
    from fuseserve.worker.model_runner import ModelRunner

    src = resolve_model(a.model)
    runner = ModelRunner(
        src.path, src.config, src.eos_token_ids(), EngineConfig(kv_cache_memory="256MiB"), progress=False
    )
    hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0)
    print(f"torch threads: {torch.get_num_threads()}; model: {src.name}")
    print(f"{'tokens':>7} {'fuseserve tok/s':>16} {'transformers tok/s':>19} {'ratio':>6}")
    for n in [int(s) for s in a.sizes.split(",")]:
        ids = torch.randint(0, runner.vocab_size, (n,)).tolist()
        ours, theirs = float("inf"), float("inf")
        for _ in range(a.repeats + 1):  # the first round warms up
            plan = StepPlan(0, [SeqChunk(0, 0, n, ids, sample=True, params=params, prompt_len=n)])
            assign_block_ids(BlockAccount(runner.info.num_blocks, runner.info.block_size, False), plan)
            t0 = time.perf_counter()
            runner.run_pass(plan)
            ours = min(ours, time.perf_counter() - t0)
            runner.free([0])
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf(torch.tensor([ids]), logits_to_keep=1)
                theirs = min(theirs, time.perf_counter() - t0)
        print(f"{n:>7} {n / ours:>16.0f} {n / theirs:>19.0f} {theirs / ours:>6.2f}")


if __name__ == "__main__":
    main()
