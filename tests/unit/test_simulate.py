"""The GPU-scale simulator: latency model shape, simulated clock, budget, and a scheduler property."""

from __future__ import annotations

import math

import pytest

from benchmarks.metrics import scale_sla, summarize
from benchmarks.simulate import PRESETS, SimRequest, make_sim_requests, run_grid, simulate, simulate_workers

A100 = PRESETS["a100-llama2-7b"]


@pytest.mark.parametrize("model", list(PRESETS.values()), ids=list(PRESETS))
def test_latency_throughput_is_concave(model):
    sizes = list(range(1, 4097, 8))
    lat = [model.pass_seconds(n) for n in sizes]  # token count alone (no attention context)
    assert all(b >= a for a, b in zip(lat, lat[1:], strict=False))  # more tokens never faster
    tput = [n / t for n, t in zip(sizes, lat, strict=True)]
    slopes = [(b - a) / 8 for a, b in zip(tput, tput[1:], strict=False)]
    assert all(s2 <= s1 + 1e-6 for s1, s2 in zip(slopes, slopes[1:], strict=False))  # concave
    assert model.latency(1) == pytest.approx(model.weight_bytes / model.bandwidth, rel=0.01)  # weights floor
    assert 16 <= model.knee() <= 1024
    assert all(model.latency(n) >= model.pass_seconds(n) for n in sizes)  # context only adds


def test_latency_grows_with_context():
    assert A100.latency(1, context=4000) > A100.latency(1, context=0)
    assert A100.latency(512, context=2000) > A100.latency(512)


def test_simulated_clock_advances_and_tokens_are_timed():
    reqs = [SimRequest(300, 5), SimRequest(50, 3)]
    res = simulate(A100, reqs, num_clients=2, policy="splitfuse", token_budget=128)
    assert res.wall_seconds > 0
    assert [t.output_tokens for t in res.traces] == [5, 3]
    for t in res.traces:
        assert t.token_times == sorted(t.token_times)
        assert t.start <= t.token_times[0] <= t.end
    # at least ceil(350 / 128) prefill passes plus the decodes, each at least the weights floor
    assert res.num_passes >= math.ceil(350 / 128)
    assert res.wall_seconds >= res.num_passes * A100.latency(1) * 0.99


@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "whole_prompt"])
def test_splitfuse_never_exceeds_budget(policy):
    reqs = make_sim_requests(24, 600, 20, seed=1)
    res = simulate(A100, reqs, num_clients=8, policy=policy, token_budget=256)
    if policy == "splitfuse":
        assert res.max_pass_tokens <= 256
        assert sum(1 for n in res.pass_tokens if n == 256) > 0  # fills the budget exactly
    assert sum(t.output_tokens for t in res.traces) == sum(r.output_len for r in reqs)


def test_tiny_run_has_sane_metrics():
    reqs = make_sim_requests(8, 400, 16, seed=2)
    res = simulate(A100, reqs, num_clients=4, policy="splitfuse", token_budget=256)
    m = summarize(res.traces, res.wall_seconds, scale_sla())
    assert m["num_failed"] == 0 and m["num_requests"] == 8
    assert 0 < m["requests_per_s"] < 1000
    assert 0 < m["token_latency_p50_s"] <= m["token_latency_p95_s"] < 1.0
    assert m["mean_ttft_s"] > 0


def test_splitfuse_p95_token_latency_beats_prefill_first_on_long_prompts():
    records = run_grid(A100, (2600, 60), clients=[16], requests_per_client=4, min_requests=32, seed=0)
    by = {r["policy"]: r for r in records}
    sf, pf = by["splitfuse"], by["prefill_first"]
    assert sf["token_latency_p95_s"] * 2 < pf["token_latency_p95_s"]
    assert sf["effective_requests_per_s"]["4"] >= pf["effective_requests_per_s"]["4"]


def test_placement_on_a_fast_and_a_3x_slower_worker():
    """Light load: every request on the fast worker (it finishes each about 3x sooner); a long queue
    (64 clients of 512-token prompts): the slow worker takes part and the pair beats the fast alone."""
    model = PRESETS["a100-llama2-7b"]
    light = simulate_workers(model, [1.0, 3.0], make_sim_requests(40, 256, 64, seed=1), 4, model.knee())
    assert light["token_share"][1] < 0.05
    reqs = make_sim_requests(256, 512, 64, seed=2)
    alone = simulate_workers(model, [4.0], reqs, 64, model.knee())
    pair = simulate_workers(model, [4.0, 12.0], reqs, 64, model.knee())
    assert 0.1 < pair["token_share"][1] < 0.3
    assert pair["tokens_per_s"] > 1.15 * alone["tokens_per_s"]
