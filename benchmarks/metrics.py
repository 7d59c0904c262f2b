"""Benchmark metrics: pure functions over recorded request traces.

All times are seconds on one monotonic clock (`time.perf_counter`); rates are per second.

The service level is the paper's (DeepSpeed-FastGen, Holmes et al. 2024, performance evaluation): a request
meets it when (1) its time to first token is at most ``prompt_tokens / prompt_rate`` (paper:
512 prompt tokens/s) and (2) an exponential moving average (span 16) of its streamed token rate
stays at or above ``token_rate`` (paper: 2, 4 or 6 tokens/s) at every generated token; following
the paper's benchmark code, the average is taken over per-token latencies (see
`smoothed_token_rate`).
*Effective throughput* is queries/s (the paper's unit) x the fraction of requests that meet it;
a tokens/s variant is reported too.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

PAPER_PROMPT_RATE = 512.0  # prompt tokens/s: TTFT <= prompt_tokens / 512 (A100, Llama-2 7B)
PAPER_TOKEN_RATES = (2.0, 4.0, 6.0)  # generated tokens/s thresholds on the EMA of the stream rate
PAPER_EMA_SPAN = 16  # tokens


@dataclass
class RequestTrace:
    """What a client saw of one request.

    start: when the request was sent (s).
    token_times: arrival time of each generated token (s), non-decreasing; tokens delivered in one
        streamed event share a timestamp.
    prompt_tokens: prompt length (tokens).
    output_tokens: generated tokens (tokens); normally ``len(token_times)``.
    end: when the stream closed (s); None means the last token's time.
    error: why the request failed, None on success.
    """

    start: float
    token_times: list[float]
    prompt_tokens: int
    output_tokens: int
    end: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Succeeded and produced at least one token."""
        return self.error is None and len(self.token_times) > 0

    @property
    def ttft(self) -> float:
        """Time to first token (s). Raises ValueError when there is no token."""
        if not self.token_times:
            raise ValueError("trace has no tokens")
        return self.token_times[0] - self.start

    @property
    def e2e_latency(self) -> float:
        """End-to-end latency (s): send to stream end (or to the last token)."""
        last = self.end if self.end is not None else (self.token_times[-1] if self.token_times else None)
        if last is None:
            raise ValueError("trace has no end time and no tokens")
        return last - self.start


@dataclass(frozen=True)
class SLA:
    """Service level: TTFT <= prompt_tokens / prompt_rate and EMA(token rate) >= each token_rate.

    prompt_rate: prompt tokens/s. token_rates: generated tokens/s, one threshold each (effective
    throughput is reported per threshold). ema_span: EMA span (tokens). factor: how much the
    paper's thresholds were divided by to fit this hardware (1 = the paper's).
    """

    prompt_rate: float = PAPER_PROMPT_RATE
    token_rates: tuple[float, ...] = PAPER_TOKEN_RATES
    ema_span: int = PAPER_EMA_SPAN
    factor: float = 1.0


def scale_sla(
    prompt_rate: float = PAPER_PROMPT_RATE,
    token_rates: Sequence[float] = PAPER_TOKEN_RATES,
    factor: float = 1.0,
    ema_span: int = PAPER_EMA_SPAN,
) -> SLA:
    """Divide the service-level rates by ``factor`` (hardware this many times slower than the paper's).

    E.g. ``scale_sla(512, (2, 4, 6), 16)`` gives 32 prompt tokens/s and 0.125/0.25/0.375 tokens/s.
    The factor is kept in the result (and in `summarize` output) so reports can state it.
    """
    if factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    return SLA(prompt_rate / factor, tuple(r / factor for r in token_rates), ema_span, factor)


# --------------------------------------------------------------------------------------------------
# Per-token latency and rates
# --------------------------------------------------------------------------------------------------


def token_gaps(token_times: Sequence[float]) -> list[float]:
    """Per-token latency (s) of each token after the first: the gap since the previous token.

    Tokens that arrive together in one event (equal timestamps) share the gap before that event:
    ``k`` tokens arriving ``g`` seconds after the previous event get ``g / k`` each. Extra tokens in
    the very first event have no measurable gap and are left out, so with one token per event this
    is exactly ``diff(token_times)``.
    """
    gaps: list[float] = []
    i = 0
    n = len(token_times)
    while i < n and token_times[i] == token_times[0]:
        i += 1
    prev = token_times[0] if n else 0.0
    while i < n:
        j = i
        while j < n and token_times[j] == token_times[i]:
            j += 1
        k = j - i
        gaps.extend([(token_times[i] - prev) / k] * k)
        prev = token_times[i]
        i = j
    return gaps


