"""The checks of `meshnet doctor`: each broken setup fails its own check with its fix, and a
good one passes. The tracker is a mock transport here; tests/e2e/test_doctor.py runs them
against a real mesh."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf import GGMLQuantizationType as QT

from meshnet.auth.keys import new_secret, node_key
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf, sha256_file
from meshnet.model.layer_bytes import model_layer_bytes
from meshnet.model.spec import read_spec
from meshnet.node.engine import EngineConfig
from meshnet.node.node_config import NodeConfig
from meshnet.node.preflight import Report, Scope, Status, check_credential, check_node
from meshnet.node.preflight.host import check_memory, check_park_dir
from meshnet.node.preflight.model import ModelFacts, check_model
from meshnet.node.preflight.result import size

KEY = node_key(new_secret(), "n1")
WHOLE = LayerRange(0, 4)
Handler = Callable[[httpx.Request], httpx.Response]


def _tracker(model: str = "tiny", status: int = 400, **extra: Any) -> Handler:
    """A tracker's /healthz and heartbeat answers (the key check's 400 or 401)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/healthz":
            health = {"status": "ok", "model": model, "nodes_up": 2, **extra}
            return httpx.Response(200, json=health)
        return httpx.Response(status, json={"error": {}})

    return handle


def _cfg(model: Path, layers: LayerRange | None = WHOLE, **changes: Any) -> NodeConfig:
    base = NodeConfig(
        tracker_url="http://127.0.0.1:8000",
        listen="127.0.0.1:0",
        model_path=str(model),
        layers=layers,
        node_id="n1",
        node_key=KEY,
        advertise_host=None,
    )
    return replace(base, **changes)


def _run(cfg: NodeConfig, handler: Handler | None = None) -> Report:
    transport = httpx.MockTransport(handler or _tracker())
    return check_node(cfg, timeout_s=1.0, http=httpx.Client(transport=transport))


def _by_name(report: Report) -> dict[str, Any]:
    return {c.name: c for c in report.checks}


def _failed(report: Report) -> list[str]:
    return [c.name for c in report.failed]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something already listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield int(s.getsockname()[1])


def test_a_good_setup_passes_every_check(tiny_path: Path) -> None:
    report = _run(_cfg(tiny_path))
    assert report.failed == [], report.lines()
    checks = _by_name(report)
    assert checks["sha256"].detail == sha256_file(tiny_path)
    assert checks["tracker key"].status is Status.OK
    assert all(line.startswith("ok ") for line in report.lines())


def test_the_layers_check_reports_the_ranges_bytes_and_kv(tiny_path: Path) -> None:
    f = open_gguf(tiny_path)
    sizes = model_layer_bytes(f, read_spec(f))
    layers = LayerRange(0, 2)
    checks, facts = check_model(tiny_path, layers, "fast")
    held = sizes.range_bytes(layers)  # two blocks and the embedding
    assert facts is not None and facts.weight_bytes == held
    assert facts.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # 2 layers, K and V, 2 heads of 16
    detail = next(c.detail for c in checks if c.name == "layers")
    assert detail == f"[0, 2) of 4: {size(held)}, KV {size(facts.kv_bytes_per_token)} per token"
    _, numpy = check_model(tiny_path, layers, "numpy")  # dequantized: four bytes per weight
    assert numpy is not None and numpy.weight_bytes > held


def test_a_mixture_of_experts_names_its_experts() -> None:
    path = Path(__file__).parents[1] / "fixtures" / "quant" / "qwen3moe-q4km.gguf"
    checks, facts = check_model(path, LayerRange(0, 1), "fast")
    by_name = {c.name: c for c in checks}
    assert by_name["architecture"].detail == "qwen3moe, 2 layers, 6 experts (3 used)"
    assert by_name["tensors"].status is Status.OK and facts is not None


