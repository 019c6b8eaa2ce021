"""Structured outputs: the vocabulary view, the grammar constraint and the sampler under it.

The model is faked by random logits (any model's logits are some vector): what
is checked is that the grammar, not the logits, decides what text can come out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
from vocab_gguf import Case, fetch_vocabularies, write_case_gguf

from meshnet.api.structured import ResponseFormat, constraint_of, json_grammar
from meshnet.errors import FieldError, MalformedBundle
from meshnet.model.constraint import Constraint, check_pick
from meshnet.model.gguf_file import open_gguf
from meshnet.model.grammar_vocab import grammar_tokenizer, token_bytes
from meshnet.model.info import ModelInfo, load_model_info
from meshnet.model.sampling import Sampler, SamplingParams
from meshnet.model.tokenizer import TextTokenizer, load_tokenizer
from meshnet.tracker.trust.sampled_check import Sampled, check_sampled

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
TEXT = 'Hello, world! {"a": 12} héllo ünïcode 日本 \t\n 🙂'


@pytest.fixture(scope="module")
def bundled() -> ModelInfo:
    return load_model_info()


@pytest.fixture(scope="module")
def llama2(tmp_path_factory: pytest.TempPathFactory) -> TextTokenizer:
    out = tmp_path_factory.mktemp("vocab") / "llama2.gguf"
    return load_tokenizer(open_gguf(write_case_gguf(fetch_vocabularies(), Case("llama2"), out)))


def _spells(tokenizer: TextTokenizer, text: str) -> bytes:
    table = token_bytes(tokenizer)
    return b"".join(table[i] for i in tokenizer.encode(text, add_special=False))


def test_byte_level_bpe_ids_spell_their_text(bundled: ModelInfo) -> None:
    assert _spells(bundled.tokenizer, TEXT).decode() == TEXT


def test_sentencepiece_ids_spell_their_text(llama2: TextTokenizer) -> None:
    # SentencePiece prepends a space; byte-fallback ids spell single bytes
    assert _spells(llama2, TEXT).decode() == " " + TEXT


def test_special_tokens_are_marked_and_eog_ids_end(bundled: ModelInfo) -> None:
    table = token_bytes(bundled.tokenizer)
    assert table[bundled.tokenizer.eos_id] == b"\xff<|im_end|>"
    tok = bundled.grammar_tokenizer
    assert tok.eos_token == bundled.tokenizer.eos_id
    assert set(tok.eos_tokens) == set(bundled.tokenizer.eog_ids)


def _generate(
    constraint: Constraint, params: SamplingParams, vocab: int, rng: np.random.Generator, n: int
) -> list[int]:
    """Sample up to ``n`` ids from random logits under ``constraint`` (prompt: 3 ids)."""
    history = [5, 6, 7]
    sampler = Sampler(params)
    for _ in range(n):
        token = sampler.sample(
            rng.normal(0, 4, vocab).astype(np.float32), history, generated_from=3
        )
        history.append(token)
        if token in constraint.tokenizer.eos_tokens:
            break
    return history[3:]


@pytest.mark.parametrize("seed", range(6))
def test_random_logits_give_json_valid_under_the_schema(bundled: ModelInfo, seed: int) -> None:
    tok = bundled.grammar_tokenizer
    constraint = constraint_of(json_grammar(SCHEMA, strict=True), tok, start=3)
    params = SamplingParams(temperature=1.0, seed=seed, constraint=constraint)
    ids = _generate(constraint, params, bundled.spec.vocab_size, np.random.default_rng(seed), 400)
    assert ids[-1] in tok.eos_tokens, "the grammar ends well inside 400 ids"
    jsonschema.validate(json.loads(bundled.tokenizer.decode(ids[:-1])), SCHEMA)


def test_the_mask_is_a_function_of_the_generated_ids(bundled: ModelInfo) -> None:
    tok = bundled.grammar_tokenizer
    grammar = json_grammar(SCHEMA, strict=True)
    walker = constraint_of(grammar, tok, start=3)
    params = SamplingParams(temperature=0.8, seed=11, constraint=walker)
    ids = _generate(walker, params, bundled.spec.vocab_size, np.random.default_rng(3), 60)
    history = [5, 6, 7, *ids]
    # a fresh constraint (a replacement node) and the walked one, going back (a verifier)
    for q in (len(history) - 1, 3, 10, len(history) - 5):
        fresh = Constraint(grammar, 3, tok)
        assert np.array_equal(fresh.allowed(history[:q]), walker.allowed(history[:q]))


def test_ids_outside_the_grammar_are_malformed(bundled: ModelInfo) -> None:
    constraint = constraint_of(json_grammar(SCHEMA, strict=True), bundled.grammar_tokenizer, 0)
    word = bundled.tokenizer.encode("hello", add_special=False)
    with pytest.raises(MalformedBundle):
        constraint.allowed(word)


def test_the_verifier_refuses_a_pick_outside_the_mask(bundled: ModelInfo) -> None:
    constraint = constraint_of(json_grammar(SCHEMA, strict=True), bundled.grammar_tokenizer, 1)
    params = SamplingParams(constraint=constraint, seed=1)
    logits = np.zeros((1, bundled.spec.vocab_size), np.float32)
    unconstrained = 5
    logits[0, unconstrained] = 10.0  # the likeliest id, but the grammar wants "{"
    pick = Sampler(params).sample(logits[0], [1], generated_from=1)
    assert pick != unconstrained
    assert _spells_id(bundled, pick).startswith(b"{")
    honest = Sampled(params, 1, ((1, pick),))
    assert check_sampled(logits, 0, [1, pick], honest) == ""
    dishonest = Sampled(params, 1, ((1, unconstrained),))
    assert "sampled" in check_sampled(logits, 0, [1, unconstrained], dishonest)
    # on a backend that is not exact, a greedy pick is compared with the masked maximum
    assert check_sampled(logits, 0, [1, pick], honest, exact=False) == ""
    assert check_sampled(logits, 0, [1, unconstrained], dishonest, exact=False) != ""


def _spells_id(info: ModelInfo, i: int) -> bytes:
    return token_bytes(info.tokenizer)[i]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "foo"},
        {"$ref": "#/nope"},
        {"type": "integer", "minimum": 5, "maximum": 1},
        {"type": "string", "pattern": "(a|b"},
    ],
)
def test_schemas_the_engine_refuses_name_response_format(
    bundled: ModelInfo, schema: dict[str, Any]
) -> None:
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    )
    with pytest.raises(FieldError) as e:
        constraint_of(fmt.grammar() or "", bundled.grammar_tokenizer, 0)
    assert e.value.param == "response_format"


def test_strict_refuses_unknown_keywords_and_lenient_ignores_them(bundled: ModelInfo) -> None:
    schema = {"type": "string", "format": "no-such-format"}
    tok = bundled.grammar_tokenizer
    with pytest.raises(FieldError):
        constraint_of(json_grammar(schema, strict=True), tok, 0)
    constraint_of(json_grammar(schema, strict=False), tok, 0)


def test_a_huge_schema_is_refused_before_compiling() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
    with pytest.raises(FieldError, match="characters"):
        json_grammar(schema, strict=True)


def test_text_format_has_no_grammar_and_json_object_is_an_object(bundled: ModelInfo) -> None:
    assert ResponseFormat(type="text").grammar() is None
    grammar = ResponseFormat(type="json_object").grammar()
    assert grammar is not None
    matcher = llguidance.LLMatcher(bundled.grammar_tokenizer, grammar, log_level=0)
    assert matcher.validate_tokens(bundled.tokenizer.encode("[1]", add_special=False)) == 0


def test_grammar_tokenizer_pads_a_wider_head(bundled: ModelInfo, tmp_path: Path) -> None:
    tok = grammar_tokenizer(bundled.tokenizer, bundled.spec.vocab_size + 64)
    assert tok.vocab_size == bundled.spec.vocab_size + 64


def test_the_tracker_takes_no_pick_outside_the_grammar(bundled: ModelInfo) -> None:
    constraint = constraint_of(json_grammar(SCHEMA, strict=True), bundled.grammar_tokenizer, 1)
    (opening,) = bundled.tokenizer.encode('{"', add_special=False)
    check_pick(constraint, [7], opening, "node-x")  # opens the object and its first key
    with pytest.raises(MalformedBundle, match="node-x") as e:
        check_pick(constraint, [7], bundled.tokenizer.encode("x", add_special=False)[0], "node-x")
    assert e.value.node_id == "node-x"
