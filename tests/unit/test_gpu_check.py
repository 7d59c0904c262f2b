"""The GPU check's bf16 near-tie rule (``benchmarks/gpu_check.py``), on hand-made logits."""

from __future__ import annotations

import torch

from benchmarks.gpu_check import compare, near_tie


def logits_with(values: dict[int, float], vocab: int = 8) -> torch.Tensor:
    x = torch.full((vocab,), -5.0)
    for i, v in values.items():
        x[i] = v
    return x


def test_near_tie_scales_with_the_logit_magnitude():
    # bf16 keeps 8 significant bits: at |logit| in [4, 8) one step is 2**-5, the rule allows 4 steps
    assert near_tie(logits_with({1: 5.0, 2: 5.0 - 0.1}), 1, 2)[0]
    assert not near_tie(logits_with({1: 5.0, 2: 5.0 - 0.2}), 1, 2)[0]
    assert not near_tie(logits_with({1: 0.5, 2: 0.5 - 0.1}), 1, 2)[0]  # finer steps near zero


def test_compare_accepts_only_a_flip_at_a_near_tie():
    steps = [logits_with({3: 6.0}), logits_with({4: 6.0, 5: 5.95}), logits_with({6: 6.0})]
    ref = [3, 4, 6]
    assert compare([3, 4, 6], [], ref, steps)["ok"]
    flipped = compare([3, 5, 1], [], ref, steps)  # a near-tie at step 1; what follows may differ
    assert flipped["ok"] and flipped["matched"] == 1 and flipped["divergence"]["step"] == 1
    wrong = compare([3, 1, 6], [], ref, steps)  # token 1 is far below: not a tie
    assert not wrong["ok"] and wrong["divergence"]["ours"] == 1
    assert not compare([3, 4], [], ref, steps)["ok"]  # too short


def test_compare_reports_logprob_agreement():
    steps = [logits_with({3: 6.0}), logits_with({4: 6.0})]
    want = [torch.log_softmax(s, -1)[t].item() for s, t in zip(steps, [3, 4], strict=True)]
    res = compare([3, 4], [want[0] + 0.01, want[1]], [3, 4], steps)
    assert res["ok"] and abs(res["max_logprob_diff"] - 0.01) < 1e-6
