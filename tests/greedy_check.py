"""The greedy-equality rule shared by the end-to-end tests: fuseserve's greedy tokens equal
``transformers.generate``'s, except that rounding may flip a near-tie.

A divergence is accepted only where transformers' two candidate logits at that step are within
``tie_bound`` of each other (fp32: less than ``NEAR_TIE``; bf16: equal or adjacent bf16 values, one
bf16 step at their magnitude); after it the continuations legitimately differ and are not compared.
"""

from __future__ import annotations

import math

import torch

NEAR_TIE = 1e-3


def tie_bound(dtype: str, logit: float) -> float:
    """Largest accepted gap between transformers' two candidates: fp32 just under ``NEAR_TIE``; bf16 one
    step of bf16 (8 significant bits) at the magnitude of ``logit``, ``2 ** (floor(log2 |logit|) - 7)``."""
    if dtype == "float32":
        return NEAR_TIE * (1 - 1e-6)
    return 2.0 ** (math.floor(math.log2(max(abs(logit), 1e-30))) - 7)


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for ``ids`` run alone, and its logits ``[vocab]`` at each step."""
    with torch.no_grad():
        g = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=hf.generation_config.eos_token_id,
        )
    return g.sequences[0, len(ids) :].tolist(), [step[0].float() for step in g.logits]


def assert_matches(
    ours: list[int],
    ref_tokens: list[int],
    ref_logits: list[torch.Tensor],
    dtype: str = "float32",
    *,
    what: str,
) -> None:
    """Assert the greedy rule for one prompt; ``dtype`` is the one both sides ran in."""
    for i, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)):
        if a != b:
            gap = (ref_logits[i][b] - ref_logits[i][a]).abs().item()
            assert gap <= tie_bound(dtype, ref_logits[i][b].item()), (
                f"{what}: token {i} is {a}, transformers {b}, logit gap {gap:.2e} (not a near-tie)"
            )
            print(f"{what}: accepted near-tie flip at token {i} (logit gap {gap:.3g})")
            return  # after an accepted near-tie flip the continuations legitimately differ
    assert len(ours) == len(ref_tokens), f"{what}: {len(ours)} tokens, transformers {len(ref_tokens)}"
