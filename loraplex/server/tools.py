"""Tool calling on chat completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.

The tools go into the prompt through the chat template when it takes them (`tools` in the
template, as Hugging Face renders them), else in a system message that lists them and the
format of a call. The answer's calls come back in OpenAI's shape:
- `required`: the output is constrained (a grammar, like any structured output) to a compact
  JSON array of calls, `[{"name": ..., "arguments": {...}}]`, each call's arguments following
  its function's schema (at most one call with `parallel_tool_calls: false`);
- a named function: the output is constrained to that function's arguments;
- `auto` (the default with tools): the model answers freely; an answer that is such an array
  of calls of known tools, or Hermes-style `<tool_call>{...}</tool_call>` blocks, is returned
  as calls;
- `none`: text, whatever the model writes.
Streamed, the calls come as deltas: the call's id and name first, then its arguments' text as
it is generated (`auto` holds back text that may be a call until it is clear)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from loraplex.errors import InvalidRequestError
from loraplex.server.schemas.openai import (
    ChatCompletionRequest,
    FunctionCallDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from loraplex.types import StructuredOutput

NO_ARGUMENTS = {"type": "object", "properties": {}}
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_OPENERS = ("[", "<tool_call>")
"""How an `auto` answer that is a call begins."""


@dataclass(frozen=True)
class ToolMode:
    kind: Literal["none", "auto", "required", "named"]
    function: str | None = None
    """The named function."""
    parallel: bool = True
    names: tuple[str, ...] = ()
    """The tools' names."""

    @property
    def is_constrained(self) -> bool:
        return self.kind in ("required", "named")


def tool_mode(body: ChatCompletionRequest) -> ToolMode | None:
    """The request's tool calling (None: no tools), checked against its tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    names = tuple(tool.function.name for tool in body.tools)
    if len(set(names)) != len(names):
        raise InvalidRequestError("two tools have the same name", param="tools")
    parallel = body.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        return ToolMode(choice or "auto", None, parallel, names)
    if choice.function.name not in names:
        raise InvalidRequestError(f"tool_choice names {choice.function.name!r}, which is not one of the "
                                  "tools", param="tool_choice")
    return ToolMode("named", choice.function.name, parallel, names)


def tool_constraint(body: ChatCompletionRequest, mode: ToolMode | None) -> StructuredOutput | None:
    """The grammar that `required` or a named function puts on the output (None otherwise)."""
    if mode is None or not mode.is_constrained:
        return None
    if mode.kind == "named":
        index = mode.names.index(mode.function)
        return StructuredOutput(json_schema=_json(_parameters(body, index)),
                                param=f"tools.{index}.function.parameters")
    calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "arguments": _parameters(body, i)},
              "required": ["name", "arguments"], "additionalProperties": False}
             for i, name in enumerate(mode.names)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not mode.parallel:
        schema["maxItems"] = 1
    return StructuredOutput(json_schema=_json(schema), param="tools")


def _parameters(body: ChatCompletionRequest, index: int) -> dict[str, Any]:
    return body.tools[index].function.parameters or NO_ARGUMENTS


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# Rendering ----------------------------------------------------------------------------------
def template_takes_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def chat_messages(body: ChatCompletionRequest, takes_tools: bool
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: Hugging Face's forms where the template takes
    tools; else the tools in a system message and earlier calls as their JSON text."""
    messages = []
    for m in body.messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text}
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
                     for c in m.tool_calls]
            if takes_tools:
                message["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                         for c, call in zip(m.tool_calls, calls)]
            else:
                message["content"] = (m.text + "\n" if m.text else "") + _json(calls)
        if m.tool_call_id is not None and takes_tools:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    if not body.tools or body.tool_choice == "none" and not takes_tools:
        return messages, None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if takes_tools:
        return messages, tools
    listing = "\n".join(_json(tool["function"]) for tool in tools)
    text = ("You can call these functions (each with a JSON schema of its arguments):\n" + listing +
            '\nTo call functions, answer with only a JSON array of calls: [{"name": "...", '
            '"arguments": {...}}].')
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages, None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError("a tool call's arguments are not JSON", param="messages") from None


# Answers -------------------------------------------------------------------------------------
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(mode: ToolMode, text: str) -> list[ToolCallOut] | None:
    """The answer's calls, or None if it is text (or calls that do not parse)."""
    if mode.kind == "none":
        return None
    if mode.kind == "named":
        return [_call(mode.function, text)] if _is_json(text) else None
    calls = _array_calls(text, mode.names)
    if calls is None and mode.kind == "auto":
        blocks = HERMES_CALL.findall(text)
        if blocks and not HERMES_CALL.sub("", text).strip():
            calls = [call for block in blocks for call in (_array_calls(f"[{block}]", mode.names) or [])]
            calls = calls if len(calls) == len(blocks) else None
    return calls or None


def _array_calls(text: str, names: tuple[str, ...]) -> list[ToolCallOut] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not (isinstance(item, dict) and item.get("name") in names
                and isinstance(item.get("arguments"), dict)):
            return None
        calls.append(_call(item["name"], _json(item["arguments"])))
    return calls


def _call(name: str, arguments: str) -> ToolCallOut:
    return ToolCallOut(id=new_call_id(), function=FunctionCallOut(name=name, arguments=arguments))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def may_become_call(text: str) -> bool:
    """Whether an `auto` answer that begins so may still turn out to be calls."""
    head = text.lstrip()
    return any(head.startswith(o) or o.startswith(head) for o in TOOL_CALL_OPENERS)


CALL_HEADER = re.compile(r'[\s\[\],}]*\{"name":"((?:[^"\\]|\\.)*)","arguments":')


@dataclass
class ToolCallStream:
    """Turns one choice's constrained output, as it grows, into tool call deltas: a call's id
    and name once its header is complete, then its arguments' text as it comes."""

    mode: ToolMode
    _text: str = ""
    _pos: int = 0
    _index: int = -1
    _in_arguments: bool = False
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    num_calls: int = field(default=0)

    def push(self, new_text: str) -> list[ToolCallDelta]:
        self._text += new_text
        deltas: list[ToolCallDelta] = []
        if self.mode.kind == "named":
            if self._index < 0:
                deltas.append(self._header(self.mode.function))
            if new_text:
                deltas.append(ToolCallDelta(index=0, function=FunctionCallDelta(arguments=new_text)))
            return deltas
        while True:
            if not self._in_arguments:
                match = CALL_HEADER.match(self._text, self._pos)
                if match is None:
                    return deltas
                self._pos = match.end()
                deltas.append(self._header(json.loads(f'"{match.group(1)}"')))
                self._in_arguments, self._depth = True, 0
                continue
            start, end = self._pos, self._scan()
            if self._pos > start:
                deltas.append(ToolCallDelta(index=self._index,
                                            function=FunctionCallDelta(arguments=self._text[start:self._pos])))
            if end is None:
                return deltas
            self._in_arguments = False

    def _header(self, name: str) -> ToolCallDelta:
        self._index += 1
        self.num_calls += 1
        return ToolCallDelta(index=self._index, id=new_call_id(), type="function",
                             function=FunctionCallDelta(name=name, arguments=""))

    def _scan(self) -> int | None:
        """Advance through the arguments' JSON; the end offset once its value closes."""
        text = self._text
        while self._pos < len(text):
            ch = text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return self._pos
        return None
