"""Benchmark metrics, workload and plots on hand-made traces with known answers."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not installed

from benchmarks import metrics as m  # noqa: E402
from benchmarks import plots  # noqa: E402
from benchmarks import workload as w  # noqa: E402

W = 15 / 17  # 1 - alpha for span 16


def stream(start: float, ttft: float, gaps: list[float], prompt_tokens: int = 1024) -> m.RequestTrace:
    """A trace whose first token comes ``ttft`` s after ``start``, then one token per gap."""
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return m.RequestTrace(start, times, prompt_tokens, len(times))


PASS = stream(0.0, 1.0, [0.1] * 19)  # TTFT 1 s <= 1024/512 = 2 s, 10 tok/s
SLOW_TTFT = stream(0.0, 3.0, [0.1] * 19)  # TTFT 3 s > 2 s
STALL = stream(0.0, 1.0, [0.1] * 9 + [2.0] + [0.1] * 9)  # 2 s stall after 10 tokens
FAILED = m.RequestTrace(0.0, [], 1024, 0, end=5.0, error="RuntimeError: boom")


# ---------------------------------------------------------------------------------------------------
# per-token latency, percentiles, EMA
# ---------------------------------------------------------------------------------------------------


def test_percentiles_known_list():
    gaps = [0.1 * i for i in range(1, 11)]  # 0.1 .. 1.0
    p = m.percentiles(gaps, (50, 90, 95))
    assert p["p50"] == pytest.approx(0.55)
    assert p["p90"] == pytest.approx(0.91)
    assert p["p95"] == pytest.approx(0.955)
    assert math.isnan(m.percentiles([], (50,))["p50"])


def test_token_gaps_plain_and_bursts():
    assert m.token_gaps([1.0, 1.5, 2.5, 2.75]) == pytest.approx([0.5, 1.0, 0.25])
    # two tokens in the first event (extra one has no gap), then 3 tokens 1 s later, then 1 more
    assert m.token_gaps([1.0, 1.0, 2.0, 2.0, 2.0, 3.0]) == pytest.approx([1 / 3] * 3 + [1.0])
    assert m.token_gaps([]) == [] and m.token_gaps([4.0]) == []


def test_ewm_mean_matches_hand_computation():
    # pandas ewm(span=16, adjust=True): y_t = sum w^i x_{t-i} / sum w^i, w = 1 - 2/17
    got = m.ewm_mean([1.0, 3.0, 5.0], 16)
    w_ = Fraction(15, 17)
    assert got[0] == pytest.approx(1.0)
    assert got[1] == pytest.approx(float((3 + w_) / (1 + w_)))  # 66/32
    assert got[1] == pytest.approx(2.0625)
    assert got[2] == pytest.approx(float((5 + 3 * w_ + w_**2) / (1 + w_ + w_**2)))  # 2435/769
    assert got[2] == pytest.approx(2435 / 769)


def test_ewm_mean_matches_pandas_if_installed():
    pd = pytest.importorskip("pandas")
    xs = list(np.random.default_rng(0).uniform(0.01, 1.0, 50))
    assert m.ewm_mean(xs, 16) == pytest.approx(pd.Series(xs).ewm(span=16).mean().tolist())


def test_smoothed_token_rate():
    assert m.smoothed_token_rate([1.0, 1.5, 2.0, 2.5]) == pytest.approx([2.0, 2.0, 2.0])
    # EMA of gaps [0.5, 0.25] = (0.25 + w*0.5) / (1 + w); the rate is its inverse
    ema = (0.25 + W * 0.5) / (1 + W)
    assert m.smoothed_token_rate([0.0, 0.5, 0.75])[1] == pytest.approx(1 / ema)


# ---------------------------------------------------------------------------------------------------
# service level
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [2.0, 4.0, 6.0])
def test_sla_pass(rate):
    assert m.meets_sla(PASS, 512, rate)


def test_sla_fails_on_slow_ttft():
    assert not m.meets_ttft(SLOW_TTFT, 512)
    assert m.meets_token_rate(SLOW_TTFT, 4.0)
    assert not m.meets_sla(SLOW_TTFT, 512, 4.0)
    assert m.meets_sla(SLOW_TTFT, 256, 4.0)  # 1024/256 = 4 s allowed


def test_sla_fails_on_stall():
    # after 9 gaps of 0.1 s the 2 s gap lifts the latency EMA to 0.1 + 1.9 / sum_{i<10} w^i
    den = sum(W**i for i in range(10))
    peak = 0.1 + 1.9 / den
    assert peak == pytest.approx(0.4132, abs=1e-3)
    assert max(m.ewm_mean(m.token_gaps(STALL.token_times), 16)) == pytest.approx(peak)
    assert m.meets_ttft(STALL, 512)
    assert not m.meets_token_rate(STALL, 4.0)  # needs EMA <= 0.25 s
    assert m.meets_token_rate(STALL, 2.0)  # EMA <= 0.5 s holds
    assert not m.meets_sla(STALL, 512, 4.0)


def test_sla_failed_and_single_token_requests():
    assert not m.meets_sla(FAILED, 512, 2.0)
    one = m.RequestTrace(0.0, [0.5], 1024, 1)
    assert m.meets_sla(one, 512, 6.0)


def test_scale_sla():
    sla = m.scale_sla(512, (2, 4, 6), 16)
    assert sla.prompt_rate == 32 and sla.token_rates == (0.125, 0.25, 0.375) and sla.factor == 16
    with pytest.raises(ValueError):
        m.scale_sla(factor=0)


def test_summarize_mix_and_effective_throughput():
    traces = [PASS, SLOW_TTFT, STALL, FAILED]
    s = m.summarize(traces, wall_seconds=10.0, sla=m.SLA())
    assert s["num_requests"] == 4 and s["num_failed"] == 1
    assert s["requests_per_s"] == pytest.approx(0.3)
    assert s["generated_tokens_per_s"] == pytest.approx(6.0)  # 3 x 20 tokens / 10 s
    assert s["total_tokens_per_s"] == pytest.approx((3 * 1024 + 60) / 10)
    assert s["mean_ttft_s"] == pytest.approx(5 / 3)
    assert s["p50_ttft_s"] == pytest.approx(1.0)
    assert s["mean_e2e_latency_s"] == pytest.approx((2.9 + 4.9 + 4.8) / 3)
    assert s["token_latency_p50_s"] == pytest.approx(0.1)
    assert s["token_latency_p95_s"] == pytest.approx(0.1)  # 1 stall among 57 gaps
    assert s["sla_fraction"] == pytest.approx({"2": 0.5, "4": 0.25, "6": 0.25})
    assert s["effective_requests_per_s"] == pytest.approx({"2": 0.15, "4": 0.075, "6": 0.075})
    assert s["effective_tokens_per_s"]["2"] == pytest.approx(3.0)
    assert s["sla"]["factor"] == 1.0 and s["sla"]["token_rates"] == [2.0, 4.0, 6.0]


def test_write_and_read_jsonl(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    s = m.summarize([FAILED], 1.0, m.SLA())  # all latency stats NaN
    m.write_jsonl(path, {"system": "x", "clients": 1, **s})
    m.write_jsonl(path, {"system": "y", "clients": 2})
    rows = m.read_jsonl(path)
    assert [r["system"] for r in rows] == ["x", "y"]
    assert rows[0]["mean_ttft_s"] is None


def test_model_flops_smollm2():
    cfg = dict(
        hidden_size=576,
        num_hidden_layers=30,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    )
    assert m.model_params(cfg) == 134_479_872  # SmolLM2-135M, tied embedding counted once
    assert m.model_flops_per_token(cfg) == 2 * 134_479_872
    assert m.model_flops_per_token(cfg, context_len=100) == 2 * 134_479_872 + 4 * 30 * 576 * 100
    assert m.mfu(100.0, 1e9, 1e12) == pytest.approx(0.1)


def test_measure_gemm_flops_positive():
    assert m.measure_gemm_flops(seconds=0.1, n=128) > 1e6


# ---------------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character: cheap, exact decode."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_workload_same_seed_same_requests():
    tok = CharTokenizer()
    a = w.make_requests(tok, 20, 100, 20, seed=3)
    b = w.make_requests(tok, 20, 100, 20, seed=3)
    c = w.make_requests(tok, 20, 100, 20, seed=4)
    assert a == b and a != c
    assert len({r.prompt_text for r in a}) == 20  # different offsets, different prompts


def test_workload_length_distribution():
    reqs = w.make_requests(CharTokenizer(), 2000, 200, 50, seed=0)
    plens = np.array([len(r.prompt_token_ids) for r in reqs])
    olens = np.array([r.max_new_tokens for r in reqs])
    assert plens.mean() == pytest.approx(200, rel=0.03)
    assert plens.std() == pytest.approx(0.3 * 200, rel=0.06)
    assert olens.mean() == pytest.approx(50, rel=0.03)
    assert olens.std() == pytest.approx(0.3 * 50, rel=0.06)
    assert plens.min() >= 1 and plens.max() <= 200 + 3 * 60
    capped = w.make_requests(CharTokenizer(), 200, 200, 50, seed=0, prompt_max=210, output_max=55)
    assert max(len(r.prompt_token_ids) for r in capped) <= 210
    assert max(r.max_new_tokens for r in capped) <= 55


def test_workload_real_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = w.build_corpus()
    assert len(corpus) > 100_000 and "the" in corpus
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus[:50_000]], trainer=trainer)

    reqs = w.make_requests(tok, 8, 64, 16, seed=1)
    assert reqs == w.make_requests(tok, 8, 64, 16, seed=1)
    for r in reqs:
        assert r.prompt_text == tok.decode(r.prompt_token_ids)
        assert abs(len(tok.encode(r.prompt_text).ids) - len(r.prompt_token_ids)) <= 3
        assert any(c.isalpha() for c in r.prompt_text)
    assert len({tuple(r.prompt_token_ids) for r in reqs}) == 8


# ---------------------------------------------------------------------------------------------------
# closed loop
# ---------------------------------------------------------------------------------------------------


def test_closed_loop_limits_concurrency_and_records_tokens():
    reqs = [w.BenchRequest([1] * (i + 1), "x", max_new_tokens=3 + i % 3) for i in range(7)]
    active = 0
    peak = 0

    async def send(req):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            if req.max_new_tokens == 5 and len(req.prompt_token_ids) == 6:
                raise RuntimeError("boom")
            for _ in range(req.max_new_tokens):
                await asyncio.sleep(0.002)
                yield time.perf_counter(), 1
        finally:
            active -= 1

    result = w.run_closed_loop(reqs, send, num_clients=3)
    assert peak == 3
    assert len(result.traces) == 7 and result.wall_seconds > 0
    for req, tr in zip(reqs, result.traces, strict=True):
        assert tr.prompt_tokens == len(req.prompt_token_ids)
        if tr.error:
            assert "boom" in tr.error and tr.output_tokens == 0
        else:
            assert tr.output_tokens == req.max_new_tokens == len(tr.token_times)
            assert tr.start < tr.token_times[0] <= tr.end
    assert sum(t.error is not None for t in result.traces) == 1


def test_send_from_blocking_thread_adapter():
    def blocking(req):
        for _ in range(req.max_new_tokens):
            time.sleep(0.001)
            yield 2  # two tokens per event

    reqs = [w.BenchRequest([1, 2], "ab", 4) for _ in range(4)]
    result = w.run_closed_loop(reqs, w.send_from_blocking(blocking), num_clients=2)
    assert [t.output_tokens for t in result.traces] == [8] * 4

    def broken(req):
        yield 1
        raise ValueError("bad")

    result = w.run_closed_loop(reqs[:1], w.send_from_blocking(broken), num_clients=1)
    assert "ValueError" in result.traces[0].error


# ---------------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------------


def test_plots_write_pngs(tmp_path):
    sla = m.scale_sla(factor=16)
    results = []
    for system, speed in (("fuseserve/splitfuse", 1.0), ("transformers", 2.0)):
        for clients in (1, 2, 4):
            traces = [stream(0.0, 0.5 * clients * speed, [0.2 * speed] * 10) for _ in range(clients)]
            results.append({"system": system, "clients": clients, **m.summarize(traces, 5.0, sla)})
    paths = [
        plots.plot_throughput_latency(results, tmp_path / "tl.png"),
        plots.plot_effective_throughput(results, tmp_path / "eff.png"),
        plots.plot_token_latency(results, tmp_path / "tok.png"),
    ]
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
