"""Serving through the HTTP API, against llama.cpp, measured in the same run.

Two comparisons, each of alternating rounds (the side that goes first swaps
every round) with the best round of each figure kept, as ``meshnet bench``
does:

1. The tracker and one node (``threads`` kernel threads) against
   ``llama-server`` (``-t threads -np streams``) on the same GGUF, both in
   their default serving configuration (see ``llama_server``): a single
   stream's decode rate, and the aggregate rate of ``streams`` concurrent
   streams while all of them decode.
2. A mesh of several nodes (``layout``, ``mesh_threads`` each) through the
   same API: its per-token time against one node with the same threads, the
   same mesh with the tracker's ``--no-relay`` (activations through the
   tracker), and llama.cpp's RPC layer split over two ``ggml-rpc-server``
   processes of one thread each.

Each measurement is taken once the CPUs are idle, and taken again when other
processes used more than a little of them meanwhile (``quiet``); figures come
from the undisturbed measurements, and are marked where none was. Every figure
is the rate at which a client sees streamed tokens after the first
(``streams``): sampling, the HTTP edge and every hop included. Greedy, the
same prompts and ``max_tokens`` on both sides; both are told ``ignore_eos``,
so both decode the same positions (a side that stopped short is reported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.benchmark.comparison import Better, Comparison
from meshnet.benchmark.llama_server import llama_server
from meshnet.benchmark.mesh import llamacpp_rpc_tok_s
from meshnet.benchmark.quiet import Measured, Quiet
from meshnet.benchmark.running_mesh import running_mesh, served_model
from meshnet.benchmark.streams import (
    StreamRecord,
    completion_body,
    decode_tok_s,
    end_to_end_tok_s,
    run_streams,
    steady_tok_s,
)
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import parse_layout

# Prompts whose greedy continuations on the bundled model run past 128 tokens.
PROMPTS = (
    "Once upon a time",
    "The history of the Roman Empire",
    "Here is a list of fruits:",
    "def fibonacci(n):",
    "The weather today",
    "Ten facts about the ocean:",
    "My favourite recipe is",
    "In the year 2050,",
)


@dataclass(frozen=True)
class ServingSetup:
    model: Path
    bin_dir: Path | None  # llama.cpp's binaries; None: our figures alone
    data_dir: Path  # logs of every process started
    tokens: int = 64  # max_tokens of every request
    rounds: int = 3
    threads: int = 2  # the single node's kernel threads, llama-server's -t
    streams: int = 8  # concurrent streams, llama-server's -np
    mesh_threads: int = 1  # kernel threads of each node in the mesh comparison
    layout: str = "0:10,10:20,20:30"
    backend: str = DEFAULT_BACKEND  # our nodes'
    quiet: Quiet = field(default_factory=Quiet)  # how neighbours' load is kept out


@dataclass
class _Side:
    """One server's measurements, every try kept."""

    name: str
    url: str
    model: str
    setup: ServingSetup
    headers: dict[str, str]  # what its clients send: a tracker's API key, or nothing
    figures: dict[str, list[Measured]] = field(default_factory=dict)
    short: list[str] = field(default_factory=list)  # streams that ended early
    log: list[str] = field(default_factory=list)  # every try, for the record

    def streams(self, n: int) -> list[StreamRecord]:
        tokens = self.setup.tokens
        bodies = [completion_body(self.model, PROMPTS[i % len(PROMPTS)], tokens) for i in range(n)]
        records = run_streams(self.url, bodies, self.headers)
        self.short += [
            f"{r.tokens} tokens ({r.finish_reason})" for r in records if r.tokens != tokens
        ]
        return records

    def measure(self, figure: str, run: Callable[[], float]) -> list[Measured]:
        """``run()`` under the setup's ``quiet`` rule; each try filed under ``figure``."""
        tries = self.setup.quiet.measure(run)
        self.file(figure, tries)
        return tries

    def file(self, figure: str, tries: Sequence[Measured]) -> None:
        self.figures.setdefault(figure, []).extend(tries)
        for m in tries:
            self.log.append(f"{self.name}, {figure}: {m.value:8.2f}  (others used {m.others:.0%})")

    def single(self) -> None:
        self.measure("1 stream tok/s", lambda: decode_tok_s(self.streams(1)[0]))

    def many(self) -> None:
        """``streams`` at once: the steady aggregate, and (same tries) with prefill."""
        e2e: list[float] = []

        def run() -> float:
            records = self.streams(self.setup.streams)
            e2e.append(end_to_end_tok_s(records))
            return steady_tok_s(records)

        tries = self.measure("steady tok/s", run)
        self.file(
            "tok/s incl. prefill", [Measured(v, m.others) for v, m in zip(e2e, tries, strict=True)]
        )

    def best(self, figure: str, better: Better = "higher") -> tuple[float, bool]:
        return self.setup.quiet.best(self.figures[figure], better)


