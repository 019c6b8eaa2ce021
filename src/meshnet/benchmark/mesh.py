"""Per-token decode latency through a local mesh against single-process decode, same run.

Both sides decode the same greedy continuation of the same prompt. The mesh
figure is the mean gap between streamed tokens as the client sees them (SSE
over HTTP, three gRPC hops, sampling in the tracker); the single-process
figure is the engine's own decode time per token. Optionally llama.cpp's RPC
layer split over two local ``ggml-rpc-server`` processes decodes the same
model for comparison.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet.backends.kernel_threads import set_threads
from meshnet.benchmark.delay_proxy import DelayProxy
from meshnet.benchmark.running_mesh import served_model
from meshnet.engine.generate import generate
from meshnet.engine.local import load_local_model
from meshnet.errors import MeshnetError
from meshnet.layer_range import split_evenly
from meshnet.local_mesh import LocalMesh, free_ports
from meshnet.model.sampling import SamplingParams

PROMPT = "The three primary colors are"


@dataclass(frozen=True)
class MeshLatency:
    single_ms: float  # median per decoded token, in this process
    mesh_ms: float  # median per streamed token, through the mesh
    tokens: int  # decoded tokens per run
    nodes: int
    rounds: int
    threads: int

    @property
    def ratio(self) -> float:
        return self.mesh_ms / self.single_ms


def measure(
    model: str | None, nodes: int, max_tokens: int, rounds: int = 3, threads: int = 1
) -> MeshLatency:
    """Alternate single-process and mesh runs so both see the same machine conditions.

    Both sides get ``threads`` kernel threads per process.
    """
    set_threads(threads)
    local = load_local_model(model)
    ids = local.tokenizer.encode(PROMPT)
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-") as tmp:
        mesh = LocalMesh(
            data_dir=Path(tmp),
            model=model,
            extra_env={"NUMBA_NUM_THREADS": str(threads)},
            node_args=["--threads", str(threads)],
        )
        try:
            mesh.start(list(split_evenly(local.spec.n_layers, nodes)))
            name = served_model(mesh)
            _stream_times(mesh, name, 4)  # warm every hop
            single: list[float] = []
            meshed: list[float] = []
            for _ in range(rounds):
                g = generate(
                    local.chain, local.tokenizer, ids, SamplingParams(max_tokens=max_tokens)
                )
                single.append(g.decode_s * 1000 / (len(g.ids) - 1))
                times = _stream_times(mesh, name, max_tokens)
                meshed.append((times[-1] - times[0]) * 1000 / (len(times) - 1))
        finally:
            mesh.stop()
    return MeshLatency(
        statistics.median(single),
        statistics.median(meshed),
        max_tokens - 1,
        nodes,
        rounds,
        threads,
    )


def _stream_times(mesh: LocalMesh, model: str, max_tokens: int) -> list[float]:
    """Arrival time of each streamed token of a greedy completion."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    times: list[float] = []
    url, headers = f"{mesh.url}/v1/completions", mesh.api_headers
    with httpx.stream("POST", url, json=body, headers=headers, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            choices = chunk.get("choices") or [{}]
            if "ids" in chunk.get("meshnet", {}) and choices[0].get("finish_reason") is None:
                times.append(time.perf_counter())  # one chunk per generated token
    return times


def stream_decode_tok_s(mesh: LocalMesh, model: str, max_tokens: int) -> float:
    """Decode tok/s of one greedy completion through the mesh, as the client sees the tokens
    arrive (the first token, which carries the prefill, is the start mark)."""
    times = _stream_times(mesh, model, max_tokens)
    if len(times) < 2:
        raise MeshnetError(f"the mesh streamed {len(times)} tokens; decode needs at least 2")
    return (len(times) - 1) / (times[-1] - times[0])


def llamacpp_rpc_tok_s(
    bin_dir: Path,
    model: Path,
    servers: int,
    tokens: int,
    repetitions: int = 3,
    threads: int = 1,
    env: dict[str, str] | None = None,
    delay_ms: float = 0.0,
) -> float:
    """Decode tok/s of llama.cpp with its layers split over ``servers`` local RPC servers
    of ``threads`` threads each, the mean of ``repetitions`` runs of llama-bench. With
    ``delay_ms``, llama-bench reaches each server through a delay proxy holding every
    byte that long each way (benchmark/delay_proxy.py), as over a network link."""
    ports = free_ports(servers)
    procs = [
        subprocess.Popen(
            [str(bin_dir / "ggml-rpc-server"), "-p", str(p), "-t", str(threads)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        for p in ports
    ]
    proxy = None
    try:
        time.sleep(1.0)
        if delay_ms > 0:
            fronts = free_ports(len(ports))
            proxy = DelayProxy(list(zip(fronts, ports, strict=True)))
            proxy.set_delay(delay_ms)
            ports = fronts
        rpc = ",".join(f"127.0.0.1:{p}" for p in ports)
        out = subprocess.run(
            [
                str(bin_dir / "llama-bench"),
                "-m",
                str(model),
                "-rpc",
                rpc,
                "-ngl",
                "99",
                "-p",
                "0",
                "-n",
                str(tokens),
                "-r",
                str(repetitions),
                "-o",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
            env={**os.environ, **(env or {})},
        ).stdout
        return float(json.loads(out)[0]["avg_ts"])
    finally:
        if proxy is not None:
            proxy.close()
        for p in procs:
            p.terminate()
            p.wait(timeout=10)
