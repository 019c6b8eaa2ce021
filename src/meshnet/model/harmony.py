"""gpt-oss's reply format ("harmony"): messages on channels, calls in their headers.

After the generation prompt (``<|start|>assistant``) the model writes one or
more messages, each ``<|channel|>NAME[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY``
ended by ``<|end|>`` (then ``<|start|>assistant`` and the next) or, last, by
``<|return|>`` / ``<|call|>`` (which end generation and are not in the text):

- ``analysis``: the model's reasoning, returned as ``reasoning_content``;
- ``final``: the answer, returned as ``content``;
- ``commentary`` addressed ``to=functions.NAME``: a call of NAME whose arguments
  are the body; without a recipient, a preamble shown as content.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from meshnet.model.tool_syntax import Function, Spell, ToolCall, guided_schema

_START = "<|start|>"
_MESSAGE = "<|message|>"
_END = "<|end|>"
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def harmony_view(text: str, final: bool) -> tuple[str, str, tuple[ToolCall, ...]]:
    """(reasoning, content, calls) of the reply ``text``; while not ``final``, only what
    no later text can change (an unfinished ``<|end|>`` is held back, calls wait)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    for part in text.split(_START):
        header, sep, body = part.partition(_MESSAGE)
        if not sep:
            continue  # the header is still being written
        closed = _END in body
        body = body.split(_END, 1)[0] if closed else body
        if not (closed or final):
            body = body[: len(body) - _held(body, _END)]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is not None:
            if final or closed:
                calls.append(ToolCall(recipient.group(1), body.strip()))
        elif channel is not None and channel.group(1) == "analysis":
            reasoning.append(body)
        else:
            content.append(body)
    return "".join(reasoning), "".join(content), tuple(calls)


def harmony_grammar(functions: Sequence[Function], spell: Spell) -> str:
    """Lark for a reply that is one call of one of ``functions``."""
    rules = []
    for i, f in enumerate(functions):
        params = guided_schema(f.parameters or {"type": "object"})
        head = f'"{f.name} " {spell("<|constrain|>")} "json" {spell("<|message|>")}'
        rules.append(f"call_{i}: {head} %json {params}")
    choice = " | ".join(f"call_{i}" for i in range(len(functions)))
    start = f'start: {spell("<|channel|>")} "commentary to=functions." ({choice})'
    return "\n".join([start, *rules]) + "\n"


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
