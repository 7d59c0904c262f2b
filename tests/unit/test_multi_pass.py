"""Multi-step decoding (``EngineConfig.decode_passes``): plans of K decode passes give the tokens,
stops and finish reasons of one pass per plan, with no leaked KV block, through preemption and a
lost worker. The workers are ``SimulatedRunner``s run inline (deterministic tokens, no sleep); the
real model is checked by ``test_pipeline_options.py::test_decode_passes_*``.
"""

from __future__ import annotations

import random

import pytest

from fuseserve.config import EngineConfig
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.sequence import FinishReason, Sequence
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker.latency_model import PRESETS
from fuseserve.worker.sim_runner import SimulatedRunner

BLOCK = 4


def _params(rng: random.Random, stop_ids: list[int]) -> SamplingParams:
    kw = {"max_new_tokens": rng.randint(1, 30)}
    if stop_ids and rng.random() < 0.4:
        kw["stop_token_ids"] = [rng.choice(stop_ids)]
        kw["min_new_tokens"] = min(kw["max_new_tokens"], rng.choice([0, 3]))
    return SamplingParams(temperature=0.0, **kw).validate()


def _run(
    passes: int, overlap: bool, blocks: dict[str, int], eos: list[int], reqs, lose_at: int | None = None
):
    """Run ``reqs`` (prompt, params) to the end; returns (outputs, finish reasons, stats)."""
    cfg = EngineConfig(token_budget=32, block_size=BLOCK, decode_passes=passes, watermark_blocks=1)
    core = EngineCore(cfg, eos, overlap=overlap)
    runners = {}
    for name, n in blocks.items():
        r = SimulatedRunner(PRESETS["a100-llama2-7b"], block_size=BLOCK, num_blocks=n, sleep=lambda s: None)
        r.info.eos_token_ids = list(eos)
        runners[name] = r
        core.add_worker(name, r, n, BLOCK, 4096, threaded=False)
    for i, (prompt, params) in enumerate(reqs):
        core.add_request(Sequence(i, list(prompt), params))
    outputs = {i: [] for i in range(len(reqs))}
    finish = {}
    multi = 0
    for step in range(20_000):
        if not core.has_work:
            break
        if lose_at is not None and step == lose_at:
            core.remove_worker("w1")
        events = core.step()
        multi += sum(p.num_passes > 1 for p in core.last_plans.values())
        for slot in core.scheduler.slots.values():
            slot.account.check()
        for ev in events:
            assert ev.seq_id not in finish, f"event after the end of seq {ev.seq_id}"
            assert ev.error is None, ev.error
            assert ev.index == len(outputs[ev.seq_id])
            outputs[ev.seq_id].append(ev.token.token_id)
            if ev.finish_reason is not None:
                finish[ev.seq_id] = ev.finish_reason
    else:
        raise AssertionError("no end")
    for name, slot in core.scheduler.slots.items():  # every block is back, on both sides
        assert slot.account.num_free == slot.account.num_blocks and not slot.account.held, name
        assert not runners[name].seqs and runners[name].num_free_blocks == blocks[name], name
    return outputs, finish, {"multi": multi, "preemptions": core.scheduler.num_preemptions}


def _workload(n: int, seed: int, stop_ids=()):
    rng = random.Random(seed)
    return [
        ([rng.randint(1, 999) for _ in range(rng.randint(1, 40))], _params(rng, list(stop_ids)))
        for _ in range(n)
    ]


