"""The runner interface the gRPC server (``server.py``) drives, and the capacity a worker reports.

Two runners implement it: ``ModelRunner`` (``model_runner.py``: a model, its paged KV cache, sampling)
and ``SimulatedRunner`` (``sim_runner.py``: the same plan and block bookkeeping, a latency model
instead of a model). Both keep their sequences in a ``SeqTable`` (``seq_table.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from fuseserve.types import StepPlan, StepResult
from fuseserve.worker.seq_table import WorkerSeq


@dataclass
class WorkerInfo:
    """Capacity a worker reports to its scheduler. quantization: the checkpoint's
    (``model_source.quantization_method``; None: float weights). kv_cache_dtype: the KV cache's
    storage dtype (``bfloat16``, ``float8_e4m3fn``, ...; None when there is none, as simulated).
    lora_adapters: the names of the LoRA adapters it serves (``lora_modules``), sorted."""

    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    quantization: str | None = None
    kv_cache_dtype: str | None = None
    lora_adapters: list[str] = field(default_factory=list)


class Runner(Protocol):
    """What the worker server needs of a runner. Not re-entrant: the server runs one call at a time.

    info: capacity reported at registration. seqs: the sequences it holds, by id.
    step(plan): free ``plan.free_seq_ids``, run the chunks, return the sampled tokens in plan order
        and the seconds the step took; raises ``SchedulerError`` / ``InvalidBlockError`` for a plan
        that breaks the contract (``SeqTable.admit``).
    free(seq_ids): drop sequences and return their blocks (unknown ids are ignored).
    num_lora_loads: LoRA adapters written into an adapter slot so far (0 without adapters).
    take_lora_load_seconds(): the seconds of each of those loads since the last call (read and reset).
    """

    info: WorkerInfo
    seqs: dict[int, WorkerSeq]

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_lora_loads(self) -> int: ...

    def take_lora_load_seconds(self) -> list[float]: ...

    def step(self, plan: StepPlan) -> StepResult: ...

    def free(self, seq_ids: list[int]) -> None: ...
