"""LoRA adapters under tensor parallelism: 2 ranks (gloo, CPU) give the logits of 1 rank, and of
transformers + PEFT, with three adapters and the base model in the same passes. Each rank keeps the
slices its base layers keep: output columns of ``b`` for the stacked column-parallel layers, input
rows of ``a`` for the row-parallel ones (whose shrink is summed over the ranks)."""

from __future__ import annotations

import torch
from lora_checkpoints import peft_model, write_adapters
from tiny_models import tiny_checkpoint
from tp_harness import assert_logits_close, one_rank, spawn_ranks, tp_prompts

ATOL = 1e-4
LORAS = {1: "a4", 2: "a8", 3: "a16"}  # sequence 4: the base model


def test_tp2_with_adapters_equals_tp1_and_peft(tmp_path):
    hf, _ = tiny_checkpoint("llama-gqa", tmp_path / "base")
    adapters = write_adapters(hf, tmp_path)
    options = {"lora_modules": adapters, "max_loras": 3, "max_lora_rank": 16}
    single = one_rank(tmp_path / "base", options=options, loras=LORAS)
    assert isinstance(single, dict), single
    (tp,) = spawn_ranks(2, [tmp_path / "base"], tmp_path, options=options, loras=LORAS)
    assert isinstance(tp, dict), tp
    assert_logits_close(tp["logits"], single["logits"], ATOL, "tp2 vs tp1")
    reference = peft_model(hf, adapters)
    for sid, tokens in tp_prompts(hf.config.vocab_size).items():
        with torch.no_grad():
            if sid in LORAS:
                reference.set_adapter(LORAS[sid])
                want = reference(torch.tensor([tokens])).logits[0].float()
            else:
                with reference.disable_adapter():
                    want = reference(torch.tensor([tokens])).logits[0].float()
        torch.testing.assert_close(tp["logits"][sid], want, atol=ATOL, rtol=0, msg=f"sequence {sid}")
