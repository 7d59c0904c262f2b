"""A simulated runner: executes step plans against a latency model instead of a model.

``fuseserve worker --simulate PRESET`` serves the real gRPC worker (``server.py``) with this runner:
control-plane load tests and capacity planning without GPUs (llm-d's inference simulator is the
anchor). Per step it does the model runner's bookkeeping with the same code (``SeqTable``: frees,
plan checks, block tables, the same errors), then sleeps the modelled pass time
(``LatencyModel.plan_seconds`` x ``slowdown``) and returns deterministic tokens.

Tokens are a pure function of (the prompt's token ids, position) in ``[SIM_FIRST_TOKEN,
SIM_VOCAB_SIZE)``: the same whatever the batch, the chunking, a recompute or the request (the same
prompt gives the same output, so stream equals non-stream), valid ids of the SmolLM2 (49,152) and
Llama-2 (32,000) vocabularies, never a special token. The runner reports no EOS id, so a sequence
ends by ``max_tokens``, a stop token id or a stop string, never by EOS. When a sequence asks for
logprobs, the sampled token gets logprob 0.0 (the simulated model is certain) and is the only
top-logprob entry. No torch, no model files: a simulated worker starts in well under a second.
"""

from __future__ import annotations

import time
import zlib
from array import array
from dataclasses import dataclass

from fuseserve.errors import SchedulerError
from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SampledToken, StepPlan, StepResult, TokenLogprob
from fuseserve.worker.kv_migration import SeqSnapshot
from fuseserve.worker.latency_model import LatencyModel
from fuseserve.worker.multi_pass_run import run_passes
from fuseserve.worker.runner import WorkerInfo
from fuseserve.worker.seq_table import SeqTable, WorkerSeq

SIM_FIRST_TOKEN = 1000  # past every special and byte token of the SmolLM2 and Llama-2 tokenizers
SIM_VOCAB_SIZE = 30000  # emitted ids are below this (both vocabularies are larger)


def prompt_key(token_ids: list[int], key: int = 0) -> int:
    """CRC-32 of token ids, continued from ``key``: ``prompt_key(b, prompt_key(a)) == prompt_key(a + b)``."""
    return zlib.crc32(array("q", token_ids).tobytes(), key)


def sim_token(key: int, position: int) -> int:
    """The token sampled at ``position`` of a sequence whose prompt has ``prompt_key`` ``key``."""
    h = ((key * 1_000_003 + position) * 2_654_435_761) & 0xFFFFFFFF
    h ^= h >> 15
    return SIM_FIRST_TOKEN + h % (SIM_VOCAB_SIZE - SIM_FIRST_TOKEN)


@dataclass
class SimSeqState:
    """A simulated sequence's state: its parameters and the ``prompt_key`` of the prompt seen so far."""

    params: SamplingParams
    key: int = 0


class SimulatedRunner:
    """Runs plans on a modelled device: ``step`` sleeps ``model.plan_seconds(plan) x slowdown``.

    Args:
        model: the latency model (``fuseserve.worker.latency_model.PRESETS``).
        block_size: tokens per KV block.
        num_blocks: KV blocks; default ``model.kv_capacity_tokens // block_size``.
        slowdown: multiplies every step's modelled seconds (> 0; 3 plays a device 3x slower).
        sleep: how to wait (tests pass a fake clock).
    """

    def __init__(
        self,
        model: LatencyModel,
        block_size: int = 16,
        num_blocks: int | None = None,
        slowdown: float = 1.0,
        sleep=time.sleep,
    ):
        if not slowdown > 0:
            raise ValueError(f"slowdown must be > 0, got {slowdown}")
        self.model = model
        self.slowdown = slowdown
        self._sleep = sleep
        num_blocks = num_blocks if num_blocks is not None else model.kv_capacity_tokens // block_size
        self.seq_table = SeqTable(num_blocks, block_size, new_sampling=SimSeqState)
        self.seqs: dict[int, WorkerSeq] = self.seq_table.seqs
        self.info = WorkerInfo(
            block_size, num_blocks, model.max_model_len, SIM_VOCAB_SIZE, [], "simulated", "simulated"
        )

    @property
    def num_free_blocks(self) -> int:
        return self.seq_table.num_free_blocks

    @property
    def num_lora_loads(self) -> int:
        """Always 0: a simulated worker serves no adapter."""
        return 0

    def take_lora_load_seconds(self) -> list[float]:
        """Always empty: a simulated worker loads no adapter."""
        return []

    def free(self, seq_ids: list[int]) -> None:
        """Drop sequences and return their blocks (unknown ids are ignored)."""
        self.seq_table.free(seq_ids)

    def export_seq(self, seq_id: int):
        """The ``kv_migration.SeqSnapshot`` of a sequence: counters, parameters and prompt key (no K/V:
        the simulated device holds none). Raises ``SchedulerError`` for one it does not hold."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise SchedulerError(f"seq {seq_id}: not on this worker")
        key = seq.sampling.key.to_bytes(8, "little")
        params = seq.sampling.params
        return SeqSnapshot(
            seq_id,
            seq.num_computed,
            seq.last_token,
            seq.prompt_len,
            [],
            [],
            params,
            "",
            runner_state=key,
            lora=seq.lora,
        )

    def import_seq(self, snap, block_ids: list[int]) -> None:
        """Take a sequence moved from another worker into ``block_ids``."""
        state = SimSeqState(snap.params, int.from_bytes(snap.runner_state, "little"))
        self.seq_table.adopt(
            snap.seq_id,
            WorkerSeq(
                snap.num_computed, snap.last_token, state, snap.prompt_len, list(block_ids), lora=snap.lora
            ),
        )

    def pass_seconds(self, plan: StepPlan) -> float:
        """Modelled seconds of ``plan`` on this worker (slowdown included); 0 for an empty plan."""
        return self.model.plan_seconds(plan) * self.slowdown if plan.chunks else 0.0

    def step(self, plan: StepPlan) -> StepResult:
        """Run ``plan``'s passes (``multi_pass_run.run_passes``; one unless ``plan.num_passes > 1``)."""
        return run_passes(self, plan, self.step_pass)

    def step_pass(self, plan: StepPlan) -> StepResult:
        """Free, check and account the plan like ``ModelRunner.step_pass``, wait the modelled time, sample."""
        t0 = time.perf_counter()
        self.seq_table.free(plan.free_seq_ids)
        sampling = []
        for c in plan.chunks:
            seq, tokens, _ = self.seq_table.admit(c)
            if c.prefix_token_ids:  # a cached prefix: its prompt tokens key the output all the same
                seq.sampling.key = prompt_key(c.prefix_token_ids[: seq.prompt_len])
            prompt_part = tokens[: max(0, seq.prompt_len - c.start_pos)]
            if prompt_part:
                seq.sampling.key = prompt_key(prompt_part, seq.sampling.key)
            if c.sample:
                sampling.append(c)
        seconds = self.pass_seconds(plan)
        if seconds > 0:
            self._sleep(seconds)
        self.seq_table.computed(plan.chunks)
        tokens = []
        for c in sampling:
            state = self.seqs[c.seq_id].sampling
            tok = sim_token(state.key, c.start_pos + c.num_tokens)
            self.seq_table.sampled(c.seq_id, tok)
            asked = state.params.logprobs
            if asked is None:
                tokens.append(SampledToken(c.seq_id, tok))
            else:
                tokens.append(SampledToken(c.seq_id, tok, 0.0, [TokenLogprob(tok, 0.0)] if asked else []))
        return StepResult(plan.step_id, tokens, time.perf_counter() - t0)
