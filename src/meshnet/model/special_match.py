"""Special tokens found whole in a text, before the rest of it is tokenized.

The ``tokenizers`` library matches its added tokens leftmost-longest (an
Aho-Corasick automaton over their texts); this does the same without one: the
positions where some special token could start are found by a regex of their
first characters, and at each the longest special that fits is looked up by
length. A special that strips the whitespace to its right (Phi-3's) takes that
whitespace with it, whitespace as Rust's ``char::is_whitespace`` has it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

# Rust's char::is_whitespace (the Unicode White_Space property), which the tokenizers
# library strips by; str.isspace also counts U+001C..U+001F.
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)

# A piece of a text: plain text to tokenize (id None), or one special token's id.
Piece = tuple[str, int | None]


@dataclass(frozen=True)
class SpecialMatcher:
    """Splits texts at the special tokens it was made with."""

    ids: dict[str, int]  # special text -> id
    rstrip: frozenset[int]  # ids that take the whitespace after them
    _lengths: tuple[int, ...]  # every special's length, longest first
    _starts: re.Pattern[str] | None  # a character some special starts with

    @staticmethod
    def of(specials: Iterable[tuple[str, int]], rstrip: Iterable[int] = ()) -> SpecialMatcher:
        """A matcher of ``specials`` (text, id); an empty text is never matched."""
        ids = {text: i for text, i in specials if text}
        lengths = tuple(sorted({len(t) for t in ids}, reverse=True))
        firsts = sorted({t[0] for t in ids})
        starts = re.compile("[" + "".join(re.escape(c) for c in firsts) + "]") if ids else None
        return SpecialMatcher(ids, frozenset(rstrip), lengths, starts)

    def split(self, text: str) -> list[Piece]:
        """``text`` as plain pieces and specials, in order; no piece is empty."""
        pieces: list[Piece] = []
        done = 0  # text before this is in pieces
        pos = 0
        while self._starts is not None and (hit := self._starts.search(text, pos)) is not None:
            at = hit.start()
            found = self._longest_at(text, at)
            if found is None:
                pos = at + 1
                continue
            special, length = found
            if at > done:
                pieces.append((text[done:at], None))
            pieces.append((text[at : at + length], special))
            end = at + length
            if special in self.rstrip:
                while end < len(text) and text[end] in _WHITESPACE:
                    end += 1
            done = pos = end
        if done < len(text):
            pieces.append((text[done:], None))
        return pieces

    def _longest_at(self, text: str, at: int) -> tuple[int, int] | None:
        ids, room = self.ids, len(text) - at
        for n in self._lengths:
            if n > room:
                continue
            special = ids.get(text[at : at + n])
            if special is not None:
                return special, n
        return None
