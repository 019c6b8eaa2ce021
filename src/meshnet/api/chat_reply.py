"""A chat reply shaped as OpenAI shapes one: ``content``, ``reasoning_content``, ``tool_calls``.

Whole: the reply's text is split once (model/reply_format.py). Streamed: each
token's text is added and the split of the text so far is compared with what
was sent; the growth of the reasoning and of the content goes out as deltas,
and the calls, read once the reply has ended, go out as ``tool_calls`` deltas
(one per call, with its id, name and whole arguments, as OpenAI's clients
accumulate them). Call ids are made per reply, the same in both.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Any

from meshnet.api.tools import ChatPlan
from meshnet.model.reply_format import ReplyView
from meshnet.model.tool_syntax import ToolCall


class ChatReply:
    """One reply's parts, whole or as they grow. Not thread-safe: one stream's."""

    def __init__(self, plan: ChatPlan, constrained: bool = False) -> None:
        """``constrained``: a grammar decides the reply from its first id. Where the
        generation prompt has opened a reasoning part, the grammar's text is then the
        content (the model had no room to reason), not reasoning."""
        self.plan = plan
        fmt = plan.format
        self._format = replace(fmt, think=False) if constrained and fmt.opens_thinking else fmt
        self._text = ""
        self._sent = ReplyView("", "")
        self._base = secrets.token_hex(8)

    def _view(self, text: str, final: bool) -> ReplyView:
        return self._format.view(text, final, with_tools=self.plan.reads_calls)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The whole reply as a message, and whether it made calls."""
        view = self._view(text, final=True)
        calls = self.plan.calls(view.calls)
        message: dict[str, Any] = {"role": "assistant", "content": view.content or None}
        if view.reasoning:
            message["reasoning_content"] = view.reasoning
        if calls:
            message["tool_calls"] = [self._call(i, c) for i, c in enumerate(calls)]
        elif message["content"] is None:
            message["content"] = ""
        return message, bool(calls)

    def grow(self, delta: str) -> list[dict[str, Any]]:
        """The deltas that ``delta`` (more of the reply's text) makes final."""
        self._text += delta
        return self._deltas(self._view(self._text, final=False))

    def end(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        """The last deltas, once the reply's whole ``text`` is known, and whether it
        made calls."""
        view = self._view(text, final=True)
        deltas = self._deltas(view)
        calls = self.plan.calls(view.calls)
        if calls:
            deltas.append({"tool_calls": [self._call(i, c, i) for i, c in enumerate(calls)]})
        return deltas, bool(calls)

    def _deltas(self, view: ReplyView) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        sent = self._sent
        if len(view.reasoning) > len(sent.reasoning):
            out.append({"reasoning_content": view.reasoning[len(sent.reasoning) :]})
        if len(view.content) > len(sent.content):
            out.append({"content": view.content[len(sent.content) :]})
        self._sent = ReplyView(
            max(view.reasoning, sent.reasoning, key=len), max(view.content, sent.content, key=len)
        )
        return out

    def _call(self, i: int, call: ToolCall, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": call.id or f"call_{self._base}{i}",
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        if index is not None:
            out["index"] = index
        return out
