"""KV migration between workers: a running sequence's state and K/V blocks move, no recompute.

The scheduler asks the source worker (``Migrate``) to move sequences that have no plan in flight to a
destination worker, into blocks it reserved there. The source snapshots each sequence
(``SeqSnapshot``: its counters, token history, sampling state, and the K/V of its computed tokens,
layer by layer, in the cache's storage dtype) and streams it to the destination's ``ImportSeqs``
(``to_parts``: a state message, then one message per layer); the destination writes the K/V into the
reserved blocks and takes the sequence (``from_parts``, then the runner's ``import_seq``). When the
destination has acknowledged, the source drops its copy, and the scheduler re-points the sequence:
its next decode entry goes to the destination.

A runner that migrates offers ``export_seq(seq_id) -> SeqSnapshot`` and ``import_seq(snapshot,
block_ids)`` (``ModelRunner``, ``SimulatedRunner``). Bytes per sequence: ``2 x layers x
ceil(computed / block_size) x block_size x kv_heads x head_dim x dtype size``
(``benchmarks/migration.py`` measures the transfer).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fuseserve.errors import SchedulerError
from fuseserve.proto import convert
from fuseserve.proto import worker_pb2 as pb
from fuseserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch is imported where K/V is handled: a simulated worker runs without it
    import torch


@dataclass
class SeqSnapshot:
    """One sequence as a worker holds it, ready to move.

    layers: per layer ``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]`` in
        ``kv_dtype`` (the blocks of its computed tokens after the ``num_shared`` first, in table
        order); empty for a runner without K/V.
    num_shared: leading blocks left out: the destination holds their K/V already (prefix cache).
    A seeded request needs no generator state: the sampler seeds its noise per output position.
    runner_state: runner-specific bytes (the simulated runner's prompt key).
    lora: the LoRA adapter it runs with (None: the base model).
    """

    seq_id: int
    num_computed: int
    last_token: int | None  # None: part-way through its prompt, nothing sampled yet
    prompt_len: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    kv_dtype: str
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    runner_state: bytes = b""
    lora: str | None = None
    num_shared: int = 0

    def share_leading(self, num_blocks: int) -> None:
        """Leave out the first ``num_blocks`` blocks' K/V (the destination holds them)."""
        self.layers = [(k[num_blocks:], v[num_blocks:]) for k, v in self.layers]
        self.num_shared = num_blocks

    @property
    def num_bytes(self) -> int:
        """K/V bytes (what crosses the wire besides the small state)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import torch

    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def _tensor_from(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    import torch

    if not data:  # every block shared: nothing sent (frombuffer refuses an empty buffer)
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def to_parts(snap: SeqSnapshot, block_ids: list[int], fence: int) -> Iterator[pb.KVPart]:
    """The ``ImportSeqs`` messages of one sequence: its state, then one message per layer (the last
    one marked ``last``; a sequence without K/V is its state message alone, marked ``last``)."""
    state = pb.SeqState(
        seq_id=snap.seq_id,
        num_computed=snap.num_computed,
        prompt_len=snap.prompt_len,
        prompt_token_ids=snap.prompt_token_ids,
        output_token_ids=snap.output_token_ids,
        params=convert.sampling_params_to_proto(snap.params),
        block_ids=block_ids,
        kv_dtype=snap.kv_dtype,
        runner_state=snap.runner_state,
        num_shared_blocks=snap.num_shared,
    )
    if snap.lora is not None:
        state.lora_name = snap.lora
    if snap.last_token is not None:
        state.last_token = snap.last_token
    yield pb.KVPart(fence=fence, state=state, seq_id=snap.seq_id, last=not snap.layers)
    for i, (k, v) in enumerate(snap.layers):
        last = i == len(snap.layers) - 1
        yield pb.KVPart(
            fence=fence, seq_id=snap.seq_id, layer=i, k=_tensor_bytes(k), v=_tensor_bytes(v), last=last
        )


def from_parts(
    parts: Iterable[pb.KVPart], layer_shape: tuple[int, ...] | None, dtype: torch.dtype | None
) -> Iterator[tuple[SeqSnapshot, list[int], int]]:
    """Read ``ImportSeqs`` messages back into ``(snapshot, destination block ids, fence)``, one per
    sequence, as each one's last message arrives. ``layer_shape``: ``(block_size, num_kv_heads,
    head_dim)`` of the destination's cache (None: a runner without K/V). Raises ``SchedulerError`` for
    messages out of order."""
    snap, block_ids = None, []
    for part in parts:
        if part.HasField("state"):
            st = part.state
            snap = SeqSnapshot(
                st.seq_id,
                st.num_computed,
                st.last_token if st.HasField("last_token") else None,
                st.prompt_len,
                list(st.prompt_token_ids),
                list(st.output_token_ids),
                convert.sampling_params_from_proto(st.params),
                st.kv_dtype,
                runner_state=bytes(st.runner_state),
                lora=st.lora_name if st.HasField("lora_name") else None,
                num_shared=st.num_shared_blocks,
            )
            block_ids = list(st.block_ids)
        elif snap is None or part.seq_id != snap.seq_id or part.layer != len(snap.layers):
            raise SchedulerError(f"KV migration: layer {part.layer} of seq {part.seq_id} out of order")
        else:
            num_blocks = -(-snap.num_computed // layer_shape[0]) - snap.num_shared  # the blocks sent
            shape = (num_blocks, *layer_shape)
            snap.layers.append((_tensor_from(part.k, dtype, shape), _tensor_from(part.v, dtype, shape)))
        if part.last:
            yield snap, block_ids, part.fence
            snap = None


def export_model_seq(runner, seq_id: int) -> SeqSnapshot:
    """``ModelRunner.export_seq``: the snapshot of ``seq_id`` (K/V of its computed tokens copied out of
    the cache), decoding or part-way through its prompt. Raises ``SchedulerError`` for an unknown
    sequence or one that asked for prompt logprobs (its scorer state does not move)."""
    import torch

    seq = runner.seqs.get(seq_id)
    if seq is None:
        raise SchedulerError(f"seq {seq_id}: not on this worker")
    st = seq.sampling
    if st.params.prompt_logprobs is not None:
        raise SchedulerError(f"seq {seq_id}: prompt logprobs do not migrate")
    kv = runner.kv_cache
    n = -(-seq.num_computed // kv.block_size)
    index = torch.tensor(seq.block_table[:n], dtype=torch.long, device=kv.k[0].device)
    layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in zip(kv.k, kv.v, strict=True)]
    return SeqSnapshot(
        seq_id,
        seq.num_computed,
        seq.last_token,
        seq.prompt_len,
        list(st.prompt_token_ids),
        list(st.output_token_ids),
        st.params,
        str(kv.dtype).removeprefix("torch."),
        layers,
        lora=seq.lora,
    )


def import_model_seq(runner, snap: SeqSnapshot, block_ids: list[int]) -> None:
    """``ModelRunner.import_seq``: write ``snap``'s K/V into ``block_ids`` of this runner's cache,
    after the ``snap.num_shared`` first (prefix-cache blocks of this cache holding it already), and
    take the sequence with all of them as its table (the scheduler reserved blocks for the rest of
    its prompt too). Raises ``SchedulerError`` when the K/V dtype, the layer count or the
    number of blocks does not match (nothing written then)."""
    import torch

    from fuseserve.worker.sampler import SeqSamplingState
    from fuseserve.worker.seq_table import WorkerSeq

    kv = runner.kv_cache
    if snap.kv_dtype != str(kv.dtype).removeprefix("torch.") or len(snap.layers) != len(kv.k):
        raise SchedulerError(
            f"seq {snap.seq_id}: {len(snap.layers)} layers of {snap.kv_dtype} K/V for a cache of "
            f"{len(kv.k)} layers of {kv.dtype}"
        )
    n = snap.num_shared + snap.layers[0][0].shape[0]
    if n * kv.block_size < snap.num_computed or len(block_ids) < n:
        raise SchedulerError(
            f"seq {snap.seq_id}: {n} blocks of K/V for {snap.num_computed} tokens, {len(block_ids)} to hold them"
        )
    if snap.lora is not None and (runner.lora is None or snap.lora not in runner.lora.adapters):
        raise SchedulerError(f"seq {snap.seq_id}: LoRA adapter {snap.lora!r} is not served here")
    index = torch.tensor(block_ids[snap.num_shared : n], dtype=torch.long, device=kv.k[0].device)
    for (k, v), (dk, dv) in zip(snap.layers, zip(kv.k, kv.v, strict=True), strict=True):
        dk.index_copy_(0, index, k.to(dk.device))
        dv.index_copy_(0, index, v.to(dv.device))
    st = SeqSamplingState.create(snap.params, snap.prompt_token_ids, runner.device)
    st.output_token_ids = list(snap.output_token_ids)
    seq = WorkerSeq(snap.num_computed, snap.last_token, st, snap.prompt_len, list(block_ids), lora=snap.lora)
    runner.seq_table.adopt(snap.seq_id, seq)


def cache_layout(runner) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    """``(block_size, num_kv_heads, head_dim)`` and the storage dtype of ``runner``'s K/V cache;
    ``(None, None)`` for a runner without one (simulated)."""
    kv = getattr(runner, "kv_cache", None)
    if kv is None:
        return None, None
    return tuple(kv.k[0].shape[1:]), kv.k[0].dtype
