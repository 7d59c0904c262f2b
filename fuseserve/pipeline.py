"""The in-process (non-persistent) mode: the engine core + a model runner in the calling process.

``fuseserve.pipeline(model)`` resolves and loads the model, sizes the KV cache, chooses the token
budget, and starts one engine thread that polls the ``EngineCore`` while requests exist; the runner
runs plans on a thread of its own, so with overlap the next plan is built while a pass runs. Any
number of threads may call the pipeline at once; their requests share forward passes. This module is
only the I/O around the core: caller threads hand requests in through a command list, and token
events go back through one queue per request.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import sys
import threading
import types
from collections.abc import Iterator

from fuseserve import exit_hook, pipeline_lora
from fuseserve.config import DEFAULT_MODEL, EngineConfig
from fuseserve.errors import FuseServeError
from fuseserve.frontend import Delta, OutputState, PromptEncoder, as_batch
from fuseserve.frontend.model_info import (
    context_length,
    generation_defaults,
    load_tokenizer,
    read_chat_template,
)
from fuseserve.model_source import resolve_model
from fuseserve.options import from_keywords
from fuseserve.outputs import Response
from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler import engine_loop
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.sequence import Sequence
from fuseserve.scheduler.slo_budget import curve_prior
from fuseserve.structured import grammar_backend
from fuseserve.types import FinishReason, TokenEvent
from fuseserve.worker.profiler import knee, profile_curve
from fuseserve.worker.tensor_parallel import load_runner

log = logging.getLogger(__name__)

Prompt = str | list[int]


class _Request(OutputState):
    """One prompt in flight: its output state, its engine ``seq_id`` and its event queue."""

    def __init__(
        self, seq_id: int, prompt_ids: list[int], params: SamplingParams, tokenizer, lora: str | None = None
    ):
        super().__init__(prompt_ids, params, tokenizer)
        self.seq_id = seq_id
        self.lora = lora  # the LoRA adapter it runs with (None: the base model)
        self.events: queue.Queue = queue.Queue()

    def response(self) -> Response:
        return Response(
            self.text,
            self.token_ids,
            len(self.prompt_ids),
            len(self.token_ids),
            self.finish_reason or "abort",
            self.logprobs,
            self.top_logprobs,
            self.prompt_logprobs,
            self.cached_tokens,
        )


class Pipeline:
    """Generate with one model in this process. See ``fuseserve.pipeline`` for the arguments."""

    def __init__(
        self,
        model: str,
        *,
        cache_dir: str | None = None,
        progress: bool = True,
        tokenizer: str | None = None,
        chat_template: str | None = None,
        max_model_len: int | None = None,
        **engine,
    ):
        self.config = from_keywords(EngineConfig, engine, "pipeline keyword")  # EngineConfig's options
        self.config.validate()
        self.source = resolve_model(
            model, cache_dir=cache_dir, progress=progress, quantization=self.config.quantization
        )
        context = context_length(self.source.config, max_model_len)  # raises before anything loads
        self.tokenizer = load_tokenizer(self.source, tokenizer)
        self.eos_token_ids = self.source.eos_token_ids()
        tp = self.config.tensor_parallel_size
        self.runner = load_runner(  # with tensor_parallel_size > 1: ranks 1.. in processes of their own
            self.source.path,
            self.source.config,
            self.eos_token_ids,
            self.config,
            tp,
            threads=max(1, (os.cpu_count() or 1) // tp) if tp > 1 else None,
            progress=progress,
            exit_on_loss=False,  # a lost rank fails the requests, not the caller's process
        )
        self.token_budget, latency_prior = self._token_budget(cache_dir)
        info = self.runner.info
        self.max_model_len = min(info.max_model_len, context)
        self.encoder = PromptEncoder(
            self.tokenizer, self.runner.vocab_size, self.max_model_len, read_chat_template(chat_template)
        )
        self.defaults = generation_defaults(self.source.path)
        self.core = EngineCore(self.config, self.eos_token_ids)
        self.core.scheduler.model_id = self.source.name
        self.core.add_worker(
            "local",
            self.runner,
            info.num_blocks,
            info.block_size,
            info.max_model_len,
            self.token_budget,
            latency_prior=latency_prior,
        )
        self._ids = itertools.count()
        self.runtime_loras: dict[str, str] = {}  # adapters of load_lora, name → path
        self._requests: dict[int, _Request] = {}
        self._commands: list[tuple[str, object]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._engine, name="fuseserve-engine", daemon=True)
        self._thread.start()
        exit_hook.LIVE.add(self)

    def _token_budget(self, cache_dir: str | None) -> tuple[int, object]:
        """The token budget (the given one, else the knee of this device's profiled latency curve,
        cached) and, with latency targets, the latency prior from the same profile (else None)."""
        config = self.config
        slo = config.target_itl is not None or config.target_prefill_rate is not None
        curve = None
        if config.token_budget is None or slo:
            curve = self.runner.on_thread(profile_curve, self.runner, str(self.source.path), cache_dir)
        return config.token_budget or knee(curve), curve_prior(curve) if slo else None

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def scheduler(self):
        """The engine core's ``Scheduler`` (read it; only the engine thread changes it)."""
        return self.core.scheduler

    # ----- public API -----
    def __call__(
        self, prompts: Prompt | list[Prompt], lora: str | list[str | None] | None = None, **kwargs
    ) -> list[Response]:
        """Generate for each prompt (text or token ids); returns one ``Response`` per prompt, in order.

        ``lora``: the LoRA adapter (a name of ``lora_modules``) every prompt runs with, or one per
        prompt (None: the base model); prompts of different adapters share forward passes.
        Raises ``InvalidParameterError`` / ``InvalidRequestError`` (unknown keyword, bad value, empty
        prompt, unknown adapter) and ``ContextLengthExceededError`` before anything runs.
        """
        params = self._params(kwargs)
        batch = as_batch(prompts)
        loras = self.config.lora_for(lora, len(batch))
        ids = [self._encode(p, params) for p in batch]
        reqs = [self._submit(p, params, a) for p, a in zip(ids, loras, strict=True)]
        return [self._collect(r) for r in reqs]

    def stream(self, prompt: Prompt, lora: str | None = None, **kwargs) -> Iterator[str]:
        """Yield text deltas as they are produced; joined, they equal the non-streamed text."""
        return self._lazy_events(prompt, kwargs, lora, with_tokens=False)

    def stream_tokens(self, prompt: Prompt, lora: str | None = None, **kwargs) -> Iterator[tuple[int, str]]:
        """Yield ``(token_id, text_delta)`` for every generated token as the engine produces it.

        ``text_delta`` may be ``""`` (an incomplete UTF-8 character or text held back as a possible
        stop string; it arrives with a later token). Same keywords and errors as ``__call__``.
        """
        return self._lazy_events(prompt, kwargs, lora, with_tokens=True)

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters this pipeline serves (``lora_modules``' names)."""
        return list(self.config.lora_paths())

    def load_lora(self, name: str, path: str) -> None:
        """Serve a PEFT LoRA adapter from now on (``allow_runtime_lora``; ``pipeline_lora.load_lora``)."""
        pipeline_lora.load_lora(self, name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving an adapter of ``load_lora`` (``pipeline_lora.unload_lora``)."""
        pipeline_lora.unload_lora(self, name)

    def loras_in_flight(self) -> set[str]:
        """The LoRA adapters of the requests not finished yet (added, or waiting to be)."""
        with self._cv:
            reqs = [*self._requests.values(), *(p for k, p in self._commands if k == "add")]
        return {r.lora for r in reqs if r.lora is not None}

    def _params(self, kwargs: dict) -> SamplingParams:
        """Validated params: ``kwargs`` over the model's ``generation_config.json`` defaults."""
        return SamplingParams.from_kwargs(**{**self.defaults, **kwargs})

    def _lazy_events(self, prompt: Prompt, kwargs: dict, lora: str | None, with_tokens: bool):
        """Check now (raises as ``__call__``); submit on the first ``next()``, so a stream dropped
        before iteration never runs."""
        params = self._params(kwargs)
        (lora,) = self.config.lora_for(lora, 1)
        return self._stream_events(self._encode(prompt, params), params, lora, with_tokens)

    def _stream_events(self, ids: list[int], params: SamplingParams, lora: str | None, with_tokens: bool):
        req = self._submit(ids, params, lora)
        for tok, delta in self._events(req):
            if with_tokens and tok is not None:
                yield tok, delta
            elif not with_tokens and delta:
                yield delta

    def chat(self, messages: list[dict], **kwargs) -> Response:
        """Apply the model's chat template (with the generation prompt) and generate one response
        (``lora`` and the other keywords as ``__call__``'s)."""
        return self(self.chat_prompt_ids(messages), **kwargs)[0]

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template (``PromptEncoder.chat``)."""
        return self.encoder.chat(messages)

    def close(self) -> None:
        """Stop the engine thread (pending requests finish with ``abort``). Idempotent; also runs at exit."""
        exit_hook.LIVE.discard(self)
        if not self._thread.is_alive():
            return
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.core.close()
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- request side (caller threads) -----
    def _encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Token ids of ``prompt``, checked to fit the context with ``params.max_new_tokens``."""
        ids = self.encoder.encode(prompt)
        self.encoder.check_context(len(ids), params.max_new_tokens)
        return ids

    def _submit(self, ids: list[int], params: SamplingParams, lora: str | None = None) -> _Request:
        if self._closed:
            raise FuseServeError("pipeline is closed")
        if params.constrained:  # a grammar the library cannot compile is a 400 here, not a worker error
            grammar_backend(self.tokenizer, self.runner.vocab_size, self.eos_token_ids).check(params)
        req = _Request(next(self._ids), ids, params, self.tokenizer, lora)
        self._command("add", req)
        return req

    def _command(self, kind: str, payload: object) -> None:
        with self._cv:
            self._commands.append((kind, payload))
            self._cv.notify()
        self.core.wakeup()

    def _collect(self, req: _Request) -> Response:
        for _ in self._events(req):
            pass
        return req.response()

    def _events(self, req: _Request) -> Iterator[tuple[int | None, str]]:
        """``(token_id, text_delta)`` per engine event until the request finishes; aborts on early exit."""
        try:
            while req.finish_reason is None:
                ev = req.events.get()
                if isinstance(ev, BaseException):
                    raise ev
                delta = self._apply(req, ev)
                yield (ev.token.token_id if ev.token is not None else None), delta
        finally:
            if req.finish_reason is None:  # the consumer stopped early
                req.finish_reason = FinishReason.ABORT.value
                self._command("abort", req.seq_id)

    def _apply(self, req: _Request, ev: TokenEvent) -> str:
        """Apply one engine event to ``req`` (``OutputState.apply``); returns the text delta."""
        if ev.error is not None:
            req.finish_reason = FinishReason.ABORT.value
            raise FuseServeError(f"generation failed: {ev.error}")
        delta = Delta()
        req.apply(ev, delta)
        if req.stop_matched:
            self._command("abort", req.seq_id)
        return delta.text

    # ----- engine thread: the engine loop (``engine_loop.run_once``) with this pipeline as its port -----
    record_cpu = True  # the core measures its own CPU per worker-step

    def _engine(self) -> None:
        while not self._closed:
            try:
                engine_loop.run_once(self.core, self)
            except Exception as e:  # an engine bug must not hang callers
                log.exception("engine step failed")
                self._fail_all(e)
        self._take_commands()  # what came with the close: requests added then finish with abort
        self._fail_all(FuseServeError("pipeline closed"), finish=True)

    def receive(self) -> float:
        """Apply the callers' commands (add, abort); fail every request once no runner is left."""
        self._take_commands()
        if self._requests and not self.core.workers:
            self._fail_all(FuseServeError("the model runner failed; see the log"))
        return 1.0  # a poll's longest wait: a result or a command ends it sooner

    def send(self, events: list[TokenEvent]) -> None:
        """Hand each event to its request's queue (read by the caller's thread)."""
        for ev in events:
            req = self._requests.get(ev.seq_id)
            if req is not None:
                req.events.put(ev)
                if ev.finish_reason is not None:
                    self._requests.pop(ev.seq_id, None)

    def idle(self, timeout: float) -> None:
        """Wait for a command, the close, or work to run."""
        with self._cv:
            self._cv.wait_for(lambda: self._commands or self._closed or self.core.has_work, timeout)

    def _take_commands(self) -> None:
        with self._cv:
            commands, self._commands = self._commands, []
        for kind, payload in commands:
            self._apply_command(kind, payload)

    def _apply_command(self, kind: str, payload) -> None:
        if kind == "add":
            req: _Request = payload
            try:
                self.core.add_request(Sequence(req.seq_id, req.prompt_ids, req.params, lora=req.lora))
                self._requests[req.seq_id] = req
            except FuseServeError as e:
                req.events.put(e)
        elif kind == "abort":
            self.core.abort(payload)
            self._requests.pop(payload, None)

    def _fail_all(self, error: Exception, finish: bool = False) -> None:
        for sid, req in list(self._requests.items()):
            self.core.abort(sid)
            req.events.put(TokenEvent(sid, None, FinishReason.ABORT) if finish else error)
        self._requests.clear()


def pipeline(model: str = DEFAULT_MODEL, **kwargs) -> Pipeline:
    """Load ``model`` (alias, Hugging Face directory or .gguf file) for in-process generation.

    Engine keywords: every ``fuseserve.config.EngineConfig`` option by its name (its docstring says
    what each does; ``fuseserve generate``'s flags are these), e.g. token_budget (None: profiled on
    this device, cached), kv_cache_memory ("512MiB"), dtype, target_itl / target_prefill_rate
    (``docs/architecture.md``, "SLO-driven token budget"), tensor_parallel_size, lora_modules
    (``{"name": path}`` of PEFT directories; a call picks one with ``lora=``), max_loras. Front end:
    tokenizer (a tokenizer directory replacing the model's; without any tokenizer only token-id
    prompts work), chat_template (a Jinja file replacing the model's), max_model_len (context length
    in tokens, at most the model's). cache_dir: where converted models and profiles are cached; progress: show
    loading progress. Sampling defaults come from the model's ``generation_config.json``
    (temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens). Raises
    ``ModelLoadError`` for a missing or corrupt model, ``InvalidParameterError`` for bad knobs and
    ``TypeError`` for an unknown keyword.
    """
    return Pipeline(model, **kwargs)


class _CallableModule(types.ModuleType):
    """``fuseserve.pipeline`` is both this module and the function above: importing the submodule
    binds the package attribute to the module, so the module calls through to the function."""

    def __call__(self, *args, **kwargs) -> Pipeline:
        return pipeline(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
