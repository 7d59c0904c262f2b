"""Structured output: grammars compiled once per (tokenizer, spec), one matcher per sequence.

A request constrains its output with at most one of ``SamplingParams.json_schema``, ``regex``,
``choice`` or ``grammar`` (xgrammar EBNF; ``docs/structured_output.md``). The grammar library is
`xgrammar <https://xgrammar.mlc.ai>`_ (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"); ``benchmarks/README.md`` has the figures
it was chosen on over llguidance.

- :func:`grammar_backend` returns the process-wide :class:`GrammarBackend` of one tokenizer; its
  :meth:`GrammarBackend.compile` caches compiled grammars by spec, so a schema is compiled once.
- The front ends (pipeline, gateway) call :meth:`GrammarBackend.check` before a request enters the
  engine: a spec the library cannot compile is an ``InvalidRequestError`` (HTTP 400) saying why.
- The worker keeps a :class:`SeqMatcher` per constrained sequence, in its sampling state. The
  matcher's state is a function of the sequence's generated tokens only: before each mask fill it
  :meth:`~SeqMatcher.sync` s to them, so a recompute (preemption, worker loss), which rebuilds the
  token list from the plan, rebuilds the matcher too, and overlap scheduling (the worker feeds its
  own last sampled token) needs nothing special.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from typing import TYPE_CHECKING

from fuseserve.errors import InvalidRequestError

if TYPE_CHECKING:  # torch is imported by xgrammar, where a grammar is compiled: the gateway image has none
    import torch

    from fuseserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "regex", "choice", "grammar")
"""The ``SamplingParams`` fields that constrain the output (at most one per request)."""

_CACHE_SIZE = 256
"""Compiled grammars kept per tokenizer (least recently used dropped first)."""

_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+?:\d+: (Check failed: \(.*?\) is false: )?")


def grammar_spec(params: SamplingParams) -> tuple[str, str] | None:
    """``(kind, text)`` of the request's constraint, or None when unconstrained.

    ``choice`` becomes an EBNF alternation of JSON-quoted literals (exact strings, no quotes emitted).
    """
    if params.json_schema is not None:
        return "json_schema", params.json_schema
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


def _library_error(exc: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix, first line only."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGR_PREFIX.sub("", text)


class GrammarLibraryMissing(InvalidRequestError):
    """The grammar library (xgrammar, which needs torch) is not installed in this process."""


class GrammarBackend:
    """Compiles grammar specs for one tokenizer and caches them (thread-safe).

    tokenizer: a Hugging Face tokenizer. vocab_size: the model's vocabulary (logits width; may exceed
    the tokenizer's). stop_token_ids: ids that end a finished grammar (the model's EOS ids).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None):
        try:
            import xgrammar as xgr
        except ImportError as exc:  # the gateway image: xgrammar needs torch, which it does not ship
            raise GrammarLibraryMissing(
                f"structured output is not available in this process: the grammar library cannot be "
                f"imported ({exc}); serve it from an install with xgrammar (and torch)",
                param="response_format",
            ) from exc

        self.vocab_size = int(vocab_size)
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(stop_token_ids or []) or None
        )
        self.stop_token_ids = list(info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self._lock = threading.Lock()
        self.compile = functools.lru_cache(maxsize=_CACHE_SIZE)(self._compile)

    def _compile(self, kind: str, text: str):
        """Compiled grammar of ``(kind, text)`` (cached by :attr:`compile`).

        Raises:
            InvalidRequestError: the library cannot compile it, or it matches no string (no first
                token is allowed, as for the regex ``[^\\s\\S]``: every row masked, the sampler
                would take a banned token and the matcher give up); ``param`` is ``kind``.
        """
        import xgrammar as xgr

        with self._lock:  # xgrammar's compiler is not documented as thread-safe
            try:
                if kind == "json_schema":
                    compiled = self._compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "regex":
                    compiled = self._compiler.compile_regex(text)
                else:
                    compiled = self._compiler.compile_grammar(text)
            except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
                raise InvalidRequestError(
                    f"cannot compile {kind}: {_library_error(exc)}", param=kind
                ) from exc
        first = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(
            compiled, override_stop_tokens=self.stop_token_ids or None
        ).fill_next_token_bitmask(first)
        if not first.any():
            raise InvalidRequestError(
                f"the {kind} matches no string: no token can start the output", param=kind
            )
        return compiled

    def check(self, params: SamplingParams) -> None:
        """Compile the request's constraint now (cached), so a bad one fails before the engine.

        Raises:
            InvalidRequestError: naming the field and the library's reason.
        """
        spec = grammar_spec(params)
        if spec is not None:
            self.compile(*spec)

    def matcher(self, params: SamplingParams) -> SeqMatcher | None:
        """A fresh matcher for the request's constraint, or None when it has none."""
        spec = grammar_spec(params)
        return None if spec is None else SeqMatcher(self.compile(*spec), self)


_BACKENDS: dict[tuple, GrammarBackend] = {}
_BACKENDS_LOCK = threading.Lock()


def grammar_backend(tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None) -> GrammarBackend:
    """The process-wide backend of ``tokenizer`` (keyed by its ``name_or_path``, vocab and stop ids)."""
    key = (getattr(tokenizer, "name_or_path", id(tokenizer)), int(vocab_size), tuple(stop_token_ids or ()))
    with _BACKENDS_LOCK:
        backend = _BACKENDS.get(key)
        if backend is None:
            backend = _BACKENDS[key] = GrammarBackend(tokenizer, vocab_size, stop_token_ids)
        return backend


def model_grammar_backend(model_path, vocab_size: int, stop_token_ids: list[int]) -> GrammarBackend:
    """The backend of the tokenizer stored with a model in ``model_path`` (the worker's side).

    Raises ``ModelLoadError`` when the directory has no tokenizer files.
    """
    from transformers import AutoTokenizer

    from fuseserve.errors import ModelLoadError

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"structured output needs the tokenizer in {model_path}: {exc}") from exc
    return grammar_backend(tokenizer, vocab_size, stop_token_ids)


