"""A model split over N node processes: meshnet's loopback mesh against llama.cpp's RPC split.

meshnet's side is the real mesh (tracker + N ``meshnet node`` processes on
loopback, ``threads`` kernel threads each, layers split as ``meshnet up --nodes N``
plans them: the largest range holding the fewest bytes; ``SplitSetup.even_layers``:
as many layers each), timed as a
client sees streamed tokens arrive. llama.cpp's side is ``llama-bench`` with its
layers offloaded to N local ``ggml-rpc-server`` processes of as many threads.
The two take turns, one round each, and each figure is its best round. With a
delay (``SplitSetup.delay_ms``) both run as over a network: the same user-space
proxy (``delay_proxy``) holds every byte on llama-bench's link to each RPC
server and on every connection to a node, each way.

With more than one thread a process, the processes hold more threads than this
machine has cores, as hops on hosts of their own would not, and an OpenMP thread
that spins after its hop's forward takes a core from the next hop: llama.cpp's
lost about a third of their speed to libgomp's default spin. So each llama.cpp
round is run twice, the second with a short spin (``GOMP_SPINCOUNT``), and its
figure is the better; meshnet's nodes keep the default (a short spin measured
slower for them). After the rounds
each node's resident memory is read and set against the file bytes of the
tensors it serves plus the KV of one benchmark sequence, whole and less the
RSS of a node started empty in the same mesh (the interpreter and libraries).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.benchmark.mesh import llamacpp_rpc_tok_s, stream_decode_tok_s
from meshnet.benchmark.mesh_delay import delayed_links
from meshnet.benchmark.node_memory import Rss, planned_layout, session_kv_bytes, shard_file_bytes
from meshnet.benchmark.running_mesh import served_model
from meshnet.layer_range import LayerRange, split_evenly
from meshnet.local_mesh import LocalMesh
from meshnet.model.spec import ModelSpec

_START_TIMEOUT_S = 900.0  # every node loads its shard of a 1B model on a shared 2-core VM
_SHORT_SPIN = {"GOMP_SPINCOUNT": "3000"}  # rounds an idle OpenMP thread spins, not ~300k


@dataclass(frozen=True)
class NodeMemory:
    node_id: str
    layers: LayerRange
    rss: Rss
    file_bytes: int  # the tensors this node serves, as stored in the GGUF
    kv_bytes: int  # one benchmark sequence's KV on this node's layers

    @property
    def ratio(self) -> float:
        """RSS over what the node must hold (goal: at most ~1.15)."""
        return self.rss.total / (self.file_bytes + self.kv_bytes)

    def ratio_above(self, baseline: Rss) -> float:
        """RSS less ``baseline`` (an empty node's: the interpreter and libraries every
        node pays once) over what the node must hold."""
        return (self.rss.total - baseline.total) / (self.file_bytes + self.kv_bytes)


@dataclass(frozen=True)
class SplitResult:
    nodes: int
    tokens: int  # decoded tokens per round, both sides
    mesh_tok_s: float  # best round
    rpc_tok_s: float | None  # best round; None without llama.cpp
    memory: list[NodeMemory]
    empty_node: Rss  # a node process started with no layers, in the same mesh

    @property
    def ratio(self) -> float | None:
        """meshnet over llama.cpp (goal: at least 1.5)."""
        return self.mesh_tok_s / self.rpc_tok_s if self.rpc_tok_s else None


@dataclass(frozen=True)
class SplitSetup:
    """What a split run needs to know of the model and the peer."""

    model: Path
    spec: ModelSpec
    tensor_bytes: Mapping[str, int]  # every tensor of the file: name -> stored bytes
    prompt_tokens: int  # ids of mesh.PROMPT, for the KV a sequence takes
    llamacpp: Path | None  # folder with llama-bench and ggml-rpc-server
    backend: str = DEFAULT_BACKEND  # the nodes'
    delay_ms: float = 0.0  # held each way on every link to a node or RPC server
    even_layers: bool = False  # split by layer count, not by bytes as ``meshnet up`` does


def measure_split(
    setup: SplitSetup, nodes: int, tokens: int, rounds: int, threads: int = 1
) -> SplitResult:
    """Start the mesh once, alternate decode rounds with llama.cpp's RPC split, read RSS."""
    n_layers = setup.spec.n_layers
    layout = (
        split_evenly(n_layers, nodes)
        if setup.even_layers
        else planned_layout(setup.tensor_bytes, n_layers, nodes)
    )
    ours: list[float] = []
    theirs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="meshnet-split-") as tmp:
        mesh = LocalMesh(
            data_dir=Path(tmp),
            model=str(setup.model),
            extra_env={"NUMBA_NUM_THREADS": str(threads)},
            node_args=["--threads", str(threads), "--backend", setup.backend],
        )
        try:
            with _nodes_behind_proxy(mesh, layout, setup.delay_ms):
                name = served_model(mesh)
                stream_decode_tok_s(mesh, name, 4)  # warm every hop
                for _ in range(rounds):
                    # tokens + 1 streamed: the first carries the prefill, then ``tokens`` decodes
                    ours.append(stream_decode_tok_s(mesh, name, tokens + 1))
                    if setup.llamacpp is not None:
                        theirs.append(
                            rpc_round(
                                setup.llamacpp, setup.model, nodes, tokens, threads, setup.delay_ms
                            )
                        )
                memory = [
                    _node_memory(setup, node_id, proc.pid, layers, tokens)
                    for (node_id, proc), layers in zip(mesh.nodes.items(), layout, strict=True)
                ]
                empty = mesh.start_node("node-empty", None)
                mesh.wait_ready(expected_nodes=nodes + 1, timeout_s=_START_TIMEOUT_S)
                baseline = Rss.of(empty.pid)
        finally:
            mesh.stop()
    rpc = max(theirs) if theirs else None
    return SplitResult(nodes, tokens, max(ours), rpc, memory, baseline)


