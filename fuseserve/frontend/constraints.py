"""Request fields that constrain the output: structured output, tools, ``logit_bias``.

Accepted shapes (OpenAI and vLLM), each mapped onto one ``SamplingParams`` constraint
(``fuseserve/structured.py``):

- ``response_format``: ``{"type": "json_object"}`` (schema ``{"type": "object"}``),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``, ``{"type": "text"}``;
- vLLM's ``structured_outputs`` ``{json, regex, choice, grammar, json_object}`` and its older
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- ``tools`` with ``tool_choice`` ``"required"`` or a named function (``fuseserve/tools.py``);
- ``logit_bias``: ``{"<token id>": bias}``, bias in [-100, 100].

At most one constraint per request (a 400 names the two that collide). Whether the grammar library
can compile it is checked by the caller (``GrammarBackend.check``), also a 400 saying why. The
gateway's request models (``services/gateway/protocol.py``) use these shapes and the front end's
``openai_params`` maps them, so they live here, beside it (the front end imports no service).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fuseserve.errors import InvalidParameterError, InvalidRequestError
from fuseserve.sampling_params import MAX_LOGIT_BIAS
from fuseserve.tools import ToolCallParser, check_tools, forced_call_schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: ``schema`` is the JSON Schema (``strict`` is always honoured)."""

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (one of the fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(_Strict):
    """A tool's function: ``parameters`` is its arguments' JSON Schema."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    """A history call: ``arguments`` is JSON text, as the API returned it."""

    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _dump_tools(tools: list[Tool] | None) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tools or []]


def constraint_kwargs(req, vocab_size: int) -> dict:
    """``SamplingParams`` keywords for the request's constraint and ``logit_bias``.

    Raises ``InvalidRequestError`` / ``InvalidParameterError`` naming the field: two constraints at
    once, ``json_schema`` without a schema, a tool choice naming no tool, a ``logit_bias`` key that
    is not a token id of the model or a bias outside [-100, 100].
    """
    found: list[tuple[str, str, Any]] = []  # (request field, SamplingParams field, value)
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json_schema", {"type": "object"}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequestError(
                'response_format type "json_schema" needs json_schema.schema', param="response_format"
            )
        found.append(("response_format", "json_schema", rf.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        for name, field_ in (
            ("json_", "json_schema"),
            ("regex", "regex"),
            ("choice", "choice"),
            ("grammar", "grammar"),
        ):
            if getattr(so, name) is not None:
                found.append(("structured_outputs", field_, getattr(so, name)))
        if so.json_object:
            found.append(("structured_outputs", "json_schema", {"type": "object"}))
    for name, field_ in (
        ("json", "json_schema"),
        ("regex", "regex"),
        ("choice", "choice"),
        ("grammar", "grammar"),
    ):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", field_, value))
    forced = forced_tool_schema(req)
    if forced is not None:
        found.append(("tool_choice", "json_schema", forced))
    if len(found) > 1:
        raise InvalidRequestError(
            f"only one output constraint per request; got {found[0][0]} and {found[1][0]}", param=found[1][0]
        )
    kwargs: dict = {found[0][1]: found[0][2]} if found else {}
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias, vocab_size)
    return kwargs


def _logit_bias(bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise InvalidParameterError("logit_bias", key, f"token ids in [0, {vocab_size}) as keys")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidParameterError(
                "logit_bias", value, f"biases in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        out[int(key)] = value
    return out


def _tool_choice(req):
    """The effective ``tool_choice``: as sent, else ``"auto"`` with tools and ``"none"`` without."""
    choice = getattr(req, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        return choice.model_dump()
    return choice or ("auto" if getattr(req, "tools", None) else "none")


def forced_tool_schema(req) -> dict | None:
    """The schema of a ``required`` / named tool choice (validated against ``tools``), else None."""
    tools = _dump_tools(getattr(req, "tools", None))
    choice = _tool_choice(req)
    if choice == "none" and not tools:
        return None
    check_tools(tools, choice)
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else True
    return forced_call_schema(tools, choice, parallel)


def rendered_tools(req) -> list[dict] | None:
    """The tools to render into the prompt (None with ``tool_choice`` ``"none"`` or no tools)."""
    tools = _dump_tools(getattr(req, "tools", None))
    return tools if tools and _tool_choice(req) != "none" else None


def tool_parser_factory(req):
    """A no-argument factory of the request's ``ToolCallParser`` per choice, or None (no parsing)."""
    if not rendered_tools(req):
        return None
    choice = _tool_choice(req)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return lambda: ToolCallParser("named", name)
    mode = "required" if choice == "required" else "auto"
    return lambda: ToolCallParser(mode)
