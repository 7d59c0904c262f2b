"""The scheduler and LoRA adapters (fake workers, ``tests/fake_worker.py``): block hashes include the
adapter, so a prefix computed under one adapter never serves another; a worker holds at most
``max_loras`` distinct adapters, so no pass holds more; a request whose adapter has no room waits
without holding up the requests behind it."""

from __future__ import annotations

import pytest
from scheduler_harness import check_free, greedy, make_engine

from fuseserve.block_hash import root_hash
from fuseserve.errors import LoRAAdapterNotServedError
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


def _place_adapter_run(eng) -> dict[int, str]:
    """Sequence 0 (adapter "a", a long prompt) and 1 (the base, a short one) start on different
    workers; then ten "a" sequences come one by one. Returns seq_id → worker."""
    eng.add(Sequence(0, [7] * 40, greedy(200), lora="a"))
    eng.step()
    eng.add(Sequence(1, [8] * 5, greedy(200)))
    eng.step()
    for sid in range(2, 12):
        eng.add(Sequence(sid, [sid] * 5, greedy(200), lora="a"))
        eng.step()
    return {sid: s.worker for sid, s in eng.sched.seqs.items()}


def test_placement_goes_where_the_adapter_runs_within_the_balance_guard():
    """An "a" sequence goes to the worker already running "a" (fewer free blocks there: the load-based
    choice alone picks the other, as the residency-blind run shows), until that worker is loaded past
    the balance guard (``placement.near_least_loaded``): then it goes elsewhere."""
    workers = {"w0": 1000, "w1": 1000}
    on = _place_adapter_run(make_engine(budget=64, block_size=4, workers=workers, max_loras=2))
    home, other = on[0], on[1]
    assert home != other
    assert on[2] == home, "the adapter is resident there"
    assert other in [on[s] for s in range(3, 12)], "one adapter must not pile everything onto one worker"
    n_home = sum(1 for w in on.values() if w == home)
    assert n_home <= 1.5 * (len(on) - n_home + 1) + 2
    blind_engine = make_engine(
        budget=64, block_size=4, workers=workers, max_loras=2, lora_aware_placement=False
    )
    blind = _place_adapter_run(blind_engine)
    assert blind[2] == blind[1] != blind[0], (
        "residency-blind (lora_aware_placement=False): the emptier worker"
    )


def test_a_sequence_goes_only_to_a_worker_that_serves_its_adapter():
    """w0 reports adapter "a", w1 "b": every "a" sequence runs on w0 and every "b" one on w1, the base
    model on either. Residency-blind, so that load alone would spread them over both without the
    reported sets (this test fails then)."""
    eng = make_engine(
        budget=64,
        block_size=4,
        workers={"w0": 1000, "w1": 1000},
        max_loras=2,
        lora_adapters={"w0": {"a"}, "w1": {"b"}},
        lora_aware_placement=False,
    )
    adapters = ["a", "a", "b", "a", None, "b", "b", "a", None, "a"]
    ran: dict[int, str] = {}
    for sid, lora in enumerate(adapters):
        eng.add(Sequence(sid, [sid + 1] * 6, greedy(8), lora=lora))
        eng.step()
        ran |= {i: s.worker for i, s in eng.sched.seqs.items() if s.worker is not None}
    for sid, lora in enumerate(adapters):
        if lora is not None:
            assert ran[sid] == {"a": "w0", "b": "w1"}[lora], (sid, lora, ran[sid])
    for name, fake in eng.fakes.items():
        first = {c.lora for p in fake.plans for c in p.chunks if c.params is not None} - {None}
        assert first == ({"a"} if name == "w0" else {"b"})
    eng.run()
    assert len(eng.finish) == len(adapters)
    check_free(eng)


def test_an_adapter_no_live_worker_serves_fails_at_once_with_a_404():
    """At arrival: ``LoRAAdapterNotServedError`` (404) when workers exist and none serves it. Queued
    when its only worker leaves: ``fail_unserved_lora`` finishes it with a 404 event; the other
    requests run on (no pass fails)."""
    eng = make_engine(
        budget=64,
        block_size=4,
        workers={"w0": 1000, "w1": 1000},
        max_loras=2,
        lora_adapters={"w0": {"a"}, "w1": {"b"}},
    )
    with pytest.raises(LoRAAdapterNotServedError) as e:
        eng.add(Sequence(0, [1] * 6, greedy(4), lora="z"))
    assert e.value.http_status == 404 and "'z'" in str(e.value)
    assert not eng.sched.waiting
    eng.add(Sequence(1, [2] * 6, greedy(4), lora="b"))
    eng.add(Sequence(2, [3] * 6, greedy(4), lora="a"))
    eng.core.remove_worker("w1")
    (event,) = eng.sched.fail_unserved_lora()
    assert (event.seq_id, event.error_status, event.error_type) == (1, 404, "invalid_request_error")
    assert [s.seq_id for s in eng.sched.waiting] == [2]
    assert eng.sched.fail_unserved_lora() == []
    eng.run()
    assert 2 in eng.finish and 1 not in eng.finish


