"""Flags declared once and shared between commands.

``meshnet node`` and ``meshnet up`` take the same node options, ``meshnet
tracker`` and ``meshnet up`` the same tracker options. Each set is one
``declare_*`` function that adds its flags to a parser (or argument group) and
returns their actions. ``meshnet up`` adds them with ``given_only=True``: a flag
left out is then absent from the parsed namespace, so ``given_argv`` writes back
exactly the flags the user gave, and every child process keeps its own defaults
for the rest.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection

from meshnet.auth.credentials import MESH_SECRET_ENV, NODE_KEY_ENV
from meshnet.backends.shard import BACKENDS, DEFAULT_BACKEND
from meshnet.kv.pace import MB, TransferPace
from meshnet.layer_range import LayerRange
from meshnet.mesh_reports import check_node_id

# Anything argparse can add arguments to: a parser or one of its groups.
ArgumentTarget = argparse.ArgumentParser | argparse._ArgumentGroup
Declare = Callable[[ArgumentTarget], list[argparse.Action]]


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def replica_count(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration(text: str) -> float:
    """An argparse type: seconds, as a number (``90``, ``1.5``) or with a unit
    suffix ``s``, ``m``, ``h`` or ``d`` (``30m``, ``7d``); never negative."""
    number, scale = text.strip(), 1.0
    if number[-1:].lower() in _UNITS:
        number, scale = number[:-1], _UNITS[number[-1].lower()]
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90, 30m, 7d)") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite duration of at least 0: {text!r}")
    return value


def node_id(text: str) -> str:
    """An argparse type: a node id, as nodes name themselves."""
    try:
        return check_node_id(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_duration(text: str) -> float:
    """An argparse type: a ``duration`` above 0."""
    value = duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be longer than 0: {text!r}")
    return value


def declare_node_setup(p: ArgumentTarget) -> list[argparse.Action]:
    """What one node is and where it stands: its tracker, addresses, model, layers,
    identity and directories. Taken by ``meshnet node`` and ``meshnet doctor`` (not by
    ``meshnet up``, which sets these for each of its nodes)."""
    layers = p.add_mutually_exclusive_group(required=True)
    return [
        p.add_argument("--tracker", required=True, help="tracker URL, e.g. http://127.0.0.1:8000"),
        p.add_argument("--listen", default="127.0.0.1:0", help="gRPC HOST:PORT (port 0: any free)"),
        p.add_argument(
            "--advertise-host", help="host the tracker should dial (default: listen host)"
        ),
        p.add_argument(
            "--advertise-port",
            type=int,
            help="port the tracker should dial (behind NAT or a proxy)",
        ),
        p.add_argument(
            "--model",
            help="GGUF file, or hf:ORG/REPO[:QUANT], hf:ORG/REPO/FILE, an https:// URL: "
            "only the tensors of --layers are fetched (default: the bundled model)",
        ),
        layers.add_argument("--layers", type=LayerRange.parse, help="START:END, half-open"),
        layers.add_argument(
            "--empty", action="store_true", help="load nothing; wait for Configure"
        ),
        p.add_argument("--node-id", default=None, help="name on the mesh (default: random)"),
        p.add_argument("--park-dir", help="where parked KV is kept (default: a temp directory)"),
        p.add_argument(
            "--model-dir",
            action="append",
            default=[],
            help="a directory the tracker may load models from (repeatable; --model's is included)",
        ),
        p.add_argument(
            "--model-cache",
            help="where models given by reference are fetched to and served to peers from "
            "(default: $MESHNET_CACHE, else ~/.cache/meshnet)",
        ),
        p.add_argument(
            "--node-key-file",
            help=f"this node's credential (or ${NODE_KEY_ENV}; `meshnet credentials node-key`)",
        ),
        p.add_argument(
            "--mesh-secret-file",
            help=f"derive the credential from the mesh secret (or ${MESH_SECRET_ENV})",
        ),
    ]


BACKEND_HELP = (
    f"numerics (default {DEFAULT_BACKEND}): q8 multiplies 8-bit activations as llama.cpp "
    "does, fast keeps float32 activations, q8-kv16 is q8 with a float16 KV cache (half "
    "the memory, as llama.cpp's default cache; all three bit-exact however a sequence "
    "is batched or split), numpy is the float32 reference"
)


def declare_node_options(p: ArgumentTarget) -> list[argparse.Action]:
    """How a node runs, whatever layers it serves: backend, threads, limits, heartbeat."""
    return [
        p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS, help=BACKEND_HELP),
        p.add_argument(
            "--threads",
            type=positive_int,
            default=None,
            help="kernel threads in this process (default: every core available to it, "
            "os.sched_getaffinity; `meshnet up` splits them among its nodes)",
        ),
        p.add_argument("--kv-budget-mb", type=float, default=0.0, help="KV budget; 0 = unlimited"),
        p.add_argument(
            "--memory-mb",
            type=float,
            default=0.0,
            help="memory this node process may take in all; what it leaves is offered for "
            "more layers when a peer dies (placement widens a node only where they fit); "
            "0 = what the host has available",
        ),
        p.add_argument(
            "--ctx",
            type=int,
            default=0,
            help="positions a sequence may reach on this node (at most the model's trained "
            "context; checked against --kv-budget-mb at load); 0 = the trained context",
        ),
        p.add_argument(
            "--prefix-cache-mb",
            type=float,
            default=256.0,
            help="KV of prompt prefixes kept for reuse by later requests, within the KV "
            "budget (sessions' KV comes first); 0 turns the prefix cache off",
        ),
        p.add_argument("--max-batch-tokens", type=int, default=512, help="rows per forward"),
        p.add_argument("--prefill-chunk", type=int, default=128, help="prompt rows per forward"),
        p.add_argument("--max-queued-steps", type=int, default=256),
        p.add_argument(
            "--max-streams",
            type=positive_int,
            default=64,
            help="generations this node serves at once; more are refused (429)",
        ),
        p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between heartbeats"),
        p.add_argument(
            "--drain-timeout",
            type=positive_duration,
            default=60.0,
            help="seconds a T2/T3 configure waits for the node to drain; then it is "
            "withdrawn and nothing changes",
        ),
        p.add_argument(
            "--metrics-port",
            type=_port_or_off,
            default=0,
            help="port of the node's /metrics on the listen host, the tracker's signature "
            "only (0: any free one; off: none)",
        ),
        p.add_argument(
            "--relay-port",
            type=_port_or_off,
            default=0,
            help="TCP port on the listen host where previous hops of a ring relay inputs, "
            "offered to them in their relay streams' answers (0: any free one, none "
            "with --advertise-port; off: none, inputs come over gRPC)",
        ),
        p.add_argument(
            "--relay-idle-timeout",
            type=positive_duration,
            default=300.0,
            help="seconds a relay-port connection may send nothing before it is closed",
        ),
        p.add_argument(
            "--relay-frame-timeout",
            type=positive_duration,
            default=10.0,
            help="seconds a relay-port frame, once begun, may take to arrive whole (and a "
            "peer to take an answer) before its connection is cut",
        ),
        p.add_argument(
            "--keepalive",
            type=positive_duration,
            default=20.0,
            help="seconds of silence after which a peer's gRPC connection is pinged and its "
            "relay connection probed; one that does not answer within half as long again "
            "is closed, freeing what it held",
        ),
        p.add_argument(
            "--head-assist",
            choices=("on", "off"),
            default="off",
            help="as a ring's last hop, have its first hop multiply part of a tied head "
            "over its relay port, trusting its answers (on: nodes of one operator, as "
            "`meshnet up`'s; default off)",
        ),
    ]


def positive_float(text: str) -> float:
    """An argparse type: a number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {value}")
    return value