def ewm_mean(values: Sequence[float], span: float) -> list[float]:
    """Exponentially weighted moving average, ``pandas.Series(values).ewm(span=span).mean()``.

    pandas' default ``adjust=True``: with alpha = 2 / (span + 1),
    ``y_t = sum_i (1-alpha)^i x_{t-i} / sum_i (1-alpha)^i`` over i = 0..t.
    """
    alpha = 2.0 / (span + 1.0)
    out: list[float] = []
    num = 0.0
    den = 0.0
    for x in values:
        num = x + (1.0 - alpha) * num
        den = 1.0 + (1.0 - alpha) * den
        out.append(num / den)
    return out


def smoothed_token_rate(token_times: Sequence[float], span: float = PAPER_EMA_SPAN) -> list[float]:
    """The stream's smoothed token rate (tokens/s) at each token after the first: 1 / EMA(gaps).

    As in the paper's benchmark code (DeepSpeedExamples ``benchmarks/inference/mii``,
    ``validate_token_ema_latency_SLA``), the EMA (pandas ``ewm(span=16).mean()``) is taken over the
    per-token *latencies* and compared with ``1 / token_rate``. An EMA of the rates themselves
    (1 / gap) could not see a stall: a long gap contributes a rate near 0, which lowers the average
    by at most ``1 / sum of weights`` however long the stall.
    """
    return [1.0 / e if e > 0 else math.inf for e in ewm_mean(token_gaps(token_times), span)]


def meets_ttft(trace: RequestTrace, prompt_rate: float) -> bool:
    """TTFT (s) <= prompt_tokens / prompt_rate (prompt tokens/s)."""
    return trace.ok and trace.ttft <= trace.prompt_tokens / prompt_rate


def meets_token_rate(trace: RequestTrace, token_rate: float, span: float = PAPER_EMA_SPAN) -> bool:
    """EMA (span tokens) of the per-token latency <= 1 / token_rate (tokens/s) at every token.

    Equivalently `smoothed_token_rate` >= token_rate throughout. A one-token response passes.
    """
    limit = 1.0 / token_rate
    return trace.ok and all(e <= limit for e in ewm_mean(token_gaps(trace.token_times), span))


def meets_sla(
    trace: RequestTrace, prompt_rate: float, token_rate: float, span: float = PAPER_EMA_SPAN
) -> bool:
    """Both halves of the paper's service level; failed or empty requests never meet it."""
    return meets_ttft(trace, prompt_rate) and meets_token_rate(trace, token_rate, span)


def sla_fraction(traces: Sequence[RequestTrace], prompt_rate: float, token_rate: float, span: float) -> float:
    """Fraction of all traces (failed ones included) that meet the service level."""
    if not traces:
        return 0.0
    return sum(meets_sla(t, prompt_rate, token_rate, span) for t in traces) / len(traces)


def percentiles(values: Sequence[float], qs: Iterable[float]) -> dict[str, float]:
    """``{"p50": ..., ...}``: numpy linear-interpolation percentiles; NaN for no values."""
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) if arr.size else math.nan for q in qs}


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else math.nan


def _key(rate: float) -> str:
    return f"{rate:g}"


def summarize(traces: Sequence[RequestTrace], wall_seconds: float, sla: SLA) -> dict[str, Any]:
    """All metrics of one run, as a JSON-able dict.

    Keys (units in the name; latency stats over successful requests only):
      num_requests, num_failed, wall_s,
      requests_per_s, generated_tokens_per_s, total_tokens_per_s (prompt + generated),
      mean_e2e_latency_s, mean_ttft_s, p50_ttft_s, p95_ttft_s,
      token_latency_p50_s, token_latency_p90_s, token_latency_p95_s (pooled per-token gaps),
      sla: {prompt_rate, token_rates, ema_span, factor},
      sla_fraction: {"<token_rate>": fraction meeting the service level},
      effective_requests_per_s: {"<token_rate>": requests_per_s x fraction}  (the paper's metric),
      effective_tokens_per_s: {"<token_rate>": generated_tokens_per_s x fraction}.
    Token-rate keys are formatted with ``f"{rate:g}"`` (e.g. "0.25").
    """
    if wall_seconds <= 0:
        raise ValueError(f"wall_seconds must be positive, got {wall_seconds}")
    good = [t for t in traces if t.ok]
    generated = sum(t.output_tokens for t in traces)
    prompt = sum(t.prompt_tokens for t in good)
    ttfts = [t.ttft for t in good]
    gaps = [g for t in good for g in token_gaps(t.token_times)]
    rps = len(good) / wall_seconds
    gen_tps = generated / wall_seconds
    ttft_p = percentiles(ttfts, (50, 95))
    gap_p = percentiles(gaps, (50, 90, 95))
    fractions = {_key(r): sla_fraction(traces, sla.prompt_rate, r, sla.ema_span) for r in sla.token_rates}
    return {
        "num_requests": len(traces),
        "num_failed": len(traces) - len(good),
        "wall_s": wall_seconds,
        "requests_per_s": rps,
        "generated_tokens_per_s": gen_tps,
        "total_tokens_per_s": (prompt + generated) / wall_seconds,
        "mean_e2e_latency_s": _mean([t.e2e_latency for t in good]),
        "mean_ttft_s": _mean(ttfts),
        "p50_ttft_s": ttft_p["p50"],
        "p95_ttft_s": ttft_p["p95"],
        "token_latency_p50_s": gap_p["p50"],
        "token_latency_p90_s": gap_p["p90"],
        "token_latency_p95_s": gap_p["p95"],
        "sla": asdict(sla) | {"token_rates": list(sla.token_rates)},
        "sla_fraction": fractions,
        "effective_requests_per_s": {k: rps * f for k, f in fractions.items()},
        "effective_tokens_per_s": {k: gen_tps * f for k, f in fractions.items()},
    }


