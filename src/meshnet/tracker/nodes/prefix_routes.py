"""Routing by prefix: send a prompt where its longest cached prefix is, unless load outweighs it.

What each node holds is learned from what the tracker routed, not reported by
the nodes: the tracker sees every prompt it sends, and every hop of a route
keeps the full blocks of the prompts it computes (node/prefixes.py), so the
index is current the moment a generation opens, where a heartbeat's report
would lag a second behind a burst of requests sharing a system prompt, and
the nodes send nothing more. SGLang's router keeps such an approximate tree
per worker from the requests it routed the same way. What the index cannot see
(a node's own evictions, a restart) costs only a missed hit: the hops agree on
what they really hold when the route opens (tracker/routing/prefix_open.py), so a wrong
guess never changes an answer. The index keeps, per node, the block keys it
was sent, least recently used first, bounded like a node's cache: the keys the
nodes use, under the request's scope (its tenant's, kv/prefix_cache.py), so a
prompt is drawn only to a prefix its own tenant left.

The choice weighs a prefix hit against load as Dynamo's KV router does, in
prompt tokens: a route costs the prompt tokens it must still compute plus
``load_tokens`` for every generation in flight on its nodes; the cheapest
route is taken. A replica holding a 2,000-token system prompt is chosen over
an idle one until it runs 2,000 / ``load_tokens`` more generations.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass

from meshnet.errors import NoRoute
from meshnet.kv.prefix_cache import BLOCK_TOKENS, block_keys
from meshnet.layer_range import LayerRange
from meshnet.tracker.nodes.registry import NodeId, NodeRecord
from meshnet.tracker.nodes.routes import Route, plan_chain

_MAX_NODES = 4096  # nodes the index remembers (the least recently routed to go first)


class PromptBlocks:
    """A prompt under one cache scope, and its full blocks' chain keys: what prefix
    routing weighs and records. The keys are hashed once per request (not per admission
    poll), and only if something asks for them (prefix routing or caching on)."""

    def __init__(self, ids: Sequence[int], scope: bytes) -> None:
        self.ids, self.scope = ids, scope

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @functools.cached_property
    def keys(self) -> list[bytes]:
        return block_keys(self.ids, scope=self.scope)


@dataclass(frozen=True)
class PrefixRouting:
    on: bool = True  # route by prefix; False: by load alone
    # Prompt tokens of prefill that one generation in flight on a route's nodes is worth:
    # the exchange rate between a prefix hit and load.
    load_tokens: int = 256
    max_blocks_per_node: int = 1 << 16  # block keys remembered per node (2 MB of keys)


class PrefixIndex:
    """Per node, the block keys of the prompts routed through it, least recent first.

    Event-loop only (not thread-safe)."""

    def __init__(self, max_blocks_per_node: int = 1 << 16) -> None:
        self._max = max_blocks_per_node
        self._nodes: OrderedDict[NodeId, OrderedDict[bytes, None]] = OrderedDict()

    def record(self, route: Route, keys: Sequence[bytes]) -> None:
        """Every hop of ``route`` now holds the blocks of ``keys`` (a prompt it computed)."""
        if not keys:
            return
        for hop in route:
            held = self._nodes.setdefault(hop.node_id, OrderedDict())
            self._nodes.move_to_end(hop.node_id)
            for key in reversed(keys):  # a prefix's first block the most recent, as a node's
                held[key] = None
                held.move_to_end(key)
            while len(held) > self._max:
                held.popitem(last=False)
        while len(self._nodes) > _MAX_NODES:
            self._nodes.popitem(last=False)

    def held(self, node_id: NodeId, keys: Sequence[bytes]) -> int:
        """How many leading blocks of ``keys`` ``node_id`` is believed to hold."""
        held = self._nodes.get(node_id)
        if held is None:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def forget(self, node_id: NodeId) -> None:
        """The node lost its cache (restarted, reloaded): it holds nothing."""
        self._nodes.pop(node_id, None)


def reusable_tokens(blocks: int, prompt_tokens: int) -> int:
    """Positions a route holding ``blocks`` of a prompt would reuse: whole blocks, short
    of the prompt's last position (which is always computed)."""
    return min(blocks * BLOCK_TOKENS, (max(prompt_tokens - 1, 0) // BLOCK_TOKENS) * BLOCK_TOKENS)


def choose_route(
    base: Route,
    plan: Callable[[Set[NodeId]], Route],
    held: Mapping[NodeId, int],
    load: Callable[[Route], int],
    prompt_tokens: int,
    load_tokens: int,
) -> Route:
    """The cheapest of ``base`` (the least-loaded route) and, for each number of blocks
    some node holds, the least-loaded route of nodes that all hold at least that many
    (``plan`` given the nodes to leave out; ``NoRoute`` when none is left).

    Cost: the prompt tokens still to compute plus ``load_tokens`` per unit of ``load``
    (generations in flight on the route's nodes). Ties keep the longer prefix."""

    def cost(route: Route) -> tuple[int, int]:
        blocks = min((held.get(h.node_id, 0) for h in route), default=0)
        reuse = reusable_tokens(blocks, prompt_tokens)
        return (prompt_tokens - reuse + load_tokens * load(route), -reuse)

    best, best_cost = base, cost(base)
    for level in sorted({b for b in held.values() if b > 0}, reverse=True):
        short = {node for node, b in held.items() if b < level}
        try:
            route = plan(short)
        except NoRoute:
            continue
        c = cost(route)
        if c < best_cost:
            best, best_cost = route, c
    return best


def route_by_prefix(
    base: Route,
    nodes: Sequence[NodeRecord],
    fingerprint: str,
    n_layers: int,
    in_flight: Mapping[NodeId, int],
    full: Set[NodeId],
    index: PrefixIndex,
    keys: Sequence[bytes],
    prompt_tokens: int,
    load_tokens: int,
) -> Route:
    """``choose_route`` over the registry's nodes of one model: ``base`` or a route of
    nodes ``index`` says hold more of ``keys``, none of them ``full``; load as the route
    planner counts it (generations in flight plus the sessions a node reports)."""
    mine = [n for n in nodes if n.fingerprint == fingerprint]
    held = {n.node_id: index.held(n.node_id, keys) for n in mine}
    if not any(held.values()):
        return base
    loads = {n.node_id: in_flight.get(n.node_id, 0) + n.load.sessions for n in mine}

    def plan(short: Set[NodeId]) -> Route:
        span = LayerRange(0, n_layers)
        return plan_chain(mine, fingerprint, span, in_flight, exclude=full | short)

    def load(route: Route) -> int:
        return sum(loads.get(h.node_id, 0) for h in route)

    return choose_route(base, plan, held, load, prompt_tokens, load_tokens)
