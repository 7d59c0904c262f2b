"""Logit processing on the worker, before sampling: steps 1-8 of the sampler's order, on fp32 ``[S, V]``.

Each step is vectorised over the batch and touches only the rows that ask for it:

1. **EOS ban** (``apply_eos_ban``): the EOS ids and the row's ``stop_token_ids`` get ``-inf`` while
   ``len(output) < min_new_tokens``; with ``ignore_eos`` the EOS ids are banned always. Ids are
   checked against the full logits width (it may exceed the tokenizer's vocab).
   Then **logit_bias** (``apply_logit_bias``; OpenAI: added to the named tokens' logits). The
   grammar mask of constrained rows comes next, applied by the sampler (``fuseserve/structured.py``).
2. **Repetition penalty** (``apply_penalties``; ``transformers`` / CTRL semantics, Keskar et al.
   2019) over prompt + output tokens: a positive logit is divided by the penalty, a negative one
   multiplied.
3. **Presence / frequency penalties** (OpenAI semantics) over output tokens only:
   ``logit -= presence * (count > 0) + frequency * count``.
4. (**Greedy rows** take the argmax: the sampler's step.)
5. **Temperature** (``apply_warpers``, as 6-8): ``logit / temperature``.
6. **top_k**: keep tokens whose logit is >= the k-th largest (ties kept, as ``transformers``).
7. **top_p**: sort ascending once, drop tokens whose ascending cumulative probability is
   ``<= 1 - top_p`` (always keeping the most likely token), as ``transformers``' TopPLogitsWarper.
8. **min_p**: drop tokens with probability ``< min_p * max_prob``.

``process_logits`` runs them all (without the grammar mask), for tests against ``transformers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fuseserve.worker.sampler import SeqSamplingState

_NEG_INF = float("-inf")
_PARTIAL_SORT_FRACTION = 8
"""When every row's top_k is at most V / this, top_k/top_p work on ``topk(k_max)``, not a full sort
(tokens tied with the k-th logit but beyond position k_max are then dropped)."""


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
