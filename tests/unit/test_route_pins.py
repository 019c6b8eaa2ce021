"""A route named by one request: checked in pure code against the registry (each reason
its own message), asked for in the request's ``meshnet`` object, by the admin only."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_routes import FP, ids, node

from meshnet.api.caller import Caller
from meshnet.api.schemas import MAX_ROUTE_HOPS, ChatCompletionRequest, CompletionRequest
from meshnet.api.tenants import Quotas, Tenant
from meshnet.errors import PermissionDenied, RequestError, Unauthenticated
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.nodes.routes import requested_route


def mesh() -> list[NodeRecord]:
    """A whole-model node, a two-node chain, a replica that is down, an empty node and a
    node of another model."""
    down = node("d", 0, 15, up=False)
    return [
        node("w", 0, 30),
        node("a", 0, 15),
        node("b", 15, 30),
        NodeRecord(**{**down.__dict__, "down_reason": "worker-death"}),
        node("e", 0, 0),
        node("x", 0, 30, fingerprint="0" * 64),
    ]


def named(*node_ids: str) -> list[str]:
    return ids(requested_route(node_ids, mesh(), FP, 30))


def test_a_usable_route_is_the_named_nodes_in_order() -> None:
    assert named("w") == ["w"]
    assert named("a", "b") == ["a", "b"]
    hops = requested_route(["a", "b"], mesh(), FP, 30)
    assert [(h.layers.start, h.layers.end) for h in hops] == [(0, 15), (15, 30)]


@pytest.mark.parametrize(
    ("route", "reason"),
    [
        (["a", "zz", "b"], "unknown node ids: zz"),
        (["d", "b"], "nodes down: d (worker-death)"),
        (["e"], "node e has no layers loaded"),
        (["x"], "node x serves another model"),
        (["a"], "layers [0, 15) do not cover [0, 30) exactly once in order"),
        (["w", "b"], "layers [0, 30), [15, 30) do not cover"),
        (["b", "a"], "layers [15, 30), [0, 15) do not cover"),
        (["a", "a", "b"], "nodes named more than once: a"),
    ],
)
def test_each_unusable_route_says_why(route: list[str], reason: str) -> None:
    with pytest.raises(RequestError) as refused:
        requested_route(route, mesh(), FP, 30)
    assert refused.value.message.startswith(reason)
    assert refused.value.http_status == 400


def test_a_down_node_is_reported_before_the_layers_it_lacks() -> None:
    """An operator fixes what is down first: it may be the very node the chain needs."""
    gone = NodeRecord(**{**node("b", 15, 30).__dict__, "state": NodeState.DOWN})
    with pytest.raises(RequestError, match="nodes down: b \\(down\\)"):
        requested_route(["a", "b"], [node("a", 0, 15), gone], FP, 30)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_the_route_travels_in_the_requests_meshnet_object() -> None:
    body = ChatCompletionRequest.model_validate({**CHAT, "meshnet": {"route": ["a", "b"]}})
    assert body.route == ["a", "b"]
    assert ChatCompletionRequest.model_validate(CHAT).route is None
    text = CompletionRequest.model_validate({"model": "m", "prompt": "x", "meshnet": {}})
    assert text.route is None


@pytest.mark.parametrize(
    "meshnet",
    [
        {"route": []},
        {"route": [""]},
        {"route": ["a" * 129]},
        {"route": ["n"] * (MAX_ROUTE_HOPS + 1)},
        {"route": "a,b"},
        {"route": ["a"], "pin": True},
    ],
)
def test_a_malformed_meshnet_object_is_refused(meshnet: object) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, "meshnet": meshnet})


TENANT = Tenant("acme", Quotas())


def test_only_the_admin_names_a_route_and_the_admin_only_with_one() -> None:
    Caller(TENANT).check_route(None)
    Caller(None).check_route(["a"])
    with pytest.raises(PermissionDenied) as refused:
        Caller(TENANT).check_route(["a"])
    assert refused.value.http_status == 403
    with pytest.raises(Unauthenticated):
        Caller(None).check_route(None)
