"""Generated ids to text, incrementally, with stop strings.

Text is released only when it is final: an incomplete UTF-8 sequence at the
end (decoded as U+FFFD) and any tail that could still grow into a stop string
are held back until the next token settles them.

Each token decodes only a short window of ids, not the whole generation (that
made every token cost time in proportion to the text so far): the text of ids
``[prefix:]`` less the text of ids ``[prefix:read]``, both decoded from the same
start, so what a tokenizer does at a text's start (SentencePiece's leading
space) cancels out, as in Hugging Face's text-generation-inference.
"""

from __future__ import annotations

from meshnet.model.tokenizer import TextTokenizer

_INCOMPLETE = "\ufffd"


class TextStream:
    """Accumulates one generation's ids and yields its text in final pieces."""

    def __init__(self, tokenizer: TextTokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self._emitted = 0  # characters of the text already released
        self.text = ""  # the text so far, cut before a stop string once one appears
        self.stopped = False  # a stop string has appeared
        # The window: ids before ``_read`` are settled, their text in ``_settled``;
        # ``_head`` is the text of ids [_prefix:_read] decoded on its own.
        self._prefix = 0
        self._read = 0
        self._settled = ""
        self._head = ""

    def push(self, token_id: int) -> str:
        """Add one generated id; return the newly final text (may be empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._decoded()
        cut = _first_stop(text, self._stop)
        if cut is not None:
            self.stopped = True
            self.text = text[:cut]
            return self._release(cut)
        self.text = text
        if text.endswith(_INCOMPLETE):
            return ""
        return self._release(len(text) - _stop_prefix_len(text, self._stop))

    def _decoded(self) -> str:
        """The text of every id so far; the window moves on when its end is final."""
        window = self._tokenizer.decode(self._ids[self._prefix :])
        if not window.startswith(self._head):  # not a tokenizer that decodes piecewise
            return self._tokenizer.decode(self._ids)
        text = self._settled + window[len(self._head) :]
        if not text.endswith(_INCOMPLETE):
            self._prefix, self._read, self._settled = self._read, len(self._ids), text
            self._head = self._tokenizer.decode(self._ids[self._prefix :])
        return text

    def finish(self) -> str:
        """Release whatever was held back; call once when generation ends."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
