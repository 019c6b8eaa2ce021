"""A node's death to the first answer: a survivor widened over its layers, against a spare.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/survivor_widen.py [--layout 0:15,15:30]
        [--rounds 3] [--model GGUF]

Each round starts two meshes of the bundled model (a tracker and a node per range of
--layout): one with no spare node, one with an empty spare besides. The last node of
each is sent SIGKILL and no request follows until ``/healthz`` says a route is complete
again (polled every 50 ms): in the first mesh the placement controller widens a
survivor over the dead node's layers (it loads its own range and the lost one as one
shard), in the second it loads the lost range onto the spare. Then one completion is
sent and its ids compared with the mesh's answer before the kill. Printed per round and
as medians: seconds from the kill to a complete route and to the first answer, and the
ratio of the widening's time to the spare's. Both include the tracker noticing the death
(``--heartbeat-timeout`` 2 s and a probe): only the load after it differs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from meshnet.local_mesh import LocalMesh, parse_layout

BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "name three rivers"}],
    "temperature": 0.0,
    "max_tokens": 8,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layout", default="0:15,15:30")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", help="GGUF file (default: the bundled model)")
    args = p.parse_args()
    widen: list[tuple[float, float]] = []
    spare: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            widen.append(_round(Path(tmp) / f"widen{i}", args.layout, args.model))
            spare.append(_round(Path(tmp) / f"spare{i}", args.layout + ",empty", args.model))
            print(f"round {i}: widen {_pair(widen[-1])}; spare {_pair(spare[-1])}", flush=True)
    w = [statistics.median(x) for x in zip(*widen, strict=True)]
    s = [statistics.median(x) for x in zip(*spare, strict=True)]
    print(f"median, no spare (survivor widened): {_pair((w[0], w[1]))}")
    print(f"median, a spare (loads the lost range): {_pair((s[0], s[1]))}")
    print(f"ratio widen/spare, death to first answer: {w[1] / s[1]:.2f}x")


def _pair(t: tuple[float, float]) -> str:
    return f"route {t[0]:.2f} s, first answer {t[1]:.2f} s"


def _round(data: Path, layout: str, model: str | None) -> tuple[float, float]:
    """Seconds from the last serving node's death to a complete route, and to an answer."""
    data.mkdir(parents=True)
    mesh = LocalMesh(data_dir=data, model=model)
    try:
        ranges = parse_layout(layout)
        mesh.start(ranges)
        before = _answer(mesh)
        victim = f"node-{max(i for i, r in enumerate(ranges) if r is not None)}"
        died = time.monotonic()
        mesh.kill_node(victim)
        _until_route(mesh, died)
        routed = time.monotonic() - died
        after = _answer(mesh)
        answered = time.monotonic() - died
        if after != before:
            sys.exit(f"{layout}: the answer after the kill differs: {after} != {before}")
        return routed, answered
    finally:
        mesh.stop()


def _until_route(mesh: LocalMesh, died: float) -> None:
    """Wait until the tracker has marked a node down and says a route is complete."""
    down = False
    while time.monotonic() - died < 300:
        health = httpx.get(f"{mesh.url}/healthz", timeout=5).json()
        down = down or health["nodes_up"] < len(mesh.nodes)
        if down and health["route_complete"]:
            return
        time.sleep(0.05)
    sys.exit("no complete route 300 s after the kill")


def _answer(mesh: LocalMesh) -> list[int]:
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions",
        json={**BODY, "model": _model(mesh)},
        headers=mesh.api_headers,
        timeout=120,
    )
    r.raise_for_status()
    return list(r.json()["meshnet"]["ids"])


def _model(mesh: LocalMesh) -> str:
    r = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers, timeout=10)
    return str(r.json()["data"][0]["id"])


if __name__ == "__main__":
    main()