def test_lora_requests_info_names_the_running_and_waiting_adapters():
    """vLLM's ``lora_requests_info``: adapters running (sorted, comma-joined), adapters waiting (here
    "c", which has no slot while "a" and "b" run with ``max_loras`` 2), ``max_lora``; value: now."""
    import time

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from fuseserve.scheduler.service.scheduler_metrics import SchedulerMetrics

    eng = make_engine(budget=64, block_size=4, max_loras=2)
    metrics = SchedulerMetrics(None, max_loras=2)
    metrics.scheduler = eng.sched
    for sid, lora in enumerate(["b", None, "a", "c", "a"]):
        eng.add(Sequence(sid, [sid + 1] * 6, greedy(20), lora=lora))
    eng.step()
    before = time.time()
    text = generate_latest(metrics.registry).decode()
    (fam,) = [f for f in text_string_to_metric_families(text) if f.name == "fuseserve_lora_requests_info"]
    (sample,) = fam.samples
    assert sample.labels["running_lora_adapters"] == "a,b"
    assert sample.labels["waiting_lora_adapters"] == "c"
    assert sample.labels["max_lora"] == "2"
    assert before <= sample.value <= time.time()


def _return_of_an_idle_adapter(aware: bool) -> tuple[str, str]:
    """ "b" runs on one worker, "a" on the other, both finish (their adapters stay in the workers'
    slots, idle); a new "a" comes while both workers are empty. Returns (where "a" ran, where it goes)."""
    eng = make_engine(
        budget=64, block_size=4, workers={"w0": 1000, "w1": 1000}, max_loras=2, lora_aware_placement=aware
    )
    eng.add(Sequence(0, [1] * 6, greedy(3), lora="b"))
    eng.step()
    eng.add(Sequence(1, [2] * 6, greedy(3), lora="a"))
    eng.step()
    first = {eng.sched.seqs[0].worker, eng.sched.seqs[1].worker}
    assert first == {"w0", "w1"}, "one each"
    home = eng.sched.seqs[1].worker
    eng.run()
    assert eng.sched.slots[home].lora_recent == ["a"]
    eng.add(Sequence(2, [3] * 6, greedy(3), lora="a"))
    eng.step()
    return home, eng.sched.seqs[2].worker


def test_an_idle_adapter_still_in_a_workers_slot_draws_its_next_request():
    """``WorkerSlot.lora_recent`` mirrors the worker's adapter slots: the adapter of a finished
    sequence stays loaded there, so its next request goes back (no load), where the residency-blind
    rule (``lora_aware_placement=False``) puts it on the other, equally empty worker."""
    home, again = _return_of_an_idle_adapter(aware=True)
    assert again == home
    home, blind = _return_of_an_idle_adapter(aware=False)
    assert blind != home, "the blind rule must choose otherwise here, or this test shows nothing"


def test_lora_recent_keeps_max_loras_and_never_drops_a_running_adapter():
    eng = make_engine(budget=64, block_size=4, max_loras=2)
    slot = eng.sched.slots["w0"]
    for sid, lora in enumerate(["a", "b", "a", "c"]):
        eng.add(Sequence(sid, [sid + 1] * 6, greedy(50), lora=lora))
        eng.step()
    # "c" waits (two adapters run): the mirror holds the running "a" and "b"
    assert sorted(slot.lora_recent) == ["a", "b"]
    eng.run()
    assert slot.lora_recent[-1] == "c" and len(slot.lora_recent) == 2


def test_scheduler_stats_merge_the_adapters_in_use_and_served():
    """Gateways read the schedulers' records (``merge_scheduler_stats``): an adapter is in use when any
    scheduler runs or queues it (an unload is refused), served when every scheduler that drives
    workers can place it (a load answers); a scheduler without workers does not count."""
    import json
    import time

    from fuseserve.messages import merge_scheduler_stats

    now = time.time()
    rec = lambda in_use, served: json.dumps({"time": now, "lora_in_use": in_use, "lora_served": served})  # noqa: E731
    # two schedulers drive workers (one of them idle: its stats name no worker), one drives none
    merged = merge_scheduler_stats([rec(["a"], ["a", "b"]), rec(["c"], ["b"]), rec(["d"], None)], now)
    assert merged["lora_in_use"] == {"a", "c", "d"} and merged["lora_served"] == {"b"}
    assert merge_scheduler_stats([rec([], None)], now)["lora_served"] is None  # none drives a worker
