"""Token budget by measurement: the knee of the throughput curve, cached per model + device."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from fuseserve.worker import profiler


def test_knee_is_smallest_size_near_peak_throughput():
    # seconds per pass → throughput 320, 640, 853, 1000, 1024 tok/s: concave, saturating
    curve = {32: 0.1, 64: 0.1, 128: 0.15, 256: 0.256, 512: 0.5}
    assert profiler.knee(curve) == 256  # 1000 >= 0.95 * 1024, 853 is not
    assert profiler.knee(curve, fraction=0.8) == 128


def test_choose_token_budget_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    calls = []

    def fake_measure(runner, sizes=profiler.PROFILE_SIZES, repeats=2):
        calls.append(1)
        return {32: 0.1, 64: 0.1, 128: 0.15, 256: 0.256, 512: 0.5}

    monkeypatch.setattr(profiler, "measure_curve", fake_measure)
    runner = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    assert profiler.choose_token_budget(runner, "model-a", tmp_path) == 256
    assert profiler.choose_token_budget(runner, "model-a", tmp_path) == 256
    assert len(calls) == 1 and (tmp_path / "token_budget.json").exists()
    profiler.choose_token_budget(runner, "model-b", tmp_path)  # another model is profiled anew
    assert len(calls) == 2


def test_measure_curve_runs_real_passes_and_frees_its_blocks(tmp_path):
    from tiny_runner import tiny_llama_runner

    runner = tiny_llama_runner(tmp_path, kv_cache_memory="1MiB")
    curve = profiler.measure_curve(runner, sizes=(8, 32), repeats=1)
    assert set(curve) == {8, 32} and all(s > 0 for s in curve.values())
    assert runner.num_free_blocks == runner.info.num_blocks and not runner.seqs


def test_measure_curve_keeps_the_sizes_the_cache_holds(tmp_path):
    import pytest
    from tiny_runner import tiny_llama_runner

    runner = tiny_llama_runner(tmp_path, kv_cache_memory="1MiB")
    capacity = runner.info.num_blocks * runner.block_size
    too_big = 2 * capacity
    curve = profiler.measure_curve(runner, sizes=(8, too_big), repeats=1)
    assert set(curve) == {8}
    with pytest.raises(ValueError, match="too few"):
        profiler.measure_curve(runner, sizes=(too_big,), repeats=1)
