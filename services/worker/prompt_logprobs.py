"""Prompt logprobs (scoring): the log-probability of each prompt token given the tokens before it.

The hidden state at position ``p`` predicts the token at ``p + 1``, so a prompt chunk covering
positions ``[s, e)`` scores the prompt tokens at ``s + 1 .. min(e, prompt_len - 1)``; position 0 has
no logprob, and the last prompt position's logits are the ones sampled for the first generated
token. The target of a chunk's last row is the first token of the sequence's next chunk, which the
worker sees only with that chunk: that row's log-softmax is kept until then (``pending``).

Logprobs are ``log_softmax`` of the raw logits in fp32, as for generated tokens (``sampler.py``).
A recompute after a preemption scores the same positions again; consumers keep one per position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fuseserve.types import PromptLogprobs, TokenLogprob


@dataclass
class ScoreRows:
    """One chunk's rows to score: ``first_row`` indexes the pass's tokens ``[T]``; ``num_rows`` rows
    from position ``start_pos``; ``tokens`` the chunk's input ids (targets of all rows but the last)."""

    seq_id: int
    start_pos: int
    first_row: int
    num_rows: int
    tokens: list[int]
    top_n: int
    has_next_target: bool  # the last row's target lies in the next chunk


@dataclass
class PromptScorer:
    """Per-worker state of prompt scoring: the pending last row of each sequence's previous chunk."""

    pending: dict[int, tuple[int, torch.Tensor, int]] = field(default_factory=dict)

    def free(self, seq_ids: list[int]) -> None:
        for sid in seq_ids:
            self.pending.pop(sid, None)

    def rows(
        self, seq_id: int, start_pos: int, num_tokens: int, prompt_len: int, first_row: int, tokens, top_n
    ):
        """The rows of one chunk to score, or None when it covers no scored position."""
        end = min(start_pos + num_tokens, prompt_len - 1)
        if end <= start_pos:
            return None
        has_next = start_pos + num_tokens < prompt_len and end == start_pos + num_tokens
        return ScoreRows(seq_id, start_pos, first_row, end - start_pos, list(tokens), top_n, has_next)

    def score(self, hidden: torch.Tensor, compute_logits, chunks: list[ScoreRows]) -> list[PromptLogprobs]:
        """Logprobs of the prompt tokens that ``chunks`` make known; ``hidden`` is ``[T, hidden]``."""
        out: list[PromptLogprobs] = []
        if not chunks:
            return out
        idx = torch.cat([torch.arange(c.first_row, c.first_row + c.num_rows) for c in chunks]).to(
            hidden.device
        )
        lp = torch.log_softmax(compute_logits(hidden[idx]).float(), dim=-1)
        row = 0
        for c in chunks:
            rows = lp[row : row + c.num_rows]
            row += c.num_rows
            entry = PromptLogprobs(c.seq_id, c.start_pos + 1)
            held = self.pending.pop(c.seq_id, None)
            if held is not None and held[0] == c.start_pos:  # the previous chunk's last row
                entry.start_pos = c.start_pos
                _append(entry, held[1], c.tokens[0], held[2])
            num_known = c.num_rows - 1 if c.has_next_target else c.num_rows
            for j in range(num_known):
                _append(entry, rows[j], c.tokens[j + 1], c.top_n)
            if c.has_next_target:
                self.pending[c.seq_id] = (c.start_pos + c.num_rows, rows[-1].clone(), c.top_n)
            if entry.logprobs:
                out.append(entry)
        return out


def _append(entry: PromptLogprobs, row: torch.Tensor, target: int, top_n: int) -> None:
    entry.logprobs.append(float(row[target]))
    if top_n > 0:
        values, ids = row.topk(top_n)
        entry.top.append(
            [TokenLogprob(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        )
    else:
        entry.top.append([])
