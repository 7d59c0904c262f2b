"""Prompt logprobs (scoring) equal ``transformers``' log-softmax on the same tokens, fp32, with the
prompt cut into several chunks (token budget 16) and scored next to a generating request."""

from __future__ import annotations

import pytest
import torch

PROMPT = (
    "The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide from the "
    "hunters. Later that evening, the fox returns to its den by the river, where its cubs wait."
)


@pytest.fixture(scope="module")
def pipe(smollm2_source):
    import fuseserve

    p = fuseserve.pipeline(
        str(smollm2_source.path), token_budget=16, kv_cache_memory="64MiB", dtype="float32", progress=False
    )
    yield p
    p.close()


@pytest.fixture(scope="module")
def reference(smollm2_source):
    """``[len(ids) - 1]`` logprobs of prompt tokens 1.. and the log-softmax rows, from transformers."""
    from transformers import AutoModelForCausalLM

    tok = smollm2_source.load_tokenizer()
    ids = tok(PROMPT)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_source.path), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    rows = torch.log_softmax(logits, dim=-1)
    return ids, rows


def test_prompt_logprobs_match_transformers(pipe, reference):
    from pipeline_harness import run_concurrently

    ids, rows = reference
    assert len(ids) > 2 * 16  # several chunks
    other = "Count to twenty: 1, 2, 3,"
    r, _ = run_concurrently(
        [
            lambda: pipe(ids, max_new_tokens=1, temperature=0.0, prompt_logprobs=2)[0],
            lambda: pipe(other, max_new_tokens=24, temperature=0.0)[0],
        ]
    )
    got = r.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    expected = [float(rows[p - 1, ids[p]]) for p in range(1, len(ids))]
    assert [e.token_id for e in got[1:]] == ids[1:]
    assert [e.logprob for e in got[1:]] == pytest.approx(expected, abs=1e-4)
    for p in (1, len(ids) // 2, len(ids) - 1):
        top = rows[p - 1].topk(2)
        assert [t.token_id for t in got[p].top] == top.indices.tolist()
        assert [t.logprob for t in got[p].top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert pipe(ids[:5], max_new_tokens=1, temperature=0.0)[0].prompt_logprobs is None
