"""Route benchmarks without a mesh: a scripted tracker serves the generations, so the
figures, the checks against the unpinned output, the bounds, one-run-at-a-time and
the recording (SQLite and PostgreSQL, read back as a restarted tracker would) are
exercised as they are."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshnet.cli.main import main
from meshnet.errors import Overloaded, RequestError
from meshnet.layer_range import LayerRange
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.routing.driver import DoneEvent, TokenEvent
from meshnet.tracker.service import Started
from meshnet.tracker.serving.bench_store import BenchStore, RouteFigures
from meshnet.tracker.serving.route_bench import (
    MAX_ROUNDS,
    MAX_ROUTES,
    MAX_TOKENS,
    BenchRequest,
    Round,
    RouteBench,
    RunInfo,
    nearest_rank,
    summarise,
)
from meshnet.tracker.storage.database import Database, open_database

FP = "f" * 64
Key = tuple[str, ...] | None  # a route's node ids; None: unpinned


class ScriptedPlanner:
    """Names any route of known nodes, one layer a hop; the model's whole context."""

    def __init__(self, context_length: int) -> None:
        self.context_length = context_length

    def context_limit(self) -> int:
        return self.context_length

    def requested_route(self, node_ids: Sequence[str]) -> Route:
        if "zz" in node_ids:
            raise RequestError("unknown node ids: zz")
        return tuple(Hop(n, "127.0.0.1:1", LayerRange(i, i + 1)) for i, n in enumerate(node_ids))


class ScriptedTracker:
    """Answers each route with its scripted tokens, one every millisecond; ``gate``
    holds every token until set; a route in ``refuse`` is ``Overloaded``."""

    def __init__(self, outputs: dict[Key, list[int]], refuse: Key = ("never",)) -> None:
        spec = SimpleNamespace(vocab_size=100, context_length=256)
        self.model = SimpleNamespace(name="m", fingerprint=FP, spec=spec)
        self.planner = ScriptedPlanner(spec.context_length)
        self.outputs = outputs
        self.refuse = refuse
        self.started: list[Key] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def start(
        self, prompt_ids: Sequence[int], params: SamplingParams, top: int, named: Route | None
    ) -> Started:
        key = None if named is None else tuple(h.node_id for h in named)
        if key == self.refuse:
            raise Overloaded("nodes are at capacity")
        self.started.append(key)
        route = named or (Hop("w", "127.0.0.1:1", LayerRange(0, 2)),)
        ids = self.outputs[key][: params.max_tokens]
        return Started("g", route, 1, self._events(ids, len(prompt_ids), route))

    async def _events(
        self, ids: list[int], prompt: int, route: Route
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        for token in ids:
            await self.gate.wait()
            await asyncio.sleep(0.001)
            yield TokenEvent(token, "")
        yield DoneEvent(ids, "", "length", prompt, route)


Opener = Callable[[str | Path], BenchStore]


@pytest.fixture
def store_at() -> Iterator[Opener]:
    """Open a bench store on a database (a path or a URL); each is closed at the end."""
    opened: list[Database] = []

    def open_store(target: str | Path) -> BenchStore:
        opened.append(open_database(target))
        return BenchStore(opened[-1])

    yield open_store
    for db in opened:
        db.close()


def bench_of(tracker: ScriptedTracker, store: BenchStore) -> RouteBench:
    return RouteBench(tracker, store)  # type: ignore[arg-type]


def request(*routes: tuple[str, ...], rounds: int = 2, max_tokens: int = 3) -> BenchRequest:
    return BenchRequest(routes, (5, 6, 7), max_tokens, rounds)


OUTPUTS: dict[Key, list[int]] = {None: [1, 2, 3], ("w",): [1, 2, 3], ("a", "b"): [1, 2, 4]}


def test_every_route_is_recorded_with_its_figures_and_whether_it_matched(
    tmp_path: Path, store_at: Opener
) -> None:
    tracker = ScriptedTracker(OUTPUTS)
    bench = bench_of(tracker, store_at(tmp_path / "t.db"))
    run = asyncio.run(bench.run(request(("w",), ("a", "b"))))
    assert tracker.started == [None, ("w",), ("w",), ("a", "b"), ("a", "b")]
    assert run.reference.ids == (1, 2, 3)
    one, two = run.figures
    assert (one.output_equal, two.output_equal) == (True, False)
    assert [n for n, _ in two.hops] == ["a", "b"] and two.hops[1][1] == LayerRange(1, 2)
    for f in run.figures:
        assert (f.model, f.fingerprint, f.rounds, f.tokens, f.prompt_tokens) == ("m", FP, 2, 3, 3)
        assert f.ttft_ms > 0 and f.tokens_per_s is not None and f.tokens_per_s > 0
        assert f.token_ms_median is not None and f.token_ms_p90 is not None
        assert 0 < f.token_ms_median <= f.token_ms_p90
    again = store_at(tmp_path / "t.db")  # a restarted tracker's
    assert again.latest() == list(run.figures)
    assert again.latest(run_id="other") == []


def test_a_bad_route_is_refused_before_anything_runs(tmp_path: Path, store_at: Opener) -> None:
    tracker = ScriptedTracker(OUTPUTS)
    bench = bench_of(tracker, store_at(tmp_path / "t.db"))
    with pytest.raises(RequestError, match="unknown node ids: zz"):
        asyncio.run(bench.run(request(("w",), ("a", "zz"))))
    assert tracker.started == [] and bench.store.latest() == []


def test_a_run_that_fails_part_way_records_nothing(tmp_path: Path, store_at: Opener) -> None:
    tracker = ScriptedTracker(OUTPUTS, refuse=("a", "b"))
    bench = bench_of(tracker, store_at(tmp_path / "t.db"))
    with pytest.raises(Overloaded):
        asyncio.run(bench.run(request(("w",), ("a", "b"))))
    assert bench.store.latest() == []


def test_a_second_run_while_one_runs_is_overloaded(tmp_path: Path, store_at: Opener) -> None:
    tracker = ScriptedTracker(OUTPUTS)
    bench = bench_of(tracker, store_at(tmp_path / "t.db"))

    async def both() -> None:
        tracker.gate.clear()
        first = asyncio.create_task(bench.run(request(("w",))))
        while not tracker.started:
            await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="already running"):
            await bench.run(request(("w",)))
        tracker.gate.set()
        await first

    asyncio.run(both())
    assert len(bench.store.latest()) == 1


