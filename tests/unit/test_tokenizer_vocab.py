"""Real vocabularies (Llama-2 SentencePiece, Llama-3 and Qwen3 byte-level BPE) in tiny GGUFs.

Prompt ids must equal llama.cpp's own tokenizer on the same GGUF (recorded in
tests/fixtures/tokenizer_llamacpp.json by scripts/record_tokenizer_oracle.py)
and Hugging Face ``tokenizers`` on the same tokenizer.json; decoding gives the
text back; every end-of-generation id stops a request.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer
from vocab_gguf import (
    CASES,
    FAMILIES,
    Case,
    FamilyFiles,
    family_dir,
    fetch_vocabularies,
    write_case_gguf,
    write_vocab_gguf,
)

from meshnet.engine.request import RequestState
from meshnet.engine.text import TextStream
from meshnet.errors import TokenizerError
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.sampling import SamplingParams
from meshnet.model.tokenizer import TextTokenizer, load_tokenizer

ORACLE = Path(__file__).parents[1] / "fixtures" / "tokenizer_llamacpp.json"

# Where llama.cpp, our reference, deliberately differs from Hugging Face: it makes every
# token whose text is a known end-of-turn marker a control token ("</s>" in Qwen3).
HF_DIFFERS = {"qwen3": ("</s>",)}


@cache
def llamacpp() -> dict[str, Any]:
    return json.loads(ORACLE.read_text(encoding="utf-8"))


def tokenizer_of(path: Path) -> TextTokenizer:
    return load_tokenizer(open_gguf(path))


@pytest.fixture(scope="session")
def vocab_cache() -> Path:
    return fetch_vocabularies()


@pytest.fixture(scope="module")
def family_tokenizer(vocab_cache: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``family_tokenizer(name)``: the tokenizer of that family's GGUF, loaded once."""
    files = FamilyFiles(vocab_cache, tmp_path_factory.mktemp("vocab"))
    loaded: dict[str, TextTokenizer] = {}

    def get(name: str) -> TextTokenizer:
        if name not in loaded:
            loaded[name] = tokenizer_of(files.path(name))
        return loaded[name]

    return get


def test_oracle_was_recorded_on_these_vocabularies(vocab_cache: Path) -> None:
    for name, digest in llamacpp()["vocabularies"].items():
        data = (family_dir(vocab_cache, name) / "tokenizer.json").read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{name}: re-record the oracle"


@pytest.fixture(scope="module")
def cut_file(vocab_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> GGUFFile:
    """The 20k-token cut of Llama-3; each pre-tokenizer case names its own in the metadata."""
    out = tmp_path_factory.mktemp("vocab") / "cut.gguf"
    return open_gguf(write_case_gguf(vocab_cache, Case("llama3", pre="default", cut=True), out))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.key)
