"""The chat template from GGUF metadata, rendered in a jinja2 sandbox.

Templates come from model files, which may come from anyone: they run in an
immutable sandbox and can only read the messages they are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
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

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template rejected these messages: {e}") from None


def load_chat_template(f: GGUFFile, tokenizer: TextTokenizer) -> ChatTemplate:
    """Compile ``tokenizer.chat_template`` (ChatML when absent)."""
    source = str(f.value_or("tokenizer.chat_template", _CHATML))
    # Same whitespace handling as the transformers library, whose templates these are.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{f.path.name}: chat template does not compile: {e}") from None
    bos = tokenizer.bos_id
    return ChatTemplate(
        template=template,
        bos_token=(tokenizer.hf.id_to_token(bos) or "") if bos is not None else "",
        eos_token=tokenizer.hf.id_to_token(tokenizer.eos_id) or "",
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)
