"""Scheduler invariants on CPU with a cost-free fake worker (``tests/fake_worker.py``).

Driven through ``EngineLoop`` / ``Scheduler`` exactly as the pipeline drives them, with one and two
workers: the token budget, full passes, the order decodes → continuing chunks → new prompts,
admission (rule 2), preemption and its cap (rule 3), abort / finish freeing, the other two policies,
placement on the least-loaded worker and losing a worker. The fake "samples" a deterministic hash of
each sequence's own tokens, so every request has one correct greedy output: the one it gets alone.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import pytest
from fake_worker import EOS, FakeWorker

from fuseserve.config import EngineConfig
from fuseserve.errors import InvalidRequestError
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.engine_loop import EngineLoop
from fuseserve.scheduler.scheduler import Scheduler
from fuseserve.scheduler.sequence import FinishReason, SeqStatus, Sequence

MAX_MODEL_LEN = 4096


@dataclass
class Engine:
    sched: Scheduler
    loop: EngineLoop
    fakes: dict[str, FakeWorker]
    seqs: dict[int, Sequence] = field(default_factory=dict)  # every sequence ever added
    outputs: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[int, FinishReason] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)  # sequences failed with an error event

    def add(self, seq: Sequence) -> None:
        self.sched.add(seq)
        self.seqs[seq.seq_id] = seq

    def step(self):
        """One engine step; returns ``(plans, before)``: ``before[seq_id] = (status, in_prefill,
        num_uncomputed)`` of every live sequence just before the plans were built."""
        before = {
            sid: (s.status, s.in_prefill, s.num_uncomputed, s.worker) for sid, s in self.sched.seqs.items()
        }
        events = self.loop.step()
        for fake in self.fakes.values():
            assert not fake.errors, fake.errors
        for ev in events:
            assert ev.seq_id not in self.finish, f"token for finished seq {ev.seq_id}"
            if ev.error is not None:
                self.errors[ev.seq_id] = ev.error
            else:
                self.outputs[ev.seq_id].append(ev.token.token_id)
            if ev.finish_reason is not None:
                self.finish[ev.seq_id] = ev.finish_reason
        return self.loop.last_plans, before

    def run(self, on_step=None, max_steps=20_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            plans, before = self.step()
            if on_step is not None:
                on_step(plans, before)
        raise AssertionError(f"no end after {max_steps} steps: {len(self.sched.seqs)} sequences left")


def make_engine(
    policy: str = "splitfuse",
    budget: int = 32,
    workers: dict[str, int] | None = None,
    block_size: int = 4,
    max_num_seqs: int = 256,
    watermark: int = 1,
    max_preemptions: int = 4,
    eos_every: int = 0,
    fail_at: dict[str, int] | None = None,
) -> Engine:
    """Scheduler + EngineLoop over fake workers ``{name: num_blocks}`` (default one with a big pool)."""
    workers = workers or {"w0": 100_000}
    cfg = EngineConfig(
        token_budget=budget,
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        watermark_blocks=watermark,
        max_preemptions=max_preemptions,
        policy=policy,
    )
    sched = Scheduler(cfg, [EOS])
    history: dict[int, list[int]] = {}
    fakes = {}
    for name, num_blocks in workers.items():
        sched.add_worker(name, num_blocks, block_size, MAX_MODEL_LEN)
        fail = (fail_at or {}).get(name)
        fakes[name] = FakeWorker(
            num_blocks, block_size, eos_every=eos_every, fail_at_step=fail, name=name, history=history
        )
    return Engine(sched, EngineLoop(sched, dict(fakes)), fakes)


def greedy(max_new_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw).validate()


def workload(n: int, seed: int, prompt_range=(1, 100), new_range=(1, 40)) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_new_tokens) pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        out.append(([rng.randint(1, 999) for _ in range(plen)], rng.randint(*new_range)))
    return out


def solo_output(prompt: list[int], params: SamplingParams, eos_every: int, budget: int = 32) -> list[int]:
    """The request's output when it runs alone on a roomy worker."""
    eng = make_engine(budget=budget, eos_every=eos_every)
    eng.add(Sequence(0, list(prompt), params))
    eng.run()
    return eng.outputs[0]


def classify(plan, before) -> list[str]:
    """Kind of each chunk: "decode", "continue" (a running prompt / recompute) or "new" (admitted now)."""
    kinds = []
    for c in plan.chunks:
        status, in_prefill, _, _ = before[c.seq_id]
        if status is SeqStatus.WAITING:
            kinds.append("new")
        else:
            kinds.append("continue" if in_prefill else "decode")
    return kinds


