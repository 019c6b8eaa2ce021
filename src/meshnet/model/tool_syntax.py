"""How each model family writes a tool call in its reply, read back and enforced.

A syntax says where a call starts in the text (``markers``), reads the calls
from the text from there (``parse``) and writes the grammar that makes a reply
nothing but calls (``grammar``: llguidance's Lark, with ``%json`` for the
arguments) for ``tool_choice: "required"`` or a named function.

- ``hermes`` (Qwen 2.5/3, Hermes, and the fallback for templates without tools):
  ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``, one block per call;
- ``llama3`` (Llama 3.1+ JSON tool calling): ``{"name": …, "parameters": {…}}``,
  maybe after ``<|python_tag|>``, calls separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": …, "arguments": {…}, "id": …}, …]``, or
  ``[TOOL_CALLS]name[ARGS]{…}`` per call (the newer templates).

gpt-oss's channels carry calls in their headers; model/harmony.py reads those.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

SyntaxName = Literal["hermes", "llama3", "mistral"]
# A literal in a grammar: a special token's own id when the vocabulary has one that
# spells exactly this text, else the text (given the text, it returns the Lark term).
Spell = Callable[[str], str]

# Compact JSON in the arguments (a free model may pad with whitespace forever); unknown
# schema keywords are ignored rather than refused (a tool's schema is the caller's).
_X_GUIDANCE = {"whitespace_flexible": False, "lenient": True}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str  # JSON text of an object
    id: str = ""  # the model's own id for it (Mistral writes one), else ""


@dataclass(frozen=True)
class Function:
    """A tool the request offers: its name and the JSON schema of its parameters."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolSyntax:
    name: SyntaxName
    markers: tuple[str, ...]  # where a call's text starts
    at_start_only: bool = False  # a marker counts only at the start of the reply

    def find(self, text: str) -> int:
        """Where the first call starts in ``text``; -1 when none does."""
        if self.at_start_only:
            stripped = len(text) - len(text.lstrip())
            hit = any(text.startswith(m, stripped) for m in self.markers)
            return stripped if hit else -1
        hits = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(hits) if hits else -1

    def parse(self, text: str) -> tuple[ToolCall, ...]:
        """The calls written in ``text`` (from a marker on); () when it holds none whole."""
        return _PARSERS[self.name](text)

    def grammar(self, functions: Sequence[Function], parallel: bool, literal: Spell) -> str:
        """Lark for a reply that is only calls of ``functions`` (several if ``parallel``)."""
        return _GRAMMARS[self.name](functions, parallel, literal)


HERMES = ToolSyntax("hermes", ("<tool_call>",))
LLAMA3 = ToolSyntax("llama3", ("<|python_tag|>", '{"name"', '{"type"'), at_start_only=True)
MISTRAL = ToolSyntax("mistral", ("[TOOL_CALLS]",))
SYNTAXES = {s.name: s for s in (HERMES, LLAMA3, MISTRAL)}


def _call_of(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """A call from a decoded ``{"name", args_key}`` object; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    call_id = obj.get("id")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), str(call_id or ""))


def _json_values(text: str) -> list[Any]:
    """The JSON values written one after another in ``text`` (``;``, ``,`` or spaces
    between them); stops at the first thing that is not one."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return out
        out.append(value)


_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _parse_hermes(text: str) -> tuple[ToolCall, ...]:
    calls = []
    for body in _HERMES_BLOCK.findall(text):
        for value in _json_values(body)[:1]:
            call = _call_of(value)
            if call is not None:
                calls.append(call)
    return tuple(calls)


def _parse_llama3(text: str) -> tuple[ToolCall, ...]:
    body = text.strip().removeprefix("<|python_tag|>")
    calls = [_call_of(v, "parameters") for v in _json_values(body)]
    return tuple(c for c in calls if c is not None)


_MISTRAL_NAMED = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z0-9_.-]+)\s*\[ARGS\]")


def _parse_mistral(text: str) -> tuple[ToolCall, ...]:
    named = list(_MISTRAL_NAMED.finditer(text))
    if named:  # [TOOL_CALLS]name[ARGS]{...} per call
        calls = []
        for m in named:
            values = _json_values(text[m.end() :])[:1]
            if values and isinstance(values[0], dict):
                calls.append(ToolCall(m.group(1), json.dumps(values[0], ensure_ascii=False)))
        return tuple(calls)
    start = text.find("[TOOL_CALLS]")
    values = _json_values(text[start + len("[TOOL_CALLS]") :]) if start >= 0 else []
    items = values[0] if values and isinstance(values[0], list) else values
    parsed = [_call_of(v) for v in items]
    return tuple(c for c in parsed if c is not None)


def guided_schema(obj: dict[str, Any]) -> str:
    return json.dumps({**obj, "x-guidance": _X_GUIDANCE}, ensure_ascii=False)


def _call_schema(f: Function, args_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": f.name}, args_key: f.parameters or {"type": "object"}},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _calls_schema(functions: Sequence[Function], args_key: str) -> dict[str, Any]:
    alternatives = [_call_schema(f, args_key) for f in functions]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _grammar_hermes(functions: Sequence[Function], parallel: bool, literal: Spell) -> str:
    schema = guided_schema(_calls_schema(functions, "arguments"))
    call = f'{literal("<tool_call>")} "\\n" %json {schema}'
    close = f'"\\n" {literal("</tool_call>")}'
    return f'start: call{"+" if parallel else ""}\ncall: {call} {close} "\\n"?\n'


def _grammar_llama3(functions: Sequence[Function], parallel: bool, literal: Spell) -> str:
    one = f"%json {guided_schema(_calls_schema(functions, 'parameters'))}"
    more = ' ("; " call)*' if parallel else ""
    return f"start: call{more}\ncall: {one}\n"


def _grammar_mistral(functions: Sequence[Function], parallel: bool, literal: Spell) -> str:
    items: dict[str, Any] = {"type": "array", "items": _calls_schema(functions, "arguments")}
    items["minItems"] = 1
    if not parallel:
        items["maxItems"] = 1
    return f"start: {literal('[TOOL_CALLS]')} %json {guided_schema(items)}\n"


_PARSERS: dict[str, Callable[[str], tuple[ToolCall, ...]]] = {
    "hermes": _parse_hermes,
    "llama3": _parse_llama3,
    "mistral": _parse_mistral,
}
_GRAMMARS: dict[str, Callable[[Sequence[Function], bool, Spell], str]] = {
    "hermes": _grammar_hermes,
    "llama3": _grammar_llama3,
    "mistral": _grammar_mistral,
}
