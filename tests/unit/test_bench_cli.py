"""`meshnet bench`: rounds on our side alone (no peer) on the tiny model, the best
of each figure over rounds, and the vector extensions the peer was built with."""

import json
from pathlib import Path

import pytest

from meshnet.benchmark.figures import Throughput
from meshnet.benchmark.llamacpp import peer_isa
from meshnet.cli.main import main


def test_each_figure_is_its_fastest_round() -> None:
    rounds = [Throughput(100.0, {1: 9.0, 8: 40.0}), Throughput(80.0, {1: 11.0, 8: 35.0})]
    assert Throughput.best(rounds) == Throughput(100.0, {1: 11.0, 8: 40.0})
    deep = [Throughput(1.0, {}, 7.0), Throughput(1.0, {}, None), Throughput(1.0, {}, 8.0)]
    assert Throughput.best(deep).deep_decode_tok_s == 8.0


def test_decode_at_depth_continues_the_timed_prompt(tiny_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["bench", "--model", str(tiny_path), "--no-peer", "--json", "--rounds", "1"]
    argv += ["--prompt-tokens", "40", "--decode-tokens", "3", "--batches", "1", "--at-depth"]
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["figure"] for r in rows] == [
        "prefill 40 tok/s",
        "decode b=1 tok/s",
        "decode @40 tok/s",
    ]
    assert rows[-1]["meshnet"] > 0


def test_bench_without_a_peer_prints_every_figure(tiny_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["bench", "--model", str(tiny_path), "--no-peer", "--json", "--rounds", "2"]
    argv += ["--prompt-tokens", "12", "--decode-tokens", "3", "--batches", "1,3"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["figure"] for r in out["rows"]] == [
        "prefill 12 tok/s",
        "decode b=1 tok/s",
        "decode b=3 tok/s",
    ]
    for row in out["rows"]:
        assert row["meshnet"] > 0 and row["llamacpp"] is None and row["ratio"] is None


@pytest.mark.parametrize("rounds", ["0", "-1", "two"])
def test_rounds_must_be_a_positive_count(tiny_path: Path, capsys, rounds: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--model", str(tiny_path), "--no-peer", "--rounds", rounds])
    assert exit_.value.code == 2
    assert "--rounds" in capsys.readouterr().err


def test_the_peers_extensions_are_read_from_its_build_record(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    assert peer_isa(tmp_path / "bin") is None  # built before the record existed
    record = "llama-cpp-python 0.3.36 -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON "
    record += "-DGGML_AVX512_VNNI=ON -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF\n"
    (tmp_path / "build-flags").write_text(record)
    assert peer_isa(tmp_path / "bin") == ["AVX2", "AVX512", "AVX512_VNNI"]


def _fake_build(home: Path, record: str) -> None:
    (home / "bin").mkdir(parents=True)
    for name in ("llama-bench", "llama-batched-bench"):
        (home / "bin" / name).write_text("")
    (home / "build-flags").write_text(record)


def test_avx2_kernels_race_the_avx2_only_peer(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from meshnet.benchmark import llamacpp

    _fake_build(tmp_path / "host", "host")
    _fake_build(tmp_path / "avx2", "avx2")
    monkeypatch.setattr(llamacpp, "DEFAULT_HOME", tmp_path / "host")
    monkeypatch.setattr(llamacpp, "AVX2_HOME", tmp_path / "avx2")
    monkeypatch.delenv("LLAMACPP_HOME", raising=False)
    monkeypatch.delenv("MESHNET_ISA", raising=False)
    assert llamacpp.find_llamacpp() == tmp_path / "host" / "bin"
    monkeypatch.setenv("MESHNET_ISA", "avx2")
    assert llamacpp.find_llamacpp() == tmp_path / "avx2" / "bin"
    assert llamacpp.find_llamacpp(str(tmp_path / "host" / "bin")) == tmp_path / "host" / "bin"


def test_the_avx2_peer_is_built_without_the_hosts_avx512(tmp_path: Path) -> None:
    """On an AVX-512 + VNNI host, LLAMACPP_ISA=avx2 chooses the options of an AVX2-only
    CPU: the script finds a build with exactly those and builds nothing."""
    import subprocess

    cpuinfo = tmp_path / "cpuinfo"
    flags = "sse4_2 avx avx2 fma f16c bmi2 avx_vnni avx512f avx512cd avx512vl avx512dq "
    cpuinfo.write_text(f"flags\t\t: {flags}avx512bw avx512vbmi avx512_vnni avx512_bf16\n")
    avx2 = "-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    avx2 += "-DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF "
    avx2 += "-DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
    amx = "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    record = f"llama-cpp-python 0.3.36 -DGGML_NATIVE=OFF {avx2} {amx}\n"
    home = tmp_path / "peer"
    _fake_build(home, record)
    tools = ["llama-server", "ggml-rpc-server", "llama-cli", "llama-quantize", "llama-tokenize"]
    for name in tools:
        (home / "bin" / name).write_text("")
    for name in [*tools, "llama-bench", "llama-batched-bench"]:
        (home / "bin" / name).chmod(0o755)
    script = Path(__file__).parents[2] / "bench" / "build_llamacpp.sh"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CPUINFO": str(cpuinfo)}
    env |= {"LLAMACPP_HOME": str(home), "PYTHON": "false"}  # a rebuild would fail at once
    done = subprocess.run(
        ["bash", str(script)], env={**env, "LLAMACPP_ISA": "avx2"}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "already built" in done.stdout
    host = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert host.returncode != 0  # the host's options differ: it would rebuild
    assert "-DGGML_AVX512=ON" in host.stdout


def test_the_peers_kv_cache_type_is_the_one_asked_for(tmp_path: Path) -> None:
    """llama-bench runs with the KV cache type the race asks for (``--peer-kv``): f16,
    its own default and q8-kv16's, or f32, the other backends'."""
    from meshnet.benchmark.llamacpp import bench_llamacpp

    (tmp_path / "bin").mkdir()
    seen = tmp_path / "argv"
    rows = [
        {"n_prompt": 16, "n_gen": 0, "avg_ts": 100.0},
        {"n_prompt": 0, "n_gen": 4, "avg_ts": 9.0},
    ]
    fake = tmp_path / "bin" / "llama-bench"
    fake.write_text(
        f"#!/bin/sh\necho \"$@\" >> {seen}\necho '{json.dumps(rows)}'\n", encoding="utf-8"
    )
    fake.chmod(0o755)
    for cache in ("f32", "f16"):
        got = bench_llamacpp(tmp_path / "bin", tmp_path / "m.gguf", 16, 4, [1], 2, kv_cache=cache)
        assert (got.prefill_tok_s, got.decode_tok_s) == (100.0, {1: 9.0})
    runs = seen.read_text().splitlines()
    assert [r.split("-ctk ")[1].split()[:3] for r in runs] == [
        ["f32", "-ctv", "f32"],
        ["f16", "-ctv", "f16"],
    ]