def _frequent_tokens(reqs) -> list[int]:
    """Tokens the one-pass run samples: a few of them become stop / EOS ids of the test."""
    out, _, _ = _run(1, False, {"w0": 10_000}, [], reqs)
    return [t for toks in out.values() for t in toks[2::7]][:12]


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_k_passes_give_the_tokens_of_one_pass(overlap):
    reqs = _workload(24, seed=3)
    stops = _frequent_tokens(reqs)
    reqs = _workload(24, seed=3, stop_ids=stops)
    eos = stops[:2]
    ref_out, ref_finish, _ = _run(1, overlap, {"w0": 10_000}, eos, reqs)
    out, finish, stats = _run(4, overlap, {"w0": 10_000}, eos, reqs)
    assert stats["multi"] > 0
    assert out == ref_out and finish == ref_finish
    assert FinishReason.STOP in finish.values() and FinishReason.LENGTH in finish.values()
    for i, (_, p) in enumerate(reqs):  # max_tokens exact
        assert len(out[i]) == p.max_new_tokens or finish[i] is FinishReason.STOP


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_small_pool_preempts_and_outputs_stay_exact(overlap):
    reqs = _workload(16, seed=5)
    ref_out, ref_finish, _ = _run(1, overlap, {"w0": 10_000}, [], reqs)
    out, finish, stats = _run(4, overlap, {"w0": 24}, [], reqs)
    assert stats["preemptions"] > 0 and stats["multi"] > 0
    assert out == ref_out and finish == ref_finish


def test_lost_worker_recomputes_exactly():
    reqs = _workload(16, seed=7)
    ref_out, ref_finish, _ = _run(1, True, {"w0": 10_000}, [], reqs)
    out, finish, stats = _run(4, True, {"w0": 10_000, "w1": 10_000}, [], reqs, lose_at=12)
    assert stats["multi"] > 0
    assert out == ref_out and finish == ref_finish


def test_worker_runs_passes_and_stops_each_sequence():
    r = SimulatedRunner(PRESETS["a100-llama2-7b"], block_size=BLOCK, num_blocks=64, sleep=lambda s: None)
    p = SamplingParams(temperature=0.0, max_new_tokens=3).validate()
    first = [
        SeqChunk(1, 0, 4, [5, 6, 7, 8], True, p, 4, [0]),
        SeqChunk(2, 0, 2, [9, 9], True, SamplingParams(max_new_tokens=10).validate(), 2, [1]),
    ]
    res = r.step(StepPlan(0, first))
    assert [t.seq_id for t in res.tokens] == [1, 2] and res.num_passes == 1
    # seq 1 has 2 tokens left, seq 2 runs all 4 passes (blocks for every pass ride on the plan)
    plan = StepPlan(
        1,
        [SeqChunk(1, 4, 1, sample=True, block_ids=[2]), SeqChunk(2, 2, 1, sample=True, block_ids=[3])],
        num_passes=4,
    )
    res = r.step(plan)
    assert [t.seq_id for t in res.tokens] == [1, 2, 1, 2, 2, 2] and res.num_passes == 4
    assert r.seqs[1].num_computed == 6 and r.seqs[2].num_computed == 6
    # a stop token ends a sequence's passes; a later plan's chunk of it (built as if every pass
    # had run) is dropped
    twin = SimulatedRunner(PRESETS["a100-llama2-7b"], block_size=BLOCK, num_blocks=64, sleep=lambda s: None)
    twin.step(StepPlan(0, first))
    twin.step(plan)
    ahead = twin.step(StepPlan(2, [SeqChunk(2, 6, 1, sample=True, block_ids=[4])], num_passes=3))
    assert len(ahead.tokens) == 3
    r.info.eos_token_ids = [ahead.tokens[1].token_id]
    res = r.step(StepPlan(2, [SeqChunk(2, 6, 1, sample=True, block_ids=[4])], num_passes=3))
    assert [t.token_id for t in res.tokens] == [t.token_id for t in ahead.tokens[:2]] and res.num_passes == 2
    assert r.seqs[2].stopped
    res = r.step(StepPlan(3, [SeqChunk(2, 9, 1, sample=True, block_ids=[5])], num_passes=2))
    assert res.tokens == [] and r.seqs[2].num_computed == 8
    r.step(StepPlan(4, [], free_seq_ids=[1, 2]))
    assert not r.seqs and r.num_free_blocks == 64


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("stop_at", [1, 4, 5, 6, 8])
@pytest.mark.parametrize("as_eos", [False, True], ids=["stop_token", "eos"])
def test_stop_inside_the_passes_ends_exactly(overlap, stop_at, as_eos):
    """A stop sampled at any pass of a plan ends the sequence there: no token after it, the blocks
    back (the overlap plan already holding the sequence is cut on the worker)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    alone, _, _ = _run(1, False, {"w0": 1000}, [], [(prompt, SamplingParams(max_new_tokens=20).validate())])
    stop = alone[0][stop_at]
    assert stop not in alone[0][:stop_at]
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[] if as_eos else [stop]).validate()
    eos = [stop] if as_eos else []
    other = ([7] * 5, SamplingParams(max_new_tokens=20).validate())  # keeps the worker busy past the stop
    out, finish, stats = _run(4, overlap, {"w0": 1000}, eos, [(prompt, params), other])
    assert stats["multi"] > 0
    assert out[0] == alone[0][: stop_at + 1] and finish[0] is FinishReason.STOP
    assert len(out[1]) == 20 and finish[1] is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("configured", "device", "expected"),
    [
        (None, "cpu", 3),
        (None, "cuda:0", 1),
        (None, "simulated", 1),
        (None, None, 1),
        (2, "cpu", 2),
        (3, None, 3),
    ],
)
def test_decode_passes_per_worker(configured, device, expected):
    """Left open, a worker on a CPU takes CPU_WORKER_DECODE_PASSES per plan and any other (a GPU, a
    simulated one, the pipeline's runner: no device) one; a configured value holds for every worker.
    The slot's value is what the plans take."""
    from fuseserve.scheduler.multi_pass_plan import CPU_WORKER_DECODE_PASSES

    assert CPU_WORKER_DECODE_PASSES == 3
    cfg = EngineConfig(token_budget=32, block_size=BLOCK, decode_passes=configured, watermark_blocks=1)
    core = EngineCore(cfg, [], overlap=False)
    r = SimulatedRunner(PRESETS["a100-llama2-7b"], block_size=BLOCK, num_blocks=64, sleep=lambda s: None)
    core.add_worker("w0", r, 64, BLOCK, 4096, threaded=False, device=device)
    assert core.scheduler.slots["w0"].decode_passes == expected
    core.add_request(Sequence(0, [1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=12).validate()))
    most = 1
    while core.has_work:
        core.step()
        most = max([most, *(p.num_passes for p in core.last_plans.values())])
    assert most == expected


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4"])
def test_decode_passes_rejects_non_positive_integers(bad):
    from fuseserve.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="decode_passes"):
        EngineConfig(decode_passes=bad).validate()


