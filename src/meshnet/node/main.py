"""The node process: load a shard (or start empty), serve gRPC, announce to the tracker."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import sys
import threading
from concurrent import futures
from functools import partial
from pathlib import Path

import grpc

from meshnet.auth.grpc_auth import NodeGate
from meshnet.backends.kernel_threads import set_threads
from meshnet.errors import KVBudgetExhausted, MeshnetError
from meshnet.memory import in_child, settle
from meshnet.model.bundled import bundled_model_path
from meshnet.model_source.config import source_config
from meshnet.model_source.reference import is_reference
from meshnet.node.announce import Announcer
from meshnet.node.engine import NodeEngine
from meshnet.node.kv_offers import KVOffers
from meshnet.node.metrics import NodeMetrics
from meshnet.node.metrics_http import MetricsServer
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.model_fetch import NodeModels, progress_wanted
from meshnet.node.node_config import NodeConfig
from meshnet.node.preflight import check_node
from meshnet.node.relay_socket import RelayListener
from meshnet.node.service import NodeIdentity, NodeService
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS

log = logging.getLogger(__name__)


_MAX_RELAY_CONNECTIONS = 8  # previous hops relaying over TCP at once (a thread each)


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity mask, which a container's
    cpuset or ``taskset`` narrows (``os.cpu_count`` would count the whole machine)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _start_threads(requested: int | None) -> int:
    """Size the kernels' pool; returns the threads it got.

    ``NUMBA_NUM_THREADS`` caps the pool (``LocalMesh`` sets it to each node's
    share); asking for more than the cap gets the cap, said once in the log.
    """
    wanted = requested or available_cores()
    got = set_threads(wanted)
    if got < wanted:
        log.warning("%d kernel threads asked, %d allowed by NUMBA_NUM_THREADS", wanted, got)
    return got


def new_node_id() -> str:
    return f"node-{secrets.token_hex(4)}"


def preflight(cfg: NodeConfig) -> bool:
    """Run the checks of ``meshnet doctor`` and print their lines; False when one of the
    node's own setup failed (it must not start). A failed check of a peer (the tracker may
    start after its nodes) is only a warning: the announcer keeps trying.

    The checks run in a forked child (``memory.in_child``), before any thread starts:
    the tokenizer check builds the model's whole tokenizer, which a node never uses
    (the tracker tokenizes), and its library and the heap pages it left kept ~10 MB
    resident in every node for its life."""
    report = in_child(partial(check_node, cfg))
    for line in report.lines():
        print(line, file=sys.stderr, flush=True)
    if report.blocking:
        print(
            f"meshnet node: {len(report.blocking)} check(s) failed, not starting "
            "(`meshnet doctor` with the same flags runs them again)",
            file=sys.stderr,
            flush=True,
        )
        return False
    for check in report.failed:
        log.warning("starting anyway: %s", check.line())
    return True


def _serve_metrics(cfg: NodeConfig, host: str, metrics: NodeMetrics) -> MetricsServer | None:
    """Start the node's /metrics server (unless off); the heartbeats tell its port."""
    if cfg.metrics_port is None:
        return None
    server = MetricsServer(host, cfg.metrics_port, cfg.node_key, metrics.registry)
    server.start()
    log.info("node %s serves its metrics on port %d", cfg.node_id, server.port)
    return server


def _serve_relay(cfg: NodeConfig, host: str, service: NodeService) -> RelayListener | None:
    """Start the relay port (unless off) and offer it to previous hops. A node reached
    through a forwarder (``advertise_port``) offers one only when told which
    (``relay_port`` not 0): only the port it advertises is known to be forwarded, and
    a port around the forwarder would bypass what it does to the links."""
    if cfg.relay_port is None or (cfg.relay_port == 0 and cfg.advertise_port is not None):
        return None
    listener = RelayListener(
        host,
        cfg.relay_port,
        service.check_relay_token,
        service.file_array,
        _MAX_RELAY_CONNECTIONS,
        head=service.answer_head,
        timeouts=cfg.relay_timeouts,
    )
    service.relay_port = listener.port
    print(f"meshnet node {cfg.node_id} takes relayed inputs on port {listener.port}", flush=True)
    return listener


