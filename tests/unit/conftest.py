"""Fixtures the unit tests of the node's servicer share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet.auth.grpc_auth import NodeGate
from meshnet.auth.keys import new_secret, node_key
from meshnet.layer_range import LayerRange
from meshnet.node.engine import NodeEngine
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.service import NodeIdentity, NodeService


@pytest.fixture
def service(tiny_path: Path) -> Iterator[NodeService]:
    """A servicer of the whole tiny model, driven in-process. The gate is the gRPC
    server's interceptor: these in-process calls do not pass it."""
    engine = NodeEngine()
    engine.start()
    engine.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
    identity = NodeIdentity("n1", str(tiny_path), ModelDirs.of([tiny_path.parent]))
    yield NodeService(identity, engine, NodeGate(node_key(new_secret(), "n1")))
    engine.stop()
