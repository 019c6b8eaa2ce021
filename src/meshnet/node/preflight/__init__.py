"""Checks of a node's setup before it serves: ``meshnet doctor``, and ``meshnet node`` at start.

Each check gives one ``Check``: passed, failed (with the fix) or skipped (a
check it depends on failed). The model is checked with the loader's own
functions and typed errors (``open_gguf``, ``read_spec``, ``load_tokenizer``,
``load_shard_weights`` with a matrix reader that reads no weights), so the
doctor refuses exactly what loading would refuse.

A check's scope says whose fault a failure is. ``LOCAL``: this host's setup
(model, layers, listen address, disk, memory, credential); ``meshnet node``
does not start on one. ``PEER``: what depends on others (the tracker, the path
to the advertised address); a node starts anyway, since its tracker may start
after it and its announcer keeps trying. ``meshnet doctor`` fails on either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from meshnet.auth.credentials import MESH_SECRET_ENV, NODE_KEY_ENV, node_credential
from meshnet.errors import MeshnetError
from meshnet.model.bundled import bundled_model_path
from meshnet.model_source.reference import is_reference
from meshnet.node.preflight.host import check_memory, check_park_dir
from meshnet.node.preflight.model import ModelFacts, check_model, check_model_dirs
from meshnet.node.preflight.network import check_addresses
from meshnet.node.preflight.result import Check, Report, Scope, Status, fail, ok, skip
from meshnet.node.preflight.tracker import check_tracker

if TYPE_CHECKING:
    from meshnet.node.node_config import NodeConfig

__all__ = ["Check", "Report", "Scope", "Status", "check_credential", "check_node"]


def check_node(cfg: NodeConfig, timeout_s: float = 3.0, http: httpx.Client | None = None) -> Report:
    """Every check of ``cfg``'s setup, in the order an operator fixes them; each network
    check within ``timeout_s``. ``http`` talks to the tracker (tests pass a mock transport)."""
    checks: list[Check] = [check_model_dirs(cfg.model_dirs)]
    facts: ModelFacts | None = None
    if cfg.layers is None:
        checks.append(skip("model", "an empty node loads what the tracker tells it to"))
    elif is_reference(cfg.model_path):
        checks.append(skip("model", f"{cfg.model_path}: its range is fetched and checked at start"))
    else:
        model_path = Path(cfg.model_path) if cfg.model_path else bundled_model_path()
        model_checks, facts = check_model(model_path, cfg.layers, cfg.engine.backend)
        checks += model_checks
    if cfg.layers is not None and facts is None and not is_reference(cfg.model_path):
        checks.append(skip("memory", "the model did not pass its checks"))
    else:
        checks.append(check_memory(facts, cfg.engine.kv_budget_bytes))
    checks.append(check_park_dir(cfg.engine.park_dir, cfg.engine.kv_budget_bytes))
    checks += check_addresses(cfg, timeout_s)
    with contextlib.ExitStack() as owned:
        client = http or owned.enter_context(httpx.Client(timeout=timeout_s))
        checks += check_tracker(cfg, facts, client)
    return Report(tuple(checks))


def check_credential(
    node_id: str, key_file: str | None, secret_file: str | None, env: Mapping[str, str]
) -> tuple[Check, str]:
    """The node's key (``""`` when there is none) and the check that says where it came from."""
    try:
        key = node_credential(node_id, key_file, secret_file, env)
    except MeshnetError as e:
        return fail("credential", e.message, "give the node its key (`meshnet credentials`)"), ""
    return ok(
        "credential", f"node {node_id}'s key from {_key_source(key_file, secret_file, env)}"
    ), key


def _key_source(key_file: str | None, secret_file: str | None, env: Mapping[str, str]) -> str:
    """Where ``node_credential`` took the key from (it tries them in this order)."""
    if key_file:
        return "--node-key-file"
    if env.get(NODE_KEY_ENV):
        return f"${NODE_KEY_ENV}"
    return "--mesh-secret-file" if secret_file else f"${MESH_SECRET_ENV}"
