"""Tokenizer built from GGUF metadata, as llama.cpp reads it.

Two vocabulary kinds (``tokenizer.ggml.model``), each behind a ``Codec``:

- ``gpt2``: byte-level BPE, run by the ``tokenizers`` library; the text is split
  by the pre-tokenizer named in ``tokenizer.ggml.pre`` (see ``pretokenizers``),
  then merged by rank (~33 MB for Llama 3's 128k tokens and 280k merges);
- ``llama``: SentencePiece with scores and byte fallback, run by ``spm`` over
  compact tables (~10 MB for Gemma 3's 262k tokens, where a ``tokenizers``
  model holding every mergeable pair took ~75 MB).

Control, user-defined and unknown-type tokens, and the tokens llama.cpp treats
as ending generation, are special: their text encodes to their single id and
never merges with neighbouring text. ``add_bos_token``/``add_eos_token`` and
the special ids default as llama.cpp defaults them when the file is silent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models

from meshnet.errors import TokenizerError
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.pretokenizers import pre_tokenizer
from meshnet.model.special_match import SpecialMatcher
from meshnet.model.special_tokens import SpecialTokens, read_special_tokens
from meshnet.model.spm import spm_codec
from meshnet.model.string_table import StringIndex, StringTable, table_of

# The per-token arrays a tokenizer is built from: once it is, the file's copies can go
# (``GGUFFile.drop``); a 262k-token vocabulary's scores alone are 8 MB as Python floats.
TOKENIZER_ARRAYS = (
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
)


class Codec(Protocol):
    """A vocabulary's encoder and decoder, the method names the ``tokenizers`` library's."""

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, special tokens matched whole; no BOS/EOS added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens spelled as their text."""
        ...

    def id_to_token(self, i: int) -> str | None: ...

    def token_to_id(self, text: str) -> int | None: ...

    def get_vocab_size(self) -> int: ...


@dataclass(frozen=True, eq=False)  # compared and hashed by identity, as tables are
class HfCodec:
    """A ``tokenizers`` Tokenizer as a ``Codec`` (byte-level BPE vocabularies)."""

    hf: Tokenizer

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=False))

    def id_to_token(self, i: int) -> str | None:
        return self.hf.id_to_token(i)

    def token_to_id(self, text: str) -> int | None:
        return self.hf.token_to_id(text)

    def get_vocab_size(self) -> int:
        return int(self.hf.get_vocab_size())


@dataclass(frozen=True)
class TextTokenizer:
    """Encode text to ids and back; knows its special tokens and which ids end generation."""

    codec: Codec
    add_bos: bool
    bos_id: int | None
    eos_id: int
    special_ids: frozenset[int]
    # Every id after which llama.cpp stops generating: eos, eot, eom and the like.
    eog_ids: frozenset[int]
    add_eos: bool = False
    # SentencePiece prepends a space to the text; decoding the start of a sequence drops it.
    strips_leading_space: bool = False

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Ids of ``text``; special-token markers in it become their single ids.

        With ``add_special`` the file's BOS/EOS are added as ``add_bos_token`` and
        ``add_eos_token`` say (a prompt); without, the bare text's ids.
        """
        ids = self.codec.encode(text)
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_special and self.add_eos:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens spelled out as their text."""
        parts: list[str] = []
        run: list[int] = []
        run_start = 0
        for pos, i in enumerate(ids):
            if i in self.special_ids:
                parts.append(self._decode_run(run, run_start))
                parts.append(self.codec.id_to_token(i) or "")
                run, run_start = [], pos + 1
            else:
                run.append(i)
        parts.append(self._decode_run(run, run_start))
        return "".join(parts)

    def _decode_run(self, run: list[int], start: int) -> str:
        if not run:
            return ""
        text = self.codec.decode(run)
        if self.strips_leading_space and start == 0 and text.startswith(" "):
            return text[1:]
        return text


def load_tokenizer(f: GGUFFile) -> TextTokenizer:
    """Build the tokenizer described by ``f``'s ``tokenizer.ggml.*`` metadata."""
    model = str(f.value_or("tokenizer.ggml.model", ""))
    name = f.path.name
    if model not in ("gpt2", "llama"):
        raise TokenizerError(f"{name}: tokenizer model {model!r} is not supported (gpt2, llama)")
    tokens = _tokens(f)
    types = _int_list(f, "tokenizer.ggml.token_type", len(tokens))
    is_spm = model == "llama"
    special = read_special_tokens(f, tokens, types, spm=is_spm)
    rstrip = _rstrips_specials(f)
    codec: Codec
    if is_spm:
        codec = _spm_codec(f, tokens, special, rstrip)
        default_add_bos = True
    else:
        pre = pre_tokenizer(str(f.value_or("tokenizer.ggml.pre", "default")), name)
        hf = _bpe_tokenizer(f, tokens, pre.ignore_merges)
        hf.pre_tokenizer = pre.build()
        _add_special_tokens(hf, tokens, special, rstrip)
        codec = HfCodec(hf)
        default_add_bos = pre.add_bos
    return TextTokenizer(
        codec=codec,
        add_bos=bool(f.value_or("tokenizer.ggml.add_bos_token", default_add_bos)),
        add_eos=bool(f.value_or("tokenizer.ggml.add_eos_token", False)),
        bos_id=special.bos_id,
        eos_id=_required_eos(special, name),
        special_ids=special.special_ids,
        eog_ids=special.eog_ids,
        strips_leading_space=is_spm and _add_space_prefix(f),
    )


