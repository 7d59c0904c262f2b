"""Batched token sampling on the worker: logits ``[S, V]`` in, one token per row out.

Lifecycle position: schedule → prepare → run → **sample** → postprocess. The model runner hands
the logits of the rows that sample (one per sequence, aligned with ``states``); the sampler
returns token ids on the logits' device plus log-probabilities where requested.

Processing order (each step vectorised over the batch; fp32 throughout):

1. **EOS ban**: the EOS ids and the row's ``stop_token_ids`` get ``-inf`` while
   ``len(output) < min_new_tokens``; with ``ignore_eos`` the EOS ids are banned always. Ids are
   checked against the full logits width (it may exceed the tokenizer's vocab).
   Then **logit_bias** (OpenAI: added to the named tokens' logits) and the **grammar mask** of
   constrained rows (``fuseserve/structured.py``: ``-inf`` where the row's matcher forbids a token;
   only constrained rows are filled and masked).
2. **Repetition penalty** (``transformers`` / CTRL semantics, Keskar et al. 2019) over prompt +
   output tokens: a positive logit is divided by the penalty, a negative one multiplied.
3. **Presence / frequency penalties** (OpenAI semantics) over output tokens only:
   ``logit -= presence * (count > 0) + frequency * count``.
4. **Greedy rows** (temperature below 1e-5, or top_k 1) take the argmax here.
5. **Temperature**: ``logit / temperature``.
6. **top_k**: keep tokens whose logit is >= the k-th largest (ties kept, as ``transformers``).
7. **top_p**: sort ascending once, drop tokens whose ascending cumulative probability is
   ``<= 1 - top_p`` (always keeping the most likely token), as ``transformers``' TopPLogitsWarper.
8. **min_p**: drop tokens with probability ``< min_p * max_prob``.
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

from fuseserve.sampling_params import SamplingParams
from fuseserve.structured import GrammarBackend, SeqMatcher, apply_grammar_masks
from fuseserve.types import TokenLogprob

_NEG_INF = float("-inf")
_PARTIAL_SORT_FRACTION = 8
"""When every row's top_k is at most V / this, top_k/top_p work on ``topk(k_max)``, not a full sort
(tokens tied with the k-th logit but beyond position k_max are then dropped)."""


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


# ---------------------------------------------------------------------------------------------- helpers
def _pad_ids(seqs: list[torch.Tensor], pad: int, device: torch.device) -> torch.Tensor:
    """Right-pad 1-D int64 tensors into ``[n, max_len]`` (at least one column) with ``pad``."""
    width = max(1, max((t.numel() for t in seqs), default=0))
    out = torch.full((len(seqs), width), pad, dtype=torch.long, device=device)
    for i, t in enumerate(seqs):  # ragged rows: one copy per row, no per-token work in Python
        if t.numel():
            out[i, : t.numel()] = t
    return out


def _row_tensor(values: list[float], device: torch.device) -> torch.Tensor:
    """``[n, 1]`` fp32 column of per-row values."""
    return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)


def apply_eos_ban(logits: torch.Tensor, states: list[SeqSamplingState], eos_token_ids: list[int]) -> None:
    """Step 1, in place on ``logits [S, V]``: ban EOS / stop ids per ``min_new_tokens`` and ``ignore_eos``.

    Ids outside ``[0, V)`` are skipped (the model can never produce them).
    """
    width = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, st in enumerate(states):
        p = st.params
        banned: set[int] = set()
        if len(st.output_token_ids) < p.min_new_tokens:
            banned.update(eos_token_ids)
            banned.update(p.stop_token_ids)
        if p.ignore_eos:
            banned.update(eos_token_ids)
        for t in banned:
            if 0 <= t < width:
                rows.append(i)
                cols.append(t)
    if rows:
        idx_r = torch.tensor(rows, dtype=torch.long, device=logits.device)
        idx_c = torch.tensor(cols, dtype=torch.long, device=logits.device)
        logits[idx_r, idx_c] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, states: list[SeqSamplingState]) -> None:
    """In place on ``logits [S, V]``: add each row's ``logit_bias`` (ids outside ``[0, V)`` skipped)."""
    width = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, st in enumerate(states):
        for t, b in st.params.logit_bias.items():
            if 0 <= t < width:
                rows.append(i)
                cols.append(t)
                vals.append(b)
    if rows:
        dev = logits.device
        index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """Steps 2-3 on ``logits [S, V]`` (fp32): repetition, then presence / frequency penalties.

    Only rows with a penalty are touched; the work is gather/scatter over each row's token ids
    (``O(S * num_tokens)``), plus one padded copy of the penalised rows. Token ids outside
    ``[0, V)`` are ignored (routed to a scratch column). Returns the penalised logits (a new tensor
    when every row is penalised, else ``logits`` updated in place).
    """
    rows = [i for i, st in enumerate(states) if st.params.has_penalties]
    if not rows:
        return logits
    device = logits.device
    vocab = logits.shape[1]
    sel = [states[i] for i in rows]
    # one scratch column at index V absorbs padding and out-of-range ids
    padded = torch.nn.functional.pad(logits[rows] if len(rows) < len(states) else logits, (0, 1))

    def ids_tensor(seqs: list[torch.Tensor]) -> torch.Tensor:
        ids = _pad_ids(seqs, vocab, device)
        return ids.masked_fill_((ids < 0) | (ids > vocab), vocab)

    outputs = ids_tensor([torch.tensor(st.output_token_ids, dtype=torch.long, device=device) for st in sel])

    rep = [st.params.repetition_penalty for st in sel]
    if any(r != 1.0 for r in rep):
        prompts = ids_tensor([st.prompt_tensor(device) for st in sel])
        seen = torch.cat([prompts, outputs], dim=1)
        score = padded.gather(1, seen)
        rep_t = _row_tensor(rep, device)
        score = torch.where(score < 0, score * rep_t, score / rep_t)
        padded.scatter_(1, seen, score)  # duplicates write the same value

    presence = [st.params.presence_penalty for st in sel]
    frequency = [st.params.frequency_penalty for st in sel]
    if any(presence) or any(frequency):
        # frequency at every occurrence, presence at the first occurrence of each distinct id
        sorted_out = outputs.sort(dim=1).values
        first = torch.ones_like(sorted_out, dtype=torch.bool)
        first[:, 1:] = sorted_out[:, 1:] != sorted_out[:, :-1]
        delta = _row_tensor(frequency, device) + _row_tensor(presence, device) * first.to(torch.float32)
        padded.scatter_add_(1, sorted_out, -delta)

    result = padded[:, :vocab]
    if len(rows) < len(states):
        logits[rows] = result
        return logits
    return result.contiguous()


