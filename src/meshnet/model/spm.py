"""SentencePiece vocabularies (``tokenizer.ggml.model == "llama"``) as llama.cpp runs them.

llama.cpp's SPM tokenizer (``llm_tokenizer_spm``) starts from the characters of
each text between special tokens (spaces escaped as U+2581, one prepended when
``add_space_prefix``), repeatedly merges the adjacent pair whose concatenation
is a token of the highest score (the leftmost on a tie), and spells a
character that is no token as its UTF-8 bytes ``<0xXX>``. ``SpmCodec`` runs
that algorithm itself over compact tables (``string_table``): a 262k-token
vocabulary (Gemma 3) costs it ~35 bytes a token, where a ``tokenizers`` BPE
model holding every such pair as a merge took ~300 (its vocabulary twice as
owned strings, and ~500k merges).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshnet.model.special_match import SpecialMatcher
from meshnet.model.string_table import StringIndex, StringTable

ESCAPED_SPACE = "\u2581"  # how SentencePiece writes a space inside a token
_REPLACEMENT = "\ufffd"  # a run of byte tokens that is not UTF-8, per byte


@dataclass(frozen=True, eq=False)  # compared and hashed by identity, as tables are
class SpmCodec:
    """Encodes text to ids and decodes ids to text with one SentencePiece vocabulary.

    Immutable: any thread may call it. ``encode`` matches ``specials`` whole first;
    ``decode`` spells every id (specials too) as the ``tokenizers`` library's
    SentencePiece decoder does: U+2581 as a space, byte tokens gathered into UTF-8.
    """

    tokens: StringTable
    index: StringIndex
    scores: memoryview  # float32 per token, read as Python floats
    specials: SpecialMatcher
    byte_ids: tuple[int, ...] | None  # the id of <0xXX> for each byte; None if one is missing
    unk_id: int | None
    add_space_prefix: bool

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``: specials as their ids, the text between them segmented."""
        out: list[int] = []
        for piece, special in self.specials.split(text):
            if special is not None:
                out.append(special)
                continue
            if self.add_space_prefix:
                piece = " " + piece
            out += self._segment(piece.replace(" ", ESCAPED_SPACE))
        return out

    def _segment(self, text: str) -> list[int]:
        """llama.cpp's merge loop over the characters of ``text``.

        Symbol ``i`` starts at character ``i`` and spans ``width[i]`` characters (0 once
        merged into its left neighbour); a heap entry is a candidate merge of two
        neighbours, stale once either has changed (their widths no longer add up).
        """
        n = len(text)
        find, scores = self.index.find, self.scores
        known: dict[str, int] = {}  # texts looked up in this call: a text repeats its pairs
        width = [1] * n
        for c in set(text):
            known[c] = find(c)
        ids = [known[c] for c in text]  # each symbol's token, -1 where it is none
        nxt = [*range(1, n), -1]
        prev = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int, int]] = []
        for i in range(n - 1):
            pair = text[i : i + 2]
            t = known.get(pair)
            if t is None:
                t = known[pair] = find(pair)
            if t >= 0:
                heap.append((-scores[t], i, i + 1, 2, t))
        heapq.heapify(heap)
        while heap:
            _, left, right, size, t = heapq.heappop(heap)
            if width[left] == 0 or width[right] == 0 or width[left] + width[right] != size:
                continue
            width[left], width[right], ids[left] = size, 0, t
            after = nxt[left] = nxt[right]
            if after >= 0:
                prev[after] = left
            for a, b in ((prev[left], left), (left, after)):
                if a >= 0 and b >= 0:
                    joined = width[a] + width[b]
                    piece = text[a : a + joined]
                    t = known.get(piece)
                    if t is None:
                        t = known[piece] = find(piece)
                    if t >= 0:
                        heapq.heappush(heap, (-scores[t], a, b, joined, t))
        out: list[int] = []
        i = 0 if n else -1
        while i >= 0:
            if ids[i] >= 0:
                out.append(ids[i])
            else:  # one character that is no token
                out += self._fallback(text[i : i + width[i]])
            i = nxt[i]
        return out

    def _fallback(self, char: str) -> list[int]:
        """A character's byte tokens; the unknown token where the vocabulary lacks one."""
        if self.byte_ids is not None:
            return [self.byte_ids[b] for b in char.encode("utf-8")]
        return [self.unk_id] if self.unk_id is not None else []

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; ids outside the vocabulary are skipped."""
        parts: list[str] = []
        pending = bytearray()  # byte tokens not yet decoded
        n = len(self.tokens)
        for i in ids:
            if not 0 <= i < n:
                continue
            text = self.tokens[i]
            byte = byte_value(text)
            if byte is not None:
                pending.append(byte)
                continue
            if pending:
                parts.append(_bytes_text(pending))
                pending.clear()
            parts.append(text.replace(ESCAPED_SPACE, " "))
        if pending:
            parts.append(_bytes_text(pending))
        return "".join(parts)

    def id_to_token(self, i: int) -> str | None:
        return self.tokens[i] if 0 <= i < len(self.tokens) else None

    def token_to_id(self, text: str) -> int | None:
        i = self.index.find(text)
        return i if i >= 0 else None

    def get_vocab_size(self) -> int:
        return len(self.tokens)


def spm_codec(
    tokens: StringTable,
    index: StringIndex,
    scores: Sequence[float],
    specials: SpecialMatcher,
    unk_id: int | None,
    add_space_prefix: bool,
) -> SpmCodec:
    """The codec of a vocabulary: ``tokens`` with their ``scores`` (one each)."""
    table = np.asarray(scores[: len(tokens)], np.float32)
    byte_ids = [index.find(f"<0x{b:02X}>") for b in range(256)]
    return SpmCodec(
        tokens=tokens,
        index=index,
        scores=table.data,
        specials=specials,
        byte_ids=tuple(byte_ids) if min(byte_ids) >= 0 else None,
        unk_id=unk_id,
        add_space_prefix=add_space_prefix,
    )


def byte_value(token: str) -> int | None:
    """The byte a ``<0xXX>`` token stands for, as the tokenizers library's ByteFallback
    reads one (Rust's u8::from_str_radix: two hex digits, or a + and one)."""
    if len(token) != 6 or not token.startswith("<0x") or token[5] != ">":
        return None
    digits = token[3:5]
    if digits[0] == "+":
        digits = digits[1]
    if not all(c in "0123456789abcdefABCDEF" for c in digits):
        return None
    return int(digits, 16)


def _bytes_text(data: bytearray) -> str:
    """A run of byte tokens as text: its UTF-8, or U+FFFD per byte where it is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return _REPLACEMENT * len(data)
