"""Request bodies of the public API, parsed at the edge into typed values.

Which fields of the OpenAI endpoints are honoured, accepted without meaning or
refused is ``api/fields.py``'s contract, checked before anything else; every
field honoured is validated here (a value out of range is a 400 naming it).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from meshnet.api.fields import Endpoint, check_fields
from meshnet.api.structured import ResponseFormat
from meshnet.api.tools import MAX_TOOLS, ToolCallIn, ToolChoice, ToolSpec
from meshnet.errors import RequestError
from meshnet.model.chat import ChatMessage
from meshnet.model.logprobs import MAX_TOP_LOGPROBS
from meshnet.model.penalties import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS, PENALTY_LIMIT
from meshnet.model.sampling import MAX_STOP_STRINGS, SamplingParams
from meshnet.model.tool_syntax import ToolCall

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024
DEFAULT_MAX_TOKENS = 256
MAX_CHOICES = 16  # n: each choice is a generation of its own on the mesh
MAX_CACHE_SALT = 256  # characters of a cache_salt (vLLM suggests 43: 256 bits, base64)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ChatMessageIn(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    # A string, or a list of content parts: text parts are joined with "\n" (as vLLM
    # does); a part of any other type (an image, audio, a file) is refused, named.
    content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=256)
    reasoning_content: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)

    @model_validator(mode="after")
    def _complete(self) -> ChatMessageIn:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (an assistant's may be null with tool_calls)")
        return self

    def message(self) -> ChatMessage:
        calls = tuple(
            ToolCall(c.function.name, c.function.arguments, c.id) for c in self.tool_calls or ()
        )
        name = self.name if self.role == "tool" and self.name else ""
        return ChatMessage(
            self.role,
            self.content,
            calls,
            self.tool_call_id or "",
            name,
            self.reasoning_content if self.role == "assistant" and self.reasoning_content else "",
        )

    @field_validator("content", mode="before")
    @classmethod
    def _joined_parts(cls, content: Any) -> Any:
        if not isinstance(content, list):
            return content
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported, only 'text'")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs its 'text' string")
            texts.append(text)
        return "\n".join(texts)


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
    endpoint: ClassVar[Endpoint]

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    presence_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: float = Field(default=0.0, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    # token id (as a JSON key) -> added to its logit
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    response_format: ResponseFormat | None = None  # structured outputs (api/structured.py)
    # vLLM's: the prompt's prefix-cache scope is narrowed to the requests of this tenant
    # that send the same salt (docs/prefix-cache.md)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    meshnet: MeshnetOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _field_policy(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_fields(cls.endpoint, data)  # UnsupportedField: a 400 naming the field
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 9 or str(int(key)) != key:
                raise ValueError(f"{key!r} is not a token id")
            if not abs(value) <= LOGIT_BIAS_LIMIT:  # NaN too
                raise ValueError(f"the bias of {key} must be in [-100, 100]")
        return bias

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return stop

    def sampling(self, vocab_size: int) -> SamplingParams:
        """The sampling contract's parameters for a model of ``vocab_size`` ids;
        ``RequestError`` if they are inconsistent."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        max_tokens = self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS
        bias = sorted((int(k), v) for k, v in (self.logit_bias or {}).items())
        if bias and bias[-1][0] >= vocab_size:
            raise RequestError(
                f"logit_bias: token ids must be below {vocab_size}", param="logit_bias"
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=tuple(bias),
            min_p=self.min_p,
            ignore_eos=self.ignore_eos,
        )

    @property
    def echo_prompt(self) -> bool:
        """Whether each choice's text starts with the prompt (``echo``, completions only)."""
        return False

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
    endpoint = "chat"

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = Field(default=None, max_length=MAX_TOOLS)  # api/tools.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _bounded_prompt(self) -> ChatCompletionRequest:
        total = sum(len(m.content or "") + len(m.reasoning_content or "") for m in self.messages)
        if total > MAX_PROMPT_CHARS:
            raise ValueError(f"the messages hold {total} characters, at most {MAX_PROMPT_CHARS}")
        return self

    @property
    def top_logprobs_wanted(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1


class CompletionRequest(_Sampling):
    endpoint = "text"

    prompt: str | list[int] = Field(...)
    logprobs: int | None = Field(default=None, ge=0, le=5)  # the legacy API's bound
    echo: bool = False
    best_of: int | None = None  # only as many as n: ranking choices is not supported

    @field_validator("echo")
    @classmethod
    def _echo_without_prompt_logprobs(cls, echo: bool, info: ValidationInfo) -> bool:
        if echo and info.data.get("logprobs") is not None:
            raise ValueError("echo with logprobs (the prompt's log-probabilities) is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n"):
            raise ValueError("best_of other than n (ranking choices) is not supported")
        return best_of

    @property
    def echo_prompt(self) -> bool:
        return self.echo

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
