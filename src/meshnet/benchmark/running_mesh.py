"""A ``LocalMesh`` held open for a benchmark: started with the kernel threads the
benchmark gives each node, and always stopped."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from meshnet import client
from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh


def mesh_for(
    data_dir: Path,
    model: Path,
    threads: int,
    relay: bool = True,
    host: str = "127.0.0.1",
    backend: str = DEFAULT_BACKEND,
    node_args: Sequence[str] = (),
    tracker_args: Sequence[str] = (),
) -> LocalMesh:
    """A mesh (not started) whose nodes run ``threads`` kernel threads each, on
    ``backend``.

    ``NUMBA_NUM_THREADS`` caps the pool ``--threads`` sizes (``LocalMesh`` sets it
    to 1); BLAS stays at one thread, as ``LocalMesh`` sets it: the node's decode
    kernels do not call BLAS, and an idle pool would only add threads.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    return LocalMesh(
        data_dir=data_dir,
        host=host,
        model=str(model),
        extra_env={"NUMBA_NUM_THREADS": str(threads)},
        tracker_args=[*([] if relay else ["--no-relay"]), *tracker_args],
        node_args=["--threads", str(threads), "--backend", backend, *node_args],
    )


@contextlib.contextmanager
def running_mesh(
    data_dir: Path,
    model: Path,
    layout: Sequence[LayerRange | None],
    threads: int,
    relay: bool = True,
    backend: str = DEFAULT_BACKEND,
    node_args: Sequence[str] = (),
    tracker_args: Sequence[str] = (),
) -> Iterator[LocalMesh]:
    """A started loopback mesh for the block's duration; every process is stopped
    however the block ends."""
    mesh = mesh_for(
        data_dir,
        model,
        threads,
        relay,
        backend=backend,
        node_args=node_args,
        tracker_args=tracker_args,
    )
    try:
        mesh.start(layout)
        yield mesh
    finally:
        mesh.stop()


def served_model(mesh: LocalMesh) -> str:
    """The name the mesh serves its model under (requests must name it)."""
    return client.served_model(mesh.url, mesh.credentials.api_key)
