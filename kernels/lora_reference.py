"""Multi-adapter LoRA over a ragged batch: the plain PyTorch reference and the CPU path.

A pass holds tokens of several LoRA adapters and of the base model (Punica's SGMV setting, Chen et
al. 2023, "Punica: Multi-Tenant LoRA Serving"). Each LoRA-wrapped linear layer keeps, per adapter
slot ``l``, ``a[l] [in, K]`` and ``b[l] [K, out]`` (``K``: rank columns, the scale folded into ``b``);
token ``t`` of slot ``s_t`` gets ``y_t += (x_t @ a[s_t]) @ b[s_t]``, the base model's tokens (slot
-1) nothing. The two halves are the *shrink* (``x @ a``: ``in`` → ``K``) and the *expand* (``s @ b``:
``K`` → ``out``).

- ``shrink_reference`` / ``expand_reference``: token by token (the weights gathered per token): the
  oracle the kernels are tested against.
- ``grouped_delta``: the CPU path: the rows of each slot taken together (a slice when they are
  contiguous), two matmuls per slot present in the pass, whatever its number of tokens.

The Triton pair for GPUs is ``fuseserve.kernels.triton_lora``.
"""

from __future__ import annotations

import torch

Rows = slice | torch.Tensor
"""The rows of one slot in a pass: a slice when contiguous, else a 1-D index tensor (int64)."""


def shrink_reference(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """``x [T, in]``, ``a [L, in, K]``, ``token_slots [T]`` (int, -1: base) → ``s [T, K]`` in fp32,
    ``s_t = x_t @ a[slot_t]`` (zeros for base tokens)."""
    lora = token_slots >= 0
    weights = a[token_slots.clamp(min=0).long()].float()  # [T, in, K]
    s = torch.bmm(x.float().unsqueeze(1), weights).squeeze(1)
    return s * lora.unsqueeze(-1)


def expand_reference(
    s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """``y [T, out] += s [T, K] @ b[slot_t] [K, out]`` row by row (base tokens unchanged); returns
    ``y``, changed in place (the sum taken in fp32, cast to ``y.dtype``)."""
    lora = token_slots >= 0
    weights = b[token_slots.clamp(min=0).long()].float()  # [T, K, out]
    delta = torch.bmm(s.float().unsqueeze(1), weights).squeeze(1) * lora.unsqueeze(-1)
    y.copy_((y.float() + delta).to(y.dtype))
    return y


def grouped_delta(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: list[tuple[int, Rows]], y: torch.Tensor
) -> torch.Tensor:
    """The CPU path: ``y[rows] += (x[rows] @ a[slot]) @ b[slot]`` for each ``(slot, rows)`` of
    ``groups`` (one entry per slot in the pass, base tokens in none). ``x [T, in]``, ``y [T, out]``
    in the model dtype; returns ``y``, changed in place."""
    for slot, rows in groups:
        if isinstance(rows, slice):  # two calls: the shrink, then the expand added in place
            y[rows].addmm_(x[rows] @ a[slot], b[slot])
        else:
            y.index_add_(0, rows, (x[rows] @ a[slot]) @ b[slot])
    return y
