"""Decode through a 3-node mesh with 10 ms on every link, against its bound (issue 14).

    sudo OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mesh_delay.py [--delay-ms 10] [--rounds 3]

Every node runs in its own network namespace joined to the host by a veth
link, and ``tc netem`` adds ``--delay-ms`` to every one-way link between any
two mesh processes (tracker to node, node to node, node to tracker; see
src/meshnet/benchmark/netem_links.py). The figure is decode tok/s through the
API (streamed tokens after the first, greedy, ``--tokens`` a run), against the
bound 1 / (compute + links x delay): compute is the per-token time of the same
mesh with the delay set to 0, measured in the same run (the two alternate),
and links the one-way links on a token's critical path. With relay (the
default) the decode steps go round a ring, hops = 3 links for 3 nodes: node 0
-> 1, node 1 -> 2, node 2 -> node 0 with the token; the token's copy to the
tracker travels beside that path. Goal: at least 90 % of the bound. The
tracker's ``--no-relay`` star crosses 2 x hops = 6 links a token and is
printed too, against its own bound.

Needs root for namespaces and tc. Where the kernel has no ``sch_netem`` (this
VM's has none), ``--links auto`` falls back to a user-space forwarder holding
every byte of every gRPC connection for the delay (tracker to node and node
to node, both directions), says so, and prints the delay the forwarder really
held; ``--links netem`` then stops with the reason instead. Namespaces,
qdiscs, the forwarder and every process are removed at the end, however it ends.
Runs wait for idle CPUs and are taken again when disturbed, as bench/serving.py's.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from meshnet.benchmark.comparison import Comparison, table
from meshnet.benchmark.mesh_delay import (
    DelayedRoute,
    bound_tok_s,
    delayed_links,
    links_per_token,
    measure,
    started_meshes,
)
from meshnet.benchmark.netem_links import unavailable
from meshnet.benchmark.quiet import Quiet
from meshnet.local_mesh import parse_layout
from meshnet.model.bundled import bundled_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the bundled model)")
    p.add_argument("--layout", default="0:10,10:20,20:30")
    p.add_argument("--delay-ms", type=float, default=10.0, help="added delay per one-way link")
    p.add_argument("--tokens", type=int, default=48, help="max_tokens of every request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="kernel threads per node")
    p.add_argument("--links", choices=["auto", "netem", "proxy"], default="auto")
    p.add_argument("--quiet-wait", type=float, default=20.0, help="seconds to wait for idle CPUs")
    p.add_argument("--retries", type=int, default=2, help="tries again of a disturbed run")
    p.add_argument("--logs", help="keep the processes' logs here (default: a temp dir)")
    args = p.parse_args()
    layout = [r for r in parse_layout(args.layout) if r is not None]
    model = Path(args.model) if args.model else bundled_model_path()
    hops, d = len(layout), args.delay_ms
    if args.links == "netem" and (why := unavailable()) is not None:
        print(f"skipped: {why}")
        return
    with (
        tempfile.TemporaryDirectory(prefix="meshnet-delay-") as tmp,
        delayed_links(args.links, 2, hops) as links,
        started_meshes(links, Path(args.logs or tmp), model, layout, args.threads) as routes,
    ):
        print(f"links: {links.name}")
        quiet = Quiet(max_wait_s=args.quiet_wait, retries=args.retries)
        held = measure(routes, links, d, args.tokens, args.rounds, quiet)
        held_ms = sum(held) / len(held) if held else None
        rows = _rows(routes, quiet, hops, d, held_ms)
        _print_tries(routes, d)
    print(f"decode of {args.tokens} tokens, greedy, streamed; best of {args.rounds} rounds")
    print(table(rows))


def _rows(
    routes: list[DelayedRoute], quiet: Quiet, hops: int, d: float, held_ms: float | None
) -> list[Comparison]:
    """Each route against its bound (printing how the bound is made, and the bound at
    the delay a forwarder really held), then relay against --no-relay; a figure with no
    undisturbed try is marked *."""
    if held_ms is not None:
        print(f"the forwarder held {held_ms:.2f} ms a link on average (asked {d:g})")
    rows = []
    for route in routes:
        n = links_per_token(hops, route.relay)
        compute, calm = route.compute_ms(quiet)
        rate, rate_calm = route.delayed_tok_s(quiet)
        name = "relay" if route.relay else "--no-relay"
        bound = bound_tok_s(compute, n, d)
        print(
            f"{name}: {n} links a token; compute {compute:.2f} ms/token with no delay; "
            f"bound 1/({compute:.2f} + {n} x {d:g}) ms = {bound:.2f} tok/s"
        )
        if held_ms is not None:
            at_held = bound_tok_s(compute, n, held_ms)
            print(
                f"  at {held_ms:.2f} ms a link: bound {at_held:.2f} tok/s, "
                f"measured {rate / at_held:.0%} of it"
            )
        mark = "" if calm and rate_calm else " *"
        figure = f"{hops}-node {name}, {d:g} ms links, tok/s{mark}"
        rows.append(
            Comparison(figure, rate, bound, f"bound, {n} links", 0.9 if route.relay else None)
        )
        if route.short:
            print(f"{name}: streams ended early, at {route.short} tokens")
    relay, star = routes
    figure = f"{hops}-node relay vs --no-relay, {d:g} ms links"
    rows.append(
        Comparison(
            figure, relay.delayed_tok_s(quiet)[0], star.delayed_tok_s(quiet)[0], "--no-relay, tok/s"
        )
    )
    return rows


def _print_tries(routes: list[DelayedRoute], d: float) -> None:
    for route in routes:
        name = "relay" if route.relay else "--no-relay"
        for label, tries in (("no delay", route.plain), (f"{d:g} ms", route.delayed)):
            for m in tries:
                print(f"{name}, {label}: {m.value:7.2f} tok/s  (others used {m.others:.0%})")


if __name__ == "__main__":
    main()