def declare_kv_pace(p: ArgumentTarget) -> list[argparse.Action]:
    """How long a KV transfer may take (kv/pace.py), taken by nodes and the tracker."""
    return [
        p.add_argument(
            "--kv-transfer-base",
            type=positive_duration,
            default=30.0,
            help="seconds any KV transfer may take whatever its size",
        ),
        p.add_argument(
            "--kv-transfer-rate",
            type=positive_float,
            default=1.0,
            help="MiB/s a KV transfer must keep up beyond that: its limit is the base plus "
            "its bytes at this rate, and a slower peer is cut",
        ),
    ]


def kv_pace(args: argparse.Namespace) -> TransferPace:
    return TransferPace(args.kv_transfer_base, args.kv_transfer_rate * MB)


def _port_or_off(text: str) -> int | None:
    """A TCP port (0: any free one), or None for "off"."""
    if text == "off":
        return None
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError("a port is 0 to 65535, or off")
    return port


def declare_tracker_options(p: ArgumentTarget) -> list[argparse.Action]:
    """How the tracker routes, times out, recovers and parks; not where it listens."""
    return [
        p.add_argument(
            "--database",
            help="postgresql://... to share state with other trackers "
            "(default: DATA_DIR/tracker.db)",
        ),
        p.add_argument(
            "--heartbeat-timeout",
            type=float,
            default=3.0,
            help="seconds of silence before a node is marked down",
        ),
        p.add_argument("--step-timeout", type=float, default=30.0, help="seconds per shard step"),
        p.add_argument(
            "--generation-timeout",
            type=float,
            default=600.0,
            help="seconds one generation may run",
        ),
        p.add_argument("--max-recoveries", type=int, default=8, help="failovers per generation"),
        p.add_argument(
            "--route-wait",
            type=float,
            default=15.0,
            help="seconds a failover waits for a failed range to be served again (a node "
            "restarting, a heal) before its generation fails, and a new request for a "
            "complete route before its 503",
        ),
        p.add_argument(
            "--replicas",
            type=replica_count,
            default=1,
            help="nodes kept on every layer range: empty nodes are told to load what is short "
            "(0: only a failing generation heals)",
        ),
        p.add_argument(
            "--placement-lease",
            type=duration,
            default="10s",
            help="of the trackers on one database, only the holder of a lease this long, "
            "renewed every third of it, runs placement; another takes it over when it "
            "expires (0: every tracker places on its own)",
        ),
        p.add_argument(
            "--verify-rate",
            type=float,
            default=0.0,
            help="share of every node's committed chunks of 32 tokens the tracker re-runs on "
            "its own engine (0 to 1; 0: off); above 0 nodes also calibrate before they are "
            "routed, and a mismatch quarantines the node (docs/verification.md)",
        ),
        p.add_argument(
            "--trusted-node",
            action="append",
            type=node_id,
            metavar="NODE_ID",
            help="a node the tracker trusts (repeatable): it is not calibrated, its work is "
            "never checked and is billable at once, and with --verify-rate above 0 checks of "
            "other nodes run on chains of trusted nodes whose ranges fit, before the "
            'tracker\'s own engine (docs/verification.md, "Trusted nodes")',
        ),
        p.add_argument(
            "--no-relay",
            dest="relay",
            action="store_false",
            help="carry every hop's activations through the tracker instead of node to node",
        ),
        p.add_argument(
            "--no-autorun",
            dest="autorun",
            action="store_false",
            help="drive every decode step instead of letting the route's hops run ahead "
            "(one node by itself, several round a ring)",
        ),
        p.add_argument(
            "--no-prefix-routing",
            dest="prefix_routing",
            action="store_false",
            help="route by load alone, not to the nodes holding a prompt's cached prefix",
        ),
        p.add_argument(
            "--prefix-load-tokens",
            type=positive_int,
            default=256,
            help="prompt tokens one generation in flight on a route's nodes is worth when a "
            "cached prefix is weighed against load (higher: load counts more)",
        ),
        p.add_argument("--max-in-flight", type=int, default=64, help="generations at once"),
        p.add_argument(
            "--max-queued",
            type=int,
            default=256,
            help="requests that wait for capacity; more get 429 at once",
        ),
        p.add_argument(
            "--queue-wait",
            type=float,
            default=1.0,
            help="seconds a request waits for capacity before its 429",
        ),
        p.add_argument("--park-after", type=float, default=300.0, help="idle seconds; 0: never"),
        p.add_argument(
            "--evict-after", type=float, default=1800.0, help="parked seconds; 0: never"
        ),
        p.add_argument(
            "--kv-pressure", type=float, default=0.9, help="share of a node's KV budget that parks"
        ),
        p.add_argument("--policy-interval", type=float, default=5.0, help="seconds between passes"),
        p.add_argument(
            "--turn-lease", type=float, default=15.0, help="seconds a claimed turn is held"
        ),
        p.add_argument(
            "--turn-attempts", type=int, default=6, help="deliveries before a turn fails"
        ),
        p.add_argument(
            "--turn-max-wait",
            type=duration,
            default=120.0,
            help="how long a turn waits out a mesh that cannot take it (no route, no capacity, "
            "no database) before it fails",
        ),
        # Retention (durations: seconds, or with s/m/h/d; 0 keeps forever).
        p.add_argument(
            "--keep-sessions",
            type=duration,
            default="7d",
            help="how long an ended session and its turns are kept after it ended",
        ),
        p.add_argument(
            "--keep-ledger", type=duration, default="30d", help="how long a ledger row is kept"
        ),
        p.add_argument(
            "--keep-dead-nodes",
            type=duration,
            default="1d",
            help="how long a node that is down stays in the registry",
        ),
        p.add_argument(
            "--keep-orphans",
            type=duration,
            default="1h",
            help="how long a snapshot no live session needs is kept",
        ),
        p.add_argument(
            "--retention-interval",
            type=positive_duration,
            default="1m",
            help="time between retention passes",
        ),
    ]


def add_options(
    parser: argparse.ArgumentParser,
    declare: Declare,
    title: str,
    description: str | None = None,
    *,
    given_only: bool = False,
) -> None:
    """Add one shared set of flags to ``parser`` as a titled group.

    With ``given_only`` the flags have no defaults of their own: one the user
    leaves out does not appear in the namespace (see ``given_argv``).
    """
    actions = declare(parser.add_argument_group(title, description))
    if given_only:
        for action in actions:
            action.default = argparse.SUPPRESS


def given_argv(declare: Declare, args: argparse.Namespace, skip: Collection[str] = ()) -> list[str]:
    """The command-line words of the flags of ``declare`` present in ``args``.

    ``args`` comes from a parser that added ``declare`` with ``given_only``, so
    present means given. ``skip`` names destinations the caller passes on its own.
    """
    given = vars(args)
    argv: list[str] = []
    for action in declare(argparse.ArgumentParser(add_help=False)):
        if action.dest not in given or action.dest in skip:
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false: the flag itself is the value
            argv.append(flag)
        elif isinstance(given[action.dest], list):  # a repeatable flag: once per value
            for value in given[action.dest]:
                argv += [flag, str(value)]
        else:
            argv += [flag, str(given[action.dest])]
    return argv
