"""Compilation is opt-in: the ``compile`` option decides, unless ``$FUSESERVE_COMPILE`` forces it."""

from __future__ import annotations

import pytest

from fuseserve.config import EngineConfig
from fuseserve.options import flag_of
from fuseserve.worker import compiled_forward


def test_off_by_default_with_an_opt_in_flag():
    field = EngineConfig.__dataclass_fields__["compile"]
    assert EngineConfig().compile is False
    assert flag_of(field) == "--compile"


@pytest.mark.parametrize(
    ("env", "option", "wanted"),
    [(None, False, False), (None, True, True), ("0", True, False), ("1", False, True), ("x", True, True)],
)
def test_the_environment_forces_either_way(monkeypatch, env, option, wanted):
    if env is None:
        monkeypatch.delenv(compiled_forward.ENV_SWITCH, raising=False)
    else:
        monkeypatch.setenv(compiled_forward.ENV_SWITCH, env)
    assert compiled_forward.wanted(option) is wanted
