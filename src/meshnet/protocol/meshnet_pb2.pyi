from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ParkPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARK_NOW: _ClassVar[ParkPhase]
    PARK_PREPARE: _ClassVar[ParkPhase]
    PARK_COMMIT: _ClassVar[ParkPhase]
    PARK_ABORT: _ClassVar[ParkPhase]
PARK_NOW: ParkPhase
PARK_PREPARE: ParkPhase
PARK_COMMIT: ParkPhase
PARK_ABORT: ParkPhase

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("session_id", "epoch", "fingerprint", "layer_start", "layer_end", "resume", "keep", "rewind", "rewind_tokens", "rewind_steps", "sampling", "next_address", "next_node_id", "next_token", "prefix_ids", "prefix_reuse")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    REWIND_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REWIND_STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NEXT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_REUSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    fingerprint: str
    layer_start: int
    layer_end: int
    resume: bool
    keep: bool
    rewind: bool
    rewind_tokens: int
    rewind_steps: int
    sampling: Sampling
    next_address: str
    next_node_id: str
    next_token: str
    prefix_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_reuse: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., fingerprint: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., resume: _Optional[bool] = ..., keep: _Optional[bool] = ..., rewind: _Optional[bool] = ..., rewind_tokens: _Optional[int] = ..., rewind_steps: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., next_address: _Optional[str] = ..., next_node_id: _Optional[str] = ..., next_token: _Optional[str] = ..., prefix_ids: _Optional[_Iterable[int]] = ..., prefix_reuse: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "repetition_penalty", "seed", "top_logprobs", "logprobs", "presence_penalty", "frequency_penalty", "min_p", "logit_bias", "grammar", "grammar_start")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_START_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    seed: int
    top_logprobs: int
    logprobs: bool
    presence_penalty: float
    frequency_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    grammar: str
    grammar_start: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., logprobs: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[str] = ..., grammar_start: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("step", "input", "timeout_ms", "replay", "draws", "history", "relayed", "forward", "rows", "autorun_until", "generated_from")
    STEP_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    DRAWS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    AUTORUN_UNTIL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FROM_FIELD_NUMBER: _ClassVar[int]
    step: int
    input: Tensor
    timeout_ms: int
    replay: bool
    draws: int
    history: _containers.RepeatedScalarFieldContainer[int]
    relayed: bool
    forward: bool
    rows: int
    autorun_until: int
    generated_from: int
    def __init__(self, step: _Optional[int] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., replay: _Optional[bool] = ..., draws: _Optional[int] = ..., history: _Optional[_Iterable[int]] = ..., relayed: _Optional[bool] = ..., forward: _Optional[bool] = ..., rows: _Optional[int] = ..., autorun_until: _Optional[int] = ..., generated_from: _Optional[int] = ...) -> None: ...

class Extend(_message.Message):
    __slots__ = ("until",)
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    until: int
    def __init__(self, until: _Optional[int] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("open", "step", "extend")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    open: Open
    step: Step
    extend: Extend
    def __init__(self, open: _Optional[_Union[Open, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., extend: _Optional[_Union[Extend, _Mapping]] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("node_id", "layer_start", "layer_end", "kv_tokens", "steps", "unparked")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    UNPARKED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    layer_start: int
    layer_end: int
    kv_tokens: int
    steps: int
    unparked: bool
    def __init__(self, node_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., steps: _Optional[int] = ..., unparked: _Optional[bool] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "output", "compute_ms", "sampled", "commitments")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    COMMITMENTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    output: Tensor
    compute_ms: float
    sampled: Sampled
    commitments: _containers.RepeatedCompositeFieldContainer[ChunkDigest]
    def __init__(self, step: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ..., compute_ms: _Optional[float] = ..., sampled: _Optional[_Union[Sampled, _Mapping]] = ..., commitments: _Optional[_Iterable[_Union[ChunkDigest, _Mapping]]] = ...) -> None: ...

class ChunkDigest(_message.Message):
    __slots__ = ("token_start", "digest", "input_digest")
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    INPUT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    token_start: int
    digest: bytes
    input_digest: bytes
    def __init__(self, token_start: _Optional[int] = ..., digest: _Optional[bytes] = ..., input_digest: _Optional[bytes] = ...) -> None: ...

class Committed(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkDigest]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkDigest, _Mapping]]] = ...) -> None: ...

