"""The chat template from GGUF metadata, rendered in a jinja2 sandbox.

Templates come from model files, which may come from anyone: they run in an
immutable sandbox and can only read the messages they are given. The sandbox
offers what real templates call, defined as the ``transformers`` library
defines it (their authors test them there): ``raise_exception``, a ``tojson``
that neither escapes HTML nor sorts keys, ``strftime_now``, ``namespace``,
loop controls (``break``/``continue``), and ``bos_token``/``eos_token``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshnet.errors import RequestError, TokenizerError
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.reply_format import ReplyFormat, reply_format_of
from meshnet.model.tokenizer import TextTokenizer
from meshnet.model.tool_syntax import ToolCall

ROLES = frozenset({"system", "user", "assistant", "tool"})

# Used when a GGUF carries no template: ChatML, which the bundled model uses.
_CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str = ""  # a tool message: the call it answers
    name: str = ""  # a tool message: the function that answered
    reasoning_content: str = ""  # an assistant's reasoning (Qwen3's template renders it)

    def as_template_value(self) -> dict[str, Any]:
        """The message as Hugging Face templates read it: the content a string, each
        call's arguments an object (templates write them with ``tojson``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        return out


def _arguments(text: str) -> Any:
    """A call's arguments as an object when they are JSON text of one, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def parse_messages(raw: Any) -> list[ChatMessage]:
    """Validate a JSON-decoded list of ``{"role", "content"}`` objects."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty JSON array")
    out: list[ChatMessage] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or set(m) - {"role", "content", "name"}:
            raise RequestError(f"messages[{i}] must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise RequestError(f"messages[{i}].role must be one of {sorted(ROLES)}")
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string")
        out.append(ChatMessage(role, content))
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special strings it may refer to."""

    template: jinja2.Template
    source: str  # the template's text: what it renders and how replies are read
    bos_token: str
    eos_token: str
    # The tokenizer adds BOS / EOS to a prompt itself: render() drops the template's own.
    adds_bos: bool = False
    adds_eos: bool = False

    @cached_property
    def reply_format(self) -> ReplyFormat:
        """How this template's replies carry reasoning and tool calls."""
        user = [ChatMessage("user", "x")]
        try:
            prompt = self.render_text(user, True)
            base = self.render_text(user, False)
        except RequestError:
            prompt = base = ""
        return reply_format_of(self.source, prompt.removeprefix(base))

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text to encode: the template's text without the BOS (EOS) it would
        double, as llama.cpp's chat code strips them when the tokenizer adds its own.
        ``extra``: more variables (``tools``, ``reasoning_effort``) for the template."""
        text = self.render_text(messages, add_generation_prompt, **extra)
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.adds_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text

    def render_text(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The template's output as ``transformers``' ``apply_chat_template`` renders it."""
        try:
            return self.template.render(
                messages=[m.as_template_value() for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template rejected these messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"the chat template failed on these messages: {e}") from None


def load_chat_template(f: GGUFFile, tokenizer: TextTokenizer) -> ChatTemplate:
    """Compile ``tokenizer.chat_template`` (ChatML when absent)."""
    source = str(f.value_or("tokenizer.chat_template", _CHATML))
    try:
        template = _environment().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{f.path.name}: chat template does not compile: {e}") from None
    bos = tokenizer.bos_id
    return ChatTemplate(
        template=template,
        source=source,
        bos_token=(tokenizer.codec.id_to_token(bos) or "") if bos is not None else "",
        eos_token=tokenizer.codec.id_to_token(tokenizer.eos_id) or "",
        adds_bos=tokenizer.add_bos and bos is not None,
        adds_eos=tokenizer.add_eos,
    )


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox as ``transformers`` sets it up for chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as ``transformers`` writes it in templates: no HTML escaping, keys in order."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
