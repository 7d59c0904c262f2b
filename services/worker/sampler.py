"""Batched token sampling on the worker: logits ``[S, V]`` in, one token per row out.

Lifecycle position: schedule → prepare → run → **sample** → postprocess. The model runner hands
the logits of the rows that sample (one per sequence, aligned with ``states``); the sampler
returns token ids on the logits' device plus log-probabilities where requested.

Processing order (each step vectorised over the batch; fp32 throughout). Steps 1-3 and 5-8 are the
logit processors of ``fuseserve.worker.logits_processors``, which describes each:

1. **EOS ban** and **logit_bias**, then the **grammar mask** of constrained rows, applied here
   (``fuseserve/structured.py``: ``-inf`` where the row's matcher forbids a token; only constrained
   rows are filled and masked).
2. **Repetition penalty** over prompt + output tokens.
3. **Presence / frequency penalties** over output tokens only.
4. **Greedy rows** (temperature below 1e-5, or top_k 1) take the argmax here.
5. **Temperature**.
6. **top_k**.
7. **top_p**.
8. **min_p**.
9. **Sample** with the exponential race (Gumbel-max equivalent): ``argmax(probs / q)``,
   ``q ~ Exp(1)``. Rows with a seed draw ``q`` from their own generator, so a seeded request gets the
   same tokens whatever else is in the batch; unseeded rows share one batch draw.

Log-probabilities are ``log_softmax`` of the *raw* logits (before any of the above): the chosen
token's, plus the top-N when ``params.logprobs = N > 0``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fuseserve.kernels import cpu_fused
from fuseserve.sampling_params import SamplingParams
from fuseserve.structured import GrammarBackend, SeqMatcher, apply_grammar_masks
from fuseserve.types import TokenLogprob
from fuseserve.worker.logits_processors import apply_eos_ban, apply_logit_bias, apply_penalties, apply_warpers


@dataclass
class SeqSamplingState:
    """Sampling state of one running sequence, kept by the worker for the sequence's lifetime.

    params: the request's sampling parameters (already validated).
    prompt_token_ids: the prompt (used by the repetition penalty).
    output_token_ids: tokens generated so far; the worker appends each sampled token.
    generator: the request's own random generator when ``params.seed`` is set, else None.
    matcher: the grammar matcher of a constrained request (built by the sampler on first use; it
        follows ``output_token_ids``, so a recompute that rebuilds them rebuilds it), else None.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    matcher: SeqMatcher | None = None
    _prompt_tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(
        cls, params: SamplingParams, prompt_token_ids: list[int], device: torch.device | str = "cpu"
    ) -> SeqSamplingState:
        """New state with an empty output; seeds a generator on ``device`` when ``params.seed`` is set."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=torch.device(device))
            generator.manual_seed(params.seed)
        return cls(
            params=params, prompt_token_ids=list(prompt_token_ids), output_token_ids=[], generator=generator
        )

    def prompt_tensor(self, device: torch.device) -> torch.Tensor:
        """The prompt as an int64 tensor ``[prompt_len]`` on ``device`` (built once, cached)."""
        if self._prompt_tensor is None or self._prompt_tensor.device != device:
            self._prompt_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)
        return self._prompt_tensor


@dataclass
class SamplerOutput:
    """Result of one sampling call.

    token_ids: ``[S]`` int64 on the logits' device, one per row.
    logprobs: chosen token's log-probability per row (None where ``params.logprobs`` is None).
    top_logprobs: per row, the top-N alternatives, most likely first (empty unless logprobs >= 1).
    """

    token_ids: torch.Tensor
    logprobs: list[float | None]
    top_logprobs: list[list[TokenLogprob]]


def _exponential(states: list[SeqSamplingState], rows: list[int], vocab: int, device) -> torch.Tensor:
    """``q ~ Exp(1)`` of shape ``[len(rows), V]``: seeded rows from their own generator, others batched."""
    q = torch.empty((len(rows), vocab), dtype=torch.float32, device=device)
    unseeded = [j for j, i in enumerate(rows) if states[i].generator is None]
    if unseeded:
        draw = torch.empty((len(unseeded), vocab), dtype=torch.float32, device=device).exponential_()
        if len(unseeded) == len(rows):
            q = draw
        else:
            q[unseeded] = draw
    for j, i in enumerate(rows):  # per-row seeded generators: unavoidable loop
        gen = states[i].generator
        if gen is not None:
            # re-seed per output position: a recomputed (preempted) sequence draws the same noise
            gen.manual_seed((states[i].params.seed * 1_000_003 + len(states[i].output_token_ids)) % (1 << 63))
            q[j] = (
                torch.empty(vocab, dtype=torch.float32, device=gen.device)
                .exponential_(generator=gen)
                .to(device)
            )
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


# ---------------------------------------------------------------------------------------------- sampler
class Sampler:
    """Samples one token per row from ``[S, V]`` logits (see the module docstring for the order).

    eos_token_ids: the model's end-of-sequence ids (banned per ``min_new_tokens`` / ``ignore_eos``).
    vocab_size: number of ids the model can emit; the logits width must be at least this (it may
        be larger, e.g. padded lm_head; EOS ids are still checked over the full width).
    grammar_backend: returns the model's ``GrammarBackend``; called once, on the first constrained
        request (None: constrained requests raise ``ValueError``).
    """

    def __init__(
        self,
        eos_token_ids: list[int],
        vocab_size: int,
        grammar_backend: Callable[[], GrammarBackend] | None = None,
    ):
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.vocab_size = int(vocab_size)
        self._grammar_backend = grammar_backend
        self._grammars: GrammarBackend | None = None

    def __call__(
        self, logits: torch.Tensor, states: list[SeqSamplingState], inplace: bool = False
    ) -> SamplerOutput:
        """Sample ``[S]`` token ids from ``logits [S, V]`` (any float dtype), rows aligned with ``states``.

        ``inplace``: the caller gives up ``logits`` (the model runner's own fp32 logits), so the logit
        processors work on it directly instead of on a copy, unless a row asks for logprobs (which
        are taken from the raw logits).

        Raises:
            ValueError: the row count differs from ``len(states)`` or ``V < vocab_size``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling states")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits width {logits.shape[1]} is below vocab_size {self.vocab_size}")
        if inplace and all(_plain_greedy(st.params) for st in states):
            # The argmax is exact in the logits' own dtype (fp32 holds every bf16 / fp16 value) and the
            # EOS ban writes -inf, so no fp32 copy of [S, V]. On CPU the fused operator (cpu_fused.argmax:
            # [64, 49152] bf16 0.21 ms against 1.57 for max(dim).indices, 16 rows 0.05 against 0.34),
            # else max(dim).indices, not argmax: the same first index on ties, but torch's CPU argmax
            # over bf16 took 1.5 ms for [16, 49152] against 0.5 ms.
            apply_eos_ban(logits, states, self.eos_token_ids)
            fused = cpu_fused.usable(logits) and logits.stride(-1) == 1
            ids = cpu_fused.argmax(logits) if fused else logits.max(dim=-1).indices
            return SamplerOutput(ids, [None] * len(states), [[] for _ in states])
        raw = logits.to(torch.float32)
        needs_raw = any(st.params.logprobs is not None for st in states)
        ours = inplace or raw is not logits  # the caller's logits given up, or a conversion made here
        work = raw if ours and not needs_raw else raw.clone()
        apply_eos_ban(work, states, self.eos_token_ids)
        apply_logit_bias(work, states)
        self._apply_grammars(work, states)
        if all(st.params.greedy and not st.params.has_penalties for st in states):
            token_ids = work.argmax(dim=-1)  # fast path
        else:
            token_ids = self._sample(work, states)
        logprobs, top_logprobs = _logprobs(raw, token_ids, states)
        return SamplerOutput(token_ids, logprobs, top_logprobs)

    def _apply_grammars(self, work: torch.Tensor, states: list[SeqSamplingState]) -> None:
        """Build missing matchers of constrained rows, then mask ``work [S, V]`` in place."""
        if not any(st.params.constrained for st in states):
            return
        for st in states:
            if st.params.constrained and st.matcher is None:
                st.matcher = self._backend().matcher(st.params)
        apply_grammar_masks(
            work,
            [st.matcher for st in states],
            [st.output_token_ids for st in states],
            self._backend().vocab_size,
        )

    def _backend(self) -> GrammarBackend:
        if self._grammars is None:
            if self._grammar_backend is None:
                raise ValueError("a constrained request reached a sampler without a grammar backend")
            self._grammars = self._grammar_backend()
        return self._grammars

    @staticmethod
    def _sample(work: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        """Steps 2-9 on the EOS-banned fp32 logits ``[S, V]``; returns ``[S]`` int64 token ids."""
        work = apply_penalties(work, states)
        token_ids = work.argmax(dim=-1)
        sample_rows = [i for i, st in enumerate(states) if not st.params.greedy]
        if not sample_rows:
            return token_ids
        sub_states = [states[i] for i in sample_rows]
        sub = work if len(sample_rows) == len(states) else work[sample_rows]
        probs = apply_warpers(sub, sub_states).softmax(dim=-1)
        q = _exponential(states, sample_rows, probs.shape[1], probs.device)
        sampled = (probs / q).argmax(dim=-1)
        if len(sample_rows) == len(states):
            return sampled
        token_ids[torch.tensor(sample_rows, dtype=torch.long, device=token_ids.device)] = sampled
        return token_ids


def _plain_greedy(p: SamplingParams) -> bool:
    """True when a row's token is the argmax of its logits after the EOS ban alone."""
    return p.greedy and not p.has_penalties and not p.logit_bias and not p.constrained and p.logprobs is None


def _logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, states: list[SeqSamplingState]
) -> tuple[list[float | None], list[list[TokenLogprob]]]:
    """Chosen-token and top-N log-probabilities from the raw fp32 logits ``[S, V]`` (natural log)."""
    chosen: list[float | None] = [None] * len(states)
    tops: list[list[TokenLogprob]] = [[] for _ in states]
    rows = [i for i, st in enumerate(states) if st.params.logprobs is not None]
    if not rows:
        return chosen, tops
    idx = torch.tensor(rows, dtype=torch.long, device=raw.device)
    lp = torch.log_softmax(raw[idx], dim=-1)
    chosen_lp = lp.gather(1, token_ids[idx].unsqueeze(1)).squeeze(1).tolist()
    for i, v in zip(rows, chosen_lp, strict=True):
        chosen[i] = v
    n_max = max(states[i].params.logprobs for i in rows)
    if n_max > 0:
        top_v, top_i = lp.topk(min(n_max, lp.shape[1]), dim=-1)
        for j, (vals, ids) in enumerate(zip(top_v.tolist(), top_i.tolist(), strict=True)):
            n = states[rows[j]].params.logprobs
            tops[rows[j]] = [TokenLogprob(t, v) for t, v in zip(ids[:n], vals[:n], strict=True)]
    return chosen, tops
