"""What a node fetches of a model by reference, against the whole file, and how fast.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/fetch.py [--model PATH] [--nodes 3]

Serves ``--model`` (default: the Llama-3.2-1B-shaped Q4_K_M that bench/realistic.py
writes into ~/.cache/meshnet/models/) from the local hub of the tests
(tests/hub_server.py: the hub's URL layout on 127.0.0.1), then, each through the real
``huggingface_hub`` client:

- the peer: one plain GET of the whole file, nothing checked: the local link's rate;
- the tracker: only the headers (and the small shared tensors) read into the
  manifest; the fingerprint is the hub's sha256;
- ``--nodes`` nodes, the layers split by bytes as ``meshnet up`` splits them: each
  fetches only its range's tensors, each hashed as it arrives (the first fetch: the
  hashes the tracker learns);
- one more node fetching the first node's range from it (its bulk port, a peer
  token), not from the hub, each tensor checked against the learned hashes.

Prints, per node, the bytes fetched (counted at the server) against the file, and each
fetch rate against the peer's. Run on the machine alone: the figures are rates.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import httpx  # noqa: E402
from hub_server import HubServer  # noqa: E402

from meshnet.auth.keys import new_secret  # noqa: E402
from meshnet.auth.mesh_keys import MeshKeys  # noqa: E402
from meshnet.layer_range import LayerRange  # noqa: E402
from meshnet.model.info import load_model_info  # noqa: E402
from meshnet.model.layer_bytes import model_layer_bytes  # noqa: E402
from meshnet.model_source.config import SourceConfig  # noqa: E402
from meshnet.model_source.manifest import Manifest  # noqa: E402
from meshnet.model_source.peers import Peer, scope  # noqa: E402
from meshnet.model_source.reference import parse_ref  # noqa: E402
from meshnet.model_source.remote import locate  # noqa: E402
from meshnet.model_source.shard_store import fetch_shard  # noqa: E402
from meshnet.model_source.tracker_source import tracker_model  # noqa: E402
from meshnet.node.kv_offers import KVOffers  # noqa: E402
from meshnet.node.model_fetch import NodeModels  # noqa: E402

DEFAULT = Path.home() / ".cache/meshnet/models/llama3.2-1b-synthetic-s0-Q4_K_M.gguf"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT)
    p.add_argument("--nodes", type=int, default=3)
    args = p.parse_args()
    if not args.model.is_file():
        print(f"{args.model}: missing (bench/realistic.py writes it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="meshnet-fetch-") as tmp:
        root = Path(tmp) / "hub"
        (root / "bench" / "model").mkdir(parents=True)
        (root / "bench" / "model" / args.model.name).symlink_to(args.model.resolve())
        with HubServer(root) as hub:
            hub.sha256(root / "bench" / "model" / args.model.name)  # not timed below
            run(hub, args.model, args.nodes, Path(tmp))
    return 0


def _cfg(hub: HubServer, tmp: Path, client: str) -> SourceConfig:
    return SourceConfig(cache_dir=tmp / client, client=client, endpoint=hub.url)


def run(hub: HubServer, model: Path, nodes: int, tmp: Path) -> None:
    size = model.stat().st_size
    ref = f"hf:bench/model/{model.name}"
    url = f"{hub.url}/bench/model/resolve/main/{model.name}"
    t0 = time.perf_counter()
    with httpx.stream("GET", url, headers={"User-Agent": "meshnet-client/peer"}) as r:
        for _ in r.iter_bytes(1 << 20):
            pass
    link = size / (time.perf_counter() - t0)
    print(f"file {model.name}: {size / 1e6:.1f} MB")
    print(f"peer (one plain GET, nothing checked): {link / 1e6:.1f} MB/s")
    t0 = time.perf_counter()
    tm = tracker_model(ref, _cfg(hub, tmp, "tracker"))
    seconds = time.perf_counter() - t0
    read = hub.sent["tracker"]
    print(f"tracker (headers only): read {read / 1e6:.2f} MB = {read / size:.2%} of the file "
          f"in {seconds:.2f} s")  # fmt: skip
    info = load_model_info(model)
    ranges = model_layer_bytes(info.file, info.spec).split(nodes)
    learned: dict[str, str] = {}
    for i, layers in enumerate(ranges):
        client = f"node-{i}"
        cfg = _cfg(hub, tmp, client)
        t0 = time.perf_counter()
        shard = fetch_shard(locate(parse_ref(ref), cfg), tm.manifest, layers, cfg)
        seconds = time.perf_counter() - t0
        learned |= shard.learned
        sent = hub.sent[client]
        print(
            f"{client} layers {layers}: fetched {sent / 1e6:.1f} MB = {sent / size:.1%} of the "
            f"file; {shard.fetched_bytes / seconds / 1e6:.1f} MB/s hashed (first fetch), "
            f"{shard.fetched_bytes / seconds / link:.2f} x the peer"
        )
    from_peer(hub, ref, tm.manifest.with_hashes(learned), ranges[0], tmp, link)


def from_peer(
    hub: HubServer, ref: str, manifest: Manifest, layers: LayerRange, tmp: Path, link: float
) -> None:
    """node-0's range fetched again by another node, from node-0's bulk port."""
    keys = MeshKeys(new_secret())
    holder = NodeModels(
        "http://unused", "node-0", keys.node_key("node-0"), _cfg(hub, tmp, "node-0")
    )
    offers = KVOffers("127.0.0.1", "127.0.0.1", shards=holder.serve_peer)
    try:
        token = keys.peer("node-0", "node-p", "pull", scope(manifest.fingerprint))
        peer = Peer("node-0", offers.address, layers, token)
        cfg = _cfg(hub, tmp, "node-p")
        t0 = time.perf_counter()
        shard = fetch_shard(
            lambda: locate(parse_ref(ref), cfg), manifest, layers, cfg, None, [peer]
        )
        seconds = time.perf_counter() - t0
    finally:
        offers.close()
    print(
        f"node-p layers {layers} from node-0's bulk port: {shard.from_peers / 1e6:.1f} MB from "
        f"the peer, {hub.sent['node-p']} B from the hub; {shard.from_peers / seconds / 1e6:.1f} "
        f"MB/s checked, {shard.from_peers / seconds / link:.2f} x the plain GET"
    )


if __name__ == "__main__":
    sys.exit(main())
