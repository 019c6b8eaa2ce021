"""Log-probabilities in the shapes the OpenAI APIs give them.

Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.
Legacy completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
(``top_logprobs`` a list of ``{token: logprob}`` maps). A token's text is its
own decoding; a token that is part of a multi-byte character decodes to U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Literal

from meshnet.model.logprobs import TokenLogprobs
from meshnet.model.tokenizer import TextTokenizer


@dataclass(frozen=True)
class LogprobShape:
    kind: Literal["chat", "text"]
    tokenizer: TextTokenizer

    def of(self, tokens: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        """The API's ``logprobs`` object for ``tokens``; None when none were asked for."""
        if not tokens:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(t) for t in tokens], "refusal": None}
        texts = [self._text(t.token) for t in tokens]
        offsets = list(accumulate((len(x) for x in texts[:-1]), initial=0))
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self._text(i): lp for i, lp in t.top} for t in tokens],
            "text_offset": offsets,
        }

    def _chat_entry(self, t: TokenLogprobs) -> dict[str, Any]:
        return {
            **self._piece(t.token, t.logprob),
            "top_logprobs": [self._piece(i, lp) for i, lp in t.top],
        }

    def _piece(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])