def apply_warpers(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """Steps 5-8 on ``logits [S, V]`` (fp32): temperature, top_k, top_p, min_p. Returns new logits.

    Greedy rows (temperature 0) are scaled by 1 instead; their argmax is unchanged by the rest.
    Removed tokens get ``-inf``; the most likely token always survives.
    """
    device = logits.device
    vocab = logits.shape[1]
    params = [st.params for st in states]

    temps = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        logits = logits / _row_tensor(temps, device)

    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    k_max = max(ks)
    use_top_k = any(k < vocab for k in ks)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        # ascending order of the candidates: the whole row, or (when every row has a small top_k)
        # only the k_max largest, found with topk instead of a full sort
        partial = k_max <= vocab // _PARTIAL_SORT_FRACTION
        if partial:
            values, index = torch.topk(logits, k_max, dim=-1, sorted=True)
            sorted_logits, sorted_idx = values.flip(-1), index.flip(-1)
        else:
            sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        width = sorted_logits.shape[1]
        if use_top_k:
            # the k-th largest logit sits at ascending position width - k; ties with it survive
            kth_pos = torch.tensor([width - k for k in ks], dtype=torch.long, device=device).unsqueeze(1)
            kth = sorted_logits.gather(1, kth_pos)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
        if use_top_p:
            top_p = _row_tensor([p.top_p for p in params], device)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = (cum <= (1 - top_p)) & (top_p < 1.0)
            remove[:, -1] = False
            sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
        base = torch.full_like(logits, _NEG_INF) if partial else torch.empty_like(logits)
        logits = base.scatter_(1, sorted_idx, sorted_logits)

    if any(p.min_p > 0 for p in params):
        min_p = _row_tensor([p.min_p for p in params], device)
        probs = logits.softmax(dim=-1)
        threshold = min_p * probs.amax(dim=-1, keepdim=True)
        remove = probs < threshold
        remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(remove, _NEG_INF)
    return logits


def process_logits(
    logits: torch.Tensor, states: list[SeqSamplingState], eos_token_ids: list[int] = ()
) -> torch.Tensor:
    """All logit processing (steps 1-3 and 5-8) without sampling; a new fp32 ``[S, V]`` tensor.

    Exposed so tests can compare each stage against ``transformers``' logits processors. For greedy
    rows the argmax of the result is the greedy token.
    """
    out = logits.to(torch.float32, copy=True)
    apply_eos_ban(out, states, list(eos_token_ids))
    apply_logit_bias(out, states)
    out = apply_penalties(out, states)
    return apply_warpers(out, states)


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

    def __call__(self, logits: torch.Tensor, states: list[SeqSamplingState]) -> SamplerOutput:
        """Sample ``[S]`` token ids from ``logits [S, V]`` (any float dtype), rows aligned with ``states``.

        Raises:
            ValueError: the row count differs from ``len(states)`` or ``V < vocab_size``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sampling states")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits width {logits.shape[1]} is below vocab_size {self.vocab_size}")
        raw = logits.to(torch.float32)
        work = raw.clone()
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
