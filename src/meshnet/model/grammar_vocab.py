"""The model's vocabulary as the grammar engine (llguidance) sees it: every id's bytes.

A token mask is computed from what each id spells, byte for byte, so the view is
built from meshnet's own tokenizer (model/tokenizer.py), never from another copy
of the vocabulary:

- byte-level BPE (``gpt2``): each character of a token's text stands for one
  byte through GPT-2's printable alphabet (Radford et al. 2019, ``bytes_to_unicode``);
- SentencePiece (``llama``): ``<0xXX>`` tokens are that byte, ``▁`` is a space,
  the rest is UTF-8.

Special (control) tokens are marked as llguidance expects, with a leading 0xFF, so
a grammar never spells them by accident; the ids that end generation are its EOS.
Ids past the tokenizer's list (a padded head) spell nothing and are never allowed.
Building a view of a large vocabulary takes about a second: one per model, kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance

from meshnet.model.spm import SpmCodec, byte_value
from meshnet.model.tokenizer import TextTokenizer

_SPECIAL = b"\xff"  # llguidance's mark of a special token's bytes
_SPM_SPACE = "▁"


class _Wrapped:
    """The attributes and call llguidance's ``TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokenizer: TextTokenizer, tokens: list[bytes]) -> None:
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokens
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        """The bare ids of ``text`` (llguidance tokenizes forced text with it)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False)


def grammar_tokenizer(tokenizer: TextTokenizer, n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for a model whose head has ``n_vocab`` logits."""
    tokens = token_bytes(tokenizer)
    tokens += [b""] * (n_vocab - len(tokens))
    eos = [tokenizer.eos_id, *sorted(tokenizer.eog_ids - {tokenizer.eos_id})]
    wrapper = llguidance.TokenizerWrapper(_Wrapped(tokenizer, tokens))
    return llguidance.LLTokenizer(wrapper, n_vocab=n_vocab, eos_token=eos)


def token_bytes(tokenizer: TextTokenizer) -> list[bytes]:
    """What each id of ``tokenizer`` spells, in id order (specials marked with 0xFF)."""
    codec = tokenizer.codec
    n = codec.get_vocab_size()
    texts = [codec.id_to_token(i) or "" for i in range(n)]
    spell = _spm_bytes if isinstance(codec, SpmCodec) else _byte_level_bytes
    out: list[bytes] = []
    for i, text in enumerate(texts):
        if i in tokenizer.special_ids:
            out.append(_SPECIAL + text.encode("utf-8"))
        else:
            out.append(spell(text))
    return out


def _spm_bytes(text: str) -> bytes:
    byte = byte_value(text)
    if byte is not None:
        return bytes([byte])
    return text.replace(_SPM_SPACE, " ").encode("utf-8")


def _byte_level_bytes(text: str) -> bytes:
    table = _BYTE_OF_CHAR
    try:
        return bytes(table[c] for c in text)
    except KeyError:  # an added token spelled in plain text, not the byte alphabet
        return text.encode("utf-8")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is
    written as -> the byte. Printable Latin-1 bytes stand for themselves; the others
    (controls, space, soft hyphen…) are moved, in byte order, to U+0100 onwards."""
    printable: Sequence[int] = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    moved = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + moved)
            moved += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_level_alphabet()  # a constant table, never written after import
