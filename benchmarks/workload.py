"""The paper's workload, and a closed-loop driver that replays it against any system.

Workload (DeepSpeed-FastGen, Holmes et al. 2024, performance evaluation): prompt and
output lengths are drawn from normal distributions whose standard deviation is 0.3 x their mean.
Prompts are real text: slices, at random offsets, of a corpus tokenized by the model's own
tokenizer. The corpus is built at run time from the docstrings of Python standard-library modules,
so it needs no network and no data file, and is identical on every machine with the same Python.
A fixed seed gives the same requests to every system under test.

Closed loop: N clients; each sends its next request as soon as its previous one finishes, until
the request list is exhausted. The driver is transport-agnostic: it takes a `send` callable that
streams ``(timestamp, n_tokens)`` events, so the in-process pipeline, an HTTP server (OpenAI
client) or ``transformers`` can all be driven by the same code.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

import numpy as np

from benchmarks.metrics import RequestTrace

# Pure-Python (or docstring-stable) standard-library modules whose docstrings form the corpus.
CORPUS_MODULES: tuple[str, ...] = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "email.message", "enum", "fractions", "functools", "heapq", "html.parser", "http.client",
    "inspect", "ipaddress", "json", "logging", "pathlib", "pickle", "pprint", "queue", "random",
    "re", "shlex", "statistics", "string", "textwrap", "threading", "typing", "unittest",
    "urllib.parse", "uuid", "zipfile",
)  # fmt: skip


class Tokenizer(Protocol):
    """What the workload needs from a tokenizer: `transformers` and `tokenizers` both fit.

    ``encode(text, add_special_tokens=False)`` returns ``list[int]`` (transformers) or an object
    with ``.ids`` (tokenizers); ``decode(ids)`` returns the text.
    """

    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request.

    prompt_token_ids: the prompt, as ids of the model's tokenizer (send these where the system
        accepts ids, e.g. OpenAI ``/v1/completions`` with a list of ints: re-tokenizing
        ``prompt_text`` may give a length that differs by a token or two).
    prompt_text: ``tokenizer.decode(prompt_token_ids)``, for systems that accept only text.
    max_new_tokens: number of tokens to generate (tokens). Systems must ignore EOS (or the run
        must report fewer generated tokens) so every system does the same work.
    """

    prompt_token_ids: list[int]
    prompt_text: str
    max_new_tokens: int


# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------


def _module_docs(name: str) -> list[str]:
    """Docstrings of a module, its public classes/functions and their methods, in name order."""
    try:
        with warnings.catch_warnings():  # e.g. typing's deprecated aliases warn when read
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
            return _collect_docs(module)
    except ImportError:  # pragma: no cover - every listed module is stdlib
        return []


def _collect_docs(module: Any) -> list[str]:
    docs = [inspect.getdoc(module) or ""]
    for attr in sorted(vars(module)):
        obj = getattr(module, attr)
        if attr.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj) or inspect.isroutine(obj):
            docs.append(inspect.getdoc(obj) or "")
        if inspect.isclass(obj):
            for member, fn in sorted(vars(obj).items()):
                # other libraries patch stdlib classes (transformers adds logging.Logger methods)
                own = getattr(fn, "__module__", module.__name__) == module.__name__
                if not member.startswith("_") and inspect.isroutine(fn) and own:
                    docs.append(inspect.getdoc(getattr(obj, member)) or "")
    return docs


@lru_cache(maxsize=1)
def build_corpus(max_chars: int = 400_000) -> str:
    """Real English prose (standard-library docstrings), deterministic for a given Python version.

    Returns at most ``max_chars`` characters (about 100k tokens with a 49k-vocab BPE tokenizer);
    identical docstrings are kept once.
    """
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for name in CORPUS_MODULES:
        for doc in _module_docs(name):
            doc = doc.strip()
            if len(doc) < 80 or doc in seen:  # skip one-liners: they are mostly signatures
                continue
            seen.add(doc)
            parts.append(doc)
            size += len(doc) + 2
            if size >= max_chars:
                return "\n\n".join(parts)[:max_chars]
    return "\n\n".join(parts)


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    encoded = tokenizer.encode(text, add_special_tokens=False)
    return list(getattr(encoded, "ids", encoded))


# --------------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------------


