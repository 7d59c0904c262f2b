"""Forward-pass latency models: a roofline per (device, model), and the presets simulated workers use.

One ragged pass of ``num_tokens`` tokens that reads ``kv_tokens`` cached tokens and computes
``attn_pairs`` (query, key) pairs takes (a roofline, stated inputs, nothing fitted to the paper):

    t = max(memory_s, compute_s)
    memory_s  = (weight_bytes + kv_bytes_per_token x kv_tokens) / bandwidth
    compute_s = overhead_s + seq_overhead_s x num_seqs
                + (flops_per_token x num_tokens + attn_flops_per_pair x attn_pairs) / (peak_flops x mfu)

``kv_tokens`` is the sum over the pass's sequences of their context (start_pos + num_tokens);
``attn_pairs`` is the sum of ``n x (start_pos + (n + 1) / 2)``; ``num_seqs`` is the number of
sequences in the pass (``seq_overhead_s`` is 0 for the GPU presets; the CPU runner's reference
attention costs time per sequence). With no context the curve is
``max(t_min, a + b n)``: flat (weights-bound) up to the knee, then compute-bound, so throughput
``n / t(n)`` is concave in the pass size (DeepSpeed-FastGen, Holmes et al. 2024, §3.1).

Used by ``fuseserve worker --simulate PRESET`` (``fuseserve.worker.sim_runner``) and by the
clock-driven projection ``benchmarks/simulate.py``. Imports neither torch nor a model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fuseserve.pass_shape import PassShape
from fuseserve.types import StepPlan

PROFILE_SIZES = (32, 64, 128, 256, 512, 1024)
"""Pass sizes (tokens, prompts of at most 128 tokens each) of a worker's start-up profile
(``fuseserve.worker.profiler``)."""

LLAMA2_7B_PARAMS = 6.74e9  # matmul parameters of Llama-2 7B (embeddings included in the LM head)
LLAMA2_7B_LAYERS = 32
LLAMA2_7B_HIDDEN = 4096
CPU_PEAK_FLOPS = 275e9  # fp32 GEMM peak measured on the 2-vCPU development machine (torch, 2 threads)


@dataclass(frozen=True)
class LatencyModel:
    """Forward-pass latency (seconds) of one ragged pass on a modelled device.

    weight_bytes: bytes streamed per pass for the weights (fp16: 2 x params).
    bandwidth: memory bandwidth (bytes/s).
    flops_per_token: matmul FLOPs per token (2 x params).
    attn_flops_per_pair: attention FLOPs per (query, key) pair (4 x layers x hidden).
    kv_bytes_per_token: KV-cache bytes read per cached token (2 x layers x kv width x element bytes).
    peak_flops: dense FLOP/s of the device. mfu: achieved fraction of it in compute-bound passes.
    overhead_s: fixed per-pass cost (launches, scheduling, sampling), seconds.
    kv_capacity_tokens: tokens the KV cache holds (the worker's blocks = this // block_size).
    max_model_len: context length in tokens (prompt + generated).
    seq_overhead_s: compute seconds per sequence in the pass (per-sequence kernels), 0 on GPUs.
    """

    name: str
    weight_bytes: float
    bandwidth: float
    flops_per_token: float
    attn_flops_per_pair: float
    kv_bytes_per_token: float
    peak_flops: float
    mfu: float
    overhead_s: float
    kv_capacity_tokens: int
    max_model_len: int = 4096
    seq_overhead_s: float = 0.0

    def pass_seconds(
        self, num_tokens: int, kv_tokens: float = 0.0, attn_pairs: float = 0.0, num_seqs: int = 1
    ) -> float:
        """Seconds for a pass of ``num_tokens`` tokens of ``num_seqs`` sequences reading ``kv_tokens``
        cached tokens and computing ``attn_pairs`` (query, key) pairs in total."""
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) / self.bandwidth
        compute = (
            self.overhead_s
            + self.seq_overhead_s * num_seqs
            + (self.flops_per_token * num_tokens + self.attn_flops_per_pair * attn_pairs)
            / (self.peak_flops * self.mfu)
        )
        return max(memory, compute)

    def latency(self, num_tokens: int, context: int = 0) -> float:
        """Seconds for a pass of ``num_tokens`` tokens of one sequence whose KV holds ``context`` tokens."""
        pairs = num_tokens * (context + (num_tokens + 1) / 2)
        return self.pass_seconds(num_tokens, context + num_tokens, pairs)

    def plan_seconds(self, plan: StepPlan) -> float:
        """Seconds for a step plan (sums context and attention pairs over its chunks)."""
        return self.shape_seconds(PassShape.of_plan(plan))

    def shape_seconds(self, shape: PassShape) -> float:
        """Seconds for a pass of this shape."""
        return self.pass_seconds(shape.num_tokens, shape.kv_tokens, shape.attn_pairs, shape.num_seqs)

    def knee(self, fraction: float = 0.9, max_tokens: int = 4096) -> int:
        """Smallest pass size (multiple of 16) whose throughput reaches ``fraction`` of the best (rule 4)."""
        sizes = list(range(16, max_tokens + 1, 16))
        tput = [n / self.latency(n) for n in sizes]
        best = max(tput)
        return next(n for n, t in zip(sizes, tput, strict=True) if t >= fraction * best)


def llama2_7b_on(
    name: str,
    bandwidth: float,
    peak_flops: float,
    memory_bytes: float,
    mfu: float = 0.5,
    overhead_s: float = 3e-3,
) -> LatencyModel:
    """Llama-2 7B (fp16, MHA) on a GPU of the given bandwidth (B/s), dense peak (FLOP/s), memory (B).

    KV capacity: 90% of memory minus the weights, at 2 x 32 layers x 4096 x 2 bytes per token.
    """
    weight_bytes = 2.0 * LLAMA2_7B_PARAMS
    kv_per_token = 2.0 * LLAMA2_7B_LAYERS * LLAMA2_7B_HIDDEN * 2
    return LatencyModel(
        name=name,
        weight_bytes=weight_bytes,
        bandwidth=bandwidth,
        flops_per_token=2.0 * LLAMA2_7B_PARAMS,
        attn_flops_per_pair=4.0 * LLAMA2_7B_LAYERS * LLAMA2_7B_HIDDEN,
        kv_bytes_per_token=kv_per_token,
        peak_flops=peak_flops,
        mfu=mfu,
        overhead_s=overhead_s,
        kv_capacity_tokens=int((0.9 * memory_bytes - weight_bytes) / kv_per_token),
        max_model_len=4096,
    )


PRESETS: dict[str, LatencyModel] = {
    # A100 80GB SXM: 2.0 TB/s nominal, 1.5 TB/s achievable streaming; 312 TFLOP/s bf16 dense.
    "a100-llama2-7b": llama2_7b_on("A100-80GB / Llama-2-7B", 1.5e12, 312e12, 80e9),
    # RTX A6000 48GB: 768 GB/s nominal (~0.65 TB/s achievable); 155 TFLOP/s fp16 dense tensor.
    "a6000-llama2-7b": llama2_7b_on("A6000-48GB / Llama-2-7B", 0.65e12, 155e12, 48e9),
    # SmolLM2-135M-Instruct, fp32, one torch thread of the shared 2-vCPU development machine (a worker of
    # `fuseserve serve --workers 2`): fitted by `python -m benchmarks.fit_latency` to 13 passes of the
    # real ModelRunner (benchmarks/results/fit_latency.json; measured under a load average of 8-10,
    # so within about +-40% of each measured pass).
    "cpu-smollm2": LatencyModel(
        name="CPU 1 thread / SmolLM2-135M fp32 (fitted)",
        weight_bytes=538_060_032.0,  # fp32 parameters, counted from the loaded model
        bandwidth=5.07e9,  # weights / fastest pass of <= 4 tokens (106 ms)
        flops_per_token=212_336_640.0,  # 2 x matmul parameters of the 30 layers (LM head: sampled rows)
        attn_flops_per_pair=142_437.0,  # fitted: the reference attention, ~2x its 4 x 30 x 576 FLOPs
        kv_bytes_per_token=46_080.0,  # 2 x 30 layers x 3 KV heads x 64 x 4 bytes
        peak_flops=CPU_PEAK_FLOPS,
        mfu=0.131,  # fitted: 36 GFLOP/s achieved in compute-bound passes
        overhead_s=0.0,  # fitted (the per-sequence term absorbs it)
        kv_capacity_tokens=23_301,  # the CPU worker's default 1 GiB KV cache
        max_model_len=8192,
        seq_overhead_s=0.0222,  # fitted: per sequence in a pass
    ),
}
"""Latency presets by name (``fuseserve worker --simulate NAME``)."""


def get_preset(name: str) -> LatencyModel:
    """The preset called ``name``. Raises ``InvalidParameterError`` naming the known presets."""
    from fuseserve.errors import InvalidParameterError

    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidParameterError("simulate", name, ", ".join(sorted(PRESETS))) from None
