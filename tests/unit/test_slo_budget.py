"""SLO-driven token budget (``fuseserve.scheduler.slo_budget``): the pass limit from the predicted
latency, earliest-deadline-first prompts, the online latency correction, and plans without targets
exactly the fixed-budget ones. The real ``Scheduler`` on a simulated clock; no model, no processes.
"""

from __future__ import annotations

import collections
import hashlib

import pytest

from fuseserve.config import EngineConfig
from fuseserve.errors import InvalidParameterError
from fuseserve.pass_shape import PassShape
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.scheduler import Scheduler
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.slo_budget import ITL_MARGIN, PassLatency, curve_prior
from fuseserve.types import SampledToken, StepResult
from fuseserve.worker.latency_model import PRESETS

A6000 = PRESETS["a6000-llama2-7b"]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(policy="splitfuse", budget=128, itl=None, rate=None, prior=None, num_blocks=4000):
    clock = Clock()
    slo = {"target_itl": itl, "target_prefill_rate": rate} if itl or rate else {}
    sched = Scheduler(
        EngineConfig(token_budget=budget, policy=policy, **slo), [], **({"clock": clock} if slo else {})
    )
    sched.add_worker("w", num_blocks, 16, 1 << 20, budget, **({"latency_prior": prior} if prior else {}))
    return sched, clock


def params(n):
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def step(sched, clock, model, check=None):
    """Plan, run on the latency model (advancing the clock), apply; returns the plan or None."""
    plan = sched.schedule().get("w")
    if plan is None:
        return None
    if check:
        check(plan)
    seconds = model.plan_seconds(plan) if plan.chunks else 0.0
    clock.now += seconds
    tokens = [SampledToken(c.seq_id, 0) for c in plan.chunks if c.sample]
    sched.postprocess("w", StepResult(plan.step_id, tokens, seconds))
    return plan


def test_pass_never_exceeds_predicted_latency_limit():
    """Every pass's predicted latency stays within the ITL target less the margin (whenever the
    running decodes alone fit), and passes do grow past the knee when prompts wait."""
    itl = 0.12
    sched, clock = make(budget=A6000.knee(), itl=itl, rate=512, prior=A6000.shape_seconds)
    slot = sched.slots["w"]
    for i in range(24):
        sched.add(Sequence(i, [i + 1] * (900 + 37 * i), params(20)))  # distinct: no prefix-cache hits
    sizes = []

    def check(plan):
        decodes = [c for c in plan.chunks if c.num_tokens == 1 and c.start_pos > 0]
        if slot.latency.predict(PassShape.of_chunks([(c.start_pos, 1) for c in decodes])) > itl:
            return  # the decodes alone break the target: the pass is just them
        assert slot.latency.predict(PassShape.of_plan(plan)) <= itl * (1 - ITL_MARGIN) + 1e-12
        assert A6000.plan_seconds(plan) <= itl  # the prior is the model here: the real pass fits too
        sizes.append(plan.num_tokens)

    while sched.has_work:
        step(sched, clock, A6000, check)
    assert len(sizes) > 20
    assert max(sizes) > 2 * A6000.knee()  # the budget grew: deadlines pressed and latency allowed


def test_prompt_past_ttft_deadline_is_taken_first():
    """FIFO without targets; with a prefill-rate target, the prompt past its deadline goes first."""
    for rate, first in ((None, 0), (100.0, 1)):
        sched, clock = make(budget=32, rate=rate)
        sched.add(Sequence(0, [1] * 1000, params(4)))  # deadline 10 s
        clock.now = 1.0
        sched.add(Sequence(1, [2] * 50, params(4)))  # deadline 1.5 s
        clock.now = 2.0  # seq 1 is past its deadline, seq 0 is not
        plan = sched.schedule()["w"]
        assert plan.chunks[0].seq_id == first
        assert plan.num_tokens == 32


