"""A worker's LoRA adapters: read at start, placed in ``max_loras`` slots as sequences need them.

``LoRAManager`` reads every adapter of ``lora_modules`` when the runner starts (a bad one stops the
start with ``LoRAAdapterError``), wraps the model's projections (``lora_layers.wrap_model``) and keeps
which adapter each slot holds. A sequence names its adapter with its first chunk; ``slot`` puts the
adapter into a slot if it is not in one (a free slot, else the least recently used slot no live
sequence's adapter holds), and ``batch`` turns the pass's chunk slots into the ``LoRABatch`` the layers
read. The scheduler places at most ``max_loras`` distinct adapters on a worker at once
(``services/scheduler/waiting_queue.py``), so a slot is always found; otherwise ``SchedulerError``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from fuseserve.errors import InvalidRequestError, SchedulerError
from fuseserve.worker.lora_adapter import LoRAAdapter, read_adapter
from fuseserve.worker.lora_layers import LoRABatch, wrap_model

log = logging.getLogger(__name__)


class LoRAManager:
    """Adapters by name and their slots on one worker (rank).

    Args:
        model: the loaded model (wrapped here).
        lora_modules: adapter name → PEFT directory.
        max_loras: slots (adapters resident at once). max_rank: the largest rank served.
    Raises ``LoRAAdapterError`` for an adapter that cannot be served.
    """

    def __init__(
        self,
        model: nn.Module,
        lora_modules: dict[str, str],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        t0 = time.perf_counter()
        self.adapters: dict[str, LoRAAdapter] = {
            name: read_adapter(name, path, model, max_rank) for name, path in lora_modules.items()
        }
        self.layers = wrap_model(model, max_loras, max_rank, dtype, device)
        self.kernel = "triton" if device.type == "cuda" else "grouped"
        self.device = device
        self.slots: list[str | None] = [None] * max_loras  # slot → adapter name
        self._last_used = [0.0] * max_loras
        self.num_loads = 0  # adapters written into a slot so far
        log.info(
            "LoRA: %d adapters (%s), %d slots of rank <= %d, %d layers, read in %.2f s",
            len(self.adapters),
            ", ".join(self.adapters),
            max_loras,
            max_rank,
            len(self.layers),
            time.perf_counter() - t0,
        )

    def slot(self, name: str | None, live: Callable[[], set[str]]) -> int:
        """The slot holding adapter ``name`` (-1 for None: the base model), loaded into a free or the
        least recently used idle slot when needed. ``live``: the adapters of the worker's live
        sequences (their slots are not taken). Raises ``InvalidRequestError`` for an unknown adapter,
        ``SchedulerError`` when every slot holds a live adapter."""
        if name is None:
            return -1
        now = time.monotonic()
        if name in self.slots:
            i = self.slots.index(name)
            self._last_used[i] = now
            return i
        if name not in self.adapters:
            raise InvalidRequestError(
                f"unknown LoRA adapter {name!r}; loaded: {sorted(self.adapters)}", "lora"
            )
        busy = live()
        idle = [i for i, held in enumerate(self.slots) if held is None or held not in busy]
        if not idle:
            raise SchedulerError(
                f"LoRA adapter {name!r}: all {len(self.slots)} slots hold adapters of live sequences"
            )
        i = min(idle, key=lambda j: (self.slots[j] is not None, self._last_used[j]))
        weights = self.adapters[name].weights
        for module, layer in self.layers.items():
            layer.load_slot(i, weights.get(module))
        self.slots[i] = name
        self._last_used[i] = now
        self.num_loads += 1
        return i

    def batch(self, slots: list[int], lengths: list[int]) -> LoRABatch | None:
        """The pass's ``LoRABatch`` from each chunk's slot and tokens, in plan order (None: base only)."""
        return LoRABatch.build(slots, lengths, self.device, self.kernel)
