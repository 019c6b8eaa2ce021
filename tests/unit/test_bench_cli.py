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
