"""Tokenizer built from GGUF metadata with the ``tokenizers`` library.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is supported so far.
The pre-tokenizer is chosen by ``tokenizer.ggml.pre``: ``smollm`` splits every
digit on its own before the GPT-2 byte-level regex. Control tokens (type 3)
become special tokens so that chat-template markers encode to their single ids
and never merge with neighbouring text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from meshnet.errors import TokenizerError
from meshnet.model.gguf_file import GGUFFile

_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED = 4

# Pre-tokenizer names whose behaviour is byte-level GPT-2, with or without
# splitting digits one by one first.
_DIGIT_SPLITTING = frozenset({"smollm"})
_PLAIN_BYTE_LEVEL = frozenset({"gpt2", "default"})


@dataclass(frozen=True)
class TextTokenizer:
    """Encode text to ids and back; knows its special tokens and bos/eos."""

    hf: Tokenizer
    add_bos: bool
    bos_id: int | None
    eos_id: int
    special_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special-token markers in it become their single ids."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens spelled out."""
        return self.hf.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(f: GGUFFile) -> TextTokenizer:
    """Build the tokenizer described by ``f``'s ``tokenizer.ggml.*`` metadata."""
    model = str(f.value_or("tokenizer.ggml.model", ""))
    if model != "gpt2":
        raise TokenizerError(f"{f.path.name}: tokenizer model {model!r} is not supported (gpt2)")
    pre = str(f.value_or("tokenizer.ggml.pre", "default"))
    tokens = [str(t) for t in f.value("tokenizer.ggml.tokens")]
    types = [int(t) for t in f.value_or("tokenizer.ggml.token_type", [])]
    merges = [_split_merge(str(m)) for m in f.value("tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{f.path.name}: the token list has duplicates")

    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    hf.pre_tokenizer = _pre_tokenizer(pre, f.path.name)
    hf.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    return TextTokenizer(
        hf=hf,
        add_bos=bool(f.value_or("tokenizer.ggml.add_bos_token", False)),
        bos_id=_opt_int(f, "tokenizer.ggml.bos_token_id"),
        eos_id=int(f.value("tokenizer.ggml.eos_token_id")),
        special_ids=frozenset(special),
    )


def _pre_tokenizer(pre: str, file_name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _PLAIN_BYTE_LEVEL:
        return byte_level
    raise TokenizerError(f"{file_name}: pre-tokenizer {pre!r} is not supported")


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise TokenizerError(f"merge rule {merge!r} is not 'LEFT RIGHT'")
    return left, right


def _opt_int(f: GGUFFile, key: str) -> int | None:
    return int(f.value(key)) if f.has(key) else None
