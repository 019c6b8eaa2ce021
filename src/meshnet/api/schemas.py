"""Request bodies of the public API, parsed at the edge into typed values.

OpenAI clients send fields we do not use (``user``…); those are ignored, but
every field we do use is validated, and values we cannot honour (``n > 1``) are
refused with 400 rather than silently changed.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshnet.model.logprobs import MAX_TOP_LOGPROBS
from meshnet.model.sampling import MAX_STOP_STRINGS, SamplingParams

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 256


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ChatMessageIn(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=MAX_PROMPT_CHARS)


class StreamOptions(_Lenient):
    include_usage: bool = False


MAX_ROUTE_HOPS = 256
NodeIdText = Annotated[str, Field(min_length=1, max_length=128)]


class MeshnetOptions(BaseModel):
    """The request's ``meshnet`` object: what only this API understands."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Node ids in route order: the generation runs on exactly these (admin token only).
    route: list[NodeIdText] | None = Field(default=None, min_length=1, max_length=MAX_ROUTE_HOPS)


class _Sampling(_Lenient):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    meshnet: MeshnetOptions | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stop

    def sampling(self) -> SamplingParams:
        """The sampling contract's parameters; ``RequestError`` if they are inconsistent."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        max_tokens = self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
        )

    @property
    def route(self) -> list[str] | None:
        """The node ids the request names as its route; None: routed as always."""
        return self.meshnet.route if self.meshnet is not None else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_logprobs_wanted(self) -> int:
        """Alternatives to report with each token's log-probability; -1: no log-probabilities."""
        return -1


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _bounded_prompt(self) -> ChatCompletionRequest:
        total = sum(len(m.content) for m in self.messages)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"the messages hold {total} characters, at most {MAX_PROMPT_CHARS}")
        return self

    @property
    def top_logprobs_wanted(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(...)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's bound

    @property
    def top_logprobs_wanted(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt_size(cls, prompt: str | list[int]) -> str | list[int]:
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ValueError("prompt is too long")
        return prompt


class PinRouteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node_ids: list[str] = Field(min_length=1, max_length=MAX_ROUTE_HOPS)