def check_free(eng: Engine) -> None:
    """Every block is back, in the scheduler's accounting and in each fake worker."""
    for name, slot in eng.sched.slots.items():
        assert slot.account.num_free == slot.account.num_blocks, name
        assert slot.account.held == {}, name
        assert not slot.running and not slot.pending_free, name
        fake = eng.fakes[name]
        assert fake.num_free_blocks == fake.num_blocks, name
        assert fake.seqs == {}, name


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


# ------------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("workers", [{"w0": 80}, {"w0": 40, "w1": 40}], ids=["one_worker", "two_workers"])
@pytest.mark.parametrize("max_preemptions", [0, 1, 4])
def test_small_kv_pool_preempts_and_every_request_finishes(workers, max_preemptions):
    # 32 requests of up to 40 + 40 tokens (20 blocks of 4): the pool holds about 4 at a time
    eng = make_engine(budget=32, workers=workers, max_preemptions=max_preemptions, eos_every=31)
    reqs = workload(32, seed=11, prompt_range=(20, 40), new_range=(20, 40))
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))

    def on_step(plans, before):
        for plan in plans.values():
            assert plan.num_tokens <= 32
        for name, slot in eng.sched.slots.items():  # the accounting covers the worker's real usage
            fake = eng.fakes[name]
            to_free = sum(fake.seqs[s].num_blocks for s in slot.pending_free if s in fake.seqs)
            assert slot.account.num_free >= 0
            assert fake.num_free_blocks + to_free >= slot.account.num_free

    eng.run(on_step)
    assert sorted(eng.finish) == list(range(32))
    assert eng.sched.num_preemptions > 0
    if max_preemptions == 0:  # only preemptions that break a deadlock (every sequence waits for a block)
        assert eng.sched.num_forced_preemptions == eng.sched.num_preemptions
    else:
        assert eng.sched.num_forced_preemptions == 0
        assert max(s.num_preemptions for s in eng.seqs.values()) <= max_preemptions
    assert sum(s.num_preemptions for s in eng.seqs.values()) == eng.sched.num_preemptions
    for i, (p, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=31), i
    check_free(eng)


def test_recompute_cut_one_token_short_of_its_end():
    """A recompute whose first chunk stops one token short of its known tokens: the last token
    is a generated one the (fresh) worker never sampled, so it must travel with the plan."""
    eng = make_engine(budget=12)
    prompt = list(range(1, 11))
    eng.add(Sequence(0, prompt, greedy(8)))
    while len(eng.outputs[0]) < 3:
        eng.step()
    seq = eng.seqs[0]
    assert seq.num_tokens == 13
    eng.sched.preempt(eng.sched.slots["w0"], seq)
    eng.run()
    assert eng.outputs[0] == solo_output(prompt, greedy(8), eos_every=0)
    assert seq.num_preemptions == 1
    check_free(eng)


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
                    assert c.start_pos == 0 and c.sample and c.num_tokens == before[c.seq_id][2]
            if plan.num_tokens > 32:  # only a single prompt may overshoot the budget
                assert kinds.count("new") == 1, f"{policy}: {kinds.count('new')} prompts in an over-budget pass"
            if policy == "prefill_first":
                assert not ("new" in kinds and "decode" in kinds), "prefill_first mixed prompts and decodes"
            prompt_passes += "new" in kinds
            decode_passes += "decode" in kinds
        assert prompt_passes > 0 and decode_passes > 0
    # splitfuse itself did split prompts here (the workload has prompts above the budget)
    assert any("continue" in kinds for _, kinds, _ in ref.kinds_per_plan)


# ------------------------------------------------------------------------------------- two workers


def test_two_workers_spread_sequences():
    eng = make_engine(budget=32, workers={"w0": 500, "w1": 500}, eos_every=19)
    reqs = workload(20, seed=23)
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))
    placed = {}

    def on_step(plans, before):
        for name, plan in plans.items():
            assert plan.num_tokens <= 32
            for c in plan.chunks:
                assert placed.setdefault(c.seq_id, name) == name, "a sequence changed worker"

    eng.run(on_step)
    counts = {name: sum(1 for w in placed.values() if w == name) for name in ("w0", "w1")}
    assert counts["w0"] >= 5 and counts["w1"] >= 5, counts
    for i, (p, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=19), i
    check_free(eng)


