"""Admin endpoints of route benchmarks: run one (``POST``), list what was recorded (``GET``).

``POST /admin/benchmarks`` answers when the run is over and recorded (it is
bounded: ``tracker/serving/route_bench.py``); a bad route is 400 with its reason
before anything runs, another run going on or no capacity is 429.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from meshnet.api.auth import require_admin
from meshnet.api.schemas import MAX_ROUTE_HOPS, NodeIdText
from meshnet.tracker.nodes.routes import route_json
from meshnet.tracker.serving import route_bench as rb

router = APIRouter(dependencies=[Depends(require_admin)])

MAX_BENCH_PROMPT_CHARS = 32_000
MAX_LISTED = 10_000


NamedRoute = Annotated[list[NodeIdText], Field(min_length=1, max_length=MAX_ROUTE_HOPS)]


class BenchmarkBody(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    routes: list[NamedRoute] = Field(min_length=1, max_length=rb.MAX_ROUTES)
    prompt: str = Field(min_length=1, max_length=MAX_BENCH_PROMPT_CHARS)  # raw text, no template
    max_tokens: int = Field(default=32, ge=1, le=rb.MAX_TOKENS)
    rounds: int = Field(default=3, ge=1, le=rb.MAX_ROUNDS)


def route_bench_of(request: Request) -> rb.RouteBench:
    return request.app.state.route_bench  # type: ignore[no-any-return]  # app.state is untyped


@router.post("/admin/benchmarks")
async def run_benchmark(body: BenchmarkBody, request: Request) -> dict[str, Any]:
    """Run every route in turn (greedy), record the figures, and answer them."""
    bench = route_bench_of(request)
    tokenizer = bench.tracker.model.tokenizer
    prompt_ids = await run_in_threadpool(tokenizer.encode, body.prompt)  # not on the loop
    run = await bench.run(
        rb.BenchRequest(
            routes=tuple(tuple(r) for r in body.routes),
            prompt_ids=tuple(prompt_ids),
            max_tokens=body.max_tokens,
            rounds=body.rounds,
        )
    )
    return {
        "run_id": run.run_id,
        "reference": {"route": route_json(run.reference.route), "ids": list(run.reference.ids)},
        "results": [f.as_json() for f in run.figures],
    }


@router.get("/admin/benchmarks")
async def list_benchmarks(
    request: Request,
    run_id: str | None = Query(None, max_length=64),
    limit: int = Query(100, ge=1, le=MAX_LISTED),
) -> dict[str, Any]:
    """The latest recorded routes (of one run, if given), oldest first."""
    figures = route_bench_of(request).store.latest(run_id, limit)
    return {"benchmarks": [f.as_json() for f in figures]}
