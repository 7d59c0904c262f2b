"""The greedy-equality rules shared by the end-to-end tests, and the bf16 logit-error check.

fp32: fuseserve's greedy tokens equal ``transformers.generate``'s, except that rounding may flip a
near-tie: a divergence is accepted only where transformers' two candidate logits at that step are
less than ``NEAR_TIE`` apart.

bf16: the two sides round differently, and how depends on the CPU (with or without bf16
instructions, the matmul kernels oneDNN picks), so a divergence is accepted wherever each side's token
is among the other side's top ``TOP_K`` at that step (vLLM's ``check_logprobs_close``,
``tests/models/utils.py``). That alone would pass a worse bf16 implementation, so
``assert_no_farther_from_fp32`` adds the strong check: teacher-forced on the same tokens, fuseserve's
bf16 logits are no farther from fp32's than transformers' bf16 logits are.

Under either rule the continuations legitimately differ after the first divergence and are not
compared.

Mixtures of experts: where a token's k-th and (k+1)-th routing probabilities are less than
``ROUTER_TIE`` apart (``router_gaps``), fp32 rounding may send it to the other expert, and the
logits from there on legitimately differ.
"""

from __future__ import annotations

import torch

NEAR_TIE = 1e-3
"""fp32: largest accepted gap (exclusive) between transformers' logits of the two candidates."""

TOP_K = 5
"""bf16: a divergent token must be among the other side's top ``TOP_K`` (as in vLLM's model tests)."""

MEAN_SLACK = 1.1
"""fuseserve's mean |logit - fp32 logit| may be at most this times transformers' (see below)."""

MAX_SLACK = 1.25
"""fuseserve's step max |logit - fp32 logit| (its ``MAX_QUANTILE`` over the steps) may be at most this
times transformers' (see below).

Why slack: fuseserve computes as ``transformers`` does (norms, softmax, residual adds, logits at the
same precision), so the two bf16 errors are draws from the same distribution and either may be the
larger. Measured, pooled over the greedy steps of a model's prompts (tests/pipeline/test_bf16_vs_hf.py,
tests/pipeline/test_smollm2_greedy.py print them), fuseserve / transformers was 0.82-1.04 on the mean and
0.80-1.14 on the max (SmolLM2 1.04 / 0.80; opt-prenorm's max 1.14), on AVX-512 with bf16 instructions
and with ATen and oneDNN held to AVX2 alike. A real precision loss is larger: the RMSNorm computed in
bf16 instead of fp32 made SmolLM2's ratio 1.18 on the mean and 1.41 on the max. A mixture-of-experts
router near-tie that one side routes differently at a greedy step would exceed both (none measured).

Why a quantile of the steps' maxima and not the one largest error: that single logit is decided by a
few sensitive steps. SmolLM2's 232 steps, five attention paths for its prompt chunks that are equally
accurate (each within 0.1% of the fp32-accumulating operator's mean error against fp32 attention in
this very run): the largest error was 0.99-2.40 (ratio 1.00-2.41; the one-bf16-P prefill kernel's 2.40
at one step whose mean error was 0.58 against transformers' 0.06) while the 90th percentile of the
steps' maxima stayed at 1.03-1.13 and the mean ratio at 0.93-1.13 (benchmarks/README.md).
"""

MAX_QUANTILE = 0.9
"""The quantile of the steps' maximum errors that ``MAX_SLACK`` bounds."""


ROUTER_TIE = 1e-5
"""Largest gap between the k-th and (k+1)-th routing probability at which either expert may be chosen."""


def router_gaps(hf, ids: list[int]) -> torch.Tensor:
    """``[len(ids)]``: per token, the smallest gap between the k-th and (k+1)-th routing probability
    over the layers of the ``transformers`` mixture of experts ``hf`` (its ``mlp.gate`` routers)."""
    k = hf.config.num_experts_per_tok
    gaps: list[torch.Tensor] = []

    def hook(_module, _inp, out):
        logits = out[0] if isinstance(out, tuple) else out
        top = torch.softmax(logits.float(), dim=-1).topk(k + 1, dim=-1).values
        gaps.append((top[..., k - 1] - top[..., k]).reshape(len(ids)))

    gates = [m for name, m in hf.named_modules() if name.endswith("mlp.gate")]
    assert gates, "guard: the router's module was not found (transformers renamed it?)"
    handles = [g.register_forward_hook(hook) for g in gates]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack(gaps).amin(0)


