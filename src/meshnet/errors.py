"""The one exception tree of meshnet.

Every error a user or a peer can cause is one of these. Each class carries a
stable ``kind`` string (used in logs, API errors and the ledger), says
whether retrying elsewhere can help, and names the HTTP status it maps to at
the API edge::

    MeshnetError                     kind                     retryable  http
    ├── ModelError
    │   ├── ModelFileError           model-file-invalid       no         400
    │   ├── UnsupportedArchitecture  unsupported-architecture no         400
    │   ├── UnsupportedTensorType    unsupported-tensor-type  no         400
    │   ├── LayerRangeError          layer-range-invalid      no         400
    │   └── ModelSourceError         model-source-invalid     no         400
    │       ├── ModelRefNotFound     model-ref-not-found      no         404
    │       ├── DiskFull             disk-full                no         507
    │       ├── HashMismatch         hash-mismatch            no         502
    │       └── FetchFailed          fetch-failed             yes        502
    ├── TokenizerError               tokenizer-invalid        no         400
    ├── RequestError                 bad-request              no         400
    │   ├── UnsupportedField         unsupported-parameter    no         400
    │   ├── FieldError               bad-request              no         400
    │   ├── Unauthenticated          unauthenticated          no         401
    │   ├── PermissionDenied         permission-denied        no         403
    │   ├── ModelNotFound            model-not-found          no         404
    │   ├── NotFound                 not-found                no         404
    │   ├── ContextTooLong           context-too-long         no         400
    │   ├── SessionGone              session-gone             no         410
    │   └── IdempotencyConflict      idempotency-conflict     no         422
    ├── MalformedBundle              malformed-bundle         no         400
    ├── ShardMismatch                shard-mismatch           yes        503
    ├── StaleEpoch                   stale-epoch              no         409
    ├── CacheMiss                    cache-miss               yes        409
    ├── NoRoute                      no-route                 yes        503
    ├── Overloaded                   overloaded               yes        429
    │   └── QuotaExceeded            quota-exceeded           yes        429
    ├── KVBudgetExhausted            kv-budget-exhausted      yes        429
    ├── Cancelled                    cancelled                no         499
    ├── KVImportFailed               kv-import-failed         yes        502
    ├── ParkFailed                   park-failed              yes        503
    ├── DatabaseUnavailable          database-unavailable     yes        503
    ├── SchemaTooNew                 schema-too-new           no         503
    └── NodeFailure                  (kind of the failure)    yes        502
        ├── DeadlineExceeded         deadline-exceeded
        ├── HeartbeatLost            heartbeat-lost
        ├── StreamReset              stream-reset
        ├── WorkerDeath              worker-death
        └── VerificationFailed       verification-failed

Capacity shortfalls are return values, not exceptions (see docs/design.md §8).
"""

from __future__ import annotations

from typing import ClassVar


class MeshnetError(Exception):
    """Base of every typed meshnet error."""

    kind: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, node_id: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.node_id = node_id  # the node that reported or caused it, when one did

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    def details(self) -> dict[str, object]:
        """What the API adds to the error object beyond message and kind (none by default)."""
        return {}


class ModelError(MeshnetError):
    """The model file, or the way it is asked to be used, is wrong."""

    kind = "model-invalid"
    http_status = 400


class ModelFileError(ModelError):
    """The GGUF file cannot be read: missing, corrupt or truncated."""

    kind = "model-file-invalid"


class UnsupportedArchitecture(ModelError):
    """The GGUF declares an architecture this engine does not run."""

    kind = "unsupported-architecture"


class UnsupportedTensorType(ModelError):
    """A tensor is stored in a quantization type this engine cannot read."""

    kind = "unsupported-tensor-type"


class LayerRangeError(ModelError):
    """A layer range is empty, reversed or outside the model's layers."""

    kind = "layer-range-invalid"


class ModelSourceError(ModelError):
    """A model reference (``hf:ORG/REPO[:QUANT]``, ``hf:ORG/REPO/FILE``, an ``https://``
    URL) cannot be resolved or fetched (``meshnet.model_source``)."""

    kind = "model-source-invalid"


class ModelRefNotFound(ModelSourceError):
    """The repository, file or quantization a reference names is not there; the message
    names the files there are."""

    kind = "model-ref-not-found"
    http_status = 404


class DiskFull(ModelSourceError):
    """No room on the disk for what a fetch needs; nothing half-written is left."""

    kind = "disk-full"
    http_status = 507


class HashMismatch(ModelSourceError):
    """Fetched bytes do not match the signed manifest's hash, however often fetched
    again, or a whole file's bytes are not the sha256 its source (the hub) gives; nothing
    half-written is left."""

    kind = "hash-mismatch"
    http_status = 502


class FetchFailed(ModelSourceError):
    """The source did not answer after the bounded retries; what was fetched and
    checked is kept, and the next fetch resumes from there."""

    kind = "fetch-failed"
    retryable = True
    http_status = 502


class TokenizerError(MeshnetError):
    """The GGUF's tokenizer metadata is missing or of an unsupported kind."""

    kind = "tokenizer-invalid"
    http_status = 400


class RequestError(MeshnetError):
    """A generation request is malformed (bad sampling values, bad messages)."""

    kind = "bad-request"
    http_status = 400

    def __init__(self, message: str, node_id: str = "", param: str | None = None) -> None:
        super().__init__(message, node_id)
        self.param = param  # the request field at fault (OpenAI's error ``param``)


class UnsupportedField(RequestError):
    """A request field this API does not honour: refused, never silently ignored."""

    kind = "unsupported-parameter"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param=param)


