"""LoRA around the model's linear layers: per-slot adapter weights and the pass's adapter segments.

The model files do not change. ``wrap_model`` replaces each adaptable projection (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``; float, prepacked or quantized) by a ``LoRALinear``
holding the base layer and, per adapter slot, the stacked ``a [in, P * R]`` and ``b [P * R, out]``
of its ``P`` parts (q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``; one for the others) at
``R = max_lora_rank`` columns each: part ``p``'s ``A^T`` fills columns ``p R ..`` of ``a``, its
``scale * B^T`` the same rows of ``b`` in the part's output columns (``b`` is block-diagonal: one
shrink and one expand per slot serve every part). A rank below ``R`` leaves zero columns; a part an
adapter does not target stays zero.

Under tensor parallelism each rank keeps the slices its base layer keeps: a column-parallel stacked
layer its output columns of ``b`` (``a`` whole), a row-parallel layer its input rows of ``a`` (``b``
whole); the shrink's partial sums are then added over the ranks before the expand.

The pass's metadata (``LoRABatch``) reaches the layers through the ``ForwardContext``; without it
(no adapter in the pass) a ``LoRALinear`` is its base layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fuseserve.kernels import lora_reference
from fuseserve.worker import parallel
from fuseserve.worker.attention import current_lora
from fuseserve.worker.models.layers import MergedLinear
from fuseserve.worker.parallel import RowParallelLinear


@dataclass
class LoRABatch:
    """Which tokens of a pass each adapter slot holds (base tokens: none).

    groups: ``(slot, rows)`` per slot present, rows a slice when contiguous, else int64 indices
        (the CPU path, ``lora_reference.grouped_delta``).
    seg_starts / seg_slots: ``[S + 1]`` / ``[S]`` int32 on the device: runs of consecutive tokens of
        one slot (-1: base), the Triton path's segments; max_seg_len: the longest run, in tokens.
    kernel: ``"grouped"`` (CPU) or ``"triton"`` (CUDA).
    """

    groups: list[tuple[int, Any]]
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    max_seg_len: int
    kernel: str = "grouped"

    @classmethod
    def build(
        cls, slots: list[int], lengths: list[int], device: torch.device, kernel: str
    ) -> LoRABatch | None:
        """From the pass's chunks in order: each chunk's slot (-1: base) and its tokens. None when no
        chunk has an adapter."""
        if all(s < 0 for s in slots):
            return None
        runs: list[list[int]] = []  # [slot, start, length], adjacent chunks of one slot merged
        start = 0
        for slot, n in zip(slots, lengths, strict=True):
            if runs and runs[-1][0] == slot:
                runs[-1][2] += n
            else:
                runs.append([slot, start, n])
            start += n
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, s, n in runs:
            if slot >= 0:
                by_slot.setdefault(slot, []).append((s, n))
        groups: list[tuple[int, Any]] = []
        for slot, spans in by_slot.items():
            if len(spans) == 1:
                s, n = spans[0]
                groups.append((slot, slice(s, s + n)))
            else:
                rows = torch.cat([torch.arange(s, s + n) for s, n in spans]).to(device)
                groups.append((slot, rows))
        starts = [r[1] for r in runs] + [start]
        return cls(
            groups,
            torch.tensor(starts, dtype=torch.int32).to(device),
            torch.tensor([r[0] for r in runs], dtype=torch.int32).to(device),
            max(r[2] for r in runs),
            kernel,
        )

    def apply(
        self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, reduce: bool
    ) -> torch.Tensor:
        """``y [T, out] += (x [T, in] @ a[slot]) @ b[slot]`` for every token of an adapter; with
        ``reduce`` (a row-parallel layer) the shrink is summed over the ranks first. Returns ``y``."""
        if self.kernel == "triton":
            from fuseserve.kernels import triton_lora

            s = triton_lora.sgmv_shrink(x, a, self.seg_starts, self.seg_slots, self.max_seg_len)
            if reduce:
                parallel.all_reduce(s)
            return triton_lora.sgmv_expand(s, b, self.seg_starts, self.seg_slots, self.max_seg_len, y)
        if not reduce:
            return lora_reference.grouped_delta(x, a, b, self.groups, y)
        for slot, rows in self.groups:
            s = parallel.all_reduce(x[rows] @ a[slot])
            if isinstance(rows, slice):
                y[rows] += s @ b[slot]
            else:
                y.index_add_(0, rows, s @ b[slot])
        return y


class LoRALinear(nn.Module):
    """A base linear layer plus ``num_slots`` adapter slots of rank up to ``max_rank``.

    ``forward(x [T, in]) -> [T, out]``: the base layer's output plus each adapter token's delta
    (``LoRABatch.apply``). ``split`` as ``MergedLinear.split`` for a stacked base. ``load_slot``
    writes an adapter's weights for this layer into a slot (zeros without any).
    """

    def __init__(self, base: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype, device):
        super().__init__()
        self.base = base
        self.max_rank = max_rank
        rank, size = parallel.world()
        self.row_parallel = isinstance(base, RowParallelLinear) and size > 1
        self.in_start = base.start if isinstance(base, RowParallelLinear) else 0
        self.parts = self._parts(base)
        num_cols = len(self.parts) * max_rank
        self.register_buffer(
            "lora_a", torch.zeros(num_slots, base.in_features, num_cols, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(num_slots, num_cols, base.out_features, dtype=dtype, device=device)
        )

    @staticmethod
    def _parts(base: nn.Module) -> list[tuple[Any, int, int, int]]:
        """``(part, local output start, local size, start in the part's full rows)`` per part."""
        if not isinstance(base, MergedLinear):
            return [(None, 0, base.out_features, 0)]
        parts, start = [], 0
        for name, size in base.sizes.items():
            parts.append((name, start, size, base.source_starts[name]))
            start += size
        return parts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = current_lora()
        if batch is None:
            return y
        return batch.apply(x, y, self.lora_a, self.lora_b, self.row_parallel)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``x [T, in]`` → one ``[T, size]`` tensor per part of the stacked base, in order."""
        return self(x).split(list(self.base.sizes.values()), dim=-1)

    def load_slot(self, slot: int, weights: dict[Any, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Fill ``slot`` from an adapter's ``{part: (A [r, in], scale * B [out_part, r])}`` for this
        layer at full size (``LoRAAdapter.weights[module]``; part None: the whole layer); None or a
        missing part: zeros."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        R = self.max_rank
        in_rows = slice(self.in_start, self.in_start + self.base.in_features)
        for part, (wa, wb) in (weights or {}).items():
            r = wa.shape[0]
            if part is None:  # one adapter over the whole stacked layer (a fused checkpoint module)
                a[:, :r] = wa[:, in_rows].T.to(a.dtype)
                offset = 0
                for name, out_start, size, src in self.parts:
                    rows = wb[offset + src : offset + src + size]
                    b[:r, out_start : out_start + size] = rows.T.to(b.dtype)
                    offset += self.base.full_sizes[name] if name is not None else size
                continue
            p = next(i for i, q in enumerate(self.parts) if q[0] == part)
            _, out_start, size, src = self.parts[p]
            a[:, p * R : p * R + r] = wa[:, in_rows].T.to(a.dtype)
            b[p * R : p * R + r, out_start : out_start + size] = wb[src : src + size].T.to(b.dtype)


def wrap_model(
    model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype, device
) -> dict[str, LoRALinear]:
    """Replace every adaptable projection of ``model`` (``lora_adapter.adaptable``) by a
    ``LoRALinear`` around it; returns them by module name (the base layer's name)."""
    from fuseserve.worker.lora_adapter import adaptable

    targets = [(name, m) for name, m in model.named_modules() if adaptable(m)]
    wrapped = {}
    for name, module in targets:
        parent_name, _, leaf = name.rpartition(".")
        layer = LoRALinear(module, num_slots, max_rank, dtype, device)
        setattr(model.get_submodule(parent_name), leaf, layer)
        wrapped[name] = layer
    return wrapped
