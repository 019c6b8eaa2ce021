"""How typed errors become HTTP statuses at the API edge."""

import pytest

from meshnet.api.errors import error_body, http_status
from meshnet.errors import (
    KVBudgetExhausted,
    MalformedBundle,
    MeshnetError,
    ModelNotFound,
    NoRoute,
    Overloaded,
    RequestError,
    ShardMismatch,
    WorkerDeath,
)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RequestError("bad temperature"), 400),
        (MalformedBundle("client sent garbage"), 400),
        (ModelNotFound("gpt-9"), 404),
        (Overloaded("busy"), 429),
        (NoRoute("no live node serves layer 0"), 503),
        (MeshnetError("bug"), 500),
        # a node's complaint is not the client's fault
        (MalformedBundle("node sent a bad tensor", "node-1"), 502),
        (ShardMismatch("node serves other layers", "node-1"), 503),
        (WorkerDeath("node died", "node-1"), 502),
        (KVBudgetExhausted("full", "node-1"), 429),
    ],
)
def test_status_of_each_error(error: MeshnetError, status: int) -> None:
    assert http_status(error) == status
    body = error_body(error)["error"]
    assert body["code"] == error.kind and body["message"] == error.message
