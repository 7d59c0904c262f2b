"""Tool calls: render tools into the prompt, constrain forced calls, parse calls out of the output.

Format (Hermes / Qwen2.5 style, the one tool-capable chat templates use): the model writes each call
as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A chat template that reads
``tools`` renders them itself; for one that does not (SmolLM2's), :func:`render_messages` puts the
generic block :data:`GENERIC_TOOLS_PROMPT` into the system message and renders history tool calls and
``tool`` results as text (``docs/structured_output.md``).

``tool_choice`` (OpenAI):

- ``"none"``: tools are not rendered and the output is never parsed for calls;
- ``"auto"``: unconstrained; :class:`ToolCallParser` finds ``<tool_call>`` blocks;
- ``"required"``: the output is grammar-constrained to a JSON array of ``{"name", "parameters"}``
  objects (at least one; exactly one when ``parallel_tool_calls`` is false), as vLLM does;
- a named function: the output is constrained to that function's ``parameters`` schema and is the
  call's ``arguments``.

:class:`ToolCallParser` is incremental: feed it text deltas, get content deltas and tool-call deltas
(OpenAI streaming shape), so one implementation serves whole and streamed responses.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from fuseserve.errors import InvalidRequestError

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
"""System-prompt block for chat templates without tool support (``{tools}``: one JSON per line)."""

_ANY_OBJECT = {"type": "object"}


def template_supports_tools(template: str | None) -> bool:
    """True when the chat template (Jinja text) reads a ``tools`` variable."""
    return "tools" in (template or "")


def check_tools(tools: list[dict], tool_choice) -> str | None:
    """Validate ``tool_choice`` against ``tools``; returns the forced function's name, or None.

    ``tools``: OpenAI tool dicts ``{"type": "function", "function": {"name", "parameters"?}}``.
    Raises ``InvalidRequestError`` (param ``tool_choice`` / ``tools``) for a choice naming no tool,
    ``required`` / a named choice without tools, or duplicate tool names.
    """
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be unique", param="tools")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {name!r}, which is not in tools ({', '.join(names) or 'none'})",
                param="tool_choice",
            )
        return name
    if tool_choice == "required" and not tools:
        raise InvalidRequestError('tool_choice "required" needs at least one tool', param="tool_choice")
    return None


def forced_call_schema(tools: list[dict], tool_choice, parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema that constrains the output for ``required`` / a named choice; None otherwise.

    Named: the function's ``parameters`` (the output is the arguments). Required: an array of
    ``{"name": <one of the tools>, "parameters": <its schema>}``, 1 item at least (at most 1 without
    ``parallel_tool_calls``).
    """
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if isinstance(tool_choice, dict):
        return by_name[tool_choice["function"]["name"]].get("parameters") or _ANY_OBJECT
    if tool_choice != "required":
        return None
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": f.get("parameters") or _ANY_OBJECT,
            },
            "required": ["name", "parameters"],
        }
        for name, f in by_name.items()
    ]
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def check_tool_messages(messages: list[dict]) -> None:
    """Raise ``InvalidRequestError`` (param ``messages``) for a malformed tool exchange.

    A ``tool`` message needs a ``tool_call_id`` naming a call of an earlier assistant message, and
    only assistant messages may carry ``tool_calls`` (each with a JSON-object ``arguments``).
    """
    call_ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                raise InvalidRequestError(
                    f"messages[{i}]: only assistant messages carry tool_calls", param="messages"
                )
            for c in m["tool_calls"]:
                _arguments_object(c)
                call_ids.add(c["id"])
        if m["role"] == "tool":
            if not m.get("tool_call_id"):
                raise InvalidRequestError(
                    f"messages[{i}]: a tool message needs tool_call_id", param="messages"
                )
            if m["tool_call_id"] not in call_ids:
                raise InvalidRequestError(
                    f"messages[{i}]: tool_call_id {m['tool_call_id']!r} answers no earlier assistant tool call",
                    param="messages",
                )


def render_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> tuple[list[dict], dict]:
    """Chat turns (and extra ``apply_chat_template`` kwargs) for messages that may involve tools.

    ``messages``: dicts with ``role``, ``content`` (str), optional ``tool_calls`` (OpenAI shape,
    ``arguments`` a JSON string) and ``tool_call_id``. ``native``: the template renders tools itself
    (then turns keep ``tool_calls`` / the ``tool`` role and ``tools`` is passed through); else tools
    go into the system message as :data:`GENERIC_TOOLS_PROMPT`, assistant calls become
    ``<tool_call>`` text and tool results become user turns in ``<tool_response>`` tags.
    """
    if native:
        turns = []
        for m in messages:
            turn = {"role": m["role"], "content": m["content"]}
            if m.get("tool_calls"):
                turn["tool_calls"] = [
                    {**c, "function": {**c["function"], "arguments": _arguments_object(c)}}
                    for c in m["tool_calls"]
                ]
            if m.get("tool_call_id"):
                turn["tool_call_id"] = m["tool_call_id"]
            turns.append(turn)
        return turns, ({"tools": tools} if tools else {})
    turns = []
    for m in messages:
        if m["role"] == "tool":
            turns.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
            continue
        content = m["content"]
        for c in m.get("tool_calls") or []:
            call = {"name": c["function"]["name"], "arguments": _arguments_object(c)}
            content += f"{TOOL_CALL_START}\n{json.dumps(call)}\n{TOOL_CALL_END}"
        turns.append({"role": m["role"], "content": content})
    if tools:
        block = GENERIC_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{block}"}
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns, {}


