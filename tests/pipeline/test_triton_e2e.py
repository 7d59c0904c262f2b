"""SmolLM2-135M-Instruct end to end with the Triton attention backend: the same greedy tokens as the CPU
path (the torch reference backend) for two short chat prompts.

Without a GPU the Triton kernels run in Triton's interpreter, which is slow (numpy per program), so
the prompts are short, the answers 8 tokens, and the token budget 16 so the first prompt is cut into
chunks that continue earlier KV beside the other sequence's decode tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

PROMPTS = ["What is the capital of France?", "List three prime numbers."]
NEW_TOKENS = 8


def greedy(source, backend):
    import fuseserve

    pipe = fuseserve.pipeline(
        str(source.path),
        token_budget=16,
        kv_cache_memory="64MiB",
        attention_backend=backend,
        dtype="float32",
        progress=False,
    )
    try:
        ids = [pipe.chat_prompt_ids([{"role": "user", "content": c}]) for c in PROMPTS]
        outs = pipe(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in outs], pipe.runner.backend.name
    finally:
        pipe.close()


@pytest.mark.slow
def test_triton_backend_smollm2_greedy_equals_cpu_path(smollm2_source):
    want, name = greedy(smollm2_source, "torch")
    assert name == "torch"
    got, name = greedy(smollm2_source, "triton")
    assert name == "triton"
    assert got == want
    assert all(len(t) == NEW_TOKENS for t in got)
