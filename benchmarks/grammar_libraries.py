"""xgrammar vs llguidance on SmolLM2's tokenizer (49152 tokens): compile time and per-token mask fill.

    .venv/bin/pip install llguidance   # not a dependency; only this comparison uses it
    .venv/bin/python benchmarks/grammar_libraries.py

Prints, per library: tokenizer preparation (s), compile of a mid-size JSON schema (ms, cache off),
mean / max mask fill per token (µs) while matching one valid document, and regex / grammar compile.
Figures and the choice are in ``benchmarks/README.md`` (Structured output).
"""

from __future__ import annotations

import json
import time

from fuseserve.model_source import resolve_model

V = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string"},
            },
            "required": ["street", "city"],
        },
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
}
DOC = {
    "name": "Ann",
    "age": 31,
    "email": "ann@x.com",
    "tags": ["a", "b"],
    "address": {"street": "Main 1", "city": "Oslo"},
    "role": "admin",
    "score": 1.5,
    "active": True,
}


def _fill_stats(fill, accept, ids) -> str:
    times = []
    for t in ids:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        assert accept(t)
    return f"mask fill mean {1e6 * sum(times) / len(times):.0f} us, max {1e6 * max(times):.0f} us over {len(ids)} tokens"


def bench_xgrammar(tok, ids) -> None:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V)
    print(f"xgrammar: tokenizer info {time.perf_counter() - start:.3f} s")
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    grammar = compiler.compile_json_schema(json.dumps(SCHEMA))
    print(f"xgrammar: compile schema {1e3 * (time.perf_counter() - start):.1f} ms")
    matcher, mask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, V)
    print("xgrammar:", _fill_stats(lambda: matcher.fill_next_token_bitmask(mask), matcher.accept_token, ids))
    for kind, build in (
        ("regex", lambda: compiler.compile_regex(r"[a-z]+@[a-z]+\.com")),
        ("EBNF", lambda: compiler.compile_grammar('root ::= "yes" | "no"')),
    ):
        start = time.perf_counter()
        build()
        print(f"xgrammar: compile {kind} {1e3 * (time.perf_counter() - start):.1f} ms")


def bench_llguidance(tok, ids) -> None:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lgt
    except ImportError:
        print("llguidance: not installed (pip install llguidance)")
        return
    start = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    print(f"llguidance: tokenizer {time.perf_counter() - start:.3f} s")
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    print(f"llguidance: compile schema + matcher {1e3 * (time.perf_counter() - start):.1f} ms")
    mask = lgt.allocate_token_bitmask(1, V)
    print(
        "llguidance:",
        _fill_stats(lambda: lgt.fill_next_token_bitmask(matcher, mask, 0), matcher.consume_token, ids),
    )
    for kind, grammar in (
        ("regex", llguidance.LLMatcher.grammar_from_regex(r"[a-z]+@[a-z]+\.com")),
        ("lark", llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"')),
    ):
        start = time.perf_counter()
        llguidance.LLMatcher(ltok, grammar)
        print(f"llguidance: compile {kind} {1e3 * (time.perf_counter() - start):.1f} ms")


def main() -> None:
    tok = resolve_model("smollm2-135m-instruct", progress=False).load_tokenizer()
    ids = tok.encode(json.dumps(DOC), add_special_tokens=False)
    bench_xgrammar(tok, ids)
    bench_llguidance(tok, ids)


if __name__ == "__main__":
    main()