def _tokens(f: GGUFFile) -> StringTable:
    raw = f.value("tokenizer.ggml.tokens")
    if not isinstance(raw, StringTable) and (
        not isinstance(raw, list) or not all(isinstance(t, str) for t in raw)
    ):
        raise TokenizerError(f"{f.path.name}: tokenizer.ggml.tokens is not a list of strings")
    tokens = table_of(raw)
    if np.any(tokens.lengths() == 0):
        # llama.cpp names an empty token after its id rather than leave it unmatchable.
        tokens = StringTable.of(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))
    return tokens


def _spm_codec(f: GGUFFile, tokens: StringTable, special: SpecialTokens, rstrip: bool) -> Codec:
    """The SentencePiece codec: ``tokens`` indexed, their scores, specials matched whole."""
    try:
        index = StringIndex(tokens)
    except ValueError:
        raise TokenizerError(f"{f.path.name}: the token list has duplicates") from None
    specials = SpecialMatcher.of(
        ((tokens[i], i) for i in special.special_ids), _rstrips(tokens, special, rstrip)
    )
    return spm_codec(
        tokens,
        index,
        _float_list(f, "tokenizer.ggml.scores", len(tokens)),
        specials,
        _unk_id(f, len(tokens)),
        _add_space_prefix(f),
    )


def _int_list(f: GGUFFile, key: str, n: int) -> list[int]:
    """Per-token integers (absent: none); at least one per token when present."""
    return [int(v) for v in _per_token(f, key, n, [], (int,))]


def _float_list(f: GGUFFile, key: str, n: int) -> list[float]:
    """Per-token numbers (absent: all 0, as llama.cpp); at least one per token."""
    return [float(v) for v in _per_token(f, key, n, [0.0] * n, (int, float))]


def _per_token(
    f: GGUFFile, key: str, n: int, default: list[Any], kinds: tuple[type, ...]
) -> list[Any]:
    values = f.value_or(key, default)
    if not isinstance(values, list) or not all(isinstance(v, kinds) for v in values):
        raise TokenizerError(f"{f.path.name}: {key} is not a list of numbers")
    if values and len(values) < n:
        raise TokenizerError(f"{f.path.name}: {key} has fewer entries than the {n} tokens")
    return values


def _bpe_tokenizer(f: GGUFFile, tokens: StringTable, ignore_merges: bool) -> Tokenizer:
    """The byte-level BPE model; its vocabulary and merges are Python objects only while
    the ``tokenizers`` library copies them in."""
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise TokenizerError(f"{f.path.name}: the token list has duplicates")
    model = models.BPE(
        vocab=vocab, merges=_merges(f, vocab), fuse_unk=False, ignore_merges=ignore_merges
    )
    hf = Tokenizer(model)
    hf.decoder = decoders.ByteLevel()
    return hf


def _merges(f: GGUFFile, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, split as llama.cpp splits them (at the first
    space after the first character); a merge that cannot apply (a half or the result is
    no token, which llama.cpp keeps unused) is dropped, the tokenizers library refusing it."""
    raw = f.value("tokenizer.ggml.merges")
    if not isinstance(raw, StringTable) and (
        not isinstance(raw, list) or not all(isinstance(m, str) for m in raw)
    ):
        raise TokenizerError(f"{f.path.name}: tokenizer.ggml.merges is not a list of strings")
    pairs = [(m[:cut], m[cut + 1 :]) for m in raw if (cut := m.find(" ", 1)) > 0]
    if len(pairs) != len(raw):
        raise TokenizerError(f"{f.path.name}: a merge rule is not 'LEFT RIGHT'")
    return [(a, b) for a, b in pairs if a in vocab and b in vocab and a + b in vocab]


def _unk_id(f: GGUFFile, n_tokens: int) -> int | None:
    unk = int(f.value_or("tokenizer.ggml.unknown_token_id", 0))
    return unk if 0 <= unk < n_tokens else None


def _add_space_prefix(f: GGUFFile) -> bool:
    return bool(f.value_or("tokenizer.ggml.add_space_prefix", True))


def _rstrips_specials(f: GGUFFile) -> bool:
    """llama.cpp strips the whitespace after Phi-3's special tokens (found by its name)."""
    name = str(f.value_or("general.name", "")).lower()
    return "phi-3" in name or "phi3" in name


_PHI3_NO_RSTRIP = frozenset({"<unk>", "<s>", "<|endoftext|>"})


def _rstrips(tokens: StringTable, special: SpecialTokens, rstrip: bool) -> set[int]:
    """The special ids that take the whitespace after them."""
    if not rstrip:
        return set()
    return {i for i in special.special_ids if tokens[i] not in _PHI3_NO_RSTRIP}


def _add_special_tokens(
    hf: Tokenizer, tokens: StringTable, special: SpecialTokens, rstrip: bool
) -> None:
    strips = _rstrips(tokens, special, rstrip)
    added = [
        AddedToken(tokens[i], special=True, normalized=False, rstrip=i in strips)
        for i in sorted(special.special_ids)
    ]
    hf.add_special_tokens(added)


def _required_eos(special: SpecialTokens, file_name: str) -> int:
    if special.eos_id is None:
        raise TokenizerError(f"{file_name}: no end-of-sequence token (tokenizer.ggml.eos_token_id)")
    return special.eos_id
