"""Decode tokens/s of weight and KV-cache formats side by side: fp32, bf16, INT8, INT4 weights and an
FP8 KV cache, on SmolLM2 or a random-weight 1B LLaMA shape (where decode is bound by memory).

Modes (``--modes``, comma-separated): ``fp32``, ``bf16`` (float weights, that compute dtype);
``int8`` (W8A16, per-channel 8-bit), ``int4`` (4-bit) with fp32 compute, ``int4-bf16`` with bf16
compute; ``fp32-fp8kv``, ``bf16-fp8kv`` (``--kv-cache-dtype fp8``; the others keep the default KV
dtype, the compute dtype). The checkpoints:

- ``--model smollm2``: the float32 conversion of the bundled GGUF file; ``int4`` is the file's own
  Q4_1 kept quantized (``quantization="gguf"``, groups of 32 with offsets); ``int8`` a
  compressed-tensors W8A16 (per channel, symmetric) written from the conversion by
  ``tests/quant_checkpoints.write_quantized`` (round to nearest);
- ``--model llama-1b``: Llama-3.2-1B's shape (16 layers, hidden 2048, intermediate 8192, 32 heads /
  8 KV heads, vocab 128256, tied embeddings), random weights (seed 0) saved in bf16 by
  ``benchmarks/gpu_check.build_checkpoint``; ``int4`` GPTQ 4-bit (groups of 128, symmetric), ``int8``
  compressed-tensors W8A16, both written by ``write_quantized`` (the decoder's linear layers; the
  embedding / LM head stays float, as GPTQ and llm-compressor leave it).

Decode rate: ``batch`` prompts of ``--prompt-len`` random tokens, ``t1`` = seconds for 1 generated
token each (the prefill), ``tN`` = seconds for ``1 + --new-tokens`` (EOS ignored, greedy, prefix
caching off, fresh prompts each call); rate = ``batch * new_tokens / (tN - t1)``. The pipelines take
turns call by call in one process (the machine is shared and noisy: compare only within one run);
median over ``--rounds``. Prints each mode's resident weight bytes and the kernel each quantized
layer shape runs (``fuseserve.kernels.quant_linear.choose_kernel``, measured at load), and the load
average before and after.

``python -m benchmarks.quantized_decode [--model smollm2|llama-1b] [--modes fp32,bf16,int8,int4]
[--rounds 3] [--new-tokens 32] [--batches 1,16] [--prompt-len 8]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import fuseserve
from fuseserve.model_source import resolve_model
from fuseserve.worker.quantization import weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from quant_checkpoints import write_quantized  # noqa: E402

CACHE = Path(os.environ.get("FUSESERVE_BENCH_MODELS", Path.home() / ".cache" / "fuseserve" / "bench"))
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
MODES = {  # name: (checkpoint kind, compute dtype, KV cache dtype)
    "fp32": ("float", "float32", "auto"),
    "bf16": ("float", "bfloat16", "auto"),
    "int8": ("int8", "float32", "auto"),
    "int4": ("int4", "float32", "auto"),
    "int4-bf16": ("int4", "bfloat16", "auto"),
    "fp32-fp8kv": ("float", "float32", "fp8"),
    "bf16-fp8kv": ("float", "bfloat16", "fp8"),
}


def _quantized_copy(float_dir: Path, out: Path, fmt: str, bits: int, group: int) -> Path:
    """``float_dir`` written quantized to ``out`` (once; tokenizer files copied along)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(float_dir)
    config.__dict__.pop("quantization_config", None)  # a GGUF conversion's entry: its weights are float
    hf = AutoModelForCausalLM.from_pretrained(float_dir, config=config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_quantized(hf, tmp, fmt, bits=bits, group=group, sym=True)
    for f in float_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


def checkpoints(model: str) -> dict[str, tuple[str, str | None]]:
    """``{kind: (model path or alias, quantization option)}`` for ``model``, built on first use."""
    if model == "smollm2":
        conversion = Path(resolve_model("smollm2-135m-instruct").path)
        resolve_model("smollm2-135m-instruct", quantization="gguf")  # repack outside the timings
        int8 = _quantized_copy(conversion, CACHE / "smollm2-w8a16", "ct-int", 8, -1)
        return {
            "float": ("smollm2-135m-instruct", None),
            "int4": ("smollm2-135m-instruct", "gguf"),
            "int8": (str(int8), None),
        }
    from benchmarks import gpu_check

    gpu_check.SHAPES.setdefault("llama-1b", LLAMA_1B)  # gpu_check's random-weight builder, this shape
    base = CACHE / "llama-1b" / "float"
    if not (base / "config.json").exists():
        gpu_check.build_checkpoint("llama-1b", base.parent)
        (base.parent / "llama-1b").rename(base)
    int4 = _quantized_copy(base, CACHE / "llama-1b" / "gptq-w4g128", "gptq", 4, 128)
    int8 = _quantized_copy(base, CACHE / "llama-1b" / "w8a16", "ct-int", 8, -1)
    return {"float": (str(base), None), "int4": (str(int4), None), "int8": (str(int8), None)}


def _pipe(source: tuple[str, str | None], dtype: str, kv_cache_dtype: str, kv_memory: str):
    path, quantization = source
    return fuseserve.pipeline(
        path,
        quantization=quantization,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        token_budget=256,
        kv_cache_memory=kv_memory,
        prefix_caching=False,
        progress=False,
    )


class Prompts:
    """Fresh random prompts for every call (no prefix is ever shared between calls)."""

    def __init__(self, vocab: int, prompt_len: int):
        self.gen = torch.Generator().manual_seed(0)
        self.vocab, self.prompt_len = vocab, prompt_len

    def __call__(self, batch: int) -> list[list[int]]:
        return torch.randint(3, self.vocab, (batch, self.prompt_len), generator=self.gen).tolist()


def _seconds(pipe, prompts: list[list[int]], tokens: int) -> float:
    start = time.perf_counter()
    outs = pipe(prompts, max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == tokens for o in outs)
    return elapsed


def decode_rate(pipe, prompts: Prompts, batch: int, new_tokens: int) -> float:
    """Generated tokens per second of decode alone: ``batch * new_tokens / (tN - t1)``."""
    t1 = _seconds(pipe, prompts(batch), 1)
    tn = _seconds(pipe, prompts(batch), 1 + new_tokens)
    return batch * new_tokens / (tn - t1)


def layer_kernels(pipe) -> list[str]:
    """``OUTxIN:kernel`` of each packed layer shape of ``pipe``'s model, sorted."""
    packed = [m.packed for m in pipe.runner.model.modules() if hasattr(m, "packed")]
    return sorted({f"{p.out_features}x{p.in_features}:{p.name}" for p in packed})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "llama-1b"), default="smollm2")
    ap.add_argument("--modes", default="fp32,bf16,int8,int4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--kv-cache-memory", default="512MiB")
    args = ap.parse_args()
    modes = args.modes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"load average at start {os.getloadavg()}; {torch.get_num_threads()} threads", flush=True)
    sources = checkpoints(args.model)
    pipes = {}
    for m in modes:
        kind, dtype, kv = MODES[m]
        pipes[m] = _pipe(sources[kind], dtype, kv, args.kv_cache_memory)
        mib = weight_bytes(pipes[m].runner.model) / 2**20
        print(f"{m}: resident weights {mib:.1f} MiB; kernels {layer_kernels(pipes[m])}", flush=True)
    vocab = pipes[modes[0]].runner.info.vocab_size
    prompts = Prompts(vocab, args.prompt_len)
    for pipe in pipes.values():  # warm-up
        decode_rate(pipe, prompts, 1, 2)
    rates: dict[tuple[str, int], list[float]] = {(m, b): [] for m in modes for b in batches}
    for r in range(args.rounds):
        for b in batches:
            for m, pipe in pipes.items():
                rates[m, b].append(decode_rate(pipe, prompts, b, args.new_tokens))
        print(
            f"round {r + 1}: " + ", ".join(f"{m} b{b} {v[-1]:.1f}" for (m, b), v in rates.items()), flush=True
        )
    for b in batches:
        base = statistics.median(rates[modes[0], b])
        line = ", ".join(
            f"{m} {statistics.median(rates[m, b]):.1f} ({statistics.median(rates[m, b]) / base:.2f}x)"
            for m in modes
        )
        print(f"{args.model} batch {b}, prompt {args.prompt_len}, decode tok/s (x {modes[0]}): {line}")
    print(f"load average at end {os.getloadavg()}")
    for pipe in pipes.values():
        pipe.close()


if __name__ == "__main__":
    main()