def test_overdue_prompts_wait_behind_the_others_when_the_kv_cache_is_short():
    """Earliest deadline first while the KV cache holds the queue; when it does not, a freed slot goes
    to a prompt that can still meet its deadline, not to the most overdue one."""
    from fuseserve.scheduler.slo_budget import SLOBudget

    clock = Clock()
    slo = SLOBudget(None, 100.0, clock)
    seqs = []
    for i, (arrival, prompt) in enumerate([(0.0, 100), (0.5, 100), (2.5, 100), (3.0, 60)]):
        clock.now = arrival
        seq = Sequence(i, [i + 1] * prompt, params(4))
        seq.arrival_time = arrival
        seqs.append(seq)  # deadlines 1.0, 1.5, 3.5, 3.6: at 3.0 s the first two are overdue
    clock.now = 3.0
    queue = collections.deque(reversed(seqs))
    slo.order_waiting(queue, kv_free_tokens=400)  # room for the whole queue: EDF
    assert [s.seq_id for s in queue] == [0, 1, 2, 3]
    slo.order_waiting(queue, kv_free_tokens=200)  # short: the overdue last, EDF within each group
    assert [s.seq_id for s in queue] == [2, 3, 0, 1]
    slo.order_waiting(queue)  # no KV figure: EDF
    assert [s.seq_id for s in queue] == [0, 1, 2, 3]


def test_online_correction_learns_a_slower_device():
    """A start-up profile of single prompts; the device turns out 2x slower and its passes carry
    decodes with context the profile never saw: measured passes correct the prediction."""
    profile = {n: A6000.latency(n) for n in (32, 64, 128, 256, 512)}
    model = PassLatency(curve_prior(profile))
    shapes = [PassShape.of_chunks([(100 * k, 1)] * k + [(0, p)]) for k in (0, 2, 8) for p in (64, 300, 900)]

    def device(shape):
        return 2 * A6000.shape_seconds(shape)

    before = [abs(model.predict(s) / device(s) - 1) for s in shapes]
    for _ in range(20):
        for s in shapes:
            model.observe(s, device(s))
    after = [abs(model.predict(s) / device(s) - 1) for s in shapes]
    assert min(before) > 0.4  # the prior is half the truth
    assert max(after) < 0.15, after  # a linear correction of a roofline (max) curve: within 15%


def test_targets_are_validated():
    with pytest.raises(InvalidParameterError):
        EngineConfig(target_itl=0).validate()
    with pytest.raises(InvalidParameterError):
        EngineConfig(target_prefill_rate=-5).validate()


def plan_digest(policy: str, **slo) -> str:
    """sha256 of every plan of a closed-loop run (8 clients, 40 requests, mixed lengths). The prompts
    share no prefix (prefix caching on, as by default, must then plan exactly as without it)."""
    sched, clock = make(policy=policy, budget=224, num_blocks=2000, **slo)
    digest = hashlib.sha256()
    lengths = [(50 + (i * 397) % 2500, 5 + (i * 31) % 60) for i in range(40)]
    sent = 0

    def send():
        nonlocal sent
        prompt, out = lengths[sent]
        sched.add(Sequence(sent, [sent + 1] * prompt, params(out)))
        sent += 1

    for _ in range(8):
        send()
    while sched.has_work:
        before = set(sched.seqs)
        plan = step(sched, clock, A6000)
        if plan is not None:
            digest.update(
                repr([(c.seq_id, c.start_pos, c.num_tokens, c.sample) for c in plan.chunks]).encode()
            )
        for _ in before - set(sched.seqs):
            if sent < len(lengths):
                send()
    return digest.hexdigest()[:16]


# digests of the fixed-budget planner before the SLO budget existed (main at 313cd8d)
FIXED_BUDGET_DIGESTS = {
    "splitfuse": "41c673643ecc6b86",
    "prefill_first": "b071c63105f25715",
    "whole_prompt": "c559bab745cb5c4a",
}


@pytest.mark.parametrize("policy", sorted(FIXED_BUDGET_DIGESTS))
def test_without_targets_plans_are_exactly_the_fixed_budget_ones(policy):
    assert plan_digest(policy) == FIXED_BUDGET_DIGESTS[policy]


def test_serve_passes_targets_to_the_scheduler():
    from fuseserve.cli import build_parser
    from fuseserve.launcher import scheduler_argv
    from fuseserve.service_cli import serve_options

    parser = build_parser()
    serve = serve_options(parser.parse_args(["serve", "--target-itl", "0.5", "--target-prefill-rate", "100"]))
    sched = parser.parse_args(scheduler_argv(serve, "redis://x:1"))
    assert (sched.target_itl, sched.target_prefill_rate) == (0.5, 100.0)
    assert "--target-itl" not in scheduler_argv(serve_options(parser.parse_args(["serve"])), "redis://x:1")
