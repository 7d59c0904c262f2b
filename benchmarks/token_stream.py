"""Per-token events from an in-process `fuseserve.Pipeline`, for benchmark timing.

``Pipeline.stream`` yields text deltas: a delta can hold several tokens (a multi-byte character
completed late) or none. The benchmark needs one timestamp per generated token, so this helper
submits through the pipeline's request queue and reads its token events directly. It uses the
pipeline's private ``_submit`` / ``_command`` (a public ``Pipeline.stream_tokens`` would replace it).
No detokenization is done, like the ``transformers`` peers.
"""

from __future__ import annotations

from collections.abc import Iterator

from fuseserve.sampling_params import SamplingParams


def stream_tokens(pipe, prompt_ids: list[int], max_new_tokens: int) -> Iterator[int]:
    """Greedy, EOS ignored: yield 1 per generated token as soon as the engine thread hands it over.

    Raises whatever the engine reports for the request (e.g. ``ContextLengthExceededError``).
    """
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True).validate()
    req = pipe._submit(list(prompt_ids), params)
    try:
        while req.finish_reason is None:
            ev = req.events.get()
            if isinstance(ev, BaseException):
                raise ev
            if ev.token is not None:
                yield 1
            if ev.finish_reason is not None:
                req.finish_reason = ev.finish_reason.value
    finally:
        if req.finish_reason is None:  # consumer stopped early
            req.finish_reason = "abort"
            pipe._command("abort", req.seq_id)
