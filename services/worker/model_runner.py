"""The worker's model runner: executes step plans (prepare → run → sample → postprocess).

It owns the model, the paged KV cache with the per-sequence block tables the scheduler fills (the
scheduler allocates the block ids, shared prefix blocks included), and per-sequence state (sampling state, last sampled token, tokens whose KV it holds). The same runner
serves the in-process pipeline and the gRPC worker (``docs/architecture.md``).
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from fuseserve.config import EngineConfig
from fuseserve.device import parse_dtype, parse_memory, resolve_device
from fuseserve.errors import InvalidRequestError, KVCacheTooSmallError
from fuseserve.kernels.kv_quant import kv_cache_dtype
from fuseserve.model_source import quantization_method
from fuseserve.structured import model_grammar_backend
from fuseserve.types import PromptLogprobs, SampledToken, SeqChunk, StepPlan, StepResult, TokenLogprob
from fuseserve.worker import compiled_forward, kv_migration, parallel, prepacked_linear, quantization
from fuseserve.worker.attention import AttentionBackend, ForwardContext, forward_context, get_backend
from fuseserve.worker.compiled_forward import CompiledForward
from fuseserve.worker.cuda_graphs import build_cuda_graphs
from fuseserve.worker.kv_cache import KVCache, bytes_per_block
from fuseserve.worker.latency_model import PROFILE_SIZES
from fuseserve.worker.layer_stack import LayerStack
from fuseserve.worker.loader import load_model
from fuseserve.worker.lora_manager import LoRAManager
from fuseserve.worker.multi_pass_run import run_passes
from fuseserve.worker.prompt_logprobs import PromptScorer, ScoreRows
from fuseserve.worker.ragged_batch import RaggedBatch
from fuseserve.worker.runner import WorkerInfo
from fuseserve.worker.sampler import Sampler, SeqSamplingState
from fuseserve.worker.seq_table import SeqTable, WorkerSeq

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 1 << 30  # 1 GiB
GPU_MEMORY_FRACTION = 0.85  # of the memory free after the weights load
DEFAULT_WARM_UP_TOKENS = 512  # largest pass compiled at start when no token budget is given


class ModelRunner:
    """Runs ragged forward passes of one model over a paged KV cache.

    Args:
        model_path: Hugging Face style directory (config.json + safetensors).
        hf_config: its ``transformers`` config.
        eos_token_ids: the model's EOS ids (generation config), checked over the full vocabulary.
        config: engine knobs (block_size, kv_cache_memory, device, dtype).
    Raises ``ModelLoadError`` / ``UnsupportedModelError`` on load, ``KVCacheTooSmallError`` when the KV
    memory cannot hold one block per layer.
    """

    def __init__(
        self,
        model_path,
        hf_config,
        eos_token_ids: list[int],
        config: EngineConfig | None = None,
        backend: AttentionBackend | None = None,
        progress: bool = True,
    ):
        self.config = config or EngineConfig()
        self.device = resolve_device(self.config.device)
        self.dtype = parse_dtype(self.config.dtype, self.device)
        self.hf_config = hf_config
        self.model = load_model(model_path, hf_config, self.device, self.dtype, progress=progress)
        quantization.keep_float_weights_bf16(self.model)  # a quantized model's bf16 embedding / LM head
        self._prepack()
        self.lora = self._load_adapters()
        self.block_size = self.config.block_size
        self.kv_dtype = kv_cache_dtype(self.config.kv_cache_dtype, self.dtype)  # the cache's storage
        self.backend = backend or get_backend(
            self.config.attention_backend,
            self.device,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_dtype,
        )
        self.kv_cache = self._allocate_kv_cache()
        self.compiled: CompiledForward | None = None
        self.compile_s = 0.0  # seconds the warm-up compilation took (0 without compilation)
        if compiled_forward.wanted(self.config.compile) and parallel.world()[1] == 1:
            self._compile(progress)
        self.graphs = build_cuda_graphs(self, progress)  # None off CUDA (and where graphs do not apply)
        self.layer_stack = self._layer_stack()
        num_blocks = self.kv_cache.num_blocks
        self.seq_table = SeqTable(
            num_blocks, self.block_size, lambda params: SeqSamplingState.create(params, [], self.device)
        )
        self.seqs: dict[int, WorkerSeq] = self.seq_table.seqs
        self.scorer = PromptScorer()  # prompt logprobs (scoring); see prompt_logprobs.py
        self._score_rows: list[ScoreRows] = []  # prepare → run_pass: rows to score this pass
        self._scored: list[PromptLogprobs] = []  # run_pass → step: prompt logprobs of this pass
        args = self.model.args
        self.vocab_size = args.vocab_size
        self.sampler = Sampler(
            eos_token_ids,
            self.vocab_size,
            lambda: model_grammar_backend(model_path, self.vocab_size, eos_token_ids),
        )
        self.info = WorkerInfo(
            self.block_size,
            num_blocks,
            args.max_position_embeddings,
            self.vocab_size,
            list(eos_token_ids),
            str(self.device),
            str(self.dtype).split(".")[-1],
            quantization_method(hf_config),
            str(self.kv_dtype).split(".")[-1],
            sorted(self.lora.adapters) if self.lora is not None else [],
        )

    def _prepack(self) -> None:
        """The CPU linears' weights packed for oneDNN (fp32, bf16 where native; ``FUSESERVE_PREPACK=0``
        off, one rank only), bf16 matmuls built for every pass size up to the token budget."""
        if parallel.world()[1] == 1 and os.environ.get("FUSESERVE_PREPACK", "1") != "0":
            max_rows = self.config.token_budget or max(PROFILE_SIZES)
            prepacked_linear.prepack(self.model, max_rows, self.config.max_num_seqs)

    def _load_adapters(self) -> LoRAManager | None:
        """The adapters of ``config.lora_modules`` wrapped around the model (``lora_manager.py``);
        None without any and without ``allow_runtime_lora``. Raises ``LoRAAdapterError`` for one that cannot be served."""
        c = self.config
        if not c.lora_modules and not c.allow_runtime_lora:
            return None
        return LoRAManager(self.model, c.lora_paths(), c.max_loras, c.max_lora_rank, self.dtype, self.device)

    def _compile(self, progress: bool) -> None:
        """Compile the forward (``compiled_forward``) and run its warm-up; a model the compiler cannot
        take whole (a data-dependent shape, say) is logged and runs eagerly. With LoRA adapters the
        forward runs eagerly (the compiled forward does not take them)."""
        if self.lora is not None:
            log.warning("LoRA adapters are served eagerly: the compiled forward does not take them")
            return
        budget = min(
            self.config.token_budget or DEFAULT_WARM_UP_TOKENS, self.model.args.max_position_embeddings
        )
        compiled = CompiledForward(self.model)
        try:
            self.compile_s = compiled.warm_up(self.backend, self.kv_cache, self.block_size, budget, progress)
        except Exception as e:  # noqa: BLE001 - any compiler failure: eager is always correct
            log.warning("torch.compile failed, the model runs eagerly: %s", str(e).splitlines()[0][:300])
            return
        self.compiled = compiled

    def _allocate_kv_cache(self) -> KVCache:
        """The paged KV cache of this rank's KV heads, as many blocks as ``_kv_memory_bytes`` holds;
        logs its size. Raises ``KVCacheTooSmallError`` when that memory holds no block."""
        args = self.model.args
        layers, head_dim = args.num_layers, args.head_dim
        kv_heads = parallel.kv_heads_per_rank(args.num_kv_heads)  # this rank's (all without TP)
        memory = self._kv_memory_bytes()
        num_blocks = KVCache.num_blocks_for(
            memory, layers, self.block_size, kv_heads, head_dim, self.kv_dtype
        )
        if num_blocks < 1:
            need = bytes_per_block(layers, self.block_size, kv_heads, head_dim, self.kv_dtype)
            raise KVCacheTooSmallError(
                f"kv_cache_memory={memory} bytes holds no block (one block needs {need})"
            )
        kv_cache = KVCache(
            layers, num_blocks, self.block_size, kv_heads, head_dim, self.kv_dtype, self.device
        )
        log.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB) on %s %s",
            num_blocks,
            self.block_size,
            memory / 2**20,
            self.device,
            str(self.kv_dtype).split(".")[-1],
        )
        return kv_cache

    def _kv_memory_bytes(self) -> int:
        if self.config.kv_cache_memory is not None:
            return parse_memory(self.config.kv_cache_memory)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * GPU_MEMORY_FRACTION)
        return DEFAULT_CPU_KV_MEMORY

    @property
    def num_free_blocks(self) -> int:
        return self.seq_table.num_free_blocks

    @property
    def num_lora_loads(self) -> int:
        """LoRA adapters written into an adapter slot so far (``LoRAManager.num_loads``; 0 without)."""
        return self.lora.num_loads if self.lora is not None else 0

    def take_lora_load_seconds(self) -> list[float]:
        """Seconds of each LoRA slot load since the last call (read and reset; ``LoRAManager``)."""
        return self.lora.take_load_seconds() if self.lora is not None else []

    def set_runtime_loras(self, paths: dict[str, str]) -> list[str]:
        """Serve the runtime LoRA adapters ``paths`` (name → path; ``LoRAManager.set_runtime``);
        returns the adapters served. Raises ``InvalidRequestError`` without ``allow_runtime_lora``."""
        if self.lora is None or not self.config.allow_runtime_lora:
            raise InvalidRequestError("runtime LoRA adapters need allow_runtime_lora", "allow_runtime_lora")
        return self.lora.set_runtime(paths)

    def _layer_stack(self) -> LayerStack | None:
        """Eager CPU passes: the decoder layers in one C++ call (layer_stack.py), where it applies."""
        if self.compiled is not None or self.device.type != "cpu":
            return None
        return LayerStack.build(self.model, self.backend, self.kv_cache, self.kv_dtype, self.lora)

    def use_backend(self, backend) -> None:
        """Run the next passes with ``backend`` (an ``AttentionBackend`` for this device: benchmarks swap
        them on one loaded model); the CPU layer stack is built again for it (None where it does not take
        that backend's metadata), and the CUDA graphs captured again."""
        self.backend = backend
        self.layer_stack = self._layer_stack()
        self.graphs = build_cuda_graphs(self, progress=False)  # captured again for this backend

    # ----- lifecycle -----
    def close(self) -> None:
        """Nothing to release: the KV pool is freed with the runner (``TensorParallelRunner.close``
        stops its ranks)."""

    def free(self, seq_ids: list[int]) -> None:
        """Drop sequences and return their blocks (unknown ids are ignored)."""
        self.seq_table.free(seq_ids)
        self.scorer.free(seq_ids)

    def export_seq(self, seq_id: int):
        """The ``kv_migration.SeqSnapshot`` of a decoding sequence (``kv_migration.export_model_seq``)."""
        return kv_migration.export_model_seq(self, seq_id)

    def import_seq(self, snap, block_ids: list[int]) -> None:
        """Take a sequence moved from another worker into ``block_ids`` (``kv_migration.import_model_seq``)."""
        kv_migration.import_model_seq(self, snap, block_ids)

    def step(self, plan: StepPlan) -> StepResult:
        """Run ``plan``'s passes (``multi_pass_run.run_passes``; one unless ``plan.num_passes > 1``)."""
        return run_passes(self, plan, self.step_pass)

    def step_pass(self, plan: StepPlan) -> StepResult:
        """Run one pass: free, prepare, run, sample, postprocess. Returns the sampled tokens in plan order."""
        t0 = time.perf_counter()
        logits, sampling_chunks = self.run_pass(plan)
        tokens: list[SampledToken] = []
        if sampling_chunks:
            states = [self.seqs[c.seq_id].sampling for c in sampling_chunks]
            with torch.inference_mode():  # the logits are inference tensors: processed in place
                out = self.sampler(logits, states, inplace=True)
            ids = out.token_ids.tolist()
            for i, c in enumerate(sampling_chunks):
                self.seq_table.sampled(c.seq_id, ids[i])
                self.seqs[c.seq_id].sampling.output_token_ids.append(ids[i])
                tops = out.top_logprobs[i] if out.top_logprobs else []
                tokens.append(
                    SampledToken(
                        c.seq_id,
                        ids[i],
                        out.logprobs[i] if out.logprobs else None,
                        [TokenLogprob(t.token_id, t.logprob) for t in tops],
                    )
                )
        scored, self._scored = self._scored, []
        return StepResult(plan.step_id, tokens, time.perf_counter() - t0, prompt_logprobs=scored)

    @torch.inference_mode()
    def run_pass(self, plan: StepPlan, all_logits: bool = False) -> tuple[torch.Tensor, list[SeqChunk]]:
        """Free, prepare and run one pass; returns logits ``[S', vocab]`` (the model's dtype) of the
        sampling chunks.

        ``all_logits=True`` (tests, scoring) returns fp32 logits ``[T, vocab]`` of every token instead.
        """
        self.free(plan.free_seq_ids)
        batch, sampling_chunks = self.prepare(plan)
        if all_logits:  # in plan order (a pass with adapters lays its tokens out adapter by adapter)
            rows = batch.plan_rows
            batch.logits_indices = (
                torch.arange(batch.num_tokens, device=self.device) if rows is None else rows
            )
        hidden, logits = self.forward_batch(batch)
        self.seq_table.computed(plan.chunks)
        return (logits.float() if all_logits else logits), sampling_chunks

    def forward_batch(self, batch: RaggedBatch, metadata=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over ``batch``: hidden states ``[T, hidden]`` and logits ``[S', vocab]`` (the model's
        dtype; the sampler widens them to fp32 where it needs to) of ``batch.logits_indices``; prompt
        logprobs of this pass go to ``self._scored``. ``metadata``: the attention backend's plan of
        ``batch``, built here when None and the pass runs eagerly (a replayed CUDA graph refills its own
        static plan: none is built for it)."""
        hidden = self.graphs.run(batch) if self.graphs is not None else None  # None: eager
        if hidden is None and metadata is None:
            metadata = self.backend.prepare(batch, self.block_size)
        ctx = ForwardContext(self.backend, metadata, self.kv_cache, lora=batch.lora)
        with forward_context(ctx):
            stack = self.layer_stack
            if hidden is None and self.compiled is not None:
                hidden = self.compiled(batch.input_ids, batch.positions, ctx)
            elif hidden is None and stack is not None and stack.accepts(batch):
                hidden = stack(batch.input_ids, batch.positions, metadata)
            elif hidden is None:
                hidden = self.model(batch.input_ids, batch.positions)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            self._scored = self.scorer.score(hidden, self.model.compute_logits, self._score_rows)
        return hidden, logits

    def prepare(self, plan: StepPlan) -> tuple[RaggedBatch, list[SeqChunk]]:
        """Build the flattened ragged batch; block tables grow by the ids the chunks carry.

        Raises what ``SeqTable.admit`` raises: ``SchedulerError`` for an inconsistent plan,
        ``InvalidBlockError`` for a block id outside the pool; ``InvalidRequestError`` for a LoRA
        adapter this worker does not serve (``LoRAManager.slot``).
        """
        admitted = [(c, *self.seq_table.admit(c)) for c in plan.chunks]
        slots = self._lora_slots([seq for _, seq, _, _ in admitted])
        order: list[int] = list(range(len(admitted)))
        if len(set(slots)) > 1:  # adapter by adapter: each slot's tokens contiguous (few, long segments)
            order.sort(key=slots.__getitem__)
        input_ids: list[int] = []
        starts, query_lens, context_lens, tables = [], [], [], []
        sampled: list[tuple[int, int, SeqChunk]] = []  # (plan index, logits row, chunk)
        self._score_rows = []
        for i in order:
            c, seq, tokens, table = admitted[i]
            if c.prefix_token_ids:  # a cached prefix: its tokens count for penalties all the same
                self._record_tokens(seq, 0, c.prefix_token_ids)
            self._record_tokens(seq, c.start_pos, tokens)
            top_n = seq.sampling.params.prompt_logprobs if seq.sampling is not None else None
            if top_n is not None:
                rows = self.scorer.rows(
                    c.seq_id, c.start_pos, c.num_tokens, seq.prompt_len, len(input_ids), tokens, top_n
                )
                if rows is not None:
                    self._score_rows.append(rows)
            input_ids.extend(tokens)
            starts.append(c.start_pos)
            query_lens.append(c.num_tokens)
            context_lens.append(c.start_pos + c.num_tokens)
            tables.append(table)
            if c.sample:
                sampled.append((i, len(input_ids) - 1, c))
        sampled.sort(key=lambda s: s[0])  # sampled tokens are returned in plan order
        logits_idx = [row for _, row, _ in sampled]
        batch = RaggedBatch.build(
            input_ids, starts, query_lens, context_lens, tables, logits_idx, self.block_size, self.device
        )
        if slots:
            batch.lora = self.lora.batch([slots[i] for i in order], query_lens)
            if order != sorted(order):
                offsets = [0, *itertools.accumulate(query_lens)]
                where = {chunk: k for k, chunk in enumerate(order)}
                batch.plan_rows = torch.cat(
                    [torch.arange(offsets[where[i]], offsets[where[i] + 1]) for i in range(len(order))]
                ).to(self.device)
        return batch, [c for _, _, c in sampled]

    def _lora_slots(self, seqs: list[WorkerSeq]) -> list[int]:
        """Each sequence's LoRA adapter slot (-1: the base model; ``LoRAManager.slot``); empty when
        the worker serves no adapter. Raises ``InvalidRequestError`` for an adapter it does not serve."""
        if self.lora is None:
            named = [s.lora for s in seqs if s.lora is not None]
            if named:
                raise InvalidRequestError(f"LoRA adapter {named[0]!r}: this worker serves none", "lora")
            return []
        return [self.lora.slot(s.lora, self._live_adapters) for s in seqs]

    def _live_adapters(self) -> set[str]:
        """The LoRA adapters of the sequences this worker holds."""
        return {s.lora for s in self.seqs.values() if s.lora is not None}

    @staticmethod
    def _record_tokens(seq: WorkerSeq, start_pos: int, tokens: list[int]) -> None:
        """Keep the token history for penalties: prompt part vs generated part (recompute included)."""
        st = seq.sampling
        known = len(st.prompt_token_ids) + len(st.output_token_ids)
        for pos, t in enumerate(tokens, start_pos):
            if pos < known:
                continue  # the decode input, already recorded when it was sampled
            (st.prompt_token_ids if pos < seq.prompt_len else st.output_token_ids).append(t)
