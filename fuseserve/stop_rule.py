"""The token-level stop rule, one pure function for the scheduler and the worker.

``check_stop`` is used by the scheduler's postprocess (``Scheduler.postprocess``), its multi-pass
path (``fuseserve.scheduler.result_applier.ResultApplier``) and the worker's multi-pass loop
(``fuseserve.worker.multi_pass_run.run_passes``), so the three agree on when a sequence ends (vLLM's
``check_stop``, ``v1/core/sched/utils.py``). Stop strings are the front end's (``fuseserve/stop.py``).
"""

from __future__ import annotations

from collections.abc import Container

from fuseserve.sampling_params import SamplingParams
from fuseserve.types import FinishReason


def check_stop(
    params: SamplingParams,
    token_id: int,
    num_output: int,
    num_tokens: int,
    eos_token_ids: Container[int],
    max_model_len: int,
) -> FinishReason | None:
    """Why a sequence ends having just sampled ``token_id``, or None when it goes on.

    ``num_output``: generated tokens, ``token_id`` included; ``num_tokens``: prompt + generated
    tokens, ``token_id`` included; ``max_model_len``: the context window (tokens).

    ``STOP``: EOS (unless ``ignore_eos``) or a ``stop_token_ids`` id, once ``min_new_tokens`` exist;
    the token is then hidden from the text. ``LENGTH``: ``max_new_tokens`` or the context window.
    """
    if num_output >= params.min_new_tokens and (
        (token_id in eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids
    ):
        return FinishReason.STOP
    if num_output >= params.max_new_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