class FieldError(RequestError):
    """A request field's value cannot be honoured as given (a schema the grammar engine
    refuses); ``param`` names the field, as OpenAI's error object does."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}", param=param)


class ContextTooLong(RequestError):
    """A prompt (with its max_tokens, or a session with its turn) past the context the
    mesh serves: the model's trained context or the least ``--ctx`` of its nodes."""

    kind = "context-too-long"
    http_status = 400


class ModelNotFound(RequestError):
    """A request names a model this mesh does not serve."""

    kind = "model-not-found"
    http_status = 404


class Unauthenticated(RequestError):
    """No credential, or one that does not check out (bad key, bad signature, expired)."""

    kind = "unauthenticated"
    http_status = 401


class PermissionDenied(RequestError):
    """A valid credential that does not allow this call."""

    kind = "permission-denied"
    http_status = 403


class NotFound(RequestError):
    """A request names something (a generation, a session) that does not exist."""

    kind = "not-found"
    http_status = 404


class SessionGone(RequestError):
    """The session has ended (deleted or failed); it takes no more turns."""

    kind = "session-gone"
    http_status = 410


class IdempotencyConflict(RequestError):
    """An ``Idempotency-Key`` already used with a different request body."""

    kind = "idempotency-conflict"
    http_status = 422


class MalformedBundle(MeshnetError):
    """An activation bundle breaks the wire contract (dtype, shape, size)."""

    kind = "malformed-bundle"
    http_status = 400


class ShardMismatch(MeshnetError):
    """A node does not serve the model or layer range the driver expects of it."""

    kind = "shard-mismatch"
    retryable = True
    http_status = 503


class StaleEpoch(MeshnetError):
    """A step names an older epoch than the one the node holds; it is never applied."""

    kind = "stale-epoch"
    http_status = 409


class CacheMiss(MeshnetError):
    """A step names a session a node holds no KV for."""

    kind = "cache-miss"
    retryable = True
    http_status = 409


class NoRoute(MeshnetError):
    """No chain of live nodes covers every layer of the model."""

    kind = "no-route"
    retryable = True
    http_status = 503


class Overloaded(MeshnetError):
    """No capacity for another generation right now; try again in ``retry_after_s``."""

    kind = "overloaded"
    retryable = True
    http_status = 429

    def __init__(self, message: str, node_id: str = "", retry_after_s: int = 1) -> None:
        super().__init__(message, node_id)
        self.retry_after_s = retry_after_s


class QuotaExceeded(Overloaded):
    """A tenant is over one of its quotas; ``retry_after_s`` says when it has room again."""

    kind = "quota-exceeded"


class KVBudgetExhausted(MeshnetError):
    """A node's KV budget cannot hold this session's next positions; nothing was changed."""

    kind = "kv-budget-exhausted"
    retryable = True
    http_status = 429


class Cancelled(MeshnetError):
    """The work was cancelled (client gone, explicit cancel, or its session released)."""

    kind = "cancelled"
    http_status = 499


class KVImportFailed(MeshnetError):
    """A KV stream was short, stalled, corrupt, mismatched or over a limit; nothing of it
    was kept. ``reason`` says which, for the tracker to pick another source or re-prefill."""

    kind = "kv-import-failed"
    retryable = True
    http_status = 502

    def __init__(self, message: str, reason: str = "invalid", node_id: str = "") -> None:
        super().__init__(message, node_id)
        self.reason = reason


class ParkFailed(MeshnetError):
    """A session's KV could not be parked (a node's park directory full, unwritable or
    refused); the session stays as it was, hot. ``hops`` says what each node did."""

    kind = "park-failed"
    retryable = True
    http_status = 503

    def __init__(
        self, message: str, node_id: str = "", hops: list[dict[str, object]] | None = None
    ) -> None:
        super().__init__(message, node_id)
        self.hops = hops or []

    def details(self) -> dict[str, object]:
        return {"hops": self.hops}


class DatabaseUnavailable(MeshnetError):
    """The tracker's database cannot be opened or reached."""

    kind = "database-unavailable"
    retryable = True
    http_status = 503


class SchemaTooNew(MeshnetError):
    """The tracker's database was migrated by a newer meshnet than this one: this
    tracker would write rows that schema does not expect, so it does not start."""

    kind = "schema-too-new"
    http_status = 503


class NodeFailure(MeshnetError):
    """A node of the route failed while serving a step."""

    kind = "node-failure"
    retryable = True
    http_status = 502


class DeadlineExceeded(NodeFailure):
    """A step, transfer or generation ran past its deadline."""

    kind = "deadline-exceeded"


class HeartbeatLost(NodeFailure):
    """The node stopped heartbeating while serving the route."""

    kind = "heartbeat-lost"


class StreamReset(NodeFailure):
    """The stream to a node broke while the node itself still answers."""

    kind = "stream-reset"


class WorkerDeath(NodeFailure):
    """The node's process is gone (its address refuses or does not answer)."""

    kind = "worker-death"


class VerificationFailed(NodeFailure):
    """The verifier re-ran a span of the node's work and got other bytes: the node is
    quarantined and its generations fail over to honest nodes."""

    kind = "verification-failed"


def error_for_kind(kind: str, message: str, node_id: str = "") -> MeshnetError:
    """Rebuild a typed error from the ``kind`` string a peer sent (base class if unknown)."""
    stack: list[type[MeshnetError]] = [MeshnetError]
    while stack:
        cls = stack.pop()
        if cls.kind == kind:
            return cls(message, node_id=node_id)
        stack.extend(cls.__subclasses__())
    return MeshnetError(message, node_id)