def test_one_pass_while_a_prompt_chunk_is_in_flight():
    """The plan built while a prompt chunk runs (overlap) stays one pass: the rest of a burst of
    requests may be reaching the queue. Once only decodes are in flight, the plan takes K passes."""
    from fuseserve.scheduler.block_accounting import BlockAccount
    from fuseserve.scheduler.multi_pass_plan import plan_passes
    from fuseserve.scheduler.policies import Draft
    from fuseserve.scheduler.worker_slot import InFlight, WorkerSlot

    params = SamplingParams(temperature=0.0, max_new_tokens=16).validate()
    seq = Sequence(7, [1, 2, 3, 4, 5], params, num_computed_tokens=5, num_pending=1)
    slot = WorkerSlot("w0", BlockAccount(64, BLOCK, False), 32, 4096, running=[seq])
    slot.account.reserve(seq.seq_id, seq.num_planned_tokens)
    prompt = StepPlan(0, [SeqChunk(7, 0, 5, [1, 2, 3, 4, 5], sample=True, params=params, prompt_len=5)])
    slot.inflight.append(InFlight(prompt, [(seq, 5, 0)]))

    def draft() -> Draft:
        d = Draft(32, 8)
        d.add(seq, 1)
        return d

    assert plan_passes(slot, draft(), 4, 4096, num_waiting=0) is None
    slot.inflight.clear()
    slot.inflight.append(InFlight(StepPlan(1, [SeqChunk(7, 5, 1, [], sample=True)]), [(seq, 1, 0)]))
    assert plan_passes(slot, draft(), 4, 4096, num_waiting=0) == {7: 4}
