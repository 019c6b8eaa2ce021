"""StringTable and StringIndex: a vocabulary's strings held compactly, found by text."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.model.special_match import SpecialMatcher
from meshnet.model.string_table import StringIndex, StringTable

WORDS = ["", "a", "▁the", "日本語", "<0x0A>", "😀", "a b", "\x00"]


def test_a_table_is_its_strings_and_equals_their_list() -> None:
    table = StringTable.of(WORDS)
    assert len(table) == len(WORDS) and list(table) == WORDS and table == WORDS
    assert [table[i] for i in range(-len(WORDS), 0)] == WORDS
    assert table[2:4] == WORDS[2:4] and table != WORDS[:-1] and table != [*WORDS[:-1], "?"]
    with pytest.raises(IndexError):
        table[len(WORDS)]


def test_bytes_cut_inside_a_character_are_refused_naming_the_string() -> None:
    blob = "aé".encode()  # 61 c3 a9
    assert StringTable.from_parts(blob, np.array([0, 1, 3])) == ["a", "é"]
    with pytest.raises(ValueError, match="string 0 is not UTF-8"):
        StringTable.from_parts(blob, np.array([0, 2, 3]))  # "a\xc3", "\xa9"


def test_the_index_finds_every_string_and_nothing_else() -> None:
    words = [f"tok{i}" for i in range(5000)] + WORDS[1:]
    index = StringIndex(StringTable.of(words))
    assert all(index.find(w) == i for i, w in enumerate(words))
    assert index.find("tok5000") == -1 and index.find("") == -1 and index.find("▁") == -1


def test_the_index_refuses_a_string_listed_twice() -> None:
    with pytest.raises(ValueError, match="equals string 1"):
        StringIndex(StringTable.of(["x", "a", "b", "a"]))


def test_specials_match_leftmost_longest_and_may_strip_the_space_after() -> None:
    m = SpecialMatcher.of([("<s>", 1), ("<s>x", 2), ("<|end|>", 3)], rstrip=[3])
    assert m.split("a<s>xb<s><|end|> \n c<s") == [
        ("a", None),
        ("<s>x", 2),
        ("b", None),
        ("<s>", 1),
        ("<|end|>", 3),
        ("c<s", None),
    ]
    assert SpecialMatcher.of([]).split("<s>") == [("<s>", None)]
