"""Engine configuration shared by the pipeline, the scheduler and the workers.

Sizes are in tokens unless named ``*_bytes``; memory strings accept ``"512MiB"``, ``"2GiB"``,
``"1.5GB"`` or a plain number of bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fuseserve.device import parse_memory
from fuseserve.errors import InvalidParameterError, InvalidRequestError
from fuseserve.options import option

DEFAULT_MODEL = "smollm2-135m-instruct"
"""The model of ``fuseserve.pipeline()``, ``fuseserve serve`` and every sub-command's ``--model``."""

POLICIES = ("splitfuse", "prefill_first", "whole_prompt")
"""Scheduling policies (``fuseserve.scheduler.policies``): Dynamic SplitFuse, vLLM v0's prefill-first,
Orca's whole-prompt."""

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flash-attn")
"""``auto``: flash-attn on SM80+ GPUs where it imports and fits, else Triton on CUDA; on CPU the C++
operator (``cpu``), else the PyTorch reference (``torch``)."""

QUANTIZATIONS = ("gguf",)
"""``--quantization``: ``gguf`` keeps a GGUF file's weights quantized (``fuseserve/gguf_quant.py``)
instead of dequantizing them to float32. A Hugging Face checkpoint's own ``quantization_config``
(GPTQ, AWQ, compressed-tensors) is always honoured and needs no flag."""

# KV cache storage: auto = the model's dtype; fp8 = e4m3 with per-tensor scales (kernels/kv_quant.py)
KV_CACHE_DTYPES = ("auto", "fp8")
MIGRATIONS = ("drain", "balance", "off")  # KV migration (services/scheduler/migration.py)
_ALL = ("generate", "serve", "scheduler", "worker")
_RUNNER = ("generate", "serve", "worker")  # the model runner's options
_PLANNER = ("generate", "serve", "scheduler")  # the scheduler's alone
_STACK = ("serve", "scheduler")