def assert_moe_matches(
    hf, ids: list[int], ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], *, what: str
) -> None:
    """The fp32 rule for a mixture of experts ``hf`` on prompt ``ids``: fuseserve's greedy tokens
    ``ours`` equal transformers' (``hf_greedy``) up to a divergence at a near-tie of the two tokens'
    logits (< ``NEAR_TIE``) or of the router on the tokens before it (< ``ROUTER_TIE``); a failure
    prints both margins, so a routing tie is told apart from a real difference."""
    step = next((j for j, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)) if a != b), None)
    if step is None:
        assert len(ours) == len(ref_tokens), f"{what}: {ours} vs {ref_tokens}"
        return
    gap = abs((ref_logits[step][ref_tokens[step]] - ref_logits[step][ours[step]]).item())
    margin = router_gaps(hf, ids + ref_tokens[:step]).min().item()
    assert gap < NEAR_TIE or margin < ROUTER_TIE, (
        f"{what}: token {step} is {ours[step]}, transformers {ref_tokens[step]}; logit gap {gap:.2e} "
        f"(tie < {NEAR_TIE}), router margin {margin:.2e} (tie < {ROUTER_TIE})"
    )
    print(f"{what}: accepted divergence at token {step} (logit gap {gap:.2e}, router margin {margin:.2e})")


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens for ``ids`` run alone, and its logits ``[vocab]`` (fp32) at each step."""
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
    our_top: list[list[int]] | None = None,
) -> None:
    """Assert the greedy rule of ``dtype`` (the one both sides ran in) for one prompt.

    ours: fuseserve's tokens. ref_tokens, ref_logits: transformers' tokens and logits ``[vocab]`` per
    step (``hf_greedy``). our_top: bf16 only, required there: fuseserve's top ``TOP_K`` token ids per
    step, most likely first (the pipeline's ``logprobs=TOP_K``, ``Response.top_logprobs``).
    """
    for i, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)):
        if a != b:
            if dtype == "float32":
                _assert_near_tie(i, a, b, ref_logits[i], what)
            else:
                if our_top is None:
                    raise ValueError(f"{what}: the {dtype} rule needs fuseserve's top-{TOP_K} (our_top)")
                _assert_in_top_k(i, a, b, our_top[i], ref_logits[i], what)
            return  # after an accepted divergence the continuations legitimately differ
    assert len(ours) == len(ref_tokens), f"{what}: {len(ours)} tokens, transformers {len(ref_tokens)}"


def _assert_near_tie(i: int, a: int, b: int, ref_logits: torch.Tensor, what: str) -> None:
    """fp32: fuseserve chose ``a`` and transformers ``b`` at step ``i``; their logits must be a near-tie."""
    gap = (ref_logits[b] - ref_logits[a]).abs().item()
    assert gap <= NEAR_TIE * (1 - 1e-6), (
        f"{what}: token {i} is {a}, transformers {b}, logit gap {gap:.2e} (not a near-tie)"
    )
    print(f"{what}: accepted near-tie flip at token {i} (logit gap {gap:.3g})")


def _assert_in_top_k(i: int, a: int, b: int, our_top: list[int], ref_logits: torch.Tensor, what: str) -> None:
    """bf16: fuseserve chose ``a`` and transformers ``b`` at step ``i``; ``b`` must be in fuseserve's
    top ``TOP_K`` and ``a`` in transformers' (by value: a logit tied with the ``TOP_K``-th counts)."""
    kth = ref_logits.topk(TOP_K).values[-1]
    gap = (ref_logits[b] - ref_logits[a]).item()
    assert b in our_top[:TOP_K] and ref_logits[a] >= kth, (
        f"{what}: token {i} is {a}, transformers {b} (logit gap {gap:.3g} in transformers); "
        f"fuseserve's top-{TOP_K} {our_top[:TOP_K]}, transformers' {ref_logits.topk(TOP_K).indices.tolist()}"
    )
    rank = our_top.index(b) + 1
    print(
        f"{what}: accepted top-{TOP_K} divergence at token {i} (transformers' token is fuseserve's "
        f"#{rank}; logit gap {gap:.3g} in transformers)"
    )


def assert_no_farther_from_fp32(
    ours: torch.Tensor, theirs: torch.Tensor, fp32: torch.Tensor, *, what: str
) -> tuple[float, float, float, float]:
    """Assert fuseserve's bf16 logits are no farther from the fp32 reference than transformers' bf16.

    ours, theirs, fp32: logits ``[steps, vocab]`` (fp32 tensors) of fuseserve in bf16, transformers in
    bf16 and the fp32 reference, all teacher-forced on the same tokens. Prints and returns
    ``(ours_mean, ours_max, theirs_mean, theirs_max)`` of the absolute errors (max: the ``MAX_QUANTILE``
    of the steps' largest); fuseserve's may exceed transformers' by ``MEAN_SLACK`` / ``MAX_SLACK`` at most
    (why: ``MAX_SLACK``).
    """
    assert ours.shape == theirs.shape == fp32.shape, (ours.shape, theirs.shape, fp32.shape)
    ours_err, theirs_err = (ours - fp32).abs(), (theirs - fp32).abs()
    o_mean, o_max = ours_err.mean().item(), ours_err.amax(1).quantile(MAX_QUANTILE).item()
    t_mean, t_max = theirs_err.mean().item(), theirs_err.amax(1).quantile(MAX_QUANTILE).item()
    print(
        f"{what}: |bf16 - fp32| logits over {ours.shape[0]} steps: fuseserve mean {o_mean:.3e} step max "
        f"p{MAX_QUANTILE:.0%} {o_max:.3e}; transformers mean {t_mean:.3e} step max {t_max:.3e} (ratio "
        f"{o_mean / t_mean:.3f} / {o_max / t_max:.3f}; largest {ours_err.max().item():.3e} / "
        f"{theirs_err.max().item():.3e})"
    )
    assert t_mean > 0, f"{what}: transformers' bf16 logits equal fp32's: bf16 did not run"
    assert o_mean <= MEAN_SLACK * t_mean, (
        f"{what}: fuseserve's mean error {o_mean:.3e} > {MEAN_SLACK} x {t_mean:.3e}"
    )
    assert o_max <= MAX_SLACK * t_max, (
        f"{what}: fuseserve's step max error (p{MAX_QUANTILE:.0%}) {o_max:.3e} > {MAX_SLACK} x {t_max:.3e}"
    )
    return o_mean, o_max, t_mean, t_max