def api_vs_llama_server(setup: ServingSetup) -> tuple[list[Comparison], list[str]]:
    """Comparison 1; the rows, and notes: every try, streams that ended short."""
    whole = [LayerRange(0, _n_layers(setup.layout))]
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(
            running_mesh(
                setup.data_dir / "node", setup.model, whole, setup.threads, backend=setup.backend
            )
        )
        sides = [_Side("meshnet", mesh.url, served_model(mesh), setup, mesh.api_headers)]
        if setup.bin_dir is not None:
            log = setup.data_dir / "llama-server.log"
            slot_ctx = 2 * (setup.tokens + 64)  # each slot holds a prompt and its completion
            url = stack.enter_context(
                llama_server(
                    setup.bin_dir, setup.model, setup.threads, setup.streams, slot_ctx, log
                )
            )
            sides.append(_Side("llama-server", url, "llama", setup, {}))
        for side in sides:
            side.streams(1)  # warm
            side.streams(setup.streams)
        for r in range(setup.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                side.single()
                side.many()
    ours, theirs = sides[0], (sides[1] if len(sides) > 1 else None)
    name = f"llama-server -t {setup.threads} -np {setup.streams}"
    n = setup.streams
    rows = [
        _row("1 stream, decode tok/s", ours, theirs, "1 stream tok/s", name, 1.2),
        _row(f"{n} streams, aggregate decode tok/s", ours, theirs, "steady tok/s", name, 2.0),
        _row(f"{n} streams, tok/s incl. prefill", ours, theirs, "tok/s incl. prefill", name, None),
    ]
    return rows, _notes(sides)


def mesh_vs_single(setup: ServingSetup) -> tuple[list[Comparison], list[str]]:
    """Comparison 2; the rows, and notes: every try, streams that ended short."""
    layout = parse_layout(setup.layout)
    whole = [LayerRange(0, _n_layers(setup.layout))]
    t, data = setup.mesh_threads, setup.data_dir
    rpc = _Side("llama.cpp RPC", "", "", setup, {})
    run_rpc = None
    if setup.bin_dir is not None and (setup.bin_dir / "ggml-rpc-server").exists():
        run_rpc = partial(llamacpp_rpc_tok_s, setup.bin_dir, setup.model, 2, setup.tokens, 1)
    with contextlib.ExitStack() as stack:
        meshes = {
            "1 node": running_mesh(data / "one", setup.model, whole, t, backend=setup.backend),
            "relay": running_mesh(data / "relay", setup.model, layout, t, backend=setup.backend),
            "--no-relay": running_mesh(
                data / "star", setup.model, layout, t, relay=False, backend=setup.backend
            ),
            "no head assist": running_mesh(
                data / "alone",
                setup.model,
                layout,
                t,
                backend=setup.backend,
                node_args=["--head-assist", "off"],
            ),
        }
        sides = []
        for name, cm in meshes.items():
            mesh = stack.enter_context(cm)
            sides.append(_Side(name, mesh.url, served_model(mesh), setup, mesh.api_headers))
            sides[-1].streams(1)  # warm
        for r in range(setup.rounds):
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                side.single()
            if run_rpc is not None:
                rpc.measure("1 stream tok/s", run_rpc)
    one, relay, star, alone = sides
    hops = len(layout)
    rows = [
        _ms_row(
            f"{hops}-node mesh vs 1 node, ms/token", relay, one, f"meshnet 1 node, {t} thr", 1.15
        ),
        _ms_row(
            f"{hops}-node --no-relay vs 1 node, ms/token", star, one, f"meshnet 1 node, {t} thr"
        ),
        _ms_row(f"{hops}-node relay vs --no-relay, ms/token", relay, star, "meshnet --no-relay"),
        _ms_row(f"{hops}-node head assist vs off, ms/token", relay, alone, "--head-assist off"),
        _row(
            f"{hops}-node mesh, decode tok/s",
            relay,
            rpc if rpc.figures else None,
            "1 stream tok/s",
            "llama.cpp RPC 2-way",
            1.5,
        ),
    ]
    return rows, _notes([*sides, rpc])


def _notes(sides: Sequence[_Side]) -> list[str]:
    """Every try in order of side, then any stream that ended short."""
    notes = [line for side in sides for line in side.log]
    return notes + [f"{side.name} stream ended short: {s}" for side in sides for s in side.short]


def _row(
    figure: str,
    ours: _Side,
    theirs: _Side | None,
    key: str,
    name: str,
    goal: float | None,
) -> Comparison:
    """``key``'s best on each side; the figure is marked (*) when a side had no
    undisturbed try."""
    value, calm = ours.best(key)
    peer, peer_calm = theirs.best(key) if theirs is not None else (None, True)
    mark = "" if calm and peer_calm else " *"
    return Comparison(figure + mark, value, peer, name, goal)


def _ms_row(
    figure: str, ours: _Side, theirs: _Side, name: str, goal: float | None = None
) -> Comparison:
    """Per-token milliseconds of two sides' single streams (the best is the fastest)."""
    value, calm = ours.best("1 stream tok/s")
    peer, peer_calm = theirs.best("1 stream tok/s")
    mark = "" if calm and peer_calm else " *"
    return Comparison(figure + mark, 1000 / value, 1000 / peer, name, goal, "lower")


def _n_layers(layout: str) -> int:
    ranges = [r for r in parse_layout(layout) if r is not None]
    return max(r.end for r in ranges)
