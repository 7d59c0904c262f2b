"""A worker's LoRA adapters: read at start or at runtime, placed in ``max_loras`` slots as sequences need them.

``LoRAManager`` reads every adapter of ``lora_modules`` when the runner starts (a bad one stops the
start with ``LoRAAdapterError``), wraps the model's projections (``lora_layers.wrap_model``) and keeps
which adapter each slot holds. Adapters loaded at runtime (the Redis hash ``messages.RUNTIME_LORA``,
read by the worker's heartbeat) come through ``set_runtime``: each is read and checked once
(``read_adapter``), one that cannot be served is logged and left out; none enters a slot before a
sequence needs it, so the passes in flight are not disturbed. A sequence names its adapter with its first chunk; ``slot`` puts the
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

#: seconds an adapter unloaded at runtime stays loadable here (no longer advertised): a request
#: already read by a scheduler that placed it here before its next discovery still runs, instead of
#: failing the whole pass it lands in
UNLOAD_GRACE_S = 30.0


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
        self.model = model
        self.max_rank = max_rank
        self.runtime: dict[str, LoRAAdapter] = {}  # loaded at runtime (replaced whole: read lock-free)
        self.refused: dict[str, tuple[str, str]] = {}  # runtime adapter → (path, why), logged once
        self.retired: dict[
            str, tuple[LoRAAdapter, float]
        ] = {}  # unloaded → (adapter, when), for UNLOAD_GRACE_S
        self.layers = wrap_model(model, max_loras, max_rank, dtype, device)
        self.kernel = "triton" if device.type == "cuda" else "grouped"
        self.device = device
        self.slots: list[str | None] = [None] * max_loras  # slot → adapter name
        self._held: list[LoRAAdapter | None] = [None] * max_loras  # slot → the adapter read it holds
        self._last_used = [0.0] * max_loras
        self.num_loads = 0  # adapters written into a slot so far
        self.load_seconds: list[float] = []  # each load's seconds, since ``take_load_seconds``
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
        adapter = self.adapters.get(name) or self.runtime.get(name)
        if adapter is None and name in self.slots:  # unloaded at runtime, still in a slot: late requests run
            adapter = self._held[self.slots.index(name)]
        if adapter is None and name in self.retired:  # unloaded lately: a request placed meanwhile runs
            adapter, since = self.retired[name]
            adapter = adapter if time.monotonic() - since < UNLOAD_GRACE_S else None
        if adapter is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}; loaded: {self.names()}", "lora")
        now = time.monotonic()
        held = [i for i, h in enumerate(self._held) if h is adapter]
        if held:
            self._last_used[held[0]] = now
            return held[0]
        busy = live()
        idle = [i for i, held in enumerate(self.slots) if held is None or held not in busy]
        if not idle:
            raise SchedulerError(
                f"LoRA adapter {name!r}: all {len(self.slots)} slots hold adapters of live sequences"
            )
        i = min(idle, key=lambda j: (self.slots[j] != name, self.slots[j] is not None, self._last_used[j]))
        t0 = time.perf_counter()
        for module, layer in self.layers.items():
            layer.load_slot(i, adapter.weights.get(module))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.load_seconds.append(time.perf_counter() - t0)
        self.slots[i], self._held[i] = name, adapter
        self._last_used[i] = now
        self.num_loads += 1
        return i

    def names(self) -> list[str]:
        """The adapters served: those of ``lora_modules`` and those loaded at runtime, sorted."""
        return sorted({*self.adapters, *self.runtime})

    def set_runtime(self, paths: dict[str, str]) -> list[str]:
        """Serve the runtime adapters ``paths`` (name → PEFT directory) and no other runtime one;
        returns ``names()``. A new one (or a new path) is read and checked now (``read_adapter``):
        one that cannot be served is logged once and left out. A name of ``lora_modules`` keeps its
        own adapter. One no longer in ``paths`` is retired: not served, yet ``slot`` still loads it
        for ``UNLOAD_GRACE_S``. Called from the heartbeat thread: ``runtime`` is replaced whole."""
        runtime = {}
        for name, path in paths.items():
            old = self.runtime.get(name)
            if name in self.adapters or self.refused.get(name, ("",))[0] == path:
                continue
            if old is not None and str(old.path) == str(path):
                runtime[name] = old
                continue
            t0 = time.perf_counter()
            try:
                runtime[name] = read_adapter(name, path, self.model, self.max_rank)
            except Exception as e:  # noqa: BLE001  # a checkpoint that breaks the reader must not stop the worker
                log.warning("runtime LoRA adapter refused: %s", e)
                self.refused[name] = (path, str(e))
                continue
            log.info("LoRA adapter %s read from %s in %.2f s", name, path, time.perf_counter() - t0)
        now = time.monotonic()
        retired = {n: r for n, r in self.retired.items() if n not in runtime and now - r[1] < UNLOAD_GRACE_S}
        retired |= {n: (a, now) for n, a in self.runtime.items() if n not in runtime}
        self.retired = retired  # replaced whole, as ``runtime``
        self.runtime = runtime
        return self.names()

    def take_load_seconds(self) -> list[float]:
        """The seconds of each slot load since the last call (read and reset)."""
        out, self.load_seconds = self.load_seconds, []
        return out

    def batch(self, slots: list[int], lengths: list[int]) -> LoRABatch | None:
        """The pass's ``LoRABatch`` from each chunk's slot and tokens, in plan order (None: base only)."""
        return LoRABatch.build(slots, lengths, self.device, self.kernel)
