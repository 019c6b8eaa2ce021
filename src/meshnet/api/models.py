"""The models endpoints: ``GET /v1/models`` (clients) and ``/admin/models`` (operators).

``/v1/models`` lists each served model that has a complete route now, and only
those. The admin calls (admin token; bodies bounded, ``extra`` fields refused;
a refused call changes nothing):

- ``GET /admin/models`` — every model held: state (``serving``/``draining``),
  fingerprint, whether its route is complete, uncovered layers, its nodes;
- ``POST /admin/models`` — serve a model file (the path as the tracker sees
  it; ``node_path`` as the nodes see it, default the same) on ``placement``
  (node ids with layer ranges covering the model once) or on ``nodes`` empty
  nodes chosen by the tracker; answers when its route is complete (201);
- ``POST /admin/models/{name}/replace`` — the same body plus ``drain_s``: the
  new model is served, then ``name`` drains (202) and its name leads to the
  new model;
- ``DELETE /admin/models/{name}?drain_s=`` — stop routing new requests to it,
  let its generations finish (``drain_s``, then cancelled), empty its nodes (202).

See tracker/serving/model_admin.py for what each does, and docs/serving-models.md.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshnet.api.auth import require_admin, require_tenant
from meshnet.api.state import model_admin_of, models_of, tracker_of
from meshnet.layer_range import LayerRange
from meshnet.tracker.serving.model_admin import MAX_DRAIN_S, ServeRequest, model_json
from meshnet.tracker.serving.widening import Load

router = APIRouter()
admin = APIRouter(dependencies=[Depends(require_admin)])

MAX_PLACEMENT = 256  # nodes named in one serve
_Path = Annotated[str, Field(min_length=1, max_length=4096)]
_Layer = Annotated[int, Field(ge=0, le=1 << 20)]
_Drain = Annotated[float, Field(ge=0, le=MAX_DRAIN_S)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlacementIn(_Body):
    node_id: Annotated[str, Field(min_length=1, max_length=256)]
    layers: Annotated[list[_Layer], Field(min_length=2, max_length=2)]  # [start, end)


_Placement = Annotated[list[PlacementIn], Field(min_length=1, max_length=MAX_PLACEMENT)]


class ServeBody(_Body):
    path: _Path
    node_path: _Path | None = None
    placement: (
        Annotated[list[PlacementIn], Field(min_length=1, max_length=MAX_PLACEMENT)] | None
    ) = None
    nodes: Annotated[int, Field(ge=1, le=MAX_PLACEMENT)] | None = None

    @model_validator(mode="after")
    def _one_placement(self) -> ServeBody:
        if self.placement is not None and self.nodes is not None:
            raise ValueError("give placement or nodes, not both")
        return self

    def request(self) -> ServeRequest:
        """The typed request; ``LayerRangeError`` (400) for an empty or negative range."""
        assignments = tuple(
            Load(p.node_id, LayerRange(p.layers[0], p.layers[1])) for p in self.placement or ()
        )
        return ServeRequest(self.path, self.node_path or "", assignments, self.nodes or 1)


class ReplaceBody(ServeBody):
    drain_s: _Drain = 60.0


@router.get("/v1/models", dependencies=[Depends(require_tenant)])
async def list_models(request: Request) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "meshnet"}
            for m in models_of(request).listed()
        ],
    }


@admin.get("/admin/models")
async def admin_models(request: Request) -> dict[str, Any]:
    nodes = tracker_of(request).store.nodes()
    return {"models": [model_json(m, nodes) for m in models_of(request)]}


@admin.post("/admin/models", status_code=201)
async def serve_model(body: ServeBody, request: Request) -> dict[str, Any]:
    model = await model_admin_of(request).serve(body.request())
    return model_json(model, tracker_of(request).store.nodes())


@admin.post("/admin/models/{name}/replace")
async def replace_model(name: str, body: ReplaceBody, request: Request) -> JSONResponse:
    new = await model_admin_of(request).replace(name, body.request(), body.drain_s)
    nodes = tracker_of(request).store.nodes()
    old = models_of(request).get(name) if name in {m.name for m in models_of(request)} else None
    content = {
        "replaced": model_json(old, nodes) if old else {"name": name, "state": "released"},
        "model": model_json(new, nodes),
    }
    return JSONResponse(content, status_code=202)


@admin.delete("/admin/models/{name}")
async def release_model(
    name: str, request: Request, drain_s: Annotated[float, Query(ge=0, le=MAX_DRAIN_S)] = 60.0
) -> JSONResponse:
    model = await model_admin_of(request).release(name, drain_s)
    return JSONResponse(model_json(model, tracker_of(request).store.nodes()), status_code=202)
