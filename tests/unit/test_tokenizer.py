import pytest

from meshnet.engine.local import LocalModel
from meshnet.errors import RequestError
from meshnet.model.chat import parse_messages

TEXTS = [
    "hello  world\n\n\t x",
    "1234567890 3.14",
    "café naïve",
    "日本語",
    "😀 emoji",
    "<|im_end|>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_round_trip(tiny: LocalModel, text: str) -> None:
    assert tiny.tokenizer.decode(tiny.tokenizer.encode(text)) == text


def test_control_tokens_are_single_special_ids(tiny: LocalModel) -> None:
    assert tiny.tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tiny.tokenizer.encode("<|im_start|>user<|im_end|>")[-1] == 2
    assert tiny.tokenizer.special_ids >= {0, 1, 2}


def test_chat_template_renders_generation_prompt(tiny: LocalModel) -> None:
    text = tiny.template.render(parse_messages([{"role": "user", "content": "hi"}]))
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {},
        [{"role": "user"}],
        [{"role": "wizard", "content": "x"}],
        [{"role": "user", "content": 3}],
        ["hi"],
        [{"role": "user", "content": "x", "z": 1}],
    ],
)
def test_bad_messages_are_typed_errors(raw: object) -> None:
    with pytest.raises(RequestError):
        parse_messages(raw)
