"""What load_tokenizer makes of tokenizer metadata, on small hand-made vocabularies (no network).

The real vocabularies are checked against llama.cpp and Hugging Face in
test_tokenizer_vocab.py; these cover llama.cpp's defaults and bad metadata.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tinymodel import byte_tokens
from tokenizers import pre_tokenizers

from meshnet.errors import TokenizerError
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.pretokenizers import PRE_TOKENIZERS
from meshnet.model.spm import ESCAPED_SPACE
from meshnet.model.tokenizer import TextTokenizer, load_tokenizer

SPECIALS = ["<|begin|>", "<|eot_id|>", "<|im_end|>", "<|user|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w"]


def bpe_metadata(**changes: Any) -> dict[str, Any]:
    tokens = [*byte_tokens(), "he", "ll", "hell", "hello", "Ġw", *SPECIALS]
    n_normal = len(tokens) - len(SPECIALS)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * n_normal + [3, 3, 1, 4],  # <|im_end|> typed normal
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": tokens.index("<|begin|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|begin|>"),
    }
    meta.update(changes)
    return meta


def load(meta: dict[str, Any]) -> TextTokenizer:
    return load_tokenizer(GGUFFile(path=Path("v.gguf"), metadata=meta, tensors={}))


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_in_the_table_compiles_and_splits(name: str) -> None:
    built = PRE_TOKENIZERS[name].build()
    assert isinstance(built, pre_tokenizers.PreTokenizer)
    pieces = built.pre_tokenize_str("Hello world 123")
    assert "".join(p for p, _ in pieces) == "HelloĠworldĠ123"  # nothing lost, bytes mapped


def test_special_and_user_defined_tokens_are_whole_ids() -> None:
    tok = load(bpe_metadata())
    ids = tok.encode("hello<|user|>hello<|eot_id|>", add_special=False)
    hello, user, eot = (tok.codec.token_to_id(t) for t in ("hello", "<|user|>", "<|eot_id|>"))
    assert ids == [hello, user, hello, eot]
    assert tok.decode(ids) == "hello<|user|>hello<|eot_id|>"


def test_end_of_generation_ids_include_known_turn_markers_of_any_type() -> None:
    meta = bpe_metadata()
    tok = load(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    # eos, and <|eot_id|> and <|im_end|> by their text (the latter typed normal in the file)
    assert tok.eog_ids == {tokens.index(t) for t in ("<|begin|>", "<|eot_id|>", "<|im_end|>")}
    assert tokens.index("<|im_end|>") in tok.special_ids  # llama.cpp makes it a control token


def test_harmony_end_closes_a_message_not_the_generation() -> None:
    markers = ["<|end|>", "<|return|>", "<|call|>"]
    meta = bpe_metadata()
    tokens = [*meta["tokenizer.ggml.tokens"], *markers]
    meta["tokenizer.ggml.tokens"] = tokens
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 3, 3, 3]
    tok = load(meta)
    end, ret, call = (tokens.index(t) for t in markers)
    assert {ret, call} <= tok.eog_ids and end not in tok.eog_ids
    assert end in tok.special_ids


def test_eot_and_eom_keys_end_generation() -> None:
    tok = load(bpe_metadata(**{"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6}))
    assert {5, 6} <= tok.eog_ids


@pytest.mark.parametrize(
    ("pre", "key", "adds_bos"),
    [
        ("gpt-2", None, False),
        ("llama-bpe", None, True),
        ("tekken", None, True),
        ("llama-bpe", False, False),
        ("gpt-2", True, True),
    ],
)
def test_add_bos_is_the_key_else_llama_cpps_default(
    pre: str, key: bool | None, adds_bos: bool
) -> None:
    changes: dict[str, Any] = {"tokenizer.ggml.pre": pre}
    if key is not None:
        changes["tokenizer.ggml.add_bos_token"] = key
    tok = load(bpe_metadata(**changes))
    assert (tok.encode("hello")[:1] == [tok.bos_id]) is adds_bos


def test_sentencepiece_merges_by_score_with_byte_fallback() -> None:
    s = ESCAPED_SPACE
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces = {s: -1.0, "a": -2.0, "b": -3.0, s + "a": -5.0, "ab": -4.0, s + "ab": -6.0}
    tokens += list(pieces)
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(pieces.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
    }
    tok = load(meta)
    ids = tok.encode("ab é")
    # "ab" (-4) merges before "▁a" (-5), then "▁"+"ab" -> "▁ab"; é is two UTF-8 bytes.
    expected = ["<s>", s + "ab", s, "<0xC3>", "<0xA9>"]
    assert ids == [tokens.index(t) for t in expected]
    assert tok.decode(ids[1:]) == "ab é"
    assert tok.eog_ids == {2}


def test_sentencepiece_without_space_prefix_as_gemma() -> None:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "a", ESCAPED_SPACE]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.ggml.add_bos_token": False,
    }
    tok = load(meta)
    assert tok.encode("a a") == [tokens.index(t) for t in ("a", ESCAPED_SPACE, "a")]
    assert tok.decode(tok.encode(" a")) == " a"  # a space the text had is kept


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"tokenizer.ggml.model": "t5"}, "'t5'"),
        ({"tokenizer.ggml.pre": "no-such-bpe"}, "'no-such-bpe'"),
        ({"tokenizer.ggml.merges": ["hello"]}, "LEFT RIGHT"),
        ({"tokenizer.ggml.token_type": ["x"]}, "not a list of numbers"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "fewer entries"),
        ({"tokenizer.ggml.tokens": ["a", "a"]}, "duplicates"),
        ({"tokenizer.ggml.merges": "h e"}, "merges is not a list"),
    ],
)
def test_bad_metadata_is_a_tokenizer_error(changes: dict[str, Any], match: str) -> None:
    meta = bpe_metadata(**changes)
    if "tokenizer.ggml.tokens" in changes:
        meta.pop("tokenizer.ggml.token_type")
    with pytest.raises(TokenizerError, match=match):
        load(meta)


def test_merges_naming_absent_tokens_are_ignored_as_llama_cpp_does() -> None:
    tok = load(bpe_metadata(**{"tokenizer.ggml.merges": [*MERGES, "x yz", "o o"]}))
    assert tok.decode(tok.encode("hello oo", add_special=False)) == "hello oo"