def serve(cfg: NodeConfig) -> int:
    """Run the node until SIGTERM or SIGINT; returns the exit status (2: a check of its
    setup failed, see ``meshnet.node.preflight``)."""
    if not preflight(cfg):
        return 2
    settle()  # the allocator's policy (memory.py), before any thread starts
    threads = _start_threads(cfg.threads)
    metrics = NodeMetrics(cfg.node_id)
    engine = NodeEngine(cfg.engine, on_forward=metrics.forward)
    engine.start()
    model_path = cfg.model_path or str(bundled_model_path())
    source = cfg.source or source_config(cfg.node_id, progress=progress_wanted())
    models = NodeModels(cfg.tracker_url, cfg.node_id, cfg.node_key, source)
    listen_host = cfg.listen.rsplit(":", 1)[0].strip("[]")
    host = cfg.advertise_host or listen_host
    # Node-to-node KV moves go over this bulk port, and peers' reads of our shards: bound
    # before the first fetch, which a node fetching the same range may read as it goes.
    offers = KVOffers(listen_host, host, shards=models.serve_peer)
    models.bulk_address = offers.address
    if cfg.layers is not None:
        try:
            if is_reference(model_path):
                shard = models.shard(model_path, cfg.layers)
                engine.tiers.load(str(shard.path), cfg.layers, shard.fingerprint).result()
                models.serving(shard.path)
            else:
                engine.tiers.load(model_path, cfg.layers).result()
        except KVBudgetExhausted as e:  # --ctx past the budget: a setup error, said plainly
            print(f"meshnet node: {e}", file=sys.stderr)
            offers.close()
            engine.stop()
            return 2
    gate = NodeGate(cfg.node_key)
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=cfg.engine.max_streams + cfg.control_workers, thread_name_prefix="grpc"
        ),
        interceptors=[gate],
        options=[*MESSAGE_OPTIONS, *cfg.relay_timeouts.keepalive.server_options()],
    )
    start_dir = [] if is_reference(model_path) else [Path(model_path).parent]
    dirs = ModelDirs.of([*cfg.model_dirs, *start_dir])
    identity = NodeIdentity(cfg.node_id, model_path, dirs, models)
    service = NodeService(
        identity, engine, gate, offers, head_assist=cfg.head_assist, kv_pace=cfg.kv_pace
    )
    pb_grpc.add_NodeServicer_to_server(service, server)
    metrics.watch(service.stats)
    port = server.add_insecure_port(cfg.listen)
    if port == 0:
        raise MeshnetError(f"cannot listen on {cfg.listen}")
    server.start()
    address = f"{host}:{cfg.advertise_port or port}"
    log.info("node %s serving on %s with %d kernel threads", cfg.node_id, address, threads)
    print(f"meshnet node {cfg.node_id} listening on {address}", flush=True)
    scrape = _serve_metrics(cfg, listen_host, metrics)
    relay_port = _serve_relay(cfg, listen_host, service)
    announcer = Announcer(
        cfg.tracker_url,
        cfg.node_id,
        cfg.node_key,
        address,
        cfg.engine.backend,
        cfg.engine.kv_budget_bytes,
        service.stats,
        cfg.heartbeat_s,
        metrics_port=scrape.port if scrape is not None else None,
        holdings=models.holdings,
        memory_cap_bytes=cfg.memory_cap_bytes,
    )
    announcer.start()
    # What the node holds for its life (the shard, the tokenizer's vocabulary, the
    # server) out of the collector's reach: a full collection walked it all, a 70-80 ms
    # stall a few times a minute, in every node of a ring, on the thread it fell on.
    gc.freeze()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    announcer.stop()
    if scrape is not None:
        scrape.stop()
    server.stop(grace=1.0).wait()
    if relay_port is not None:
        relay_port.close()
    service.close()
    offers.close()
    engine.stop()
    return 0
