"""Test helper: drive a ModelRunner with hand-made step plans (teacher-forced chunks)."""

from __future__ import annotations

import torch

from fuseserve.sampling_params import SamplingParams
from fuseserve.types import SeqChunk, StepPlan


def chunked_logits(
    runner, prompts: dict[int, list[int]], chunk_sizes: dict[int, int]
) -> dict[int, torch.Tensor]:
    """Run every prompt through the runner at once, sequence ``i`` in chunks of ``chunk_sizes[i]`` tokens
    per pass, all sequences packed into the same passes. Returns logits ``[len, vocab]`` per sequence
    and frees the sequences afterwards."""
    pos = dict.fromkeys(prompts, 0)
    out: dict[int, list[torch.Tensor]] = {sid: [] for sid in prompts}
    step = 0
    while any(pos[s] < len(p) for s, p in prompts.items()):
        chunks = []
        for sid, toks in prompts.items():
            start = pos[sid]
            if start >= len(toks):
                continue
            n = min(chunk_sizes[sid], len(toks) - start)
            chunks.append(
                SeqChunk(
                    sid,
                    start,
                    n,
                    toks[start : start + n],
                    sample=start + n == len(toks),
                    params=SamplingParams(temperature=0.0) if start == 0 else None,
                    prompt_len=len(toks),
                )
            )
            pos[sid] = start + n
        logits, _ = runner.run_pass(StepPlan(step, chunks), all_logits=True)
        offset = 0
        for c in chunks:
            out[c.seq_id].append(logits[offset : offset + c.num_tokens])
            offset += c.num_tokens
        step += 1
    runner.free(list(prompts))
    return {sid: torch.cat(parts) for sid, parts in out.items()}
