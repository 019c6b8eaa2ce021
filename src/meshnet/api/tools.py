"""``tools``, ``tool_choice`` and ``parallel_tool_calls``: rendered, read back, enforced.

The tools go to the model's own chat template as ``tools`` (as Hugging Face's
``apply_chat_template`` passes them); a template that does not render tools
gets them described in a system message (model/reply_format.py). Calls are
read back from the reply in the template's syntax (model/tool_syntax.py,
model/harmony.py). ``tool_choice``:

- ``auto`` (the default with tools): the model may call; calls are read back;
- ``none``: the tools are not shown and nothing is read as a call;
- ``required``: a grammar (the structured-output engine) makes the reply
  nothing but calls; with ``parallel_tool_calls: false``, exactly one;
- a named function: the grammar makes the reply one call of it.

An assistant message's ``tool_calls`` and a ``tool`` message's ``tool_call_id``
go back into the template. ``reasoning_effort`` is a template variable
(gpt-oss's); a template that does not read it refuses it with a 400.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from meshnet.errors import FieldError
from meshnet.model.chat import ChatMessage, ChatTemplate
from meshnet.model.harmony import harmony_grammar
from meshnet.model.reply_format import ReplyFormat, tools_system_text
from meshnet.model.tokenizer import TextTokenizer
from meshnet.model.tool_syntax import Function, Spell, ToolCall

MAX_TOOLS = 128
MAX_TOOL_SCHEMA_CHARS = 64 * 1024
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FunctionSpec(_Strict):
    name: FunctionName
    description: str | None = Field(default=None, max_length=8192)
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool | None = None


class ToolSpec(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: FunctionName
    arguments: str = Field(max_length=1_000_000)


class ToolCallIn(_Strict):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True)
class ChatPlan:
    """How one chat request is rendered and how its reply is read."""

    messages: list[ChatMessage]
    variables: dict[str, Any]  # more template variables: tools, reasoning_effort
    format: ReplyFormat
    reads_calls: bool  # calls are read back from the reply
    parallel: bool  # more than one call may be returned
    grammar: str | None = None  # a grammar that forces calls (required / named)

    @property
    def shapes_reply(self) -> bool:
        """Whether the reply is split into parts (else it is all content)."""
        f = self.format
        return self.reads_calls or f.think or f.harmony

    def calls(self, calls: Sequence[ToolCall]) -> tuple[ToolCall, ...]:
        """The calls to return: one at most unless parallel."""
        return tuple(calls) if self.parallel else tuple(calls[:1])


def plan_chat(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolSpec] | None,
    choice: ToolChoice | None,
    parallel: bool,
    reasoning_effort: str | None,
    template: ChatTemplate,
    tokenizer: TextTokenizer,
) -> ChatPlan:
    """The plan for a chat request; ``FieldError`` naming the field it cannot honour."""
    fmt = template.reply_format
    variables: dict[str, Any] = {}
    if reasoning_effort is not None:
        if "reasoning_effort" not in template.source:
            raise FieldError("reasoning_effort", "this model's chat template has no such setting")
        variables["reasoning_effort"] = reasoning_effort
    choice = choice if choice is not None else ("auto" if tools else "none")
    # a template that cannot render calls and results reads them as text
    written = list(messages) if fmt.renders_tools else _written(messages)
    if not tools:
        if choice not in ("auto", "none"):
            raise FieldError("tool_choice", "needs tools")
        return ChatPlan(written, variables, fmt, False, parallel)
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"at most {MAX_TOOLS} tools")
    functions = tuple(_function(t) for t in tools)
    if choice == "none":
        return ChatPlan(written, variables, fmt, False, parallel)
    forced = _forced(functions, choice)
    if fmt.renders_tools:
        variables["tools"] = [t.model_dump(exclude_none=True) for t in tools]
        shown = written
    else:
        descriptions = [t.function.description or "" for t in tools]
        shown = _described(written, tools_system_text(functions, descriptions))
    grammar = None
    if isinstance(choice, NamedToolChoice):
        parallel = False  # a named function: one call of it, as OpenAI makes
    if forced:
        spell = _speller(tokenizer)
        if fmt.harmony:
            grammar = harmony_grammar(forced, spell)
        else:
            grammar = fmt.tools.grammar(forced, parallel, spell)
    return ChatPlan(shown, variables, fmt, True, parallel, grammar)


def _function(tool: ToolSpec) -> Function:
    f = tool.function
    if len(json.dumps(f.parameters)) > MAX_TOOL_SCHEMA_CHARS:
        raise FieldError("tools", f"{f.name}'s parameters exceed {MAX_TOOL_SCHEMA_CHARS} chars")
    return Function(f.name, f.parameters)


def _forced(functions: tuple[Function, ...], choice: ToolChoice) -> tuple[Function, ...]:
    """The functions a grammar must restrict the reply to; () when none is forced."""
    if choice == "auto":
        return ()
    if choice == "required":
        return functions
    assert isinstance(choice, NamedToolChoice)  # the type admits nothing else
    named = [f for f in functions if f.name == choice.function.name]
    if not named:
        raise FieldError("tool_choice", f"no tool is named {choice.function.name!r}")
    return tuple(named)


def _described(messages: list[ChatMessage], system: str) -> list[ChatMessage]:
    """``messages`` with the tools described in the system message."""
    if messages and messages[0].role == "system":
        first = messages[0].content or ""
        return [ChatMessage("system", f"{first}\n\n{system}"), *messages[1:]]
    return [ChatMessage("system", system), *messages]


def _written(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
    """``messages`` for a template that cannot render tools: calls and results written
    as text, in the syntax the tools' description asks for."""
    out: list[ChatMessage] = []
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            calls = "".join(_hermes_block(c) for c in m.tool_calls)
            out.append(ChatMessage("assistant", (m.content or "") + calls))
        elif m.role == "tool":
            out.append(ChatMessage("tool", f"<tool_response>\n{m.content or ''}\n</tool_response>"))
        else:
            out.append(m)
    return out


def _hermes_block(call: ToolCall) -> str:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = call.arguments
    body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _speller(tokenizer: TextTokenizer) -> Spell:
    """A grammar term for a text: its special token's id when the vocabulary has one that
    spells it (the model writes the token, not its letters), else the text."""

    def spell(text: str) -> str:
        i = tokenizer.codec.token_to_id(text)
        if i is not None and i in tokenizer.special_ids:
            return f"<[{i}]>"
        return json.dumps(text)

    return spell