# --------------------------------------------------------------------------------------------------
# Model FLOPs utilisation
# --------------------------------------------------------------------------------------------------


def _get(config: Any, name: str, default: Any = None) -> Any:
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def model_params(config: Any) -> int:
    """Parameters that take part in matmuls (LLaMA-style config; embeddings lookup excluded).

    Reads Hugging Face names from an object or dict: hidden_size, num_hidden_layers,
    intermediate_size, num_attention_heads, num_key_value_heads (default: attention heads),
    head_dim (default hidden / heads), vocab_size. The LM head counts (tied or not): it is a matmul.
    """
    hidden = _get(config, "hidden_size")
    layers = _get(config, "num_hidden_layers")
    inter = _get(config, "intermediate_size")
    heads = _get(config, "num_attention_heads")
    kv_heads = _get(config, "num_key_value_heads") or heads
    head_dim = _get(config, "head_dim") or hidden // heads
    vocab = _get(config, "vocab_size")
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # wq, wo, wk, wv
    mlp = 3 * hidden * inter  # w1, w2, w3 (gated MLP)
    return layers * (attn + mlp) + vocab * hidden


def model_flops_per_token(config: Any, context_len: int = 0) -> float:
    """FLOPs to process one token: 2 x matmul params, plus attention 4 x layers x (heads x head_dim) x ctx.

    ``context_len`` (tokens) is the number of keys the token attends to (0 leaves attention out).
    """
    hidden = _get(config, "hidden_size")
    heads = _get(config, "num_attention_heads")
    head_dim = _get(config, "head_dim") or hidden // heads
    layers = _get(config, "num_hidden_layers")
    return 2.0 * model_params(config) + 4.0 * layers * heads * head_dim * context_len


def measure_gemm_flops(seconds: float = 2.0, n: int = 1024) -> float:
    """Achievable fp32 matmul FLOP/s on this machine: repeated ``[n, n] @ [n, n]`` for ``seconds``."""
    import torch

    a = torch.randn(n, n)
    b = torch.randn(n, n)
    out = torch.empty(n, n)
    torch.matmul(a, b, out=out)  # warm-up
    reps = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.matmul(a, b, out=out)
        reps += 1
    elapsed = time.perf_counter() - t0
    return 2.0 * n**3 * reps / elapsed


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s (tokens/s x FLOPs/token) / peak FLOP/s."""
    return tokens_per_s * flops_per_token / peak_flops


# --------------------------------------------------------------------------------------------------
# Results files
# --------------------------------------------------------------------------------------------------


def write_jsonl(path: str | Path, record: Mapping[str, Any]) -> None:
    """Append one record as a JSON line (parent folders created). NaN and infinities become null."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(_json_safe(record), default=str, allow_nan=False) + "\n")


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All records of a JSON-lines file (blank lines skipped)."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


__all__ = [
    "PAPER_EMA_SPAN",
    "PAPER_PROMPT_RATE",
    "PAPER_TOKEN_RATES",
    "SLA",
    "RequestTrace",
    "ewm_mean",
    "measure_gemm_flops",
    "meets_sla",
    "meets_token_rate",
    "meets_ttft",
    "mfu",
    "model_flops_per_token",
    "model_params",
    "percentiles",
    "read_jsonl",
    "scale_sla",
    "sla_fraction",
    "summarize",
    "token_gaps",
    "smoothed_token_rate",
    "write_jsonl",
]