def test_the_memory_check_says_how_many_positions_the_kv_budget_holds(
    tmp_path: Path, tiny_path: Path
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4000 kB\nMemAvailable: 2048 kB\n")
    facts = ModelFacts(tiny_path, None, "", 1 << 20, 1024)  # type: ignore[arg-type]
    assert "KV 1.0 MiB (1024 positions)" in check_memory(facts, 1 << 20, str(meminfo)).detail


def test_an_empty_node_skips_the_model(tiny_path: Path) -> None:
    checks = _by_name(_run(_cfg(tiny_path, layers=None)))
    assert checks["model"].status is Status.SKIP
    assert checks["tracker model"].status is Status.SKIP
    assert checks["memory"].status is Status.OK


def test_a_missing_model_file(tmp_path: Path) -> None:
    report = _run(_cfg(tmp_path / "nothing.gguf"))
    (check,) = report.failed
    assert check.name == "model file" and "no such model file" in check.detail
    assert "--model" in check.fix and "fix: --model" in check.line()
    assert check.line().startswith("FAIL")
    assert report.blocking == [check]  # a node does not start with it


def test_an_unsupported_architecture(tiny_factory: Any) -> None:
    report = _run(_cfg(tiny_factory("mamba.gguf", architecture="mamba")))
    assert _failed(report) == ["architecture"]
    assert "'mamba' is not supported" in report.failed[0].detail


def test_an_unsupported_tensor_type_only_in_the_layers_that_hold_it(tiny_factory: Any) -> None:
    path = tiny_factory("iq.gguf", layer_types={1: QT.IQ4_NL})
    report = _run(_cfg(path, layers=LayerRange(0, 2)))
    assert _failed(report) == ["tensors"] and "IQ4_NL" in report.failed[0].detail
    assert _run(_cfg(path, layers=LayerRange(2, 4)), _tracker(model="iq")).failed == []


def test_the_fast_kernels_refuse_what_the_reference_reads(tiny_path: Path) -> None:
    checks, facts = check_model(tiny_path, LayerRange(0, 4), "numpy")
    assert facts is not None and not any(c.failed for c in checks)
    # The reference holds float32: four bytes a weight, more than the file's blocks.
    _, fast = check_model(tiny_path, LayerRange(0, 4), "fast")
    assert fast is not None and facts.weight_bytes > fast.weight_bytes


def test_a_layer_range_outside_the_model(tiny_path: Path) -> None:
    report = _run(_cfg(tiny_path, layers=LayerRange(2, 9)))
    assert _failed(report) == ["layers"]
    assert "0 <= START < END <= 4" in report.failed[0].fix
    assert _by_name(report)["tensors"].status is Status.SKIP


def test_a_listen_port_in_use(tiny_path: Path, busy_port: int) -> None:
    report = _run(_cfg(tiny_path, listen=f"127.0.0.1:{busy_port}"))
    assert _failed(report) == ["listen"]
    assert "Address already in use" in report.failed[0].detail
    assert _by_name(report)["advertise"].status is Status.SKIP


def test_a_listen_address_of_another_host_or_malformed(tiny_path: Path) -> None:
    assert _failed(_run(_cfg(tiny_path, listen="192.0.2.1:0"))) == ["listen"]
    assert _failed(_run(_cfg(tiny_path, listen="7000"))) == ["listen"]


def test_advertising_a_wildcard_or_loopback_to_a_remote_tracker(tiny_path: Path) -> None:
    wildcard = _run(_cfg(tiny_path, listen="0.0.0.0:0"))
    assert _failed(wildcard) == ["advertise"] and "dial 0.0.0.0:" in wildcard.failed[0].detail
    assert wildcard.blocking  # the tracker could never dial it
    remote = _run(_cfg(tiny_path, tracker_url="http://192.0.2.7:8000"))
    assert _failed(remote) == ["advertise"] and "on another host" in remote.failed[0].detail


def test_an_advertised_port_nobody_or_somebody_else_answers(
    tiny_path: Path, busy_port: int
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = int(closed.getsockname()[1])
    report = _run(_cfg(tiny_path, advertise_port=nobody))
    assert _failed(report) == ["advertise"] and "cannot connect" in report.failed[0].detail
    assert report.blocking == []  # a forward may come up later: the node starts
    other = _run(_cfg(tiny_path, advertise_port=busy_port))
    assert "does not lead to --listen" in other.failed[0].detail


def test_an_unreachable_tracker_is_a_peers_failure(tiny_path: Path) -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    report = _run(_cfg(tiny_path), down)
    assert _failed(report) == ["tracker"] and report.blocking == []
    checks = _by_name(report)
    assert checks["tracker model"].status is checks["tracker key"].status is Status.SKIP
    assert report.failed[0].scope is Scope.PEER


def test_a_tracker_serving_another_model(tiny_path: Path) -> None:
    report = _run(_cfg(tiny_path), _tracker(model="SmolLM2-135M-Instruct.Q4_1"))
    assert _failed(report) == ["tracker model"]
    assert "serves 'SmolLM2-135M-Instruct.Q4_1', this node 'tiny'" in report.failed[0].detail
    # Where /healthz names its sha256, that decides.
    same_name = _run(_cfg(tiny_path), _tracker(fingerprint="0" * 64))
    assert _failed(same_name) == ["tracker model"]
    assert _run(_cfg(tiny_path), _tracker(fingerprint=sha256_file(tiny_path))).failed == []


def test_a_key_the_tracker_refuses(tiny_path: Path) -> None:
    report = _run(_cfg(tiny_path), _tracker(status=401))
    assert _failed(report) == ["tracker key"]
    assert "meshnet credentials node-key n1" in report.failed[0].fix


def test_the_credential_and_where_it_came_from(tmp_path: Path) -> None:
    missing, key = check_credential("n1", None, None, {})
    assert missing.failed and key == "" and "needs its credential" in missing.detail
    (tmp_path / "secret").write_text(new_secret() + "\n")
    found, key = check_credential("n1", None, str(tmp_path / "secret"), {})
    assert not found.failed and key and "--mesh-secret-file" in found.detail


def test_memory_for_the_layers_and_the_kv_budget(tmp_path: Path, tiny_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 4000 kB\nMemAvailable: 2048 kB\n")
    facts = ModelFacts(tiny_path, None, "", 1 << 20)  # type: ignore[arg-type]
    assert check_memory(facts, 0, str(meminfo)).status is Status.OK  # 1 MiB of 2
    short = check_memory(facts, 2 << 20, str(meminfo))
    assert short.failed and "--kv-budget-mb" in short.fix
    assert check_memory(facts, 0, str(tmp_path / "none")).status is Status.SKIP


def test_disk_for_parked_kv(tmp_path: Path) -> None:
    assert check_park_dir(str(tmp_path / "new" / "dir"), 0).status is Status.OK  # made on use
    assert check_park_dir(str(tmp_path), 1 << 60).failed  # an exabyte of KV budget
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert check_park_dir(str(blocked / "dir"), 0).failed  # a file where a directory must go


def test_a_model_dir_that_is_not_a_directory(tiny_path: Path, tmp_path: Path) -> None:
    report = _run(_cfg(tiny_path, model_dirs=(str(tmp_path / "missing"),)))
    assert _failed(report) == ["model dirs"]


def test_kv_budget_counts_against_memory(tiny_path: Path) -> None:
    huge = EngineConfig(kv_budget_bytes=1 << 60)
    assert "memory" in _failed(_run(_cfg(tiny_path, engine=huge)))


def test_sizes_read_well() -> None:
    assert [size(n) for n in (12, 2048, 3 << 20, 5 << 30)] == [
        "12 B",
        "2.0 KiB",
        "3.0 MiB",
        "5.0 GiB",
    ]


def test_lines_are_one_per_check_with_the_fix(tiny_path: Path) -> None:
    report = _run(_cfg(tiny_path, layers=LayerRange(0, 9)))
    line = next(line for line in report.lines() if line.startswith("FAIL"))
    assert "\n" not in line and "; fix: --layers" in line
    json.dumps(report.lines())  # plain strings
