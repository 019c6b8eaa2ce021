"""The tracker: it answers, serves this node's model, and accepts this node's key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import httpx

from meshnet.auth.node_http import NodeAuth
from meshnet.model.gguf_split import model_stem
from meshnet.node.preflight.model import ModelFacts
from meshnet.node.preflight.result import Check, Scope, fail, ok, skip

if TYPE_CHECKING:
    from meshnet.node.node_config import NodeConfig


def check_tracker(cfg: NodeConfig, facts: ModelFacts | None, http: httpx.Client) -> list[Check]:
    """The tracker answers /healthz, serves this node's model, and accepts its key."""
    url = cfg.tracker_url.rstrip("/")
    try:
        r = http.get(f"{url}/healthz")
        r.raise_for_status()
        health = r.json()
        if not isinstance(health, dict):
            raise ValueError("the answer is not a JSON object")
    except (httpx.HTTPError, ValueError) as e:
        fix = "start the tracker, or fix --tracker"
        return [
            fail("tracker", f"{url}/healthz: {e}", fix, Scope.PEER),
            skip("tracker model", "no tracker", Scope.PEER),
            skip("tracker key", "no tracker", Scope.PEER),
        ]
    served = f"serving {health.get('model')!r}, {health.get('nodes_up')} nodes up"
    return [
        ok("tracker", f"{url} answers ({served})", Scope.PEER),
        check_served_model(health, facts),
        check_key(cfg, url, http),
    ]


def check_served_model(health: Mapping[str, object], facts: ModelFacts | None) -> Check:
    """The tracker serves this node's model: the same sha256 where /healthz says it, else
    the same name (the file's, less ``.gguf``)."""
    if facts is None:
        return skip("tracker model", "no model of this node to compare", Scope.PEER)
    ours, served = model_stem(facts.path.name), health.get("model")
    fingerprint = health.get("fingerprint")
    fix = "--model the same GGUF file as the tracker's"
    models = health.get("models")
    if isinstance(models, list) and len(models) > 1:  # a tracker of several models
        if any(isinstance(m, dict) and m.get("fingerprint") == facts.fingerprint for m in models):
            return ok("tracker model", f"the tracker serves {ours!r}", Scope.PEER)
        names = ", ".join(repr(m.get("name")) for m in models if isinstance(m, dict))
        detail = f"the tracker serves {names}, none with this file's sha256"
        return fail("tracker model", detail, "--model a GGUF file the tracker serves", Scope.PEER)
    if fingerprint and fingerprint != facts.fingerprint:
        return fail("tracker model", f"the tracker's sha256 is {fingerprint}", fix, Scope.PEER)
    if served != ours:
        detail = f"the tracker serves {served!r}, this node {ours!r}"
        return fail("tracker model", detail, fix, Scope.PEER)
    return ok("tracker model", f"the tracker serves {ours!r}", Scope.PEER)


def check_key(cfg: NodeConfig, url: str, http: httpx.Client) -> Check:
    """The tracker accepts the node's signature: a signed heartbeat whose body is not one
    is refused 401 for a bad key, 400 (or 422) for a good one; nothing is recorded."""
    if not cfg.node_key:
        return skip("tracker key", "no credential", Scope.PEER)
    try:
        r = http.post(
            f"{url}/mesh/nodes/{cfg.node_id}/heartbeat",
            content=b"[]",
            headers={"content-type": "application/json"},
            auth=NodeAuth(cfg.node_id, cfg.node_key),
        )
    except httpx.HTTPError as e:
        return fail("tracker key", f"{url}: {e}", "start the tracker, or fix --tracker", Scope.PEER)
    if r.status_code in (400, 422):
        return ok("tracker key", f"the tracker accepts node {cfg.node_id}'s key", Scope.PEER)
    if r.status_code in (401, 403):
        fix = (
            f"the key `meshnet credentials node-key {cfg.node_id}` prints on the tracker's "
            "data dir (--node-key-file), or its --mesh-secret-file; --node-id must match"
        )
        detail = f"the tracker refuses node {cfg.node_id}'s key (HTTP {r.status_code})"
        return fail("tracker key", detail, fix, Scope.PEER)
    return fail("tracker key", f"unexpected HTTP {r.status_code}", "fix --tracker", Scope.PEER)
