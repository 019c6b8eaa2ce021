"""Recorded route benchmarks: one row per route per run, in the tracker's database.

The table is made like the others (``Database.create_schema``, the SQL both
SQLite and PostgreSQL accept), so a restarted tracker, or another one sharing
the PostgreSQL, lists what was measured before. Booleans are stored as 0/1
integers, the type both dialects compare the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from meshnet.layer_range import LayerRange
from meshnet.tracker.storage.database import Database, Row, parse_rows

_SCHEMA = """
CREATE TABLE IF NOT EXISTS route_benchmarks (
    id {serial},
    run_id TEXT NOT NULL,
    position INTEGER NOT NULL,
    recorded DOUBLE PRECISION NOT NULL,
    model TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    route TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    max_tokens INTEGER NOT NULL,
    rounds INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
    ttft_ms DOUBLE PRECISION NOT NULL,
    token_ms_median DOUBLE PRECISION,
    token_ms_p90 DOUBLE PRECISION,
    tokens_per_s DOUBLE PRECISION,
    output_equal INTEGER NOT NULL,
    UNIQUE (run_id, position)
);
CREATE INDEX IF NOT EXISTS route_benchmarks_run ON route_benchmarks (run_id)
"""

_COLUMNS = (
    "run_id, position, recorded, model, fingerprint, route, prompt_tokens, max_tokens, "
    "rounds, tokens, ttft_ms, token_ms_median, token_ms_p90, tokens_per_s, output_equal"
)


@dataclass(frozen=True)
class RouteFigures:
    """What one route measured in one benchmark run. Times are the tracker's: from
    asking for the route to each token it hands on, not the client's network."""

    run_id: str
    position: int  # the route's place in the run's request
    recorded: float  # wall clock, seconds since the epoch
    model: str
    fingerprint: str  # the model's (GGUF sha256): every node of the route serves it
    hops: tuple[tuple[str, LayerRange], ...]  # node id and layers, in route order
    prompt_tokens: int
    max_tokens: int
    rounds: int
    tokens: int  # generated in the first round (equal outputs: in every round)
    ttft_ms: float  # median over rounds: admission, open and prefill to the first token
    token_ms_median: float | None  # gaps between tokens, every round's pooled; None: one token
    token_ms_p90: float | None
    tokens_per_s: float | None  # tokens after the first / time from the first to the last
    output_equal: bool  # every round's tokens equal the unpinned run's

    def as_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "position": self.position,
            "recorded": self.recorded,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "nodes": [node for node, _ in self.hops],
            "route": _route_json(self.hops),
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "rounds": self.rounds,
            "tokens": self.tokens,
            "ttft_ms": self.ttft_ms,
            "token_ms_median": self.token_ms_median,
            "token_ms_p90": self.token_ms_p90,
            "tokens_per_s": self.tokens_per_s,
            "output_equal": self.output_equal,
        }


class BenchStore:
    """The ``route_benchmarks`` table."""

    def __init__(self, db: Database) -> None:
        self._db = db
        db.create_schema(_SCHEMA)

    def record(self, figures: Sequence[RouteFigures]) -> None:
        """Write one run's routes together: a run is listed whole or not at all."""
        places = ", ".join("?" * len(_COLUMNS.split(", ")))
        with self._db.transaction() as tx:
            for f in figures:
                tx.run(f"INSERT INTO route_benchmarks ({_COLUMNS}) VALUES ({places})", _row(f))

    def latest(self, run_id: str | None = None, limit: int = 100) -> list[RouteFigures]:
        """The latest ``limit`` rows (of one run, if given), oldest first."""
        where, args = (" WHERE run_id = ?", (run_id,)) if run_id is not None else ("", ())
        rows = self._db.query(
            f"SELECT {_COLUMNS} FROM route_benchmarks{where} ORDER BY id DESC LIMIT ?",
            (*args, limit),
        )
        return parse_rows(reversed(rows), _figures, "route benchmark")

    def purge(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` rows recorded before ``before``, oldest first; how many
        (a run's rows are recorded at one time, so a run goes whole, but for one cut by
        ``limit``, whose rest goes in the next call)."""
        return self._db.run(
            "DELETE FROM route_benchmarks WHERE id IN "
            "(SELECT id FROM route_benchmarks WHERE recorded < ? ORDER BY id LIMIT ?)",
            (before, limit),
        )


def _route_json(hops: Sequence[tuple[str, LayerRange]]) -> list[dict[str, Any]]:
    return [{"node_id": node, "layers": [r.start, r.end]} for node, r in hops]


def _row(f: RouteFigures) -> tuple[Any, ...]:
    return (
        f.run_id,
        f.position,
        f.recorded,
        f.model,
        f.fingerprint,
        json.dumps(_route_json(f.hops)),
        f.prompt_tokens,
        f.max_tokens,
        f.rounds,
        f.tokens,
        f.ttft_ms,
        f.token_ms_median,
        f.token_ms_p90,
        f.tokens_per_s,
        int(f.output_equal),
    )


def _figures(r: Row) -> RouteFigures:
    (run_id, position, recorded, model, fingerprint, route, *counts) = r
    prompt_tokens, max_tokens, rounds, tokens, ttft, median, p90, tok_s, equal = counts
    hops = tuple((str(h["node_id"]), LayerRange(*h["layers"])) for h in json.loads(route))
    return RouteFigures(
        run_id=str(run_id),
        position=int(position),
        recorded=float(recorded),
        model=str(model),
        fingerprint=str(fingerprint),
        hops=hops,
        prompt_tokens=int(prompt_tokens),
        max_tokens=int(max_tokens),
        rounds=int(rounds),
        tokens=int(tokens),
        ttft_ms=float(ttft),
        token_ms_median=_maybe(median),
        token_ms_p90=_maybe(p90),
        tokens_per_s=_maybe(tok_s),
        output_equal=bool(equal),
    )


def _maybe(value: Any) -> float | None:
    return None if value is None else float(value)
