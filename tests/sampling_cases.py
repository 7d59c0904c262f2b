"""Sampling parameters shared by the proto and front-end tests."""

from __future__ import annotations

from fuseserve.sampling_params import SamplingParams


def full_params() -> SamplingParams:
    """Every field of ``SamplingParams`` set to a value other than its default."""
    return SamplingParams(
        max_new_tokens=64,
        min_new_tokens=2,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        seed=1234567890123,
        stop=["\n\n", "END"],
        stop_token_ids=[2, 49152],
        ignore_eos=True,
        logprobs=5,
        include_stop_str_in_output=True,
        prompt_logprobs=3,
        # the constraints exclude each other in a validated request; the wire carries each of them
        json_schema={"type": "object"},
        regex="[a-z]+",
        choice=["yes", "no"],
        grammar='root ::= "a"',
        logit_bias={5: -1.5, 49152: 100.0},
    )