def _arguments_object(call: dict) -> dict:
    """A history call's ``arguments`` JSON string as an object; a malformed one is a 400."""
    raw = call["function"].get("arguments") or "{}"
    try:
        value = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError as exc:
        raise InvalidRequestError(f"tool call arguments are not JSON: {exc}", param="messages") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError("tool call arguments must be a JSON object", param="messages")
    return value


# ------------------------------------------------------------------------------------------- parsing
@dataclass
class ToolCallDelta:
    """One streamed piece of a call (OpenAI ``delta.tool_calls[i]``); id/name only on its first piece."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
        fn: dict = {"arguments": self.arguments}
        if self.name is not None:
            fn["name"] = self.name
        out["function"] = fn
        return out


@dataclass
class ParsedDelta:
    """What one ``feed`` produced: visible content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser:
    """Splits model output into content and tool calls, incrementally.

    mode: ``"auto"`` (``<tool_call>`` blocks inside free text), ``"named"`` (the whole output is the
    arguments of ``name``; streamed as argument pieces) or ``"required"`` (the whole output is a JSON
    array of ``{"name", "parameters"}``; its calls come out at :meth:`finish`).
    ``calls``: complete calls so far, as OpenAI ``tool_calls`` entries.
    """

    def __init__(self, mode: str = "auto", name: str | None = None):
        if mode not in ("auto", "named", "required") or (mode == "named") != (name is not None):
            raise ValueError(f"bad parser mode {mode!r} / name {name!r}")
        self.mode = mode
        self.name = name
        self.calls: list[dict] = []
        self._buffer = ""  # auto: text not yet emitted; forced modes: the whole output
        self._in_call = False
        self._named_started = False

    def feed(self, text: str) -> ParsedDelta:
        """Consume the next text delta; returns what can be emitted now."""
        if self.mode == "named":
            return self._feed_named(text)
        self._buffer += text
        if self.mode == "required":
            return ParsedDelta()
        out = ParsedDelta()
        while True:
            if self._in_call:
                end = self._buffer.find(TOOL_CALL_END)
                if end < 0:
                    return out
                self._emit_call(self._buffer[:end], out)
                self._buffer = self._buffer[end + len(TOOL_CALL_END) :]
                self._in_call = False
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start >= 0:
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(TOOL_CALL_START) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buffer, TOOL_CALL_START)  # a tag may be split across deltas
            out.content += self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep :]
            return out

    def push(self, text: str, delta) -> None:
        """The shared front end's ``TextParser`` protocol: :meth:`feed` ``text``, adding the content
        to ``delta.text`` and the tool-call pieces to ``delta.tool_calls``."""
        parsed = self.feed(text)
        delta.text += parsed.content
        delta.tool_calls.extend(parsed.tool_calls)

    def finish(self, delta=None) -> ParsedDelta:
        """Flush at the end of the output: held-back text, an unterminated call, the forced array.

        With ``delta`` (the front end's ``TextParser`` protocol) the flushed pieces are also added
        to ``delta.text`` / ``delta.tool_calls``.
        """
        out = self._flush()
        if delta is not None:
            delta.text += out.content
            delta.tool_calls.extend(out.tool_calls)
        return out

    def _flush(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "named":
            if not self._named_started:  # empty output: still one call
                out = self._feed_named("")
            return out
        if self.mode == "required":
            try:
                items = json.loads(self._buffer)
            except ValueError:
                items = None
            if isinstance(items, list) and all(isinstance(i, dict) and "name" in i for i in items):
                for item in items:
                    args = json.dumps(item.get("parameters", item.get("arguments", {})))
                    self._append(out, str(item["name"]), args)
            else:
                out.content = self._buffer  # cut off (length): shown as content, not a broken call
            self._buffer = ""
            return out
        if self._in_call and not self._emit_call(self._buffer, out):
            out.content += TOOL_CALL_START + self._buffer
        elif not self._in_call:
            out.content += self._buffer
        self._buffer, self._in_call = "", False
        return out

    # ----- helpers
    def _feed_named(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if not self._named_started:
            self._named_started = True
            self.calls.append(_call(self.name, text))
            out.tool_calls.append(ToolCallDelta(0, text, self.calls[0]["id"], self.name))
        elif text:
            out.tool_calls.append(ToolCallDelta(0, text))
            self.calls[0]["function"]["arguments"] += text
        return out

    def _emit_call(self, body: str, out: ParsedDelta) -> bool:
        """Parse one ``{"name", "arguments"}`` body; False (nothing emitted) when it is not one."""
        try:
            call = json.loads(body)
        except ValueError:
            return False
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return False
        args = call.get("arguments", call.get("parameters", {}))
        self._append(out, call["name"], args if isinstance(args, str) else json.dumps(args))
        return True

    def _append(self, out: ParsedDelta, name: str, arguments: str) -> None:
        call = _call(name, arguments)
        self.calls.append(call)
        out.tool_calls.append(ToolCallDelta(len(self.calls) - 1, arguments, call["id"], name))


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: str, arguments: str) -> dict:
    """A new OpenAI ``tool_calls`` entry with a fresh id."""
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
