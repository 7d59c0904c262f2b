"""benchmarks/grpc_floor.py: one short configuration runs and its numbers add up."""

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
    # 2 streams x 0.5 s at >= 1.2 ms a round trip: at most ~830; at least a few dozen even on a loaded CI box
    assert 20 <= rec["round_trips"] <= 900
    assert rec["busy_ms_per_round_trip"] >= 0.2  # the spin runs at least what was asked
    assert rec["busy_ms_per_round_trip"] < 0.5
    assert 0 < rec["cpu_ms_per_round_trip"] < 5  # the transport's own cost, the busy work taken out
