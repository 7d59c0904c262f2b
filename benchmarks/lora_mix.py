"""Multi-LoRA throughput: 4 adapters mixed in every pass against the base model alone, same requests.

Pipeline mode, SmolLM2-135M (the bundled model) unless ``--model`` says otherwise. Four random LoRA
adapters of rank ``--rank`` on every projection (q, k, v, o, gate, up, down) are written as PEFT
checkpoints (``adapter_config.json`` + ``adapter_model.safetensors``) into a temporary directory.
Two pipelines are built once: a plain one (no LoRA) and one serving the four adapters
(``max_loras=4``). Each round sends the same ``--requests`` requests (the paper's workload shape,
``benchmarks/workload.py``, all at once) to: the plain pipeline; the LoRA pipeline with the
adapters round-robin over the requests; the LoRA pipeline with no adapter. Rounds alternate so the
noise of a shared machine falls on all three alike; the median round of each is reported. Prefix
caching is off (the rounds repeat the prompts).

Run: ``python -m benchmarks.lora_mix [--requests 32 --prompt 200 --output 32 --rounds 3]``; prints
generated tokens per second (wall) and per CPU second of the process, of each, and the ratios mixed /
base (the goal on CPU: >= 0.8), and appends the record (with the load average: a shared machine
moves wall-clock figures) to ``results/lora_mix.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

RESULTS = Path(__file__).parent / "results"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(config, path: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA checkpoint for a LLaMA-shaped ``config`` with random A and B on every projection."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    h, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {  # module -> (in, out)
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_proj": (h, inter),
        "mlp.up_proj": (h, inter),
        "mlp.down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (k_in, k_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k_in, generator=g) / k_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(k_out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    return path


def run_round(pipe, prompts: list[list[int]], outputs: list[int], loras) -> tuple[float, float]:
    """Generated tokens per second and per CPU second of this process, of one batch of requests (all
    submitted at once, greedy, no EOS stop). CPU seconds hold better than wall seconds on a machine
    another job shares."""
    import threading

    results: list[int] = [0] * len(prompts)

    def one(i: int) -> None:
        r = pipe([prompts[i]], lora=loras[i], max_new_tokens=outputs[i], temperature=0.0, ignore_eos=True)
        results[i] = len(r[0].token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0, c0 = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(results) / (time.perf_counter() - t0), sum(results) / (time.process_time() - c0)


def main() -> None:
    import fuseserve
    from benchmarks.workload import make_requests
    from fuseserve.model_source import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=200, help="mean prompt tokens")
    ap.add_argument("--output", type=int, default=32, help="mean generated tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()

    source = resolve_model(args.model, cache_dir=args.cache_dir)
    engine = dict(
        token_budget=args.token_budget,
        kv_cache_memory="512MiB",
        dtype=args.dtype,
        progress=False,
        prefix_caching=False,
        cache_dir=args.cache_dir,
    )
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {
            f"lora{i}": str(write_adapter(source.config, Path(tmp) / f"lora{i}", args.rank, i))
            for i in range(4)
        }
        plain = fuseserve.pipeline(str(source.path), **engine)
        lora = fuseserve.pipeline(
            str(source.path), lora_modules=adapters, max_loras=4, max_lora_rank=args.rank, **engine
        )
        try:
            reqs = make_requests(plain.tokenizer, args.requests, args.prompt, args.output, seed=1)
            prompts = [r.prompt_token_ids for r in reqs]
            outputs = [r.max_new_tokens for r in reqs]
            names = list(adapters)
            mixed = [names[i % 4] for i in range(len(reqs))]
            none = [None] * len(reqs)
            run_round(plain, prompts[:4], [4] * 4, none[:4])  # warm up both
            run_round(lora, prompts[:4], [4] * 4, mixed[:4])
            runs = {"base": (plain, none), "mixed": (lora, mixed), "lora_pipeline_base": (lora, none)}
            rates: dict[str, list[float]] = {k: [] for k in runs}
            cpu_rates: dict[str, list[float]] = {k: [] for k in runs}
            for r in range(args.rounds):
                for name, (pipe, loras) in runs.items():
                    wall, cpu = run_round(pipe, prompts, outputs, loras)
                    rates[name].append(wall)
                    cpu_rates[name].append(cpu)
                print(
                    f"round {r + 1}: "
                    + ", ".join(f"{k} {rates[k][-1]:.1f} tok/s ({cpu_rates[k][-1]:.1f}/cpu-s)" for k in runs)
                )
        finally:
            plain.close()
            lora.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu_rates.items()}
    record = {
        "benchmark": "lora_mix",
        "model": args.model,
        "requests": args.requests,
        "prompt_mean": args.prompt,
        "output_mean": args.output,
        "rank": args.rank,
        "token_budget": args.token_budget,
        "dtype": args.dtype,
        "rounds": args.rounds,
        "tok_s": {k: round(v, 1) for k, v in med.items()},
        "tok_per_cpu_s": {k: round(v, 1) for k, v in cpu_med.items()},
        "ratio_mixed_over_base": round(med["mixed"] / med["base"], 3),
        "ratio_mixed_over_base_cpu": round(cpu_med["mixed"] / cpu_med["base"], 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(
        f"base {med['base']:.1f} tok/s, 4 adapters mixed {med['mixed']:.1f} tok/s, "
        f"ratio {record['ratio_mixed_over_base']:.2f} (LoRA pipeline, no adapter: "
        f"{med['lora_pipeline_base']:.1f} tok/s); per CPU second: base {cpu_med['base']:.1f}, "
        f"mixed {cpu_med['mixed']:.1f}, ratio {record['ratio_mixed_over_base_cpu']:.2f}"
    )
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "lora_mix.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
