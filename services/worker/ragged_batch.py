"""The flattened ragged batch of one forward pass (``docs/architecture.md``, "Vocabulary").

S sequences contribute chunks of different lengths; their T tokens are concatenated. Built
(``RaggedBatch.build``) by the model runner's prepare stage from a ``StepPlan`` and the worker's block
tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
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

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        starts: list[int],
        query_lens: list[int],
        context_lens: list[int],
        tables: list[list[int]],
        logits_idx: list[int],
        block_size: int,
        device: torch.device,
    ) -> RaggedBatch:
        """The pass's tensors on ``device`` from per-chunk counts (chunk j: ``query_lens[j]`` tokens from
        position ``starts[j]``), each sequence's block ids ``tables`` and the rows to take logits of;
        each tensor built in one go (positions and slots from the counts and the padded block tables,
        no per-token Python)."""
        max_blocks = max((len(t) for t in tables), default=0)
        bt = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
        bt = bt.reshape(len(tables), max_blocks)
        q = torch.tensor(query_lens, dtype=torch.long)
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        torch.cumsum(q, 0, out=cu[1:])
        # token i of chunk j sits at position starts[j] + (i - cu[j]). numpy, not torch.repeat_interleave:
        # its CPU kernel opens a parallel region for any size, and in a served worker the second thread
        # was often off its core between passes, so the call took 2-8 ms instead of 0.04 (measured)
        chunk_of = torch.from_numpy(np.repeat(np.arange(len(query_lens)), query_lens))
        shift = torch.tensor(starts, dtype=torch.long) - cu[:-1].long()
        positions = torch.arange(len(input_ids)) + shift[chunk_of]
        slots = bt[chunk_of, positions // block_size].long() * block_size + positions % block_size
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.long).to(device, non_blocking=True),
            positions=positions.to(device, non_blocking=True),
            cu_seqlens_q=cu.to(device, non_blocking=True),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32).to(device, non_blocking=True),
            block_tables=bt.to(device, non_blocking=True),
            slot_mapping=slots.to(device, non_blocking=True),
            logits_indices=torch.tensor(logits_idx, dtype=torch.long).to(device, non_blocking=True),
            query_lens=query_lens,
            context_lens=context_lens,
        )
