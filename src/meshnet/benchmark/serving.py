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

Every figure is the rate at which a client sees streamed tokens after the
first (``streams``): sampling, the HTTP edge and every hop included. Greedy,
the same prompts and ``max_tokens`` on both sides; llama-server is told
``ignore_eos`` and the prompts are ones meshnet does not end early, so both
decode the same positions (a side that stopped short is reported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshnet.benchmark.comparison import Comparison, best
from meshnet.benchmark.llama_server import llama_server
from meshnet.benchmark.mesh import llamacpp_rpc_tok_s
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


@dataclass
class _Side:
    """One server's rounds."""

    url: str
    model: str
    tokens: int
    single: list[float] = field(default_factory=list)  # tok/s, one stream
    steady: list[float] = field(default_factory=list)  # aggregate tok/s, all decoding
    e2e: list[float] = field(default_factory=list)  # aggregate tok/s, prefill included
    short: list[str] = field(default_factory=list)  # streams that ended early

    def bodies(self, n: int) -> list[dict[str, Any]]:
        return [
            completion_body(self.model, PROMPTS[i % len(PROMPTS)], self.tokens) for i in range(n)
        ]

    def stream(self, n: int) -> list[StreamRecord]:
        records = run_streams(self.url, self.bodies(n))
        self.short += [
            f"{r.tokens} tokens ({r.finish_reason})" for r in records if r.tokens != self.tokens
        ]
        return records

    def warm(self, n: int) -> None:
        run_streams(self.url, self.bodies(n))


def api_vs_llama_server(setup: ServingSetup) -> tuple[list[Comparison], list[str]]:
    """Comparison 1; the rows and notes (streams that ended short)."""
    whole = [LayerRange(0, _n_layers(setup.layout))]
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(
            running_mesh(setup.data_dir / "node", setup.model, whole, setup.threads)
        )
        ours = _Side(mesh.url, served_model(mesh.url), setup.tokens)
        sides = [ours]
        if setup.bin_dir is not None:
            log = setup.data_dir / "llama-server.log"
            slot_ctx = 2 * (setup.tokens + 64)  # each slot holds a prompt and its completion
            url = stack.enter_context(
                llama_server(
                    setup.bin_dir, setup.model, setup.threads, setup.streams, slot_ctx, log
                )
            )
            sides.append(_Side(url, "llama", setup.tokens))
        for side in sides:
            side.warm(1)
            side.warm(setup.streams)
        for r in range(setup.rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:
                side.single.append(decode_tok_s(side.stream(1)[0]))
                many = side.stream(setup.streams)
                side.steady.append(steady_tok_s(many))
                side.e2e.append(end_to_end_tok_s(many))
    theirs = sides[1] if len(sides) > 1 else None
    name = f"llama-server -t {setup.threads} -np {setup.streams}"
    n = setup.streams
    rows = [
        _row("1 stream, decode tok/s", ours.single, theirs and theirs.single, name, 1.2),
        _row(
            f"{n} streams, aggregate decode tok/s", ours.steady, theirs and theirs.steady, name, 2.0
        ),
        _row(f"{n} streams, tok/s incl. prefill", ours.e2e, theirs and theirs.e2e, name, None),
    ]
    notes = [f"meshnet stream ended short: {s}" for s in ours.short]
    notes += [f"llama-server stream ended short: {s}" for s in theirs.short] if theirs else []
    return rows, notes


def mesh_vs_single(setup: ServingSetup) -> tuple[list[Comparison], list[str]]:
    """Comparison 2; the rows and notes."""
    layout = parse_layout(setup.layout)
    whole = [LayerRange(0, _n_layers(setup.layout))]
    t = setup.mesh_threads
    with contextlib.ExitStack() as stack:
        meshes = {
            "single": stack.enter_context(
                running_mesh(setup.data_dir / "one", setup.model, whole, t)
            ),
            "relay": stack.enter_context(
                running_mesh(setup.data_dir / "relay", setup.model, layout, t)
            ),
            "star": stack.enter_context(
                running_mesh(setup.data_dir / "star", setup.model, layout, t, relay=False)
            ),
        }
        sides = {k: _Side(m.url, served_model(m.url), setup.tokens) for k, m in meshes.items()}
        for side in sides.values():
            side.warm(1)
        order = list(sides)
        rpc: list[float] = []
        for r in range(setup.rounds):
            for k in order[r % len(order) :] + order[: r % len(order)]:
                sides[k].single.append(decode_tok_s(sides[k].stream(1)[0]))
            if setup.bin_dir is not None and (setup.bin_dir / "ggml-rpc-server").exists():
                rpc.append(llamacpp_rpc_tok_s(setup.bin_dir, setup.model, 2, setup.tokens, 1))
    ms = {k: 1000 / best(s.single) for k, s in sides.items()}
    hops = len(layout)
    one = f"meshnet 1 node, {t} thr"
    rows = [
        Comparison(
            f"{hops}-node mesh vs 1 node, ms/token", ms["relay"], ms["single"], one, 1.15, "lower"
        ),
        Comparison(
            f"{hops}-node --no-relay vs 1 node, ms/token",
            ms["star"],
            ms["single"],
            one,
            None,
            "lower",
        ),
        Comparison(
            f"{hops}-node relay vs --no-relay, ms/token",
            ms["relay"],
            ms["star"],
            "meshnet --no-relay",
            None,
            "lower",
        ),
        _row(
            f"{hops}-node mesh, decode tok/s",
            sides["relay"].single,
            rpc or None,
            "llama.cpp RPC 2-way",
            1.5,
        ),
    ]
    notes = [f"{k} stream ended short: {s}" for k, side in sides.items() for s in side.short]
    return rows, notes


def _row(
    figure: str, ours: Sequence[float], peer: Sequence[float] | None, name: str, goal: float | None
) -> Comparison:
    return Comparison(figure, best(ours), best(peer) if peer else None, name, goal)


def _n_layers(layout: str) -> int:
    ranges = [r for r in parse_layout(layout) if r is not None]
    return max(r.end for r in ranges)
