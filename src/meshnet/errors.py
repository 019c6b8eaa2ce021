"""The one exception tree of meshnet.

Every error a user or a peer can cause is one of these. Each class carries a
stable ``kind`` string (used in logs, API errors and, later, the ledger), says
whether retrying elsewhere can help, and names the HTTP status it maps to at
the API edge::

    MeshnetError                     kind                     retryable  http
    ├── ModelError
    │   ├── ModelFileError           model-file-invalid       no         400
    │   ├── UnsupportedArchitecture  unsupported-architecture no         400
    │   ├── UnsupportedTensorType    unsupported-tensor-type  no         400
    │   └── LayerRangeError          layer-range-invalid      no         400
    ├── TokenizerError               tokenizer-invalid        no         400
    └── RequestError                 bad-request              no         400

Capacity shortfalls are return values, not exceptions (see DESIGN.md §4).
"""

from __future__ import annotations

from typing import ClassVar


class MeshnetError(Exception):
    """Base of every typed meshnet error."""

    kind: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


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


class TokenizerError(MeshnetError):
    """The GGUF's tokenizer metadata is missing or of an unsupported kind."""

    kind = "tokenizer-invalid"
    http_status = 400


class RequestError(MeshnetError):
    """A generation request is malformed (bad sampling values, bad messages)."""

    kind = "bad-request"
    http_status = 400
