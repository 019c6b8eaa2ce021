"""One generation request's decoding state: sampler, generated ids, text, finish.

Shared by the in-process loop and the tracker's route driver, so that a
request gives the same tokens and text wherever its logits are computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from meshnet.engine.text import TextStream
from meshnet.errors import ContextTooLong, RequestError
from meshnet.model.sampling import Sampler, SamplingParams
from meshnet.model.spec import ModelSpec
from meshnet.model.tokenizer import TextTokenizer

FinishReason = Literal["stop", "length"]


def check_request(
    spec: ModelSpec, prompt: Sequence[int], params: SamplingParams, context: int = 0
) -> None:
    """Raise ``RequestError`` for an empty prompt or a bad id, ``ContextTooLong`` for one
    too long for ``context`` positions (0: the model's trained context)."""
    if not prompt:
        raise RequestError("the prompt is empty")
    if min(prompt) < 0 or max(prompt) >= spec.vocab_size:
        raise RequestError(f"prompt ids must be in [0, {spec.vocab_size})")
    limit = context or spec.context_length
    if len(prompt) + params.max_tokens > limit:
        raise ContextTooLong(
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the context length {limit}"
        )


class RequestState:
    """Turns each step's logits (or a token sampled from them elsewhere) into the next
    token and the newly final text."""

    def __init__(
        self, prompt_ids: Sequence[int], params: SamplingParams, tokenizer: TextTokenizer
    ) -> None:
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.ids: list[int] = []
        self.finish: FinishReason | None = None
        self._sampler = Sampler(params)
        self._stream = TextStream(tokenizer, params.stop)
        self._eog = tokenizer.eog_ids  # every id that ends generation

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def text(self) -> str:
        """The generated text so far: no eos, cut before a stop string."""
        return self._stream.text

    @property
    def history(self) -> list[int]:
        """Every id the sampler has seen: the prompt and the generated ids."""
        return self.prompt_ids + self.ids

    def take(self, logits: np.ndarray) -> str:
        """Sample from logits [vocab], record the token, return text made final by it."""
        history = self.history
        return self.push(self._sampler.sample(logits, history, generated_from=len(self.prompt_ids)))

    def push(self, token: int) -> str:
        """Record a token sampled elsewhere (the route's last node); the text it made final."""
        self.ids.append(token)
        delta = ""
        if token in self._eog and not self.params.ignore_eos:
            self.finish = "stop"
        else:
            delta = self._stream.push(token)
            if self._stream.stopped:
                self.finish = "stop"
            elif len(self.ids) >= self.params.max_tokens:
                self.finish = "length"
        if self.finish is not None:
            delta += self._stream.finish()
        return delta