@dataclass
class EngineConfig:
    """Knobs of one engine (pipeline) or one scheduler + its workers: an option table
    (``fuseserve.options``): each field is a ``pipeline()`` keyword, and the flag of the sub-commands
    its ``commands`` name.

    token_budget: max tokens per forward pass (None → chosen by profiling the device).
    max_num_seqs: max sequences per pass.
    kv_cache_memory: bytes for K and V of all layers on one worker (None → a default by device).
    block_size: tokens per KV-cache block.
    policy: one of ``POLICIES``.
    device, dtype: where and in what precision the workers run (``resolve_device``, ``parse_dtype``).
    attention_backend: one of ``ATTENTION_BACKENDS`` (the workers' attention kernels).
    target_itl: inter-token latency to keep, seconds; with it (or ``target_prefill_rate``) each
        SplitFuse pass is sized from the measured latency curve (``fuseserve.scheduler.slo_budget``).
        None (and no prefill-rate target): the fixed ``token_budget``.
    target_prefill_rate: prompt tokens per second of TTFT allowance (TTFT target = prompt tokens /
        rate); waiting prompts run earliest deadline first. None: no TTFT deadlines.
    decode_passes: decode passes per plan when a worker's pass holds decodes only and nothing waits
        to be placed (multi-step scheduling, as vLLM v0's ``--num-scheduler-steps``; the worker
        feeds its own sampled tokens, ``services/worker/multi_pass_run.py``); None (default): per worker,
        ``multi_pass_plan.default_decode_passes`` (3 on a CPU, 1 on a GPU and in the pipeline).
    tensor_parallel_size: ranks (processes) one worker or pipeline splits the model over
        (``services/worker/tensor_parallel.py``).
    overlap: build and send each worker's next plan while its current pass runs (at most one plan
        queued per worker); False runs one plan at a time per worker.
    migration: "drain" moves a draining worker's decoding sequences to other workers with their K/V
        (``services/scheduler/migration.py``); "balance" does that and also moves sequences from a
        worker whose queue delay exceeds another's by ``balance_threshold`` seconds; "off" lets them
        finish where they run.
    balance_threshold: with ``migration="balance"``, the seconds by which one worker's expected time
        to finish its sequences (``placement.drain_seconds``) must exceed another's before sequences
        move from the first to the second.
    enable_prefix_caching: reuse the K/V of full blocks already computed for an equal prefix
        (``services/scheduler/block_accounting.py``); keyword ``prefix_caching``, flag
        ``--no-prefix-caching``.
    watermark_blocks: blocks kept free at admission (SplitFuse rule 2).
    max_preemptions: preemptions allowed per sequence before it may no longer be preempted.
    prefix_aware_placement: place a new sequence on the worker holding most of its prefix, among
        the workers whose load is near the least (``Scheduler.place``); False: by load only.
    compile: compile the model's forward with ``torch.compile`` (``services/worker/compiled_forward.py``);
        flag ``--compile``; off by default (not yet measured faster than eager on SmolLM2).
    cuda_graphs: on CUDA, capture the forward as CUDA graphs, one per token-count bucket, and replay
        them (``services/worker/cuda_graphs.py``); flag ``--no-cuda-graphs``; no effect on CPU.
    quantization: one of ``QUANTIZATIONS`` or None (a GGUF file dequantized to float32).
    kv_cache_dtype: one of ``KV_CACHE_DTYPES``; ``fp8``: 2x the blocks of bf16 in the same memory.
    lora_modules: LoRA adapters served, ``NAME=PATH`` entries (keyword: also a dict name → path);
        ``lora_paths()`` reads them (vLLM's ``--lora-modules``).
    max_loras: adapter slots per worker: distinct adapters among a worker's running sequences, hence
        per pass (the base model counts as none); vLLM's ``--max-loras``.
    max_lora_rank: the largest adapter rank served (slots are this wide); vLLM's ``--max-lora-rank``.
    lora_aware_placement: among the workers loaded near the least, place a LoRA request on one whose
        running sequences use its adapter (``WaitingQueue.place``: no adapter load); False: blind to
        residency (``benchmarks/lora_placement.py`` compares the two). Flag ``--no-lora-aware-placement``.
    allow_runtime_lora: adapters may be loaded and unloaded while serving (the gateway's
        ``/v1/load_lora_adapter``, ``pipeline.load_lora``); workers then wrap the model for adapters
        even without ``lora_modules``. One rank per worker (``tensor_parallel_size`` 1).
    """

    token_budget: int | None = option(
        None,
        "tokens per forward pass; default: chosen by profiling this device (cached)",
        commands=_ALL,
        help_for={"scheduler": "tokens per pass (default: each worker's own)"},
    )
    max_num_seqs: int = option(
        256,
        "sequences per forward pass (default: %(default)s)",
        commands=_ALL,
        help_for={"scheduler": "sequences per pass (default: %(default)s)"},
    )
    kv_cache_memory: int | str | None = option(
        None,
        "KV cache size, bytes or e.g. 512MiB, 2GiB (default: 1GiB on CPU, 85%% of free GPU memory)",
        commands=_RUNNER,
    )
    block_size: int = option(
        16,
        "tokens per KV-cache block (default: %(default)s)",
        commands=_ALL,
        help_for={"scheduler": "tokens per KV block (must match the workers)"},
    )
    policy: str = option(
        "splitfuse",
        "scheduling policy (default: %(default)s)",
        commands=_ALL,
        help_for={"scheduler": None},
        choices=POLICIES,
    )
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available)", commands=_RUNNER)
    dtype: str | None = option(
        None,
        "auto, float32, bfloat16, float16 (default: auto = bf16 on GPUs and on CPUs with "
        "AVX512-BF16/AMX, else float32); logits and sampling are fp32 whatever the dtype",
        commands=_RUNNER,
    )
    attention_backend: str = option(
        "auto",
        "attention kernels: flash-attn (SM80+ GPU), triton (GPU), torch (reference, the CPU path); "
        "auto picks the first that fits this device (default: %(default)s)",
        commands=_RUNNER,
        choices=ATTENTION_BACKENDS,
    )
    target_itl: float | None = option(
        None,
        "inter-token latency to keep: each SplitFuse pass is sized from the measured latency "
        "curve to stay within it (default: off, the fixed token budget)",
        commands=_PLANNER,
        metavar="SECONDS",
    )
    target_prefill_rate: float | None = option(
        None,
        "TTFT target = prompt tokens / this rate; prompts run earliest deadline first and "
        "passes grow (within --target-itl) as deadlines need (default: off)",
        commands=_PLANNER,
        metavar="TOKENS_PER_S",
    )
    decode_passes: int | None = option(
        None,
        "decode passes per plan when a worker's pass holds decodes only and no request waits: "
        "one round trip for K tokens per sequence (default: 3 for a worker on a CPU, 1 on a GPU "
        "and in the pipeline)",
        commands=_PLANNER,
        metavar="K",
    )
    tensor_parallel_size: int = option(
        1,
        "ranks (processes) per worker (default: %(default)s)",
        commands=("serve", "worker"),
        help_for={"worker": "ranks (processes) this worker runs as (default: %(default)s)"},
    )
    overlap: bool = option(
        True,
        "the scheduler sends a worker its next plan only after its current result (default: overlap)",
        commands=_STACK,
        help_for={
            "scheduler": "send a worker its next plan only after its current result (default: overlap)"
        },
    )
    migration: str = option(
        "drain",
        "KV migration: 'drain' moves a draining worker's decoding sequences, with their KV cache, to "
        "other workers instead of letting them finish there; 'balance' also moves sequences off a "
        "worker whose queue delay exceeds another's by --balance-threshold; 'off' (default: %(default)s)",
        commands=_STACK,
        choices=MIGRATIONS,
    )
    balance_threshold: float = option(
        1.0,
        "with --migration balance: seconds by which one worker's expected time to finish its "
        "sequences must exceed another's before sequences move (default: %(default)s)",
        commands=_STACK,
        type=float,
        metavar="SECONDS",
    )
    enable_prefix_caching: bool = option(
        True,
        "compute every prompt from its first token (default: reuse the KV of cached prefixes)",
        commands=_STACK,
        name="prefix_caching",
    )
    quantization: str | None = option(
        None,
        "gguf: serve a .gguf file from its quantized weights (repacked once, cached) instead of "
        "dequantizing them to float32; quantized Hugging Face checkpoints (GPTQ, AWQ, "
        "compressed-tensors) load quantized without it (default: none)",
        commands=("generate", "serve", "gateway", "worker"),
        help_for={"gateway": "gguf: resolve a .gguf model as the workers do (no float32 conversion)"},
        choices=QUANTIZATIONS,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage: auto (the model's dtype) or fp8 (e4m3, scale 1.0, dequantized inside "
        "attention: 2x the blocks of bf16 in the same memory) (default: %(default)s)",
        commands=_RUNNER,
        choices=KV_CACHE_DTYPES,
    )
    compile: bool = option(
        False,
        "compile the model's forward with torch.compile at start (cached across restarts, attention "
        "left as its own kernel); off by default until it is measured faster than eager on SmolLM2",
        commands=_RUNNER,
    )
    cuda_graphs: bool = option(
        True,
        "launch every kernel of each pass eagerly on CUDA (default: replay CUDA graphs captured at "
        "start per token-count bucket, Triton attention; no effect on CPU)",
        commands=_RUNNER,
    )
    lora_modules: list[str] | None = option(
        None,
        "LoRA adapters to serve, each NAME=PATH (a PEFT directory: adapter_config.json + "
        "adapter_model.safetensors); a request names one (pipeline: lora=NAME; the API: its model "
        "NAME) (default: none)",
        commands=(*_RUNNER, "gateway"),
        help_for={
            "gateway": "LoRA adapters served, NAME=PATH: a request whose model is NAME runs "
            "with that adapter (the gateway reads only the names)"
        },
        metavar="NAME=PATH",
    )
    max_loras: int = option(
        1,
        "distinct LoRA adapters per worker at once (its adapter slots; a pass holds at most this "
        "many, the base model counts as none) (default: %(default)s)",
        commands=_ALL,
    )
    max_lora_rank: int = option(
        16,
        "largest LoRA rank served; a higher one is refused (default: %(default)s)",
        commands=(*_RUNNER, "gateway"),
    )
    allow_runtime_lora: bool = option(
        False,
        "allow loading and unloading LoRA adapters at runtime: POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; off: they answer 404)",
        commands=("serve", "worker", "gateway"),
        help_for={"worker": "serve the adapters loaded at runtime (POST /v1/load_lora_adapter)"},
    )
    lora_aware_placement: bool = option(
        True,
        "place LoRA requests blind to where their adapter is resident (default: prefer a worker whose "
        "running sequences use the adapter)",
        commands=_STACK,
    )
    watermark_blocks: int = 1
    max_preemptions: int = 4
    prefix_aware_placement: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, dict):  # pipeline(lora_modules={"name": path})
            self.lora_modules = [f"{name}={path}" for name, path in self.lora_modules.items()]

    def lora_paths(self) -> dict[str, str]:
        """``lora_modules`` as adapter name → path. Raises ``InvalidParameterError`` for an entry
        that is not ``NAME=PATH`` or a name given twice."""
        paths: dict[str, str] = {}
        for entry in self.lora_modules or ():
            name, sep, path = str(entry).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise InvalidParameterError("lora_modules", entry, "NAME=PATH entries")
            if name.strip() in paths:
                raise InvalidParameterError("lora_modules", entry, "each adapter name once")
            paths[name.strip()] = path.strip()
        return paths

    def lora_for(self, lora: str | list[str | None] | None, n: int) -> list[str | None]:
        """The adapter of each of ``n`` prompts: ``lora`` for all, or one per prompt (None: the base
        model). Raises ``InvalidRequestError`` for a count that does not match or an adapter that
        ``lora_modules`` does not name."""
        loras = list(lora) if isinstance(lora, list | tuple) else [lora] * n
        if len(loras) != n:
            raise InvalidRequestError(f"lora: {len(loras)} adapters for {n} prompts", param="lora")
        known = list(self.lora_paths())
        for name in loras:
            if name is not None and name not in known:
                raise InvalidRequestError(
                    f"unknown LoRA adapter {name!r}; served: {known or 'none'} (lora_modules)", param="lora"
                )
        return loras

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` for an out-of-range field."""
        if self.token_budget is not None and self.token_budget < 1:
            raise InvalidParameterError("token_budget", self.token_budget, ">= 1 or None")
        if self.max_num_seqs < 1:
            raise InvalidParameterError("max_num_seqs", self.max_num_seqs, ">= 1")
        if self.block_size < 1:
            raise InvalidParameterError("block_size", self.block_size, ">= 1")
        if self.policy not in POLICIES:
            raise InvalidParameterError("policy", self.policy, ", ".join(POLICIES))
        if self.migration not in MIGRATIONS:
            raise InvalidParameterError("migration", self.migration, ", ".join(MIGRATIONS))
        if not self.balance_threshold >= 0:
            raise InvalidParameterError("balance_threshold", self.balance_threshold, "seconds >= 0")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidParameterError(
                "attention_backend", self.attention_backend, ", ".join(ATTENTION_BACKENDS)
            )
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InvalidParameterError("quantization", self.quantization, ", ".join(QUANTIZATIONS))
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidParameterError("kv_cache_dtype", self.kv_cache_dtype, ", ".join(KV_CACHE_DTYPES))
        if self.watermark_blocks < 0:
            raise InvalidParameterError("watermark_blocks", self.watermark_blocks, ">= 0")
        if self.max_preemptions < 0:
            raise InvalidParameterError("max_preemptions", self.max_preemptions, ">= 0")
        self.lora_paths()
        if self.allow_runtime_lora and self.tensor_parallel_size > 1:
            raise InvalidParameterError("allow_runtime_lora", True, "tensor_parallel_size 1")
        for name in ("decode_passes", "tensor_parallel_size", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if name == "decode_passes" and value is None:
                continue  # per worker: multi_pass_plan.default_decode_passes
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidParameterError(name, value, "an integer >= 1")
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        for name in ("target_itl", "target_prefill_rate"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise InvalidParameterError(name, value, "> 0 or None")


API_KEY_ENV = "FUSESERVE_API_KEY"
"""Environment variable holding the gateway's API key (keeps the key out of ``ps`` output)."""


def _limit(default: int | None, flag: str, status: int, help: str):
    """A field of ``RequestLimits``: its default, its flag (``serve`` and ``gateway``) and the HTTP
    status of a refusal."""
    shown = "none: the context length" if default is None else "%(default)s"
    return option(
        default,
        f"{help}; refused with {status} (default: {shown})",
        commands=("serve", "gateway"),
        flag=flag,
        metadata={"status": status},
    )


@dataclass
class RequestLimits:
    """What one request may cost at the gateway; each refusal is a 4xx naming the limit's flag.

    Sizes in bytes, lengths of stop strings in characters, the rest in tokens or counts. ``None``
    means no limit beyond the model's own (the context length for tokens). README "Limits" lists
    them; ``fuseserve gateway --help`` shows each flag with its default.
    """

    max_body_bytes: int = _limit(4 << 20, "--max-body-bytes", 413, "largest request body in bytes")
    max_prompt_tokens: int | None = _limit(
        None, "--max-prompt-tokens", 400, "tokens per prompt (a chat prompt after its template)"
    )
    max_n: int = _limit(16, "--max-n", 400, "choices per prompt (n)")
    max_stop: int = _limit(16, "--max-stop", 400, "stop strings per request")
    max_stop_chars: int = _limit(256, "--max-stop-chars", 400, "characters per stop string")
    max_output_tokens: int | None = _limit(
        None,
        "--max-output-tokens",
        400,
        "max_tokens a request may ask for, and the default when it asks none",
    )
    max_logprobs: int = _limit(20, "--max-logprobs", 400, "logprobs / top_logprobs alternatives per token")
    max_schema_bytes: int = _limit(
        64 << 10, "--max-schema-bytes", 400, "JSON size of response_format / tools / guided_* fields"
    )
    max_concurrent_per_key: int = _limit(
        256,
        "--max-concurrent-per-key",
        429,
        "requests in flight per API key (per client without keys); 0: none",
    )

    def validate(self) -> None:
        """Raise ``InvalidParameterError`` for a limit below its minimum (1; 0 for logprobs and concurrency)."""
        for f in fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in ("max_logprobs", "max_concurrent_per_key") else 1
            if value is not None and value < low:
                raise InvalidParameterError(f.name, value, f">= {low}")
