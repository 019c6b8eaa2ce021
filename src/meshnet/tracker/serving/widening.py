"""Covering a dead peer's layers on a live node, and absorbing the peer when it returns.

With no empty node to load a gap (layers a node served before and no up node serves
now, nor a node being calibrated for them), placement widens a live node next to it: a
node serving ``[15, 30)`` beside a dead ``[0, 15)`` is told to serve ``[0, 30)`` (one
contiguous shard: a node holds one).
It is the same T3 ``Configure`` as any load: the wider shard loads beside the old one,
then the node drains and swaps, its sessions' KV dropped (their next steps miss and fail
over exactly, as after any T3).

A node is asked only when its own report says the wider range fits (``headroom``):

- the wider shard's weights, loaded beside the current one, fit the memory the node
  says is available now (``NodeLoad.free_memory_bytes``; a node that says nothing is
  never asked);
- once swapped, the wider weights and the KV the node may hold (its KV budget, or with
  none one sequence of its context on the wider layers) fit that memory plus what the
  swap frees (its current weights and KV).

Of the nodes next to a gap that fit, the one with the most memory left over widens.

When the dead peer comes back serving its old range, that range lies inside a wider one
and chains with nothing (no node starts where it ends, or ends where it starts): no
route can use it. It is **absorbed**: told to load the smallest wider range around it
(a replica of the node that covered for it) when that fits, else emptied (ready for
the next gap or replica). A range that chains with nothing but lies inside no other
range is a mesh still being assembled, and is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

from meshnet.layer_range import LayerRange
from meshnet.model.layer_bytes import LayerBytes
from meshnet.tracker.nodes.registry import NodeId, NodeRecord

Sizes = Callable[[str], LayerBytes]  # a backend's name -> the model's bytes as it holds them


@dataclass(frozen=True)
class Load:
    """Tell node ``node_id`` to serve ``span`` (None: to empty itself)."""

    node_id: NodeId
    span: LayerRange | None


def headroom(node: NodeRecord, span: LayerRange, sizes: LayerBytes, context: int) -> int | None:
    """Bytes of memory ``node`` would have left once serving ``span`` (its KV room
    counted as used), or None when ``span`` does not fit what it reported.
    ``context``: positions of one sequence, when the node does not say its own."""
    free = node.load.free_memory_bytes
    weights = sizes.range_bytes(span)
    if free <= 0 or weights > free:
        return None  # says nothing, or cannot hold the new shard beside its current one
    current = sizes.range_bytes(node.layers) if node.layers is not None else 0
    positions = node.load.context or context
    kv_room = node.kv_budget_bytes or sizes.kv_bytes_per_token(span) * positions
    left = free + current + node.load.kv_bytes - weights - kv_room
    return left if left >= 0 else None


def plan_widening(
    nodes: Sequence[NodeRecord],
    fingerprint: str,
    gaps: Sequence[LayerRange],
    sizes: Sizes,
    context: int,
    held: Set[LayerRange] = frozenset(),
    busy: Set[NodeId] = frozenset(),
    avoid: Set[NodeId] = frozenset(),
) -> list[Load]:
    """For each gap, the routable node of the model next to it that fits serving its
    own range and the gap (most headroom first, nodes in ``avoid`` last), told to.
    ``held``: wider spans not to ask for now; ``busy``: nodes not to ask now."""
    taken = set(busy)
    loads: list[Load] = []
    for gap in gaps:
        options: list[tuple[bool, int, NodeId, LayerRange]] = []
        for n in nodes:
            if not n.routable or n.fingerprint != fingerprint or n.node_id in taken:
                continue
            assert n.layers is not None  # routable
            if n.layers.end != gap.start and gap.end != n.layers.start:
                continue
            if n.load.free_memory_bytes <= 0:
                continue  # says nothing of its memory: never asked
            span = LayerRange(min(n.layers.start, gap.start), max(n.layers.end, gap.end))
            room = None if span in held else headroom(n, span, sizes(n.backend), context)
            if room is not None:
                options.append((n.node_id in avoid, -room, n.node_id, span))
        if options:
            _, _, node_id, span = min(options)
            taken.add(node_id)
            loads.append(Load(node_id, span))
    return loads


def plan_absorb(
    nodes: Sequence[NodeRecord],
    fingerprint: str,
    n_layers: int,
    sizes: Sizes,
    context: int,
    busy: Set[NodeId] = frozenset(),
) -> list[Load]:
    """The routable nodes of the model whose range no route can use and lies inside a
    wider one that routes can: each told to serve the smallest such range when it fits
    (a replica), else to empty itself."""
    ours = sorted(
        (n for n in nodes if n.routable and n.fingerprint == fingerprint),
        key=lambda n: n.node_id,
    )
    ranges = [n.layers for n in ours if n.layers is not None]
    chained = [r for r in ranges if chains(r, ranges, n_layers)]
    loads: list[Load] = []
    for n in ours:
        r = n.layers
        if r is None or r in chained or n.node_id in busy:
            continue
        wider = [w for w in chained if w != r and w.start <= r.start and r.end <= w.end]
        if not wider:
            continue  # not shadowed: a mesh being assembled
        span = min(wider, key=lambda w: (len(w), w.start))
        said = n.load.free_memory_bytes > 0
        fits = said and headroom(n, span, sizes(n.backend), context) is not None
        loads.append(Load(n.node_id, span if fits else None))
    return loads


def chains(r: LayerRange, ranges: Sequence[LayerRange], n_layers: int) -> bool:
    """Whether some chain of ``ranges`` from layer 0 to ``n_layers`` runs through ``r``."""
    return r.start in _reach(ranges, 0, forward=True) and r.end in _reach(
        ranges, n_layers, forward=False
    )


def _reach(ranges: Sequence[LayerRange], origin: int, forward: bool) -> set[int]:
    """Boundaries a chain of ``ranges`` reaches from ``origin`` (forward: ranges' ends
    from their starts; backward: starts from ends)."""
    seen, todo = {origin}, [origin]
    while todo:
        at = todo.pop()
        for r in ranges:
            frm, to = (r.start, r.end) if forward else (r.end, r.start)
            if frm == at and to not in seen:
                seen.add(to)
                todo.append(to)
    return seen
