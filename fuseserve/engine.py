"""The in-process (non-persistent) mode: the engine core + a model runner in the calling process.

``fuseserve.pipeline(model)`` resolves and loads the model, sizes the KV cache, chooses the token
budget, and starts one engine thread that polls the ``EngineCore`` while requests exist; the runner
runs plans on a thread of its own, so with overlap the next plan is built while a pass runs. Any
number of threads may call the pipeline at once; their requests share forward passes. This module is
only the I/O around the core: caller threads hand requests in through a command list, and token
events go back through one queue per request.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import queue
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

from fuseserve.config import EngineConfig
from fuseserve.detokenizer import DetokenizeStream
from fuseserve.errors import ContextLengthExceededError, FuseServeError, InvalidRequestError
from fuseserve.model_source import resolve_model
from fuseserve.outputs import Response
from fuseserve.sampling_params import SamplingParams, check_text
from fuseserve.scheduler.engine_core import EngineCore
from fuseserve.scheduler.scheduler import TokenEvent
from fuseserve.scheduler.sequence import FinishReason, Sequence
from fuseserve.structured import grammar_backend
from fuseserve.worker.model_runner import ModelRunner
from fuseserve.worker.profiler import choose_token_budget

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class _Request:
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    detok: DetokenizeStream
    events: queue.Queue = field(default_factory=queue.Queue)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None

    def response(self) -> Response:
        return Response(
            self.detok.text,
            self.token_ids,
            len(self.prompt_ids),
            len(self.token_ids),
            self.finish_reason or "abort",
            self.logprobs,
            self.top_logprobs,
        )


class Pipeline:
    """Generate with one model in this process. See ``fuseserve.pipeline`` for the arguments."""

    def __init__(
        self,
        model: str,
        *,
        token_budget: int | None = None,
        max_num_seqs: int = 256,
        kv_cache_memory: int | str | None = None,
        policy: str = "splitfuse",
        block_size: int = 16,
        device: str | None = None,
        dtype: str | None = None,
        attention_backend: str = "auto",
        cache_dir: str | None = None,
        progress: bool = True,
        overlap: bool = True,
    ):
        self.config = EngineConfig(
            token_budget=token_budget,
            max_num_seqs=max_num_seqs,
            block_size=block_size,
            kv_cache_memory=kv_cache_memory,
            policy=policy,
            overlap=overlap,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
        )
        self.config.validate()
        self.source = resolve_model(model, cache_dir=cache_dir, progress=progress)
        self.tokenizer = self.source.load_tokenizer()
        self.eos_token_ids = self.source.eos_token_ids()
        self.runner = ModelRunner(
            self.source.path, self.source.config, self.eos_token_ids, self.config, progress=progress
        )
        info = self.runner.info
        self.token_budget = token_budget or choose_token_budget(self.runner, str(self.source.path), cache_dir)
        self.max_model_len = info.max_model_len
        self.core = EngineCore(self.config, self.eos_token_ids)
        self.core.add_worker(
            "local", self.runner, info.num_blocks, info.block_size, info.max_model_len, self.token_budget
        )
        self._ids = itertools.count()
        self._requests: dict[int, _Request] = {}
        self._commands: list[tuple[str, object]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._engine, name="fuseserve-engine", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def scheduler(self):
        """The engine core's ``Scheduler`` (read it; only the engine thread changes it)."""
        return self.core.scheduler

    # ----- public API -----
    def __call__(self, prompts: Prompt | list[Prompt], **kwargs) -> list[Response]:
        """Generate for each prompt (text or token ids); returns one ``Response`` per prompt, in order.

        Raises ``InvalidParameterError`` / ``InvalidRequestError`` (unknown keyword, bad value, empty
        prompt without BOS) and ``ContextLengthExceededError`` before anything runs.
        """
        batch = _as_batch(prompts)
        params = SamplingParams.from_kwargs(**kwargs).validate()
        ids = [self._encode(p, params) for p in batch]
        reqs = [self._submit(p, params) for p in ids]
        return [self._collect(r) for r in reqs]

    def stream(self, prompt: Prompt, **kwargs) -> Iterator[str]:
        """Yield text deltas as they are produced; joined, they equal the non-streamed text."""
        params = SamplingParams.from_kwargs(**kwargs).validate()
        return self._lazy_events(self._encode(prompt, params), params, with_tokens=False)

    def stream_tokens(self, prompt: Prompt, **kwargs) -> Iterator[tuple[int, str]]:
        """Yield ``(token_id, text_delta)`` for every generated token as the engine produces it.

        ``text_delta`` may be ``""`` (an incomplete UTF-8 character or text held back as a possible
        stop string; it arrives with a later token). Same keywords and errors as ``__call__``.
        """
        params = SamplingParams.from_kwargs(**kwargs).validate()
        return self._lazy_events(self._encode(prompt, params), params, with_tokens=True)

    def _lazy_events(self, ids: list[int], params: SamplingParams, with_tokens: bool):
        """Submit on the first ``next()``, so a stream dropped before iteration never runs."""
        req = self._submit(ids, params)
        for tok, delta in self._events(req):
            if with_tokens and tok is not None:
                yield tok, delta
            elif not with_tokens and delta:
                yield delta

    def chat(self, messages: list[dict], **kwargs) -> Response:
        """Apply the model's chat template (with the generation prompt) and generate one response."""
        return self(self.chat_prompt_ids(messages), **kwargs)[0]

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered by the tokenizer's chat template."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt", param="messages"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequestError(
                "messages must be a list of {'role': ..., 'content': ...} dicts", "messages"
            )
        for m in messages:
            if isinstance(m.get("content"), str):
                check_text(m["content"], "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # jinja errors on malformed messages
            raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def close(self) -> None:
        """Stop the engine thread (pending requests finish with ``abort``). Idempotent; also runs at exit."""
        _LIVE.discard(self)
        if not self._thread.is_alive():
            return
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=10)
        self.core.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- request side (caller threads) -----
    def _encode(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """Token ids of ``prompt``, checked to fit the context with ``params.max_new_tokens``."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            ids = self.tokenizer(prompt)["input_ids"]
        elif _is_ids(prompt):
            bad = [t for t in prompt if not 0 <= t < self.runner.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} outside [0, {self.runner.vocab_size})", param="prompt"
                )
            ids = list(prompt)
        else:
            raise InvalidRequestError("a prompt is a string or a list of token ids", param="prompt")
        if not ids:
            bos = self.tokenizer.bos_token_id
            if bos is None:
                raise InvalidRequestError("empty prompt and the model has no BOS token", param="prompt")
            ids = [bos]
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ContextLengthExceededError(len(ids), params.max_new_tokens, self.max_model_len)
        return ids

    def _submit(self, ids: list[int], params: SamplingParams) -> _Request:
        if self._closed:
            raise FuseServeError("pipeline is closed")
        if params.constrained:  # a grammar the library cannot compile is a 400 here, not a worker error
            grammar_backend(self.tokenizer, self.runner.vocab_size, self.eos_token_ids).check(params)
        req = _Request(
            next(self._ids),
            ids,
            params,
            DetokenizeStream(self.tokenizer, params.stop, params.include_stop_str_in_output),
        )
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
        if ev.error is not None:
            req.finish_reason = FinishReason.ABORT.value
            raise FuseServeError(f"generation failed: {ev.error}")
        delta = ""
        if ev.token is not None:
            req.token_ids.append(ev.token.token_id)
            if ev.token.logprob is not None:
                req.logprobs.append(ev.token.logprob)
                req.top_logprobs.append(ev.token.top_logprobs)
            if not ev.hidden:
                delta = req.detok.push([ev.token.token_id])
            if req.detok.stopped:
                req.finish_reason = FinishReason.STOP.value
                self._command("abort", req.seq_id)
                return delta
        if ev.finish_reason is not None:
            req.finish_reason = ev.finish_reason.value
            delta += req.detok.finish()
        return delta

    # ----- engine thread -----
    def _engine(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self.core.has_work and not self._closed:
                    self._cv.wait()
                commands, self._commands = self._commands, []
                closed = self._closed
            for kind, payload in commands:
                self._apply_command(kind, payload)
            if closed:
                break
            if not self.core.has_work:
                continue
            try:
                events = self.core.poll(timeout=1.0)  # returns early on a result or a command
            except Exception as e:  # an engine bug must not hang callers
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            if not self.core.workers:
                self._fail_all(FuseServeError("the model runner failed; see the log"))
            for ev in events:
                req = self._requests.get(ev.seq_id)
                if req is not None:
                    req.events.put(ev)
                    if ev.finish_reason is not None:
                        self._requests.pop(ev.seq_id, None)
        self._fail_all(FuseServeError("pipeline closed"), finish=True)

    def _apply_command(self, kind: str, payload) -> None:
        if kind == "add":
            req: _Request = payload
            try:
                self.core.add_request(Sequence(req.seq_id, req.prompt_ids, req.params))
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


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _as_batch(prompts) -> list[Prompt]:
    """``prompts`` as a list of prompts: a str, a list of token ids, or a list of those.

    Raises ``InvalidRequestError`` for anything else (None, numbers, dicts, nested lists).
    """
    if isinstance(prompts, str) or _is_ids(prompts):  # [] is an empty prompt: BOS
        return [prompts]
    if isinstance(prompts, list | tuple) and all(isinstance(p, str) or _is_ids(p) for p in prompts):
        return list(prompts)
    raise InvalidRequestError(
        f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}",
        param="prompt",
    )


_LIVE: weakref.WeakSet[Pipeline] = weakref.WeakSet()


@atexit.register
def _close_live_pipelines() -> None:
    """Stop engine threads before the interpreter tears torch down (a thread killed inside a torch op
    aborts the process)."""
    for pipe in list(_LIVE):
        pipe.close()


def pipeline(
    model: str = "smollm2-135m-instruct",
    *,
    token_budget: int | None = None,
    max_num_seqs: int = 256,
    kv_cache_memory: int | str | None = None,
    policy: str = "splitfuse",
    **kwargs,
) -> Pipeline:
    """Load ``model`` (alias, Hugging Face directory or .gguf file) for in-process generation.

    token_budget: tokens per forward pass; None → chosen by profiling this device (cached).
    max_num_seqs: sequences per pass. kv_cache_memory: bytes or "512MiB"/"2GiB" (default: 1 GiB
    on CPU, 85% of free GPU memory on CUDA). policy: "splitfuse", "prefill_first", "whole_prompt".
    Other keywords: block_size, device, dtype, attention_backend ("auto", "torch", "cpu", "triton",
    "flash-attn"), cache_dir, progress, overlap (build the next pass while the current one runs;
    default True).
    Raises ``ModelLoadError`` for a missing or corrupt model, ``InvalidParameterError`` for bad knobs.
    """
    return Pipeline(
        model,
        token_budget=token_budget,
        max_num_seqs=max_num_seqs,
        kv_cache_memory=kv_cache_memory,
        policy=policy,
        **kwargs,
    )
