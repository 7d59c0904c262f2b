"""Scheduler invariants on CPU with a cost-free fake worker (``tests/scheduler_harness.py``).

Driven through ``EngineCore`` / ``Scheduler`` exactly as the pipeline drives them: the token budget,
full passes, the order decodes → continuing chunks → new prompts, admission (rule 2), abort /
finish freeing, and the other two policies against splitfuse. Preemption, placement on several
workers and losing a worker are in ``test_scheduler_workers.py``. The fake "samples" a
deterministic hash of each sequence's own tokens, so every request has one correct greedy output:
the one it gets alone.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from fake_worker import EOS
from scheduler_harness import Engine, check_free, classify, greedy, make_engine, solo_output, workload

from fuseserve.errors import InvalidRequestError
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence

# ------------------------------------------------------------------------------------- budget


@pytest.mark.parametrize("budget", [7, 32, 100])
def test_budget_never_exceeded_and_passes_full(budget):
    eng = make_engine(budget=budget, eos_every=23)
    reqs = workload(40, seed=budget)
    for i, (prompt, n) in enumerate(reqs[:20]):
        eng.add(Sequence(i, prompt, greedy(n)))
    stats = {"full": 0, "checked": 0}

    def on_step(plans, before):
        plan = plans["w0"]
        assert plan.num_tokens <= budget
        work = sum(u for _, _, u, _ in before.values())
        if work >= budget:  # enough waiting + running work to fill the pass: it must be full
            assert plan.num_tokens == budget, (plan.num_tokens, work)
            stats["full"] += 1
        else:  # everything that exists runs
            assert plan.num_tokens == work
        stats["checked"] += 1
        if stats["checked"] == 5:  # a second wave arrives mid-run
            for i, (prompt, n) in enumerate(reqs[20:], start=20):
                eng.add(Sequence(i, prompt, greedy(n)))

    eng.run(on_step)
    assert stats["full"] > 3
    assert len(eng.finish) == 40
    for i, (prompt, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(prompt, greedy(n), eos_every=23), i
    check_free(eng)


def test_long_prompts_split_into_budget_chunks():
    budget = 16
    eng = make_engine(budget=budget)
    long_prompts = {0: list(range(1, 161)), 1: [7] * 200}  # 10x and 12.5x the budget
    for sid, p in long_prompts.items():
        eng.add(Sequence(sid, p, greedy(8)))
    for sid, (p, n) in enumerate(workload(6, seed=3, prompt_range=(2, 12)), start=2):
        eng.add(Sequence(sid, p, greedy(n)))
    chunks = defaultdict(list)

    def on_step(plans, before):
        assert plans["w0"].num_tokens <= budget
        for c in plans["w0"].chunks:
            if c.seq_id in long_prompts and c.start_pos < len(long_prompts[c.seq_id]):
                chunks[c.seq_id].append(c)

    eng.run(on_step)
    for sid, p in long_prompts.items():
        cs = chunks[sid]
        assert len(cs) >= len(p) // budget
        assert sum(c.num_tokens for c in cs) == len(p)
        assert all(c.num_tokens <= budget for c in cs)
        assert [c.start_pos for c in cs] == [sum(x.num_tokens for x in cs[:i]) for i in range(len(cs))]
        assert [c.sample for c in cs] == [False] * (len(cs) - 1) + [True]
        assert eng.finish[sid] is FinishReason.LENGTH
        assert eng.outputs[sid] == solo_output(p, greedy(8), eos_every=0)
    # once the short prompts are out of the way, the long prompt alone takes whole budgets
    assert [c.num_tokens for c in chunks[1][-6:-1]] == [budget] * 5
    check_free(eng)


# ------------------------------------------------------------------------------------- order


def test_decodes_first_then_continuing_chunks_then_new_prompts():
    budget = 24
    eng = make_engine(budget=budget)
    reqs = workload(30, seed=5, prompt_range=(5, 60), new_range=(3, 20))
    pending = list(enumerate(reqs))
    seen_kinds = set()
    mixed = 0

    def feed():
        for _ in range(3):
            if pending:
                i, (p, n) = pending.pop(0)
                eng.add(Sequence(i, p, greedy(n)))

    def on_step(plans, before):
        nonlocal mixed
        plan = plans["w0"]
        kinds = classify(plan, before)
        rank = {"decode": 0, "continue": 1, "new": 2}
        assert [rank[k] for k in kinds] == sorted(rank[k] for k in kinds), kinds
        # every running decode comes before anything else while the budget lasts
        decodes = [sid for sid, (st, pre, _, _) in before.items() if st is SeqStatus.RUNNING and not pre]
        assert kinds.count("decode") == min(len(decodes), budget)
        # at most one chunk is cut: only the last prompt chunk may stop short of its known tokens
        for c, k in zip(plan.chunks[:-1], kinds[:-1], strict=True):
            if k != "decode":
                assert c.sample, "a prompt chunk other than the last was cut"
        seen_kinds.update(kinds)
        mixed += len(set(kinds)) == 3
        feed()

    feed()
    eng.run(on_step)
    assert seen_kinds == {"decode", "continue", "new"}
    assert mixed > 0, "no pass held decodes, continuing chunks and new prompts together"
    assert len(eng.finish) == len(reqs)


# ------------------------------------------------------------------------------------- admission


def test_admission_needs_blocks_for_whole_prompt_plus_watermark():
    # 20 blocks of 4 tokens, watermark 2
    eng = make_engine(budget=64, workers={"w0": 20}, block_size=4, watermark=2)
    slot = eng.sched.slots["w0"]
    eng.add(Sequence(0, [5] * 40, greedy(4)))  # 10 blocks; 41 tokens (11 blocks) after one step
    eng.step()
    assert eng.seqs[0].status is SeqStatus.RUNNING and slot.account.held[0] == 10
    eng.add(Sequence(1, [6] * 29, greedy(4)))  # 8 blocks + watermark 2 > 9 free
    plans, _ = eng.step()
    assert slot.account.held[0] == 11 and slot.account.num_free == 9
    assert [c.seq_id for c in plans["w0"].chunks] == [0]
    assert eng.seqs[1].status is SeqStatus.WAITING and 1 not in slot.account.held
    eng.sched.abort(1)
    eng.add(Sequence(2, [6] * 28, greedy(4)))  # 7 blocks + 2 = 9 free: admitted
    plans, _ = eng.step()
    assert [c.seq_id for c in plans["w0"].chunks] == [0, 2]
    assert slot.account.held[2] == 7 and slot.account.num_free == 2
    # a request that could never fit one worker is refused up front, not left waiting forever
    with pytest.raises(InvalidRequestError) as e:
        eng.sched.add(Sequence(3, [1] * 70, greedy(8)))
    assert e.value.param == "max_tokens"
    eng.run()
    assert eng.finish == {0: FinishReason.LENGTH, 2: FinishReason.LENGTH}
    check_free(eng)


def test_admission_reserves_whole_prompt_before_its_first_chunk():
    eng = make_engine(budget=8, workers={"w0": 20}, block_size=4, watermark=2)
    slot = eng.sched.slots["w0"]
    eng.add(Sequence(0, [5] * 40, greedy(4)))
    plans, _ = eng.step()
    assert plans["w0"].chunks[0].num_tokens == 8
    assert slot.account.held[0] == 10, "admission reserves the whole prompt, not the first chunk"
    eng.add(Sequence(1, [6] * 36, greedy(4)))  # 9 blocks + 2 > 10 free, though only 2 hold K/V yet
    for _ in range(4):
        eng.step()
        assert eng.seqs[1].status is SeqStatus.WAITING
    eng.run()
    assert sorted(eng.finish) == [0, 1]
    check_free(eng)


# ------------------------------------------------------------------------------------- freeing


def test_abort_frees_blocks_at_once():
    eng = make_engine(budget=16, workers={"w0": 200})
    slot = eng.sched.slots["w0"]
    fake = eng.fakes["w0"]
    eng.add(Sequence(0, [3] * 30, greedy(50)))
    eng.add(Sequence(1, [4] * 30, greedy(50)))
    for _ in range(6):
        eng.step()
    assert eng.seqs[0].status is SeqStatus.RUNNING and eng.outputs[0]
    held = slot.account.held[0]
    free_before = slot.account.num_free
    assert eng.sched.abort(0) is eng.seqs[0]
    assert slot.account.num_free == free_before + held  # in the accounting: at once
    assert eng.seqs[0].finish_reason is FinishReason.ABORT
    assert eng.sched.abort(0) is None  # unknown now
    plans, _ = eng.step()  # on the worker: with the very next plan
    assert 0 in plans["w0"].free_seq_ids
    assert 0 not in [c.seq_id for c in plans["w0"].chunks]
    assert 0 not in fake.seqs
    # abort of a waiting sequence: no blocks, simply gone
    eng.add(Sequence(5, [1] * 5, greedy(3)))
    eng.sched.abort(5)
    assert 5 not in eng.sched.seqs and eng.seqs[5] not in eng.sched.waiting
    eng.run()
    assert 0 not in eng.finish  # no token after the abort
    check_free(eng)


def test_finished_sequence_frees_at_once():
    eng = make_engine(budget=16, workers={"w0": 200})
    slot = eng.sched.slots["w0"]
    fake = eng.fakes["w0"]
    eng.add(Sequence(0, [3] * 20, greedy(3)))
    eng.add(Sequence(1, [4] * 20, greedy(30)))
    while 0 not in eng.finish:
        eng.step()
    assert eng.finish[0] is FinishReason.LENGTH and len(eng.outputs[0]) == 3
    assert 0 not in slot.account.held
    assert slot.account.num_free == slot.account.num_blocks - slot.account.held[1]
    plans, _ = eng.step()
    assert plans["w0"].free_seq_ids == [0]
    assert 0 not in fake.seqs
    eng.run()
    check_free(eng)


def test_eos_stop_ids_and_min_new_tokens():
    eng = make_engine(budget=32, eos_every=3)  # EOS about every third token
    prompts = workload(12, seed=2, prompt_range=(3, 20), new_range=(30, 30))
    for i, (p, n) in enumerate(prompts):
        kw = {"min_new_tokens": 10} if i % 3 == 1 else {"ignore_eos": True} if i % 3 == 2 else {}
        eng.add(Sequence(i, p, greedy(n, **kw)))
    eng.run()
    for i in range(12):
        out = eng.outputs[i]
        if i % 3 == 2:
            assert EOS not in out and eng.finish[i] is FinishReason.LENGTH and len(out) == 30
        elif eng.finish[i] is FinishReason.STOP:
            assert out[-1] == EOS and EOS not in out[:-1]
            assert len(out) >= (10 if i % 3 == 1 else 1)
    assert any(eng.finish[i] is FinishReason.STOP for i in range(0, 12, 3))
    assert any(eng.finish[i] is FinishReason.STOP and len(eng.outputs[i]) >= 10 for i in range(1, 12, 3))


# ------------------------------------------------------------------------------------- policies


POLICY_WORKLOAD = workload(24, seed=17, prompt_range=(3, 70), new_range=(5, 25))


def run_policy(policy: str, workers=None) -> Engine:
    eng = make_engine(policy=policy, budget=32, workers=workers, eos_every=29)
    kinds_per_plan = []
    for i, (p, n) in enumerate(POLICY_WORKLOAD):
        eng.add(Sequence(i, p, greedy(n)))

    def on_step(plans, before):
        for plan in plans.values():
            kinds = classify(plan, before)
            kinds_per_plan.append((plan, kinds, before))

    eng.run(on_step)
    eng.kinds_per_plan = kinds_per_plan
    assert sorted(eng.finish) == list(range(len(POLICY_WORKLOAD)))
    check_free(eng)
    return eng


@pytest.mark.parametrize("workers", [None, {"w0": 60, "w1": 60}], ids=["roomy", "small_pool_two_workers"])
def test_prefill_first_and_whole_prompt_match_splitfuse(workers):
    ref = run_policy("splitfuse", workers)
    for policy in ("prefill_first", "whole_prompt"):
        eng = run_policy(policy, workers)
        assert dict(eng.outputs) == dict(ref.outputs), policy
        assert eng.finish == ref.finish, policy
        prompt_passes = decode_passes = 0
        for plan, kinds, before in eng.kinds_per_plan:
            assert "continue" not in kinds, f"{policy} split a prompt"
            for c, k in zip(plan.chunks, kinds, strict=True):
                if k == "new":  # a whole prompt (or a whole recompute) in one chunk
                    # (a sequence preempted earlier in the same round recomputes all its tokens)
                    preempted_now = before[c.seq_id][0] is SeqStatus.RUNNING
                    # (a recompute may start after its own blocks, still in the prefix cache)
                    assert c.start_pos == len(c.prefix_token_ids) and c.sample
                    assert c.start_pos + c.num_tokens == before[c.seq_id][2] or preempted_now
            if plan.num_tokens > 32:  # only a single prompt may overshoot the budget
                assert kinds.count("new") == 1, (
                    f"{policy}: {kinds.count('new')} prompts in an over-budget pass"
                )
            if policy == "prefill_first":
                assert not ("new" in kinds and "decode" in kinds), "prefill_first mixed prompts and decodes"
            prompt_passes += "new" in kinds
            decode_passes += "decode" in kinds
        assert prompt_passes > 0 and decode_passes > 0
    # splitfuse itself did split prompts here (the workload has prompts above the budget)
    assert any("continue" in kinds for _, kinds, _ in ref.kinds_per_plan)


# ------------------------------------------------------------------------------------- overlap


def test_overlap_drops_the_surplus_token_of_a_stop_learned_late():
    """With overlap a worker's next plan is built before its current result is known: a sequence
    that sampled EOS is decoded once more; that surplus token is never an event, every output equals
    the one without overlap, ``max_new_tokens`` is exact (a length stop is never planned past) and
    every block comes back."""
    reqs = workload(24, seed=41, prompt_range=(3, 70), new_range=(1, 25))
    outputs = {}
    for overlap in (False, True):
        eng = make_engine(budget=32, workers={"w0": 1000, "w1": 1000}, eos_every=7, overlap=overlap)
        for i, (p, n) in enumerate(reqs):
            eng.add(Sequence(i, p, greedy(n)))
        eng.run()
        outputs[overlap] = (dict(eng.outputs), dict(eng.finish))
        for i, (_, n) in enumerate(reqs):
            assert len(eng.outputs[i]) <= n
            if eng.finish[i] is FinishReason.LENGTH:
                assert len(eng.outputs[i]) == n
        sampled = sum(1 for f in eng.fakes.values() for plan in f.plans for c in plan.chunks if c.sample)
        emitted = sum(len(o) for o in eng.outputs.values())
        assert sampled == emitted + eng.sched.num_surplus_tokens
        if overlap:
            assert eng.sched.num_surplus_tokens > 0  # EOS was learned late at least once
        else:
            assert eng.sched.num_surplus_tokens == 0
        check_free(eng)
    assert outputs[True] == outputs[False]


def test_two_results_applied_together_keep_their_own_token_index():
    """With overlap a worker holds two plans; when both results are applied before the events are
    published (one poll), each token event still carries its own output position. The gateway drops
    an event whose index it has already seen, so a shared index would lose a token."""
    eng = make_engine(budget=32, workers={"w0": 1000}, overlap=True)
    eng.add(Sequence(0, [5, 6, 7], greedy(6)))
    sched, fake = eng.sched, eng.fakes["w0"]
    first = sched.schedule_worker("w0")  # the prompt, sampling token 0
    second = sched.schedule_worker("w0")  # planned before token 0 is known: a decode entry
    assert first is not None and second is not None
    results = [fake.step(first), fake.step(second)]
    events = [ev for r in results for ev in sched.postprocess("w0", r)]
    assert [ev.index for ev in events] == [0, 1]
    assert [ev.token.token_id for ev in events] == sched.seqs[0].output_token_ids