class Sampled(_message.Message):
    __slots__ = ("token", "logprob", "top_ids", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("kind", "message", "retryable", "node_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    message: str
    retryable: bool
    node_id: str
    def __init__(self, kind: _Optional[str] = ..., message: _Optional[str] = ..., retryable: _Optional[bool] = ..., node_id: _Optional[str] = ...) -> None: ...

class RelayFrame(_message.Message):
    __slots__ = ("session_id", "epoch", "step", "input")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    step: int
    input: Tensor
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., input: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RelayAck(_message.Message):
    __slots__ = ("failure", "relay_port")
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    failure: Failure
    relay_port: int
    def __init__(self, failure: _Optional[_Union[Failure, _Mapping]] = ..., relay_port: _Optional[int] = ...) -> None: ...

class OutputsRequest(_message.Message):
    __slots__ = ("session_id", "first_step", "end_step")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    END_STEP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_step: int
    end_step: int
    def __init__(self, session_id: _Optional[str] = ..., first_step: _Optional[int] = ..., end_step: _Optional[int] = ...) -> None: ...

class StepOutput(_message.Message):
    __slots__ = ("step", "output")
    STEP_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    step: int
    output: Tensor
    def __init__(self, step: _Optional[int] = ..., output: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("opened", "result", "failure", "committed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    result: StepResult
    failure: Failure
    committed: Committed
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., committed: _Optional[_Union[Committed, _Mapping]] = ...) -> None: ...

class LoadShard(_message.Message):
    __slots__ = ("model_path", "layer_start", "layer_end")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    layer_start: int
    layer_end: int
    def __init__(self, model_path: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_streams", "max_queued_steps", "log_level")
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    max_streams: int
    max_queued_steps: int
    log_level: str
    def __init__(self, max_streams: _Optional[int] = ..., max_queued_steps: _Optional[int] = ..., log_level: _Optional[str] = ...) -> None: ...

class Batching(_message.Message):
    __slots__ = ("max_batch_tokens", "prefill_chunk", "kv_budget_bytes")
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_batch_tokens: int
    prefill_chunk: int
    kv_budget_bytes: int
    def __init__(self, max_batch_tokens: _Optional[int] = ..., prefill_chunk: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("load", "limits", "batching", "check_only")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    CHECK_ONLY_FIELD_NUMBER: _ClassVar[int]
    load: LoadShard
    limits: Limits
    batching: Batching
    check_only: bool
    def __init__(self, load: _Optional[_Union[LoadShard, _Mapping]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., batching: _Optional[_Union[Batching, _Mapping]] = ..., check_only: _Optional[bool] = ...) -> None: ...

class NodeSettings(_message.Message):
    __slots__ = ("max_streams", "max_queued_steps", "log_level", "max_batch_tokens", "prefill_chunk", "kv_budget_bytes")
    MAX_STREAMS_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_streams: int
    max_queued_steps: int
    log_level: str
    max_batch_tokens: int
    prefill_chunk: int
    kv_budget_bytes: int
    def __init__(self, max_streams: _Optional[int] = ..., max_queued_steps: _Optional[int] = ..., log_level: _Optional[str] = ..., max_batch_tokens: _Optional[int] = ..., prefill_chunk: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("applied", "failure", "layer_start", "layer_end", "fingerprint", "tier", "detail", "settings", "sessions_ended", "keeps_kv")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ENDED_FIELD_NUMBER: _ClassVar[int]
    KEEPS_KV_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    failure: Failure
    layer_start: int
    layer_end: int
    fingerprint: str
    tier: str
    detail: str
    settings: NodeSettings
    sessions_ended: int
    keeps_kv: bool
    def __init__(self, applied: _Optional[bool] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., fingerprint: _Optional[str] = ..., tier: _Optional[str] = ..., detail: _Optional[str] = ..., settings: _Optional[_Union[NodeSettings, _Mapping]] = ..., sessions_ended: _Optional[int] = ..., keeps_kv: _Optional[bool] = ...) -> None: ...

class FenceRequest(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class FenceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("version", "fingerprint", "layer_start", "layer_end", "session_id", "epoch", "tokens", "steps", "token_prefix_hash", "dtype", "n_kv_heads", "head_dim", "chunk_bytes", "total_bytes", "hash")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    N_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    version: int
    fingerprint: str
    layer_start: int
    layer_end: int
    session_id: str
    epoch: int
    tokens: int
    steps: int
    token_prefix_hash: str
    dtype: str
    n_kv_heads: int
    head_dim: int
    chunk_bytes: int
    total_bytes: int
    hash: str
    def __init__(self, version: _Optional[int] = ..., fingerprint: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., tokens: _Optional[int] = ..., steps: _Optional[int] = ..., token_prefix_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., n_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., hash: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("index", "data", "digest")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    index: int
    data: bytes
    digest: bytes
    def __init__(self, index: _Optional[int] = ..., data: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class KVTrailer(_message.Message):
    __slots__ = ("root_hash",)
    ROOT_HASH_FIELD_NUMBER: _ClassVar[int]
    root_hash: bytes
    def __init__(self, root_hash: _Optional[bytes] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    trailer: KVTrailer
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ...) -> None: ...

class StateGetRequest(_message.Message):
    __slots__ = ("session_id", "token_prefix_hash")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_prefix_hash: str
    def __init__(self, session_id: _Optional[str] = ..., token_prefix_hash: _Optional[str] = ...) -> None: ...

class StateOfferResponse(_message.Message):
    __slots__ = ("address", "ticket", "tokens")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    address: str
    ticket: bytes
    tokens: int
    def __init__(self, address: _Optional[str] = ..., ticket: _Optional[bytes] = ..., tokens: _Optional[int] = ...) -> None: ...

class StatePullRequest(_message.Message):
    __slots__ = ("source", "session_id", "token_prefix_hash", "source_token")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    source: str
    session_id: str
    token_prefix_hash: str
    source_token: str
    def __init__(self, source: _Optional[str] = ..., session_id: _Optional[str] = ..., token_prefix_hash: _Optional[str] = ..., source_token: _Optional[str] = ...) -> None: ...

class StatePutResponse(_message.Message):
    __slots__ = ("imported", "failure", "reason", "tokens", "transport")
    IMPORTED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    imported: bool
    failure: Failure
    reason: str
    tokens: int
    transport: str
    def __init__(self, imported: _Optional[bool] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., reason: _Optional[str] = ..., tokens: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ParkRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "phase")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    phase: ParkPhase
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., phase: _Optional[_Union[ParkPhase, str]] = ...) -> None: ...

class ParkResponse(_message.Message):
    __slots__ = ("parked", "failure", "tokens", "freed_bytes")
    PARKED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    parked: bool
    failure: Failure
    tokens: int
    freed_bytes: int
    def __init__(self, parked: _Optional[bool] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., tokens: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("node_id", "fingerprint", "loaded", "layer_start", "layer_end", "sessions", "kv_bytes", "parked")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARKED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    fingerprint: str
    loaded: bool
    layer_start: int
    layer_end: int
    sessions: int
    kv_bytes: int
    parked: int
    def __init__(self, node_id: _Optional[str] = ..., fingerprint: _Optional[str] = ..., loaded: _Optional[bool] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., sessions: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., parked: _Optional[int] = ...) -> None: ...
