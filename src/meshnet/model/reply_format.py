"""A chat reply's parts: reasoning, content and tool calls, as the model's template writes them.

Which format a model writes is read off its chat template (``reply_format_of``):
gpt-oss's channels (model/harmony.py), a ``<think>…</think>`` part (Qwen3,
DeepSeek-R1; some templates open it in the generation prompt already), and one
of the tool-call syntaxes (model/tool_syntax.py). A template that does not
render ``tools`` at all gets them described in a system message, in the Hermes
syntax (``TOOLS_SYSTEM``), and its replies are read in that syntax.

``ReplyFormat.view(text, final)`` splits a reply's text so far. The split is
monotone: while not ``final`` it shows only what more text cannot change
(a tag or marker that may be starting is held back, calls wait for the end), so
a stream sends the growth of each part, and the parts at the end equal the
whole reply's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from meshnet.model.harmony import harmony_view
from meshnet.model.tool_syntax import HERMES, LLAMA3, MISTRAL, Function, ToolCall, ToolSyntax

_OPEN, _CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReplyView:
    reasoning: str
    content: str
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ReplyFormat:
    """How one template's replies are written."""

    tools: ToolSyntax  # the syntax of calls (unused by harmony)
    renders_tools: bool  # the template renders ``tools`` itself
    think: bool = False  # replies may open with a <think> part
    opens_thinking: bool = False  # the generation prompt has opened it already
    harmony: bool = False  # gpt-oss's channels

    def view(self, text: str, final: bool, with_tools: bool = True) -> ReplyView:
        """The parts of the reply ``text`` (calls read only when ``with_tools``)."""
        if self.harmony:
            reasoning, content, calls = harmony_view(text, final)
            return ReplyView(reasoning, content, calls if with_tools else ())
        reasoning, rest = self._split_think(text, final)
        if not with_tools:
            return ReplyView(reasoning, rest)
        return self._split_calls(reasoning, rest, final)

    def _split_think(self, text: str, final: bool) -> tuple[str, str]:
        if not self.think:
            return "", text
        inside = self.opens_thinking
        body = text
        if not inside:
            stripped = text.lstrip()
            if stripped.startswith(_OPEN):
                inside, body = True, stripped[len(_OPEN) :]
            elif stripped and _OPEN.startswith(stripped) and not final:
                return "", ""  # "<thi…" may be the tag
        if not inside:
            return "", text
        end = body.find(_CLOSE)
        if end >= 0:
            return body[:end].lstrip(), body[end + len(_CLOSE) :].lstrip()
        if final:
            return body.lstrip(), ""
        return _cut(body, (_CLOSE,)).lstrip(), ""

    def _split_calls(self, reasoning: str, text: str, final: bool) -> ReplyView:
        at = self.tools.find(text)
        if at < 0:
            if final:
                return ReplyView(reasoning, text)
            if self.tools.at_start_only:
                stripped = text.lstrip()
                maybe = any(m.startswith(stripped) for m in self.tools.markers)
                return ReplyView(reasoning, "" if stripped and maybe else text)
            return ReplyView(reasoning, _cut(text, self.tools.markers))
        if not final:
            return ReplyView(reasoning, text[:at])
        calls = self.tools.parse(text[at:])
        if not calls:  # a marker, then no call: it was text after all
            return ReplyView(reasoning, text)
        return ReplyView(reasoning, text[:at], calls)


def _cut(text: str, markers: Sequence[str]) -> str:
    """``text`` less any end of it that may be the start of one of ``markers``."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return text[: len(text) - longest]


def reply_format_of(source: str, generation_prompt: str) -> ReplyFormat:
    """The reply format of the template ``source`` whose generation prompt (rendered
    after one user message) is ``generation_prompt``."""
    renders_tools = "tools" in source
    think = _CLOSE in source or _OPEN in source
    opens = think and generation_prompt.rstrip().endswith(_OPEN)
    if "<|channel|>" in source:
        return ReplyFormat(HERMES, renders_tools, harmony=True)
    if "[TOOL_CALLS]" in source:
        syntax = MISTRAL
    elif "<|python_tag|>" in source or ("ipython" in source and "<|eot_id|>" in source):
        syntax = LLAMA3
    else:
        syntax = HERMES
    return ReplyFormat(syntax, renders_tools, think=think, opens_thinking=opens)


TOOLS_SYSTEM = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tools_system_text(functions: Sequence[Function], descriptions: Sequence[str]) -> str:
    """The system text that describes ``functions`` to a template that cannot."""
    lines = [
        json.dumps(
            {
                "type": "function",
                "function": {"name": f.name, "description": d, "parameters": f.parameters},
            },
            ensure_ascii=False,
        )
        for f, d in zip(functions, descriptions, strict=True)
    ]
    return TOOLS_SYSTEM.format(tools="\n".join(lines))
