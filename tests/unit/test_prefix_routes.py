"""Routing by prefix as pure math: the longest cached prefix against load, in prompt tokens."""

from __future__ import annotations

from collections.abc import Set

from meshnet.errors import NoRoute
from meshnet.layer_range import LayerRange
from meshnet.tracker.nodes.prefix_routes import PrefixIndex, choose_route, reusable_tokens
from meshnet.tracker.nodes.registry import NodeId
from meshnet.tracker.nodes.routes import Hop, Route


def _route(*ids: str) -> Route:
    return tuple(Hop(NodeId(i), f"{i}:1", LayerRange(0, 4)) for i in ids)


def _choose(held: dict[str, int], loads: dict[str, int], prompt: int, rate: int) -> Route:
    """Between one-hop replicas a and b; ``base`` is the less loaded (a on a tie)."""
    names = sorted(held)

    def plan(short: Set[str]) -> Route:
        left = [n for n in names if n not in short]
        if not left:
            raise NoRoute("none")
        return _route(min(left, key=lambda n: (loads[n], n)))

    base = plan(frozenset())
    return choose_route(base, plan, held, lambda r: loads[r[0].node_id], prompt, rate)


def test_the_holder_is_chosen_until_its_load_outweighs_the_prefix() -> None:
    held = {"a": 0, "b": 125}  # b holds 2,000 tokens of a 2,010-token prompt
    assert _choose(held, {"a": 0, "b": 0}, 2010, 256) == _route("b")
    assert _choose(held, {"a": 0, "b": 7}, 2010, 256) == _route("b")  # 10 + 1792 < 2010
    assert _choose(held, {"a": 0, "b": 8}, 2010, 256) == _route("a")  # 10 + 2048 > 2010


def test_no_prefix_anywhere_leaves_the_least_loaded() -> None:
    assert _choose({"a": 0, "b": 0}, {"a": 2, "b": 1}, 500, 256) == _route("b")


def test_the_last_position_is_never_counted_reused() -> None:
    assert reusable_tokens(4, 64) == 48  # 64 ids: the 64th must be computed
    assert reusable_tokens(4, 65) == 64
    assert reusable_tokens(2, 100) == 32


def test_the_index_learns_prefixes_per_node_and_forgets_a_node() -> None:
    index = PrefixIndex(max_blocks_per_node=3)
    keys = [b"k1", b"k2", b"k3", b"k4"]
    index.record(_route("a"), keys[:2])
    assert index.held(NodeId("a"), keys) == 2
    assert index.held(NodeId("b"), keys) == 0
    index.record(_route("a"), [b"x1", b"x2"])  # bounded: the oldest blocks go
    assert index.held(NodeId("a"), keys) < 2
    index.forget(NodeId("a"))
    assert index.held(NodeId("a"), [b"x1"]) == 0
