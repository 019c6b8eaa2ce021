"""The contract of the OpenAI endpoints' request fields: each is honoured, accepted
without meaning, or refused. Nothing is silently ignored.

- **honoured**: changes the answer as OpenAI documents it (validated by the request
  models in ``api/schemas.py``; a value out of range is a 400 naming the field);
- **accepted without meaning**: carries nothing that could change the answer
  (``user``, ``metadata``, ``store``…): taken and dropped;
- **refused**: a 400 ``unsupported-parameter`` whose ``param`` names the field,
  unless its value is one that asks for nothing (``null``, ``response_format:
  {"type": "text"}``, ``modalities: ["text"]``, an empty ``suffix``);
- any other field is refused the same way, as unknown: a misspelt control is a
  400, never a default.

The same holds for each chat message's fields (``MESSAGE_*``): ``role`` and
``content`` are honoured, anything else is refused with ``param``
``messages.N.field``.

Tool calls, structured outputs and reasoning (``tools``, ``tool_choice``,
``parallel_tool_calls``, ``response_format``, ``reasoning_effort``; a message's
``tool_calls``, ``tool_call_id`` and ``reasoning_content``) are honoured:
docs/structured-outputs.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from meshnet.errors import UnsupportedField

Endpoint = Literal["chat", "text"]

# Both endpoints; ``top_k``, ``repetition_penalty``, ``min_p``, ``ignore_eos`` and
# ``meshnet`` are meshnet's own (llama.cpp and vLLM take the first four too);
# ``cache_salt`` is vLLM's (a narrower prefix-cache scope: docs/prefix-cache.md).
_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "ignore_eos",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "n",
        "logprobs",
        "cache_salt",
        "meshnet",
    }
)

# Structured outputs, tools and reasoning: docs/structured-outputs.md.
_CHAT_ONLY = {"tools", "tool_choice", "parallel_tool_calls", "reasoning_effort"}

HONOURED: Mapping[Endpoint, frozenset[str]] = {
    "chat": _COMMON | {"messages", "top_logprobs", "response_format"} | _CHAT_ONLY,
    "text": _COMMON | {"prompt", "echo", "best_of", "response_format"},  # best_of: = n
}

MEANINGLESS = frozenset(
    {
        "user",  # an end-user id, for the caller's abuse monitoring
        "metadata",  # tags for OpenAI's dashboard
        "store",  # whether OpenAI keeps the completion
        "service_tier",  # OpenAI's processing tier
        "prompt_cache_key",  # a hint for OpenAI's prompt cache
        "safety_identifier",  # an end-user id, as ``user``
        "prediction",  # predicted output: a latency hint, the answer is the same
    }
)


def _is_text_only(value: object) -> bool:
    return value == ["text"]


def _is_empty(value: object) -> bool:
    return value == ""


def _never(value: Any) -> bool:
    return False


Refusal = tuple[str, Callable[[Any], bool]]  # why, and which values ask for nothing

REFUSED: Mapping[str, Refusal] = {
    "functions": ("the deprecated functions API is not supported; nor are tools", _never),
    "function_call": ("the deprecated functions API is not supported; nor are tools", _never),
    "audio": ("audio output is not supported", _never),
    "modalities": ("only ['text'] is supported", _is_text_only),
    "web_search_options": ("web search is not supported", _never),
    "verbosity": ("verbosity is not supported", _never),
    "suffix": ("suffix (insertion) is not supported", _is_empty),
}


MESSAGE_HONOURED = frozenset({"role", "content", "tool_calls", "tool_call_id", "reasoning_content"})

MESSAGE_REFUSED: Mapping[str, Refusal] = {
    "name": ("participant names are not rendered by the chat template", _never),
    "function_call": ("the deprecated functions API is not supported", _never),
    "audio": ("audio is not supported", _never),
    "refusal": ("refusals are not rendered by the chat template", _never),
}


def check_fields(endpoint: Endpoint, body: Mapping[str, Any]) -> None:
    """Raise ``UnsupportedField`` naming the first field of ``body`` (or of one of its
    chat messages) that ``endpoint`` neither honours nor may accept without meaning."""
    _check(body, HONOURED[endpoint] | MEANINGLESS, REFUSED, "")
    messages = body.get("messages")
    if endpoint == "chat" and isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                _check(message, MESSAGE_HONOURED, MESSAGE_REFUSED, f"messages.{i}.")


def _check(
    fields: Mapping[str, Any], taken: frozenset[str], refused: Mapping[str, Refusal], at: str
) -> None:
    for name, value in fields.items():
        if name in taken or value is None:
            continue  # null asks for nothing: OpenAI's clients send it for "not given"
        refusal = refused.get(name)
        if refusal is None:
            raise UnsupportedField(f"unknown field '{at}{name}' is not supported", at + name)
        reason, asks_nothing = refusal
        if not asks_nothing(value):
            raise UnsupportedField(f"{at}{name}: {reason}", at + name)
