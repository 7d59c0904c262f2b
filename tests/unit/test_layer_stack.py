"""The decoder layers as one C++ call (services/worker/layer_stack.py, kernels/cpu_stack.cpp): every
pass that takes it gives the Python layers' hidden states bit for bit, on each LLaMA-shaped family's
tiny checkpoint and on SmolLM2 in fp32 and bf16, prefill-split passes included; other families keep
Python."""

from __future__ import annotations

import pytest
import torch
from tiny_models import EOS, tiny_checkpoint

from fuseserve.config import EngineConfig
from fuseserve.kernels import cpu_attention, cpu_stack
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount, assign_block_ids
from fuseserve.types import SeqChunk, StepPlan
from fuseserve.worker import prepacked_linear
from fuseserve.worker.layer_stack import LayerStack
from fuseserve.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    not (cpu_stack.available() and prepacked_linear.available()), reason="no C++ compiler or no oneDNN here"
)

STACKED = ["llama-gqa", "llama-tied", "mistral-sw16", "qwen2-bias", "phi3-longrope-partial"]
PYTHON = ["qwen3-qknorm", "gemma2-sw16-softcap", "opt-prenorm", "mixtral-top2of8"]


def _dtypes():
    bf16 = torch.bfloat16 in prepacked_linear._packable_dtypes()  # packed bf16 only where native
    return ["float32", "bfloat16"] if bf16 else ["float32"]


def _runner(path, config, dtype, **engine) -> ModelRunner:
    cfg = EngineConfig(device="cpu", dtype=dtype, kv_cache_memory="64MiB", compile=False, **engine)
    return ModelRunner(path, config, [EOS], cfg, progress=False)


def _drive(runner: ModelRunner, monkeypatch, prompts: list[int], decodes: int) -> list[int]:
    """Prefill ``prompts`` (lengths, one pass) then ``decodes`` decode passes through ``runner.step``,
    every stack call checked against the Python layers on the same inputs; returns the tokens each
    stack call covered."""
    calls: list[int] = []
    stack_call = LayerStack.__call__

    def checked(self, input_ids, positions, metadata):
        got = stack_call(self, input_ids, positions, metadata)
        want = runner.model(input_ids, positions)  # inside the runner's forward_context
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        calls.append(input_ids.shape[0])
        return got

    monkeypatch.setattr(LayerStack, "__call__", checked)
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    blocks = BlockAccount(runner.info.num_blocks, runner.info.block_size, False)
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for sid, n in enumerate(prompts):
        ids = torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
        chunks.append(SeqChunk(sid, 0, n, ids, sample=True, params=params, prompt_len=n))
    pos = list(prompts)
    for step in range(decodes + 1):
        plan = StepPlan(step, chunks)
        assign_block_ids(blocks, plan)
        runner.step(plan)
        chunks = [SeqChunk(sid, pos[sid], 1, [], sample=True) for sid in range(len(prompts))]
        pos = [p + 1 for p in pos]
    return calls


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("family", STACKED)
def test_stack_equals_python_layers(tmp_path, monkeypatch, family, dtype):
    _, config = tiny_checkpoint(family, tmp_path)
    runner = _runner(tmp_path, config, dtype)
    assert runner.layer_stack is not None
    monkeypatch.setattr(cpu_attention, "amx_prefill", lambda: False)  # every pass takes the stack
    calls = _drive(runner, monkeypatch, [20, 7, 33], decodes=3)
    assert calls == [60, 3, 3, 3]


@pytest.mark.parametrize("family", PYTHON)
def test_other_families_keep_python_layers(tmp_path, family):
    _, config = tiny_checkpoint(family, tmp_path)
    assert _runner(tmp_path, config, "float32").layer_stack is None


def test_lora_and_switch_keep_python_layers(tmp_path, monkeypatch):
    _, config = tiny_checkpoint("llama-gqa", tmp_path)
    assert _runner(tmp_path, config, "float32", allow_runtime_lora=True).layer_stack is None
    monkeypatch.setattr(cpu_stack, "ENABLED", False)
    assert _runner(tmp_path, config, "float32").layer_stack is None


@pytest.mark.parametrize("family", ["llama-gqa", "mistral-sw16"])
@pytest.mark.parametrize("prompts", [[5, 40, 3], [40, 5], [33, 40]])
def test_prefill_split_passes_take_the_stack(tmp_path, monkeypatch, family, prompts):
    """Passes whose long prefill chunks go to the prefill kernel (AMX CPUs, bf16; forced here): the operator's rows
    first (a slice), gathered, or none; with a sliding window or without."""
    if "bfloat16" not in _dtypes():
        pytest.skip("bf16 linears are not packed on this CPU")
    _, config = tiny_checkpoint(family, tmp_path)
    runner = _runner(tmp_path, config, "bfloat16")
    monkeypatch.setattr(cpu_attention, "amx_prefill", lambda: True)
    assert _drive(runner, monkeypatch, prompts, decodes=2) == [sum(prompts), len(prompts), len(prompts)]


@pytest.mark.parametrize("dtype", _dtypes())
def test_smollm2_stack_equals_python_layers(smollm2_source, monkeypatch, dtype):
    runner = _runner(smollm2_source.path, smollm2_source.config, dtype)
    assert runner.layer_stack is not None
    monkeypatch.setattr(cpu_attention, "amx_prefill", lambda: False)
    assert _drive(runner, monkeypatch, [24, 9], decodes=2) == [33, 2, 2]


def test_long_bf16_passes_split_rows_in_both_paths(smollm2_source, monkeypatch):
    """A bf16 pass of at least 192 rows per thread runs its linears as one row chunk per thread
    (cpu_stack.cpp's ``linear``), in the stack and in the Python layers alike: on SmolLM2's shapes a
    512-row product's bits differ between oneDNN's own two-thread split and the row chunks."""
    if "bfloat16" not in _dtypes():
        pytest.skip("bf16 linears are not packed on this CPU")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = _runner(smollm2_source.path, smollm2_source.config, "bfloat16")
        monkeypatch.setattr(cpu_attention, "amx_prefill", lambda: False)
        assert _drive(runner, monkeypatch, [300, 212], decodes=1) == [512, 2]
    finally:
        torch.set_num_threads(threads)


def test_a_slot_past_the_cache_is_refused(tmp_path):
    """The stack writes K/V rows at their slots itself (cpu_stack.cpp's ``write_kv``): a slot outside
    the cache is a RuntimeError, never a write past it."""
    _, config = tiny_checkpoint("llama-gqa", tmp_path)
    runner = _runner(tmp_path, config, "float32")
    slots = runner.kv_cache.k[0].shape[0] * runner.kv_cache.k[0].shape[1]
    for bad in (slots, -1):
        meta = cpu_attention.CpuAttentionMetadata(
            torch.tensor([bad]), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1]), torch.tensor([1])
        )
        with pytest.raises(RuntimeError, match="outside the cache"):
            runner.layer_stack(torch.tensor([1]), torch.tensor([0]), meta)
