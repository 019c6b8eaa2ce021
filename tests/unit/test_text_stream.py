"""Incremental text: stop strings cut the text, and nothing is released too early."""

from meshnet.engine.local import LocalModel
from meshnet.engine.text import TextStream


def _push_all(stream: TextStream, ids: list[int]) -> str:
    return "".join(stream.push(i) for i in ids) + stream.finish()


def test_plain_text_streams_whole(tiny: LocalModel) -> None:
    ids = tiny.tokenizer.encode("the cat sat on the mat")
    stream = TextStream(tiny.tokenizer)
    assert _push_all(stream, ids) == "the cat sat on the mat" == stream.text


def test_stop_string_cuts_text_and_stops(tiny: LocalModel) -> None:
    ids = tiny.tokenizer.encode("the cat sat on the mat")
    stream = TextStream(tiny.tokenizer, stop=("sat",))
    out = _push_all(stream, ids)
    assert out == "the cat " == stream.text
    assert stream.stopped


def test_possible_stop_prefix_is_held_back_then_released(tiny: LocalModel) -> None:
    stream = TextStream(tiny.tokenizer, stop=("cat!",))
    released = [stream.push(i) for i in tiny.tokenizer.encode("a cat")]
    assert "".join(released) == "a "  # "cat" could still become "cat!"
    assert stream.push(tiny.tokenizer.encode("?")[0]) == "cat?"
    assert not stream.stopped


def test_incomplete_utf8_is_held_until_complete(tiny: LocalModel) -> None:
    ids = tiny.tokenizer.encode("é")  # two byte tokens
    assert len(ids) == 2
    stream = TextStream(tiny.tokenizer)
    assert stream.push(ids[0]) == ""
    assert stream.push(ids[1]) == "é"
