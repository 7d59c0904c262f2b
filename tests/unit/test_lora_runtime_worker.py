"""A worker's runtime LoRA adapters (``LoRAManager.set_runtime`` through ``ModelRunner``): what the
heartbeat hands it is read and checked against the model at once (another base model's adapter is
left out, so the worker never advertises it), but enters an adapter slot only when a sequence needs
it; each slot load's seconds are read and reset (``fuseserve_lora_load_seconds``); an unloaded
adapter still held in a slot, or unloaded within ``UNLOAD_GRACE_S``, serves its late requests; a
name never loaded is refused. A tiny CPU
``ModelRunner`` (``tests/tiny_runner.py``) with PEFT adapters."""

from __future__ import annotations

import pytest
import torch
from lora_checkpoints import write_adapter
from prometheus_client import generate_latest
from tiny_models import llama_config, random_model
from tiny_runner import tiny_llama_runner

from fuseserve.errors import InvalidRequestError
from fuseserve.worker import lora_manager
from fuseserve.worker.worker_metrics import WorkerMetrics


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("model")


@pytest.fixture(scope="module")
def runner(model_dir):
    return tiny_llama_runner(model_dir, allow_runtime_lora=True, max_loras=1)


@pytest.fixture(scope="module")
def adapters(runner, model_dir, tmp_path_factory) -> dict[str, str]:
    """``a`` / ``b``: adapters of the runner's model; ``other``: one of a wider LLaMA (another base)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    other = random_model(llama_config(hidden_size=96), seed=1)
    return {
        "a": str(write_adapter(hf, root / "a", 4, ["q_proj", "down_proj"], seed=1)),
        "b": str(write_adapter(hf, root / "b", 8, ["v_proj"], seed=2)),
        "other": str(write_adapter(other, root / "other", 4, ["q_proj"], seed=3)),
    }


def test_runtime_adapters_are_checked_at_once_and_loaded_when_needed(runner, adapters, monkeypatch):
    monkeypatch.setattr(lora_manager, "UNLOAD_GRACE_S", 0.0)  # an unloaded adapter is refused at once
    lora = runner.lora
    assert runner.info.lora_adapters == [] and lora is not None  # wrapped without --lora-modules
    assert runner.set_runtime_loras(adapters) == ["a", "b"]  # "other": another base model's shapes
    assert lora.num_loads == 0 and runner.take_lora_load_seconds() == []  # no slot taken yet
    assert lora.slot("a", set) == 0 and lora.slot("a", set) == 0
    assert lora.num_loads == 1
    (seconds,) = runner.take_lora_load_seconds()
    assert seconds > 0 and runner.take_lora_load_seconds() == []
    with pytest.raises(InvalidRequestError, match="'ghost'"):
        lora.slot("ghost", set)
    assert runner.set_runtime_loras({}) == []  # unloaded: "a" still sits in the slot
    assert lora.slot("a", set) == 0 and lora.num_loads == 1
    with pytest.raises(InvalidRequestError, match="'b'"):
        lora.slot("b", set)
    assert runner.set_runtime_loras({"b": adapters["b"]}) == ["b"]
    assert lora.slot("b", set) == 0 and lora.num_loads == 2  # the idle slot of "a" is reused


def test_an_unloaded_adapter_stays_loadable_for_the_grace_period(runner, adapters, monkeypatch):
    """A request placed before the scheduler learned of the unload runs (not advertised any more);
    past ``UNLOAD_GRACE_S`` it is refused."""
    lora = runner.lora
    assert runner.set_runtime_loras({"late": adapters["b"]}) == ["late"]
    assert runner.set_runtime_loras({}) == []  # unloaded before any sequence needed it
    loads = lora.num_loads
    lora.slot("late", set)
    assert lora.num_loads == loads + 1
    assert runner.set_runtime_loras({"a": adapters["a"]}) == ["a"]
    lora.slot("a", set)  # takes the only slot back
    monkeypatch.setattr(lora_manager, "UNLOAD_GRACE_S", 0.0)
    with pytest.raises(InvalidRequestError, match="'late'"):
        lora.slot("late", set)


def test_a_reload_under_the_same_name_takes_the_new_weights(runner, adapters):
    lora = runner.lora
    runner.set_runtime_loras({"x": adapters["a"]})
    lora.slot("x", set)
    loads = lora.num_loads
    runner.set_runtime_loras({})
    runner.set_runtime_loras({"x": adapters["b"]})  # another checkpoint, the same name
    lora.slot("x", set)
    assert lora.num_loads == loads + 1


def test_without_the_flag_runtime_adapters_are_refused(tmp_path):
    plain = tiny_llama_runner(tmp_path)
    with pytest.raises(InvalidRequestError, match="allow_runtime_lora"):
        plain.set_runtime_loras({"a": "/x"})
    assert plain.take_lora_load_seconds() == []


def test_the_load_time_histogram():
    metrics = WorkerMetrics("w0", "m", None)
    metrics.observe_lora_loads([0.004, 0.2])
    text = generate_latest(metrics.registry).decode()
    assert 'fuseserve_lora_load_seconds_count{model_name="m",worker="w0"} 2.0' in text
    assert 'fuseserve_lora_load_seconds_bucket{le="0.005",model_name="m",worker="w0"} 1.0' in text
