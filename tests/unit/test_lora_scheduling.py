"""The scheduler and LoRA adapters (fake workers, ``tests/fake_worker.py``): block hashes include the
adapter, so a prefix computed under one adapter never serves another; a worker holds at most
``max_loras`` distinct adapters, so no pass holds more; a request whose adapter has no room waits
without holding up the requests behind it."""

from __future__ import annotations

import pytest
from scheduler_harness import check_free, greedy, make_engine

from fuseserve.block_hash import root_hash
from fuseserve.scheduler.sequence import Sequence


def test_a_prefix_is_shared_only_under_the_same_adapter():
    """Fails if the block hash ignored the adapter: sequences 1 and 3 would then start at 28."""
    eng = make_engine(budget=64, block_size=4)
    prompt = list(range(1, 31))  # 7 full blocks + 2 tokens
    for sid, lora in ((0, "a"), (1, "b"), (2, "a"), (3, None), (4, None), (5, "b")):
        eng.add(Sequence(sid, list(prompt), greedy(3), lora=lora))
        eng.run()
    got = {sid: s.num_cached_tokens for sid, s in eng.seqs.items()}
    assert got == {0: 0, 1: 0, 2: 28, 3: 0, 4: 28, 5: 28}
    first = [c for p in eng.fakes["w0"].plans for c in p.chunks if c.params is not None]
    assert [c.lora for c in first] == ["a", "b", "a", None, None, "b"]
    assert [c.start_pos for c in first] == [0, 0, 28, 0, 28, 28]
    check_free(eng)


def test_adapter_and_salt_ids_do_not_collide():
    eng = make_engine(budget=64, block_size=4)
    prompt = list(range(1, 31))
    eng.add(Sequence(0, list(prompt), greedy(3), lora="t"))
    eng.run()
    eng.add(Sequence(1, list(prompt), greedy(3), cache_salt="t"))
    eng.add(Sequence(2, list(prompt), greedy(3), cache_salt="lora:t"))
    eng.run()
    assert eng.seqs[1].num_cached_tokens == 0 and eng.seqs[2].num_cached_tokens == 0
    assert root_hash("m", None, ("lora:t",)) != root_hash("m", 'lora:t"], "')
    assert root_hash("m", None, ("lora:t",)) != root_hash("m", "lora:t\x1f")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("max_loras", [1, 2, 3])
def test_no_pass_holds_more_than_max_loras_adapters(max_loras, overlap):
    eng = make_engine(budget=16, block_size=4, max_loras=max_loras, overlap=overlap)
    adapters = ["a", "b", "c", None, "d", "a", None, "b", "c", "d", "a", None]
    for sid, lora in enumerate(adapters):
        eng.add(Sequence(sid, [sid + 1] * (5 + 3 * sid), greedy(4 + sid % 5), lora=lora))
    seen: list[int] = []

    def check(plans, before):
        for plan in plans.values():
            held = {eng.seqs[c.seq_id].lora for c in plan.chunks} - {None}
            assert len(held) <= max_loras, (plan.step_id, held)
            seen.append(len(held))
        running = {s.lora for s in eng.sched.slots["w0"].running} - {None}
        assert len(running) <= max_loras

    eng.run(on_step=check)
    assert max(seen) == max_loras
    assert len(eng.finish) == len(adapters)
    check_free(eng)


def test_a_request_whose_adapter_has_no_room_does_not_hold_up_the_queue():
    eng = make_engine(budget=64, block_size=4, max_loras=1)
    eng.add(Sequence(0, [1] * 8, greedy(20), lora="a"))
    eng.add(Sequence(1, [2] * 8, greedy(2), lora="b"))  # waits for "a" to end
    eng.add(Sequence(2, [3] * 8, greedy(2)))  # the base model: admitted beside "a"
    eng.add(Sequence(3, [4] * 8, greedy(2), lora="a"))  # "a" is running: admitted too
    eng.step()
    assert {sid for sid, s in eng.sched.seqs.items() if s.worker == "w0"} == {0, 2, 3}
    assert [s.seq_id for s in eng.sched.waiting] == [1]
    eng.run()
    assert len(eng.finish) == 4
    check_free(eng)