def rpc_round(
    llamacpp: Path, model: Path, nodes: int, tokens: int, threads: int = 1, delay_ms: float = 0.0
) -> float:
    """One round of llama.cpp's RPC split of ``model`` over ``nodes`` servers of ``threads``
    threads, decode tok/s; with more than one thread, the better of libgomp's default
    spin and a short one (the module docstring says why)."""
    envs: list[dict[str, str]] = [{}] if threads == 1 else [{}, _SHORT_SPIN]
    return max(
        llamacpp_rpc_tok_s(llamacpp, model, nodes, tokens, 1, threads, env, delay_ms)
        for env in envs
    )


@contextlib.contextmanager
def _nodes_behind_proxy(
    mesh: LocalMesh, layout: Sequence[LayerRange], delay_ms: float
) -> Iterator[None]:
    """Start ``mesh`` on ``layout``; with ``delay_ms``, every connection to a node (the
    tracker's, the previous hop's, its relay port's) through the delay proxy, holding
    each byte that long each way, as llama.cpp's RPC servers are reached."""
    if delay_ms <= 0:
        mesh.start(list(layout), timeout_s=_START_TIMEOUT_S)
        yield
        return
    with delayed_links("proxy", 1, len(layout)) as links:
        mesh.start_tracker()
        for i, layers in enumerate(layout):
            listen, prefix, extra = links.node_place(0, i)
            mesh.start_node(f"node-{i}", layers, listen=listen, prefix=prefix, extra=extra)
        mesh.wait_ready(expected_nodes=len(layout), timeout_s=_START_TIMEOUT_S)
        links.set_delay(delay_ms)
        yield


def _node_memory(
    setup: SplitSetup, node_id: str, pid: int, layers: LayerRange, tokens: int
) -> NodeMemory:
    spec = setup.spec
    positions = setup.prompt_tokens + tokens + 1
    return NodeMemory(
        node_id,
        layers,
        Rss.of(pid),
        shard_file_bytes(setup.tensor_bytes, layers, spec.n_layers),
        session_kv_bytes(layers, spec, positions),
    )
