"""Replies read back: each family's tool-call syntax, reasoning parts, and their streaming.

Pure functions on text, plus Qwen3's real template (tools and <think>) and the
grammars that force calls compiled for real vocabularies.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import pytest
from vocab_gguf import FamilyFiles, fetch_vocabularies

from meshnet.api.chat_reply import ChatReply
from meshnet.api.tools import ToolSpec, _speller, plan_chat
from meshnet.model.chat import ChatMessage, ChatTemplate, load_chat_template
from meshnet.model.gguf_file import open_gguf
from meshnet.model.grammar_vocab import grammar_tokenizer
from meshnet.model.harmony import harmony_grammar, harmony_view
from meshnet.model.info import load_model_info
from meshnet.model.reply_format import ReplyFormat, ReplyView, reply_format_of
from meshnet.model.tokenizer import TextTokenizer, load_tokenizer
from meshnet.model.tool_syntax import HERMES, LLAMA3, MISTRAL, Function, ToolCall

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FUNCTIONS = (Function("get_weather", WEATHER), Function("get_time", {"type": "object"}))


def _call(name: str, **args: Any) -> ToolCall:
    return ToolCall(name, json.dumps(args))


# --- each syntax's parser


def test_hermes_reads_each_block() -> None:
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert HERMES.parse(text) == (_call("get_weather", city="Paris"), _call("get_time"))


def test_hermes_skips_a_block_that_is_not_a_call() -> None:
    assert HERMES.parse("<tool_call>\nnot json\n</tool_call>") == ()
    assert HERMES.parse('<tool_call>\n{"arguments": {}}\n</tool_call>') == ()


def test_llama3_reads_json_calls_with_or_without_the_python_tag() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert LLAMA3.parse(one) == (_call("get_weather", city="Oslo"),)
    two = f'<|python_tag|>{one}; {{"name": "get_time", "parameters": {{}}}}'
    assert LLAMA3.parse(two) == (_call("get_weather", city="Oslo"), _call("get_time"))


def test_llama3_calls_count_only_at_the_start() -> None:
    assert LLAMA3.find('Sure: {"name": "x", "parameters": {}}') == -1
    assert LLAMA3.find('  {"name": "x", "parameters": {}}') == 2


def test_mistral_reads_the_array_and_the_named_forms() -> None:
    array = (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "a1b2c3d4e"}]'
    )
    (call,) = MISTRAL.parse(array)
    assert (call.name, json.loads(call.arguments), call.id) == (
        "get_weather",
        {"city": "Rome"},
        "a1b2c3d4e",
    )
    named = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}'
    assert MISTRAL.parse(named) == (_call("get_weather", city="Rome"), _call("get_time"))


def test_arguments_written_as_a_json_string_are_read_as_the_object() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert HERMES.parse(text) == (_call("f", a=1),)


# --- gpt-oss channels

HARMONY_CALL = (
    "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant"
    '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"SF"}'
)


def test_harmony_splits_analysis_final_and_calls() -> None:
    text = (
        "<|channel|>analysis<|message|>Think.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hi!"
    )
    assert harmony_view(text, final=True) == ("Think.", "Hi!", ())
    reasoning, content, calls = harmony_view(HARMONY_CALL, final=True)
    assert (reasoning, content) == ("The user wants weather.", "")
    assert calls == (ToolCall("get_weather", '{"city":"SF"}'),)


def test_harmony_holds_back_what_may_be_an_end() -> None:
    assert harmony_view("<|channel|>analysis<|message|>Think<|en", final=False) == ("Think", "", ())
    assert harmony_view("<|channel|>analy", final=False) == ("", "", ())


# --- streaming: every prefix's view is a prefix of the whole reply's view

FORMATS = {
    "qwen3": ReplyFormat(HERMES, renders_tools=True, think=True),
    "r1": ReplyFormat(HERMES, renders_tools=True, think=True, opens_thinking=True),
    "llama3": ReplyFormat(LLAMA3, renders_tools=True),
    "mistral": ReplyFormat(MISTRAL, renders_tools=True),
    "gpt-oss": ReplyFormat(HERMES, renders_tools=True, harmony=True),
}
REPLIES = {
    "qwen3": "<think>\nLet me see.\n</think>\n\nCalling.\n<tool_call>\n"
    '{"name": "get_time", "arguments": {}}\n</tool_call>',
    "r1": "Hmm, 2+2.\n</think>\n\nIt is 4.",
    "llama3": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": 'Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
    "gpt-oss": HARMONY_CALL,
}
WHOLE = {
    "qwen3": ReplyView("Let me see.\n", "Calling.\n", (_call("get_time"),)),
    "r1": ReplyView("Hmm, 2+2.\n", "It is 4."),
    "llama3": ReplyView("", "", (_call("get_weather", city="Oslo"),)),
    "mistral": ReplyView("", "Sure.", (_call("get_time"),)),
    "gpt-oss": ReplyView(
        "The user wants weather.", "", (ToolCall("get_weather", '{"city":"SF"}'),)
    ),
}


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_the_whole_reply_splits_into_its_parts(family: str) -> None:
    assert FORMATS[family].view(REPLIES[family], final=True) == WHOLE[family]


@pytest.mark.parametrize("family", sorted(FORMATS))
def test_a_growing_reply_only_ever_grows_its_parts(family: str) -> None:
    text, whole = REPLIES[family], WHOLE[family]
    for n in range(len(text) + 1):
        view = FORMATS[family].view(text[:n], final=False)
        assert whole.reasoning.startswith(view.reasoning), (n, view)
        assert whole.content.startswith(view.content), (n, view)
        assert view.calls == ()


def test_a_reply_without_calls_is_all_content_even_with_a_stray_marker() -> None:
    fmt = FORMATS["qwen3"]
    assert (
        fmt.view("Use <tool_call> like this.", final=True).content == "Use <tool_call> like this."
    )
    assert fmt.view("no tools here", final=True, with_tools=False) == ReplyView("", "no tools here")


# --- the formats of real templates, and their grammars


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[TextTokenizer, ChatTemplate]:
    files = FamilyFiles(fetch_vocabularies(), tmp_path_factory.mktemp("vocab"))
    f = open_gguf(files.path("qwen3"))
    tok = load_tokenizer(f)
    return tok, load_chat_template(f, tok)


def test_qwen3_is_hermes_with_thinking(qwen3: tuple[TextTokenizer, ChatTemplate]) -> None:
    fmt = qwen3[1].reply_format
    assert (fmt.tools, fmt.renders_tools, fmt.think, fmt.harmony) == (HERMES, True, True, False)


def test_qwen3_renders_tools_calls_and_results(qwen3: tuple[TextTokenizer, ChatTemplate]) -> None:
    tok, template = qwen3
    tools = [
        ToolSpec.model_validate(
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
        )
    ]
    messages = [
        ChatMessage("user", "Weather in Paris?"),
        ChatMessage(
            "assistant",
            None,
            (ToolCall("get_weather", '{"city": "Paris"}', "c1"),),
            reasoning_content="Need the weather.",
        ),
        ChatMessage("tool", "21 C", tool_call_id="c1"),
    ]
    plan = plan_chat(messages, tools, "required", True, None, template, tok)
    text = template.render(plan.messages, **plan.variables)
    described = text.split("<tools>\n")[1].split("</tools>")[0]
    assert json.loads(described)["function"]["name"] == "get_weather"
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n21 C\n</tool_response>" in text
    assert "<think>\nNeed the weather.\n</think>" in text  # the turn's reasoning, back in
    grammar = plan.grammar
    assert grammar is not None and f"<[{tok.codec.token_to_id('<tool_call>')}]>" in grammar
    vocab = grammar_tokenizer(tok, tok.codec.get_vocab_size())
    matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    reply = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>\n'
    ids = tok.encode(reply, add_special=False)
    assert matcher.validate_tokens(ids) == len(ids)


def test_the_bundled_template_gets_tools_described_and_calls_as_text() -> None:
    info = load_model_info()
    fmt = info.template.reply_format
    assert not fmt.renders_tools and fmt.tools == HERMES
    tools = [
        ToolSpec.model_validate(
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
        )
    ]
    plan = plan_chat(
        [ChatMessage("user", "hi")], tools, "auto", True, None, info.template, info.tokenizer
    )
    assert plan.messages[0].role == "system" and "<tools>" in (plan.messages[0].content or "")
    assert plan.grammar is None and plan.reads_calls


@pytest.mark.parametrize("syntax", ["llama3", "mistral", "harmony"])
def test_forcing_grammars_compile_and_accept_a_call(syntax: str) -> None:
    info = load_model_info()
    spell = _speller(info.tokenizer)
    if syntax == "harmony":
        grammar = harmony_grammar(FUNCTIONS, spell)
        text = (
            "<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city":"A"}'
        )
    elif syntax == "llama3":
        grammar = LLAMA3.grammar(FUNCTIONS, True, spell)
        text = (
            '{"name":"get_weather","parameters":{"city":"A"}}; {"name":"get_time","parameters":{}}'
        )
    else:
        grammar = MISTRAL.grammar(FUNCTIONS, False, spell)
        text = '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"A"}}]'
    matcher = llguidance.LLMatcher(info.grammar_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = info.tokenizer.encode(text, add_special=False)
    assert matcher.validate_tokens(ids) == len(ids)
    assert matcher.consume_tokens(ids) and matcher.is_accepting()


# --- the API's shaping, whole and streamed


def test_streamed_deltas_add_up_to_the_whole_message(tmp_path: Path) -> None:
    info = load_model_info()
    tools = [
        ToolSpec.model_validate(
            {"type": "function", "function": {"name": "get_time", "parameters": {}}}
        )
    ]
    plan = plan_chat(
        [ChatMessage("user", "hi")], tools, "auto", True, None, info.template, info.tokenizer
    )
    plan = type(plan)(**{**plan.__dict__, "format": FORMATS["qwen3"]})
    text = REPLIES["qwen3"]
    whole = ChatReply(plan)
    message, called = whole.message(text)
    streamed = ChatReply(plan)
    parts: dict[str, str] = {"reasoning_content": "", "content": ""}
    for i in range(0, len(text), 3):
        for d in streamed.grow(text[i : i + 3]):
            for k, v in d.items():
                parts[k] += v
    last, called_too = streamed.end(text)
    calls = []
    for d in last:
        if "tool_calls" in d:
            calls = d["tool_calls"]
        else:
            for k, v in d.items():
                parts[k] += v
    assert called and called_too
    assert parts == {
        "reasoning_content": message["reasoning_content"],
        "content": message["content"],
    }
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]


def test_reply_format_of_reads_the_template_source() -> None:
    assert reply_format_of("{{ tools }} [TOOL_CALLS]", "").tools == MISTRAL
    assert reply_format_of("{{ tools }} <|python_tag|>", "").tools == LLAMA3
    assert reply_format_of("<|channel|> {{ tools }}", "").harmony
    r1 = reply_format_of("{{ '<think>' }} </think>", "<|Assistant|><think>\n")
    assert r1.think and r1.opens_thinking and not r1.renders_tools
