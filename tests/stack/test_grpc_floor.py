"""benchmarks/grpc_floor.py: one short configuration runs and its numbers add up (the numbers
themselves, CPU per round trip and round trips/s, are the benchmark's to print)."""

import pytest

from benchmarks.grpc_floor import run_one
from fuseserve.redis_launcher import free_port


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_one_configuration_counts_round_trips_and_subtracts_the_busy_work(transport):
    cfg = {
        "transport": transport,
        "streams": 2,
        "delay_ms": 1.0,
        "busy_ms": 0.2,
        "payload": 100,
        "seconds": 0.5,
        "port": free_port(),
    }
    rec = run_one(cfg)
    # a round trip waits >= 1 ms on the server and spins >= 0.2 ms: each stream starts at most
    # 0.5 s / 1.2 ms + 1 of them, however loaded the machine
    assert 0 < rec["round_trips"] <= 2 * (0.5 / 1.2e-3 + 1)
    # the measured window lasts at least the configured 0.5 s
    assert 0 < rec["round_trips_per_s"] <= rec["round_trips"] / cfg["seconds"]
    assert rec["busy_ms_per_round_trip"] >= 0.2  # the spin runs at least what was asked (thread CPU time)
    assert rec["cpu_ms_per_round_trip"] > 0  # the transport's own cost, the busy work taken out