def test_placement_goes_to_least_loaded_worker():
    # blocks of 16 tokens; 4 new tokens never cross a block boundary here, so counts stay exact
    eng = make_engine(budget=256, workers={"w0": 100, "w1": 100}, block_size=16)
    eng.add(Sequence(0, [1] * 150, greedy(4)))  # 10 blocks
    eng.step()
    first = eng.seqs[0].worker
    other = "w1" if first == "w0" else "w0"
    eng.add(Sequence(1, [2] * 100, greedy(4)))  # 7 blocks: to the emptier worker
    eng.step()
    assert eng.seqs[1].worker == other
    eng.add(Sequence(2, [3] * 20, greedy(4)))  # 2 blocks: `other` holds 7, `first` 10
    eng.step()
    assert eng.seqs[2].worker == other
    eng.add(Sequence(3, [4] * 20, greedy(4)))  # `other` holds 9 → 11 after this one
    eng.add(Sequence(4, [5] * 100, greedy(4)))  # `first` holds 10 < 11: goes there
    eng.step()
    assert eng.seqs[3].worker == other
    assert eng.seqs[4].worker == first
    eng.run()
    check_free(eng)
    # placement compares free blocks in proportion: a bigger worker takes more
    eng = make_engine(budget=1024, workers={"small": 50, "big": 400}, block_size=16)
    for i in range(8):
        eng.add(Sequence(i, [1] * 150, greedy(2)))  # 10 blocks each
    eng.step()
    placed = [eng.seqs[i].worker for i in range(8)]
    assert placed.count("big") == 7 and placed.count("small") == 1, placed


@pytest.mark.parametrize("how", ["remove_worker", "worker_fails"])
def test_removed_worker_sequences_finish_elsewhere(how):
    reqs = workload(16, seed=29, prompt_range=(10, 60), new_range=(10, 30))
    fail_at = {"w1": 6} if how == "worker_fails" else None
    eng = make_engine(budget=32, workers={"w0": 1000, "w1": 1000}, eos_every=37, fail_at=fail_at)
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))
    for _ in range(6):
        eng.step()
    on_w1 = {s.seq_id for s in eng.sched.slots["w1"].running}
    assert on_w1, "nothing ran on w1"
    if how == "remove_worker":
        moved = eng.sched.remove_worker("w1")
        eng.loop.workers.pop("w1")
        assert {s.seq_id for s in moved} == on_w1
        assert all(s.status is SeqStatus.WAITING and s.num_computed_tokens == 0 for s in moved)
    else:
        for _ in range(20):  # w1 raises at its 7th plan; the loop drops it
            if "w1" not in eng.sched.slots:
                break
            eng.step()
        assert set(eng.sched.slots) == {"w0"} and set(eng.loop.workers) == {"w0"}
    del eng.fakes["w1"]
    eng.run()
    assert sorted(eng.finish) == list(range(16))
    assert on_w1 <= eng.fakes["w0"].seen_seq_ids
    for i, (p, n) in enumerate(reqs):
        assert eng.outputs[i] == solo_output(p, greedy(n), eos_every=37), i
    check_free(eng)


def test_failed_plan_fails_only_its_sequences_and_the_worker_stays():
    """A step that raises something other than WorkerLostError (a plan the worker rejected) finishes
    exactly that plan's sequences with an error; the worker keeps serving the others."""
    reqs = workload(12, seed=31, prompt_range=(10, 40), new_range=(5, 20))
    eng = make_engine(budget=32, workers={"w0": 1000, "w1": 1000}, eos_every=0, fail_at={"w1": 3})
    eng.fakes["w1"].fail_with = ValueError
    for i, (p, n) in enumerate(reqs):
        eng.add(Sequence(i, p, greedy(n)))
    failed_plan = None
    for _ in range(4):
        plans, _ = eng.step()
        if "w1" in plans and eng.fakes["w1"].num_steps == 4:
            failed_plan = {c.seq_id for c in plans["w1"].chunks}
    assert failed_plan and set(eng.errors) == failed_plan
    assert all("ValueError" in e for e in eng.errors.values())
    assert "w1" in eng.loop.workers and "w1" in eng.sched.slots
    eng.run()
    assert set(eng.finish) == set(range(len(reqs)))
    assert all(len(eng.outputs[i]) == reqs[i][1] for i in range(len(reqs)) if i not in failed_plan)
    for name, fake in eng.fakes.items():
        assert fake.num_free_blocks == fake.num_blocks, name
        assert eng.sched.slots[name].account.num_free == eng.sched.slots[name].account.num_blocks
