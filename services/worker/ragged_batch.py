"""The flattened ragged batch of one forward pass (``docs/architecture.md``, "Vocabulary").

S sequences contribute chunks of different lengths; their T tokens are concatenated. Built by the
model runner's prepare stage from a ``StepPlan`` and the worker's block tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RaggedBatch:
    """Inputs of one pass.

    input_ids: ``[T]`` int64 token ids, chunks concatenated.
    positions: ``[T]`` int64 position of each token in its sequence.
    cu_seqlens_q: ``[S+1]`` int32 prefix sums of chunk lengths (chunk i is tokens cu[i]:cu[i+1]).
    seq_lens: ``[S]`` int32 context length of each sequence after this chunk (start_pos + num_tokens).
    block_tables: ``[S, max_blocks]`` int32, padded with 0.
    slot_mapping: ``[T]`` int64 KV-cache slot of each token.
    logits_indices: ``[S']`` int64 indices into T of the tokens whose logits are needed.
    query_lens / context_lens: the same counts as Python lists (for host-side planning).
    lora: which tokens each LoRA adapter slot holds (``lora_layers.LoRABatch``); None: base only.
    plan_rows: ``[T]`` int64 the batch's rows in plan order when the chunks were laid out in another
        order (adapter by adapter, ``ModelRunner.prepare``); None: the plan's order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    lora: Any = None
    plan_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """T, tokens in the pass."""
        return int(self.input_ids.shape[0])
