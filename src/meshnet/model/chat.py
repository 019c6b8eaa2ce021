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
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshnet.errors import RequestError, TokenizerError
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.tokenizer import TextTokenizer

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
    content: str


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
    bos_token: str
    eos_token: str
    # The tokenizer adds BOS / EOS to a prompt itself: render() drops the template's own.
    adds_bos: bool = False
    adds_eos: bool = False

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The prompt text to encode: the template's text without the BOS (EOS) it would
        double, as llama.cpp's chat code strips them when the tokenizer adds its own."""
        text = self.render_text(messages, add_generation_prompt)
        if self.adds_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.adds_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text

    def render_text(
        self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
    ) -> str:
        """The template's output as ``transformers``' ``apply_chat_template`` renders it."""
        try:
            return self.template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
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
