"""llama.cpp's ``llama-server`` as the serving peer, started and stopped by a benchmark.

It runs in its default serving configuration apart from what the comparison
fixes: the GGUF, the threads, the slots (``-np``) and a context large enough
for every slot. Its defaults are kept on purpose, as meshnet's node keeps its
own: KV cache in f16, flash attention ``auto``, continuous batching, the
prompt cache. Each side is measured as its users would run it.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from meshnet.errors import MeshnetError
from meshnet.local_mesh import free_port


def server_argv(
    bin_dir: Path, model: Path, port: int, threads: int, slots: int, slot_ctx: int
) -> list[str]:
    """The command line: ``slots`` slots of ``slot_ctx`` positions each, ``threads``
    threads for decode and prompt alike."""
    return [
        str(bin_dir / "llama-server"),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-np",
        str(slots),
        "-c",
        str(slots * slot_ctx),  # the server gives each slot an equal share
    ]


@contextlib.contextmanager
def llama_server(
    bin_dir: Path,
    model: Path,
    threads: int,
    slots: int,
    slot_ctx: int,
    log: Path,
    ready_timeout_s: float = 120.0,
) -> Iterator[str]:
    """A running llama-server for the block's duration; yields its base URL. The
    process is stopped (and killed if it lingers) however the block ends."""
    if not (bin_dir / "llama-server").is_file():
        raise MeshnetError(f"no llama-server in {bin_dir} (run bench/build_llamacpp.sh)")
    port = free_port()
    argv = server_argv(bin_dir, model, port, threads, slots, slot_ctx)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc, ready_timeout_s, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise MeshnetError(
                f"llama-server exited with {proc.returncode}: {log.read_text()[-2000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.2)
    raise MeshnetError(f"llama-server not healthy after {timeout_s:.0f}s")
