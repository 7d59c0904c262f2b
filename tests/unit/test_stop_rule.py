"""``fuseserve.stop_rule.check_stop``: the one token-level stop rule of the scheduler and the worker."""

from fuseserve.sampling_params import SamplingParams
from fuseserve.stop_rule import check_stop
from fuseserve.types import FinishReason

EOS = 0


def _params(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw).validate()


def test_eos_and_stop_ids_stop_once_min_new_tokens_exist():
    p = _params(max_new_tokens=10, min_new_tokens=2, stop_token_ids=[7])
    assert check_stop(p, EOS, 1, 5, {EOS}, 100) is None  # under min_new_tokens: goes on
    assert check_stop(p, EOS, 2, 6, {EOS}, 100) is FinishReason.STOP
    assert check_stop(p, 7, 2, 6, {EOS}, 100) is FinishReason.STOP
    assert check_stop(p, 5, 2, 6, {EOS}, 100) is None


def test_ignore_eos_keeps_stop_ids():
    p = _params(max_new_tokens=10, ignore_eos=True, stop_token_ids=[7])
    assert check_stop(p, EOS, 1, 5, {EOS}, 100) is None
    assert check_stop(p, 7, 1, 5, {EOS}, 100) is FinishReason.STOP


def test_length_by_max_new_tokens_or_the_context_window():
    p = _params(max_new_tokens=3)
    assert check_stop(p, 5, 3, 8, {EOS}, 100) is FinishReason.LENGTH
    assert check_stop(p, 5, 1, 100, {EOS}, 100) is FinishReason.LENGTH
    assert check_stop(p, 5, 1, 99, {EOS}, 100) is None
    assert check_stop(p, EOS, 3, 8, {EOS}, 100) is FinishReason.STOP  # a stop token wins over length
