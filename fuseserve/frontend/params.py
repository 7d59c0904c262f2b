"""``SamplingParams``' own field definitions, mapped to every surface that carries them.

One table (the dataclass fields and their metadata, see ``fuseserve.sampling_params._param``)
drives the OpenAI request body (the gateway's protocol models and the Python client), the
``fuseserve generate`` flags, and the proto conversion (``proto/convert.py``, by field name). A new
``SamplingParams`` field flows through all of them without a hand edit; only a field whose OpenAI
shape differs per endpoint (``logprobs``) is mapped by hand, with ``openai=None``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from fuseserve.sampling_params import SamplingParams


def _fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(SamplingParams))


def _hints() -> dict[str, Any]:
    import fuseserve.sampling_params as module

    return typing.get_type_hints(SamplingParams, vars(module))


def openai_names() -> dict[str, str]:
    """``{SamplingParams field: OpenAI body field}`` for every field mapped generically."""
    out = {}
    for f in _fields():
        name = f.metadata.get("openai", "")
        if name is not None:
            out[f.name] = name or f.name
    return out


def openai_model_fields() -> dict[str, tuple[Any, None]]:
    """Pydantic field definitions ``{body name: (type | None, None)}`` for the protocol models.

    Every field is optional in a body: None means "the ``SamplingParams`` default" (or, for
    ``max_tokens``, whatever fits the context).
    """
    hints = _hints()
    out: dict[str, tuple[Any, None]] = {}
    for f in _fields():
        name = f.metadata.get("openai", "")
        if name is None:
            continue
        typ = f.metadata.get("openai_type") or hints[f.name] | None
        out[name or f.name] = (typ, None)
    return out


def params_kwargs_from_body(body: Any) -> dict[str, Any]:
    """``SamplingParams`` keywords from an OpenAI body (a pydantic model or a dict); unset (None)
    fields are left out, so they take the ``SamplingParams`` default."""
    get = body.get if isinstance(body, dict) else lambda k: getattr(body, k, None)
    out = {}
    for field_name, body_name in openai_names().items():
        value = get(body_name)
        if value is not None:
            out[field_name] = value
    return out


def body_from_params(params: SamplingParams) -> dict[str, Any]:
    """The OpenAI body fields of ``params`` (every generically mapped field, lists copied)."""
    return {
        body_name: (list(v) if isinstance(v := getattr(params, name), list | tuple) else v)
        for name, body_name in openai_names().items()
    }


# ------------------------------------------------------------------------------------- the CLI
def _base_type(hint: Any) -> tuple[Any, bool]:
    """``(element type, is_list)`` of a field's type hint, None stripped (``int | None`` → int)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


def add_cli_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None) -> None:
    """One ``--field-name`` flag per ``SamplingParams`` field with ``cli`` set, in a "sampling" group.

    defaults: CLI defaults that differ from the dataclass (e.g. greedy for ``generate``). Lists are
    repeatable flags; booleans are switches. Unset flags are left out of :func:`cli_kwargs`.
    """
    defaults = defaults or {}
    hints = _hints()
    group = parser.add_argument_group("sampling")
    for f in _fields():
        if not f.metadata.get("cli", False):
            continue
        flag = "--" + f.name.replace("_", "-")
        typ, is_list = _base_type(hints[f.name])
        default = defaults.get(f.name)
        shown = (
            default if f.name in defaults else (f.default if f.default is not dataclasses.MISSING else None)
        )
        help_text = f.metadata["help"] + (
            f" (default: {shown})" if shown is not None and shown is not False else ""
        )
        help_text = help_text.replace("%", "%%")
        if typ is bool:
            group.add_argument(flag, action="store_true", default=None, help=help_text)
        elif is_list:
            group.add_argument(flag, type=typ, action="append", default=None, help=help_text)
        else:
            group.add_argument(flag, type=typ, default=default, help=help_text)


def cli_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``SamplingParams`` keywords from parsed flags (flags left unset are left out)."""
    out = {}
    for f in _fields():
        value = getattr(args, f.name, None)
        if f.metadata.get("cli", False) and value is not None:
            out[f.name] = value
    return out