@pytest.mark.parametrize(
    ("routes", "prompt", "max_tokens", "rounds"),
    [
        ((), (1,), 4, 1),
        ((("w",),) * (MAX_ROUTES + 1), (1,), 4, 1),
        (((),), (1,), 4, 1),
        ((("w",),), (), 4, 1),
        ((("w",),), (1,), 0, 1),
        ((("w",),), (1,), MAX_TOKENS + 1, 1),
        ((("w",),), (1,), 4, 0),
        ((("w",),), (1,), 4, MAX_ROUNDS + 1),
        ((("w",),) * MAX_ROUTES, (1,), MAX_TOKENS, MAX_ROUNDS),  # too much work in all
    ],
)
def test_a_run_out_of_bounds_is_refused(
    routes: tuple[tuple[str, ...], ...], prompt: tuple[int, ...], max_tokens: int, rounds: int
) -> None:
    with pytest.raises(RequestError, match="out of bounds"):
        BenchRequest(routes, prompt, max_tokens, rounds)


def test_quantiles_are_values_that_occurred() -> None:
    values = [float(v) for v in range(10, 0, -1)]
    assert nearest_rank(values, 0.9) == 9.0 and nearest_rank(values, 0.5) == 5.0
    assert nearest_rank([3.0], 0.9) == 3.0


def test_a_one_token_route_has_no_token_figures() -> None:
    info = RunInfo("r", "m", FP, 3, 1)
    hop = Hop("w", "127.0.0.1:1", LayerRange(0, 2))
    one = Round((7,), (hop,), 0.25, (10.0,))
    f = summarise(info, 0, [one, one], [7], now=1.0)
    assert (f.ttft_ms, f.tokens, f.output_equal) == (250.0, 1, True)
    assert (f.token_ms_median, f.token_ms_p90, f.tokens_per_s) == (None, None, None)


def test_the_figures_round_trip_through_postgresql(fresh_postgres: str, store_at: Opener) -> None:
    hops = (("a", LayerRange(0, 2)), ("b", LayerRange(2, 4)))
    rows = [
        RouteFigures("r1", 0, 1.5, "m", FP, hops, 3, 8, 2, 8, 12.5, 1.25, 2.5, 800.0, True),
        RouteFigures("r1", 1, 1.5, "m", FP, hops[:1], 3, 8, 2, 1, 9.0, None, None, None, False),
    ]
    store_at(fresh_postgres).record(rows)
    again = store_at(fresh_postgres)  # another tracker's, sharing the database
    assert again.latest() == rows
    assert again.latest(limit=1) == rows[1:]
    assert again.latest(run_id="r1")[0].as_json()["nodes"] == ["a", "b"]


def test_bench_route_mode_needs_well_formed_routes_and_a_tracker(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--route", "node-0,,node-1"])
    assert exit_.value.code == 2 and "--route" in capsys.readouterr().err
    argv = ["bench", "--route", "node-0", "--url", "http://127.0.0.1:9", "--admin-token", "t"]
    assert main(argv) == 2
    assert "did not answer" in capsys.readouterr().err
