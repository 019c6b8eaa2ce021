"""Nodes on another host: a network namespace with its own stack, joined by a veth pair.

The tracker listens on the host side of the link; one node runs inside the
namespace and is reachable only through the link's address, so registration,
heartbeats and the gRPC data plane all cross a real network boundary. Needs
root (``ip netns``); skipped where the machine does not allow it.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.sampling import SamplingParams


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def other_host() -> Iterator[tuple[str, str, str]]:
    """(namespace, host-side address, namespace-side address) of a fresh veth link."""
    tag = f"mn{os.getpid() % 100000}"
    octet = 100 + os.getpid() % 150
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    try:
        _ip("netns", "add", tag)
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as e:
        pytest.skip(f"network namespaces are not available here: {e}")
    try:
        _ip("link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}n")
        _ip("link", "set", f"{tag}n", "netns", tag)
        _ip("addr", "add", f"{host_ip}/24", "dev", f"{tag}h")
        _ip("link", "set", f"{tag}h", "up")
        _ip("netns", "exec", tag, "ip", "addr", "add", f"{ns_ip}/24", "dev", f"{tag}n")
        _ip("netns", "exec", tag, "ip", "link", "set", f"{tag}n", "up")
        _ip("netns", "exec", tag, "ip", "link", "set", "lo", "up")
        yield tag, host_ip, ns_ip
    finally:
        subprocess.run(["ip", "link", "del", f"{tag}h"], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", tag], capture_output=True, timeout=10)


def test_a_node_on_another_host_registers_and_serves(
    other_host: tuple[str, str, str], tiny_path: Path, tiny: LocalModel, tmp_path: Path
) -> None:
    namespace, host_ip, ns_ip = other_host
    mesh = LocalMesh(data_dir=tmp_path, host=host_ip, model=str(tiny_path))
    try:
        mesh.start_tracker()
        mesh.start_node(
            "remote",
            LayerRange(0, 2),
            listen=f"{ns_ip}:0",
            prefix=["ip", "netns", "exec", namespace],
        )
        mesh.start_node("local", LayerRange(2, 4))
        mesh.wait_ready(expected_nodes=2, timeout_s=120)
        listed = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
        nodes = {n["node_id"]: n for n in listed}
        assert nodes["remote"]["address"].startswith(f"{ns_ip}:")
        r = httpx.post(
            f"{mesh.url}/v1/completions",
            headers=mesh.api_headers,
            timeout=60,
            json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert [h["node_id"] for h in r.json()["meshnet"]["route"]] == ["remote", "local"]
        alone = generate(tiny.chain, tiny.tokenizer, [5, 6, 7], SamplingParams(max_tokens=6))
        assert r.json()["meshnet"]["ids"] == alone.ids
    finally:
        mesh.stop()