class SeqMatcher:
    """The grammar state of one sequence, advanced over its generated tokens.

    num_synced: generated tokens the matcher has seen. A token the grammar rejects (it cannot be
    sampled under the mask; a caller bypassing the mask could) disables the matcher with a warning
    instead of failing the step.
    """

    def __init__(self, compiled, backend: GrammarBackend):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=backend.stop_token_ids or None)
        self._stop_token_ids = backend.stop_token_ids
        self.num_synced = 0
        self.disabled = False

    def sync(self, output_token_ids: list[int]) -> None:
        """Advance over ``output_token_ids[num_synced:]``; replays from the start if the list shrank."""
        if len(output_token_ids) < self.num_synced:
            self._matcher.reset()
            self.num_synced = 0
            self.disabled = False
        for token in output_token_ids[self.num_synced :]:
            self.num_synced += 1
            if self.disabled or self._matcher.is_terminated():
                continue  # surplus tokens after the end (a stop learned one pass late) are dropped upstream
            if not self._matcher.accept_token(int(token)):
                log.warning("grammar rejected token %d; the sequence continues unconstrained", token)
                self.disabled = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token mask of the next position into ``bitmask[row]`` (int32 bit words).

        A finished grammar allows only its stop tokens; a disabled matcher allows everything.
        """
        if self.disabled:
            bitmask[row].fill_(-1)
        elif self._matcher.is_terminated():
            bitmask[row].zero_()
            for t in self._stop_token_ids:
                bitmask[row, t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammar_masks(
    logits: torch.Tensor, matchers: list[SeqMatcher | None], output_ids: list[list[int]], vocab_size: int
) -> None:
    """Set ``-inf`` in ``logits [S, W]`` (fp32, in place) where a row's grammar forbids the token.

    ``matchers[i]`` / ``output_ids[i]``: row i's matcher (None: unconstrained) and generated tokens.
    ``vocab_size``: the grammar backend's vocabulary; columns ``>= vocab_size`` (a padded lm_head)
    are banned in constrained rows. Only constrained rows are filled and masked; each matcher is
    synced to its tokens first.
    """
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(logits), vocab_size)
    for i in rows:
        matchers[i].sync(output_ids[i])
        matchers[i].fill(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=vocab_size, indices=rows)
    if logits.shape[1] > vocab_size:
        logits[rows, vocab_size:] = float("-inf")
