"""The greedy-equality rule shared by the end-to-end tests: fuseserve's greedy tokens equal
``transformers.generate``'s, except that fp32 rounding may flip a near-tie.

A divergence is accepted only where transformers' two candidate logits differ by less than
``NEAR_TIE`` at that step; after it the continuations legitimately differ and are not compared.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3


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
    return g.sequences[0, len(ids) :].tolist(), [step[0] for step in g.logits]


def assert_matches(ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)):
        if a != b:
            gap = (ref_logits[i][b] - ref_logits[i][a]).abs().item()
            assert gap < NEAR_TIE, (
                f"{what}: token {i} is {a}, transformers {b}, logit gap {gap:.2e} (not a near-tie)"
            )
            return  # after an accepted near-tie flip the continuations legitimately differ
    assert len(ours) == len(ref_tokens), f"{what}: {len(ours)} tokens, transformers {len(ref_tokens)}"