def test_prompt_ids_equal_llama_cpp(case: Case, cut_file: GGUFFile, family_tokenizer) -> None:  # type: ignore[no-untyped-def]
    if case.cut:
        # The file the oracle was recorded on differs from cut_file only in this key.
        metadata = {**cut_file.metadata, "tokenizer.ggml.pre": case.pre}
        tok = load_tokenizer(replace(cut_file, metadata=metadata))
    else:
        tok = family_tokenizer(case.family)
    expected = llamacpp()["cases"][case.key]
    for text, ids in zip(llamacpp()["texts"], expected, strict=True):
        assert tok.encode(text) == ids, f"{case.key}: {text!r}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_equal_hugging_face_tokenizers(
    family: str, vocab_cache: Path, family_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    hf = Tokenizer.from_file(str(family_dir(vocab_cache, family) / "tokenizer.json"))
    tok = family_tokenizer(family)
    texts = [
        t
        for t in llamacpp()["texts"]
        if not any(marker in t for marker in HF_DIFFERS.get(family, ()))
    ]
    for text in texts:
        assert (
            tok.encode(text, add_special=False) == hf.encode(text, add_special_tokens=False).ids
        ), text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_gives_the_text_back(family: str, family_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = family_tokenizer(family)
    for text in llamacpp()["texts"]:
        ids = tok.encode(text, add_special=False)
        if family == "llama2" and any(i in tok.special_ids for i in ids):
            # SentencePiece puts a space before text that follows a special token, as
            # llama.cpp and transformers do; that space is not given back.
            continue
        assert tok.decode(ids) == text


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_text_is_the_whole_decode_at_every_token(family: str, family_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A stream decodes a short window per token; its text must still be the decode of
    every id so far: real text of every kind, then random ids (byte pieces that split
    characters, special tokens mid-text)."""
    tok = family_tokenizer(family)
    texts = [tok.encode(t, add_special=False) for t in llamacpp()["texts"]]
    rng = np.random.default_rng(7)
    specials = sorted(tok.special_ids)
    noise = [
        [int(i) if rng.random() > 0.05 else specials[int(i) % len(specials)] for i in row]
        for row in rng.integers(0, tok.codec.get_vocab_size(), size=(20, 60))
    ]
    for ids in [*texts, *noise]:
        stream = TextStream(tok)
        released = []
        for k, i in enumerate(ids):
            released.append(stream.push(i))
            assert stream.text == tok.decode(ids[: k + 1]), (family, ids[: k + 1])
        assert "".join(released) + stream.finish() == tok.decode(ids)


def test_special_tokens_are_single_ids_and_spelled_out(family_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = family_tokenizer("llama3")
    ids = tok.encode("<|start_header_id|>user<|end_header_id|>", add_special=False)
    assert ids == [128006, 882, 128007]
    assert tok.decode([128000, 9906, 128009]) == "<|begin_of_text|>Hello<|eot_id|>"


@pytest.mark.parametrize(
    ("family", "eog"),
    [
        ("llama2", {2}),  # </s>
        ("llama3", {128001, 128009}),  # <|end_of_text|>, <|eot_id|> (3.0 has no <|eom_id|>)
        ("qwen3", {151643, 151645}),  # <|endoftext|>, <|im_end|>
    ],
)
def test_every_end_of_generation_id_is_known(family: str, eog: set[int], family_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert family_tokenizer(family).eog_ids >= eog


def test_generation_stops_at_end_of_turn_not_only_eos(family_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = family_tokenizer("llama3")
    state = RequestState([128000], SamplingParams(max_tokens=10), tok)
    logits = np.zeros(128256, np.float32)
    logits[9906] = 1.0  # "Hello"
    state.take(logits)
    assert not state.done
    logits[128009] = 2.0  # <|eot_id|>, not the file's eos <|end_of_text|>
    state.take(logits)
    assert state.finish == "stop" and state.text == "Hello"


@pytest.mark.parametrize(
    ("family", "pre", "adds_bos"),
    [("llama2", None, True), ("llama3", "llama-bpe", True), ("llama3", "qwen2", False)],
)
def test_add_bos_defaults_as_llama_cpp(
    family: str, pre: str | None, adds_bos: bool, vocab_cache: Path, tmp_path: Path
) -> None:
    silent = replace(FAMILIES[family], pre=pre, add_bos=None)
    cut = silent.model == "gpt2"  # the first 20k tokens suffice and load faster
    path = write_vocab_gguf(family_dir(vocab_cache, family), silent, tmp_path / "v.gguf", cut=cut)
    tok = tokenizer_of(path)
    assert (tok.encode("hi")[0] == tok.bos_id) is adds_bos


def test_add_eos_and_explicit_add_bos_are_honoured(vocab_cache: Path, tmp_path: Path) -> None:
    path = write_vocab_gguf(
        family_dir(vocab_cache, "llama3"),
        FAMILIES["llama3"],
        tmp_path / "v.gguf",
        cut=True,
        add_bos=False,
        add_eos=True,
    )
    tok = tokenizer_of(path)
    ids = tok.encode("hi")
    assert ids[0] != tok.bos_id and ids[-1] == tok.eos_id
    assert tok.encode("hi", add_special=False) == ids[:-1]


def test_unknown_pre_tokenizer_is_refused_by_name(vocab_cache: Path, tmp_path: Path) -> None:
    odd = replace(FAMILIES["llama3"], pre="wizard-bpe")
    path = write_vocab_gguf(family_dir(vocab_cache, "llama3"), odd, tmp_path / "v.gguf", cut=True)
    with pytest.raises(TokenizerError, match="'wizard-bpe'"):
        tokenizer_of(path)


def test_unknown_tokenizer_model_is_refused_by_name(vocab_cache: Path, tmp_path: Path) -> None:
    odd = replace(FAMILIES["llama3"], model="t5")
    path = write_vocab_gguf(family_dir(vocab_cache, "llama3"), odd, tmp_path / "v.gguf", cut=True)
    with pytest.raises(TokenizerError, match="'t5'"):
        tokenizer_of(path)
