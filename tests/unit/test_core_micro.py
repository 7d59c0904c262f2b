"""benchmarks/core_micro.py drives the engine core through the handle interface it uses today."""

import argparse

import pytest

from benchmarks.core_micro import run


def _args(**kw) -> argparse.Namespace:
    base = dict(
        tree=None, metrics=False, budget=512, workers=2, blocks=4096, seqs=4, workload="decode",
        prompt_len=64, new_tokens=8, steps=40, warmup=5,
    )  # fmt: skip
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize("workload", ["decode", "mixed"])
def test_every_plan_completes_and_cpu_is_measured(workload):
    out = run(_args(workload=workload))
    # a plan the fake worker could not take fails its sequences (the benchmark's old handle did):
    # those numbers would time the failure path, not postprocess + planning
    assert out["failed_sequences"] == 0
    assert 0 < out["p50_ms"] <= out["p99_ms"]
