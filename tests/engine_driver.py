"""Test helper: drive a ModelRunner with hand-made step plans (teacher-forced chunks)."""

from __future__ import annotations

import weakref

import torch

from fuseserve.sampling_params import SamplingParams
from fuseserve.scheduler.block_accounting import BlockAccount, assign_block_ids
from fuseserve.types import SeqChunk, StepPlan

_ACCOUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def with_blocks(runner, plan: StepPlan) -> StepPlan:
    """``plan`` with the block ids the scheduler would send (one ``BlockAccount`` per runner)."""
    account = _ACCOUNTS.get(runner)
    if account is None:
        account = _ACCOUNTS[runner] = BlockAccount(runner.info.num_blocks, runner.info.block_size, False)
    assign_block_ids(account, plan)
    return plan


def free(runner, seq_ids: list[int]) -> None:
    """Free sequences on the runner and in its account."""
    runner.free(seq_ids)
    account = _ACCOUNTS.get(runner)
    for sid in seq_ids:
        if account is not None:
            account.release(sid)


def chunked_logits(
    runner, prompts: dict[int, list[int]], chunk_sizes: dict[int, int], loras: dict[int, str] | None = None
) -> dict[int, torch.Tensor]:
    """Run every prompt through the runner at once, sequence ``i`` in chunks of ``chunk_sizes[i]`` tokens
    per pass, all sequences packed into the same passes (sequence ``i`` with LoRA adapter ``loras[i]``
    when given). Returns logits ``[len, vocab]`` per sequence and frees the sequences afterwards."""
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
            chunks.append(_chunk(sid, toks, start, n, len(toks), (loras or {}).get(sid)))
            pos[sid] = start + n
        logits, _ = runner.run_pass(with_blocks(runner, StepPlan(step, chunks)), all_logits=True)
        offset = 0
        for c in chunks:
            out[c.seq_id].append(logits[offset : offset + c.num_tokens])
            offset += c.num_tokens
        step += 1
    free(runner, list(prompts))
    return {sid: torch.cat(parts) for sid, parts in out.items()}


def greedy_tokens(runner, prompt: list[int], max_new_tokens: int, chunk: int = 16):
    """Greedy decoding of one sequence straight on the runner (prompt in chunks of ``chunk`` tokens,
    then one token per pass, argmax of the logits). Returns ``(tokens, logits [vocab] per step)``."""
    seq_id, pos, step = 1, 0, 0
    tokens: list[int] = []
    logits_per_step: list[torch.Tensor] = []
    known = list(prompt)
    while len(tokens) < max_new_tokens:
        n = min(chunk, len(known) - pos)
        c = _chunk(seq_id, known, pos, n, len(prompt))
        logits, _ = runner.run_pass(with_blocks(runner, StepPlan(step, [c])))
        pos, step = pos + n, step + 1
        if c.sample:
            logits_per_step.append(logits[0])
            tokens.append(int(logits[0].argmax()))
            known.append(tokens[-1])
    free(runner, [seq_id])
    return tokens, logits_per_step


def _chunk(
    seq_id: int, tokens: list[int], start: int, n: int, prompt_len: int, lora: str | None = None
) -> SeqChunk:
    """Tokens ``start:start+n`` of a sequence whose known tokens are ``tokens`` (greedy params and
    the LoRA adapter first)."""
    return SeqChunk(
        seq_id,
        start,
        n,
        tokens[start : start + n],
        sample=start + n == len(tokens),
        params=SamplingParams(temperature=0.0) if start == 0 else None,
        prompt_len=prompt_len,
        lora=lora if start == 0 else None,
    )


def max_relative_error(hf, prompts: dict[int, list[int]], ours: dict[int, torch.Tensor]) -> float:
    """The largest ``|ours - transformers|`` over every prompt position, relative to the largest
    ``transformers`` logit of that prompt (``ours``: ``chunked_logits``' result for ``prompts``)."""
    worst = 0.0
    for sid, tokens in prompts.items():
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0].float()
        worst = max(worst, ((ours[sid] - ref).abs().max() / ref.abs().max()).item())
    return worst
