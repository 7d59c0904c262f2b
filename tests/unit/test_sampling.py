"""SamplingParams validation and the batched sampler, checked against transformers' processors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fuseserve.errors import InvalidParameterError, InvalidRequestError
from fuseserve.sampling_params import SamplingParams
from fuseserve.worker.logits_processors import apply_penalties, apply_warpers, process_logits
from fuseserve.worker.sampler import Sampler, SeqSamplingState

V = 257


def states_for(params: list[SamplingParams], prompts=None, outputs=None) -> list[SeqSamplingState]:
    out = []
    for i, p in enumerate(params):
        st = SeqSamplingState.create(p, prompts[i] if prompts else [], "cpu")
        if outputs:
            st.output_token_ids = list(outputs[i])
        out.append(st)
    return out


def random_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def same_survivors(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    finite = ~torch.isinf(a)
    torch.testing.assert_close(a[finite], b[finite])


# ----------------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1000.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**31}, "top_k"),  # past the wire's int32: it failed the whole pass's batch
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"min_new_tokens": 20, "max_new_tokens": 10}, "min_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop_token_ids": [-5]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_validation_names_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(**kwargs).validate()
    assert exc.value.param == param
    assert param in str(exc.value) and "allowed" in str(exc.value)
    assert exc.value.http_status == 400


def test_valid_edges_accepted():
    for kw in (
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_k": 2**31 - 1},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"min_new_tokens": 16, "max_new_tokens": 16},
        {"stop": ["a"] * 16},
    ):
        SamplingParams(**kw).validate()


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


def test_from_kwargs_rejects_unknown_keyword():
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams.from_kwargs(temperature=0.5, top_q=0.3)
    assert exc.value.param == "top_q" and "top_q" in str(exc.value)
    with pytest.raises(InvalidParameterError):
        SamplingParams.from_kwargs(top_p=2.0)
    assert SamplingParams.from_kwargs(stop="###").stop == ["###"]
    assert SamplingParams.from_kwargs(stop=None, stop_token_ids=(3,)).stop_token_ids == [3]
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams.from_kwargs(stop=5)
    assert exc.value.param == "stop"


def test_dict_round_trip_is_json_able():
    p = SamplingParams(temperature=0.3, seed=7, stop=["a", "b"], stop_token_ids=[3], logprobs=5)
    data = json.loads(json.dumps(p.to_dict()))
    assert SamplingParams.from_dict(data) == p


# ----------------------------------------------------------------------------------- processors vs HF
def test_repetition_penalty_matches_transformers():
    logits = random_logits(3)
    prompts = [[1, 5, 5, 9], [], [200, 3]]
    outputs = [[7, 1], [4, 4, 250], []]
    penalty = 1.7
    ours = apply_penalties(
        logits.clone(), states_for([SamplingParams(repetition_penalty=penalty)] * 3, prompts, outputs)
    )
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for r in range(3):
        ids = torch.tensor([prompts[r] + outputs[r]])
        ref = proc(ids, logits[r : r + 1].clone()) if ids.numel() else logits[r : r + 1]
        torch.testing.assert_close(ours[r : r + 1], ref)


def test_presence_and_frequency_penalties_hand_computed():
    logits = random_logits(2)
    prompts = [[10, 11], [12]]
    outputs = [[3, 3, 3, 8], [10]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(presence_penalty=-1.0, frequency_penalty=0.0),
    ]
    ours = apply_penalties(logits.clone(), states_for(params, prompts, outputs))
    expected = logits.clone()
    expected[0, 3] -= 0.5 + 0.25 * 3
    expected[0, 8] -= 0.5 + 0.25 * 1
    expected[1, 10] -= -1.0
    torch.testing.assert_close(ours, expected)  # prompt tokens 11, 12 untouched


def test_penalties_only_touch_rows_that_ask():
    logits = random_logits(3)
    params = [SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams()]
    ours = apply_penalties(logits.clone(), states_for(params, [[1]] * 3, [[2, 2]] * 3))
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])
    assert ours[1, 2] == logits[1, 2] - 2.0


@pytest.mark.parametrize(
    "kw, warpers",
    [
        ({"temperature": 0.7}, lambda: [TemperatureLogitsWarper(0.7)]),
        ({"top_k": 10}, lambda: [TopKLogitsWarper(10)]),
        ({"top_p": 0.8}, lambda: [TopPLogitsWarper(0.8)]),
        ({"min_p": 0.1}, lambda: [MinPLogitsWarper(0.1)]),
        (
            {"temperature": 1.3, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
            lambda: [
                TemperatureLogitsWarper(1.3),
                TopKLogitsWarper(50),
                TopPLogitsWarper(0.9),
                MinPLogitsWarper(0.05),
            ],
        ),
    ],
)
def test_warpers_match_transformers(kw, warpers):
    logits = random_logits(4, seed=3)
    ours = apply_warpers(logits.clone(), states_for([SamplingParams(**kw)] * 4))
    ref = logits.clone()
    dummy_ids = torch.zeros((4, 1), dtype=torch.long)
    for w in warpers():
        ref = w(dummy_ids, ref)
    same_survivors(ours, ref)


def test_mixed_batch_each_row_matches_its_own_processors():
    logits = random_logits(3, seed=5)
    kws = [{"top_k": 5}, {"top_p": 0.5, "temperature": 0.5}, {}]
    refs = [
        [TopKLogitsWarper(5)],
        [TemperatureLogitsWarper(0.5), TopPLogitsWarper(0.5)],
        [],
    ]
    ours = apply_warpers(logits.clone(), states_for([SamplingParams(**k) for k in kws]))
    for r in range(3):
        ref = logits[r : r + 1].clone()
        for w in refs[r]:
            ref = w(torch.zeros((1, 1), dtype=torch.long), ref)
        same_survivors(ours[r : r + 1], ref)


def test_process_logits_full_pipeline_matches_transformers():
    logits = random_logits(1, seed=9)
    p = SamplingParams(repetition_penalty=1.3, temperature=0.9, top_k=40, top_p=0.85, min_p=0.02)
    prompt, output = [5, 6, 7], [8, 8]
    ours = process_logits(logits, states_for([p], [prompt], [output]))
    ids = torch.tensor([prompt + output])
    ref = logits.clone()
    for w in (
        RepetitionPenaltyLogitsProcessor(1.3),
        TemperatureLogitsWarper(0.9),
        TopKLogitsWarper(40),
        TopPLogitsWarper(0.85),
        MinPLogitsWarper(0.02),
    ):
        ref = w(ids, ref)
    same_survivors(ours, ref)


# ----------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize(
    "kw", [{"temperature": 0.0}, {"top_k": 1}, {"top_p": 1e-9}, {"top_k": 1, "temperature": 1.5}]
)
def test_greedy_settings_give_argmax(kw):
    logits = random_logits(8, seed=1)
    sampler = Sampler(eos_token_ids=[], vocab_size=V)
    for _ in range(3):
        out = sampler(logits, states_for([SamplingParams(**kw)] * 8))
        assert torch.equal(out.token_ids, logits.argmax(dim=-1))
        assert out.token_ids.dtype == torch.int64


def test_greedy_argmax_in_mixed_batch_and_half_precision():
    logits = random_logits(4, seed=2).to(torch.bfloat16)
    params = [SamplingParams(temperature=0), SamplingParams(), SamplingParams(top_p=1e-9), SamplingParams()]
    out = Sampler([], V)(logits, states_for(params))
    ref = logits.float().argmax(dim=-1)
    assert out.token_ids[0] == ref[0] and out.token_ids[2] == ref[2]


def test_seeded_row_is_independent_of_batch():
    steps = 20
    seeded = SamplingParams(seed=1234, temperature=1.0, top_p=0.95)
    logits_seq = [random_logits(16, seed=100 + s) for s in range(steps)]
    sampler = Sampler([], V)

    alone = states_for([seeded])
    alone_tokens = []
    for s in range(steps):
        t = int(sampler(logits_seq[s][7:8], alone).token_ids[0])
        alone[0].output_token_ids.append(t)
        alone_tokens.append(t)

    batch = states_for(
        [SamplingParams(temperature=1.0)] * 7 + [seeded] + [SamplingParams(temperature=0.8)] * 8
    )
    batch_tokens = []
    for s in range(steps):
        toks = sampler(logits_seq[s], batch).token_ids.tolist()
        for st, t in zip(batch, toks, strict=True):
            st.output_token_ids.append(t)
        batch_tokens.append(toks[7])
    assert batch_tokens == alone_tokens
    # the seed actually matters: another seed gives another sequence
    other = states_for([SamplingParams(seed=99, temperature=1.0, top_p=0.95)])
    other_tokens = [int(sampler(logits_seq[s][7:8], other).token_ids[0]) for s in range(steps)]
    assert other_tokens != alone_tokens


def test_sampling_distribution_follows_probabilities():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]])).repeat(4000, 1)
    out = Sampler([], 4)(logits, states_for([SamplingParams(temperature=1.0)] * 4000))
    freq = torch.bincount(out.token_ids, minlength=4).float() / 4000
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.03, rtol=0)


def test_min_new_tokens_bans_eos_and_stop_token_ids():
    eos, stop_id = 0, 5
    logits = torch.zeros(2, V)
    logits[:, eos] = 100.0
    logits[:, stop_id] = 90.0
    sampler = Sampler([eos], V)
    p = SamplingParams(temperature=0, min_new_tokens=3, stop_token_ids=[stop_id])
    sts = states_for([p, p], outputs=[[1, 2], [1, 2, 3]])
    out = sampler(logits, sts)
    assert out.token_ids[0] not in (eos, stop_id)  # 2 < 3 generated: banned
    assert out.token_ids[1] == eos  # 3 generated: allowed
    # sampled (non-greedy) rows too
    ps = SamplingParams(temperature=1.0, min_new_tokens=1, stop_token_ids=[stop_id])
    out = sampler(logits, states_for([ps, ps]))
    assert all(t not in (eos, stop_id) for t in out.token_ids.tolist())


def test_ignore_eos_bans_eos_always():
    logits = torch.zeros(1, V)
    logits[0, 2] = 50.0
    sampler = Sampler([2], V)
    st = states_for([SamplingParams(temperature=0, ignore_eos=True)], outputs=[list(range(100))])
    assert int(sampler(logits, st).token_ids[0]) != 2


def test_eos_banned_over_full_logits_width():
    vocab, width = 200, 256  # the lm_head is padded beyond the tokenizer's vocab
    eos = [250]
    logits = torch.zeros(3, width)
    logits[:, 250] = 100.0
    sampler = Sampler(eos, vocab)
    params = [
        SamplingParams(temperature=0, min_new_tokens=2),
        SamplingParams(min_new_tokens=2, top_k=3),
        SamplingParams(temperature=0, repetition_penalty=1.2, min_new_tokens=2),
    ]
    out = sampler(logits, states_for(params, [[1]] * 3))
    assert 250 not in out.token_ids.tolist()
    with pytest.raises(ValueError):
        sampler(torch.zeros(1, 100), states_for([SamplingParams()]))


def test_logprobs_match_log_softmax_of_raw_logits():
    logits = random_logits(3, seed=4)
    params = [
        SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=2.0),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0),
    ]
    out = Sampler([], V)(logits, states_for(params, [[1, 2]] * 3))
    ref = torch.log_softmax(logits, dim=-1)
    for r in (0, 2):
        assert math.isclose(out.logprobs[r], float(ref[r, out.token_ids[r]]), abs_tol=1e-5)
    assert out.logprobs[1] is None and out.top_logprobs[1] == [] and out.top_logprobs[2] == []
    top_v, top_i = ref[0].topk(5)
    assert [t.token_id for t in out.top_logprobs[0]] == top_i.tolist()
    for t, v in zip(out.top_logprobs[0], top_v.tolist(), strict=True):
        assert math.isclose(t.logprob, v, abs_tol=1e-5)


def test_fast_path_and_general_path_agree_for_greedy():
    logits = random_logits(5, seed=8)
    sampler = Sampler([], V)
    fast = sampler(logits, states_for([SamplingParams(temperature=0)] * 5)).token_ids
    # one sampled row sends the batch down the general path; greedy rows still take the argmax
    general = sampler(logits, states_for([SamplingParams(temperature=0)] * 4 + [SamplingParams()])).token_ids
    assert torch.equal(fast, logits.argmax(dim=-1))
    assert torch.equal(general[:4], fast[:4])


def test_plain_greedy_in_place_keeps_the_model_dtype():
    """The runner's case (``inplace=True``, every row plain greedy): the argmax of the bf16 logits
    themselves, EOS banned in place, equals the general path's over an fp32 copy."""
    eos = 7
    logits = random_logits(6, seed=9).to(torch.bfloat16)
    logits[:, eos] = 100.0  # the top logit everywhere, banned for the ignore_eos rows
    logits[2, 5] = logits[2, 3] = 60.0  # a tie after the ban: the first index wins, as with argmax
    params = [SamplingParams(temperature=0, ignore_eos=i % 2 == 0) for i in range(6)]
    general = Sampler([eos], V)(logits.float(), states_for(params), inplace=False).token_ids
    given = logits.clone()
    fast = Sampler([eos], V)(given, states_for(params), inplace=True)
    assert torch.equal(fast.token_ids, general)
    assert fast.token_ids.tolist()[1::2] == [eos] * 3 and eos not in fast.token_ids.tolist()[0::2]
    assert int(fast.token_ids[2]) == 3
    assert given.dtype == torch.bfloat16 and float(given[0, eos]) == float("-inf")  # banned in place
    assert fast.logprobs == [None] * 6 and fast.top_logprobs == [[]] * 6


def test_rejected_values_are_shortened_in_the_message():
    """A 49 152-entry logit_bias once came back whole in a 726 KB error body."""
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(logit_bias={i: 1.0 for i in range(49152)}).validate()
    assert exc.value.param == "logit_bias" and len(str(exc.value)) < 300
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(top_p=1.5).validate()
    assert "top_p=1.5" in str(exc.value)