def sample_lengths(
    rng: np.random.Generator, n: int, mean: float, std_frac: float, max_len: int | None
) -> list[int]:
    """``n`` lengths (tokens) ~ Normal(mean, std_frac x mean), rounded, clipped to [1, max_len].

    ``max_len`` None means mean + 3 standard deviations.
    """
    if mean <= 0:
        raise ValueError(f"mean length must be positive, got {mean}")
    std = std_frac * mean
    upper = max_len if max_len is not None else int(round(mean + 3 * std))
    draws = np.rint(rng.normal(mean, std, size=n))
    return [int(x) for x in np.clip(draws, 1, max(1, upper))]


def make_requests(
    tokenizer: Tokenizer,
    num_requests: int,
    prompt_mean: float,
    output_mean: float,
    seed: int,
    std_frac: float = 0.3,
    prompt_max: int | None = None,
    output_max: int | None = None,
    corpus: str | None = None,
) -> list[BenchRequest]:
    """The paper's workload: ``num_requests`` requests with normally distributed lengths.

    Args:
        tokenizer: the model's tokenizer (see `Tokenizer`).
        num_requests: how many requests.
        prompt_mean, output_mean: mean prompt / output length (tokens).
        seed: the same seed gives the same requests (same tokenizer and Python version).
        std_frac: standard deviation as a fraction of the mean (paper: 0.3).
        prompt_max, output_max: upper clip (tokens); None means mean + 3 std. Lower clip is 1.
        corpus: text to slice prompts from; default `build_corpus()`.

    Each prompt is a slice of the tokenized corpus at a uniformly drawn offset (the corpus is
    repeated if a prompt is longer than it).
    """
    ids = _encode(tokenizer, corpus if corpus is not None else build_corpus())
    if not ids:
        raise ValueError("corpus tokenized to no tokens")
    rng = np.random.default_rng(seed)
    prompt_lens = sample_lengths(rng, num_requests, prompt_mean, std_frac, prompt_max)
    output_lens = sample_lengths(rng, num_requests, output_mean, std_frac, output_max)
    longest = max(prompt_lens, default=1)
    reps = 1 + -(-longest // len(ids))  # enough copies that every slice fits
    tiled = ids * reps
    offsets = rng.integers(0, len(ids), size=num_requests)
    requests = []
    for plen, olen, off in zip(prompt_lens, output_lens, offsets, strict=True):
        prompt = tiled[int(off) : int(off) + plen]
        requests.append(BenchRequest(prompt, tokenizer.decode(prompt), olen))
    return requests


def shared_prefix_requests(
    tokenizer: Tokenizer,
    num_requests: int,
    system_len: int = 1024,
    question_mean: float = 24,
    output_mean: float = 16,
    seed: int = 0,
    num_prefixes: int = 1,
    corpus: str | None = None,
) -> list[BenchRequest]:
    """Shared-prefix workload (prefix caching): a ``system_len``-token system prompt, then a short
    distinct question (normal length, std 0.3 x mean); request ``i`` uses system prompt
    ``i % num_prefixes`` (several tenants or agents, each with its own prompt).

    Prompts are corpus slices (``make_requests``): system prompts at fixed distinct offsets,
    questions at random ones.
    """
    ids = _encode(tokenizer, corpus if corpus is not None else build_corpus())
    tiled = ids * (1 + -(-(system_len * num_prefixes + 4096) // len(ids)))
    systems = [tiled[k * system_len : (k + 1) * system_len] for k in range(num_prefixes)]
    questions = make_requests(tokenizer, num_requests, question_mean, output_mean, seed, corpus=corpus)
    out = []
    for i, q in enumerate(questions):
        prompt = systems[i % num_prefixes] + q.prompt_token_ids
        out.append(BenchRequest(prompt, tokenizer.decode(prompt), q.max_new_tokens))
    return out


def multi_turn_requests(
    tokenizer: Tokenizer,
    num_conversations: int,
    num_turns: int,
    system_len: int = 256,
    turn_mean: float = 48,
    output_len: int = 32,
    seed: int = 0,
    corpus: str | None = None,
) -> list[BenchRequest]:
    """Multi-turn chat: each turn resends the whole conversation so far (system prompt, every earlier
    user message and reply) plus a new user message; ordered turn by turn (all first turns, then all
    second turns, ...), so with one client per conversation a turn is sent after the one before it.

    The replies in later prompts are corpus text of ``output_len`` tokens, not the model's own output
    (requests are made before the run): a turn can reuse the cached KV of the previous turn's prompt,
    not of its reply.
    """
    ids = _encode(tokenizer, corpus if corpus is not None else build_corpus())
    rng = np.random.default_rng(seed)
    tiled = ids * (1 + -(-(system_len + num_turns * (int(turn_mean * 2) + output_len)) // len(ids)))
    convs = []
    for _ in range(num_conversations):
        off = int(rng.integers(0, len(ids)))
        convs.append(list(tiled[off : off + system_len]))
    out = []
    for _turn in range(num_turns):
        for history in convs:
            n = int(sample_lengths(rng, 1, turn_mean, 0.3, None)[0])
            off = int(rng.integers(0, len(ids)))
            history.extend(tiled[off : off + n])  # the user's message
            prompt = list(history)
            out.append(BenchRequest(prompt, tokenizer.decode(prompt), output_len))
            off = int(rng.integers(0, len(ids)))
            history.extend(tiled[off : off + output_len])  # stands in for the reply
    return out


# --------------------------------------------------------------------------------------------------
# Closed-loop driver
# --------------------------------------------------------------------------------------------------

#: ``send(request)`` streams ``(timestamp, n_tokens)``: each event's time (seconds, on the
#: driver's clock, `time.perf_counter` by default) and how many tokens arrived in it.
SendFn = Callable[[BenchRequest], AsyncIterator[tuple[float, int]]]


@dataclass
class ClosedLoopResult:
    """Traces in request order, and the run's wall time (seconds, first send to last finish)."""

    traces: list[RequestTrace]
    wall_seconds: float


async def closed_loop(
    requests: Sequence[BenchRequest],
    send: SendFn,
    num_clients: int,
    clock: Callable[[], float] = time.perf_counter,
) -> ClosedLoopResult:
    """Drive ``requests`` with ``num_clients`` closed-loop clients (asyncio tasks).

    Each client takes the next unsent request as soon as its previous one has finished. A request
    whose ``send`` raises gets a trace with ``error`` set (it counts as failing the service level);
    the run continues. A ``send`` with an ``aclose`` coroutine function is closed at the end, in
    this event loop.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    traces: list[RequestTrace | None] = [None] * len(requests)
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while next_index < len(requests):
            i = next_index
            next_index += 1  # single event loop: no lock needed
            request = requests[i]
            start = clock()
            token_times: list[float] = []
            error = None
            try:
                async for timestamp, n_tokens in send(request):
                    token_times.extend([timestamp] * n_tokens)
            except Exception as exc:  # recorded, not raised: one bad request must not end the run
                error = f"{type(exc).__name__}: {exc}"
            traces[i] = RequestTrace(
                start=start,
                token_times=token_times,
                prompt_tokens=len(request.prompt_token_ids),
                output_tokens=len(token_times),
                end=clock(),
                error=error,
            )

    t0 = clock()
    await asyncio.gather(*(client() for _ in range(min(num_clients, max(1, len(requests))))))
    wall = clock() - t0
    close = getattr(send, "aclose", None)  # a sender holding connections of this loop closes them
    if close is not None:
        await close()
    return ClosedLoopResult([t for t in traces if t is not None], wall)


def run_closed_loop(requests: Sequence[BenchRequest], send: SendFn, num_clients: int) -> ClosedLoopResult:
    """Blocking wrapper: `closed_loop` in a fresh event loop."""
    return asyncio.run(closed_loop(requests, send, num_clients))


def send_from_blocking(
    stream: Callable[[BenchRequest], Iterable[int]],
    clock: Callable[[], float] = time.perf_counter,
) -> SendFn:
    """Adapt a blocking streaming call into a `SendFn`.

    ``stream(request)`` yields, for each streamed event, the number of tokens it carried (e.g. a
    pipeline's streaming generator mapped to ``len(new_ids)``). It runs in its own thread, so
    several clients can call it concurrently; the timestamp is taken in that thread when the event
    is produced.
    """

    async def send(request: BenchRequest) -> AsyncIterator[tuple[float, int]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def worker() -> None:
            try:
                for n_tokens in stream(request):
                    item = (clock(), int(n_tokens))
                    loop.call_soon_threadsafe(queue.put_nowait, ("item", item))
            except BaseException as exc:  # forwarded to the awaiting client
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
            else:
                loop.call_soon_threadsafe(queue.put_nowait, ("done", None))

        threading.Thread(target=worker, daemon=True).start()
        while True:
            kind, value = await queue.get()
            if kind == "item":
                yield value
            elif kind == "error":
                raise value
            else:
                return

    return send


def iter_token_counts(chunks: Iterator[Sequence[int]]) -> Iterator[int]:
    """Map a stream of token-id chunks to their sizes (helper for `send_from_blocking`)."""
    for chunk in chunks:
        yield len(chunk)
