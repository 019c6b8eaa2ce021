"""The operator commands' pieces: tables, where the admin token comes from, the admin
client's errors (a mock transport), and `meshnet --version`."""

from __future__ import annotations

import argparse
from importlib import metadata
from pathlib import Path

import httpx
import pytest

from meshnet.auth.credentials import ensure_user_credentials
from meshnet.cli.main import main
from meshnet.cli.mesh_admin import ADMIN_TOKEN_ENV, admin_token
from meshnet.cli.table import age, render, size
from meshnet.client import AdminClient
from meshnet.errors import MeshnetError, Unauthenticated


def test_a_table_pads_columns_and_right_aligns_numbers() -> None:
    rows = [["a", 10, 1.5, None], ["bbb", 2000, None, "x"]]
    table = render(["NODE", "KV", "TOK/S", "NOTE"], rows)
    assert table.splitlines() == [
        "NODE    KV  TOK/S  NOTE",
        "a       10    1.5  -",
        "bbb   2000      -  x",
    ]
    assert render(["A", "B"], []).splitlines() == ["A  B", "(none)"]


def test_sizes_and_ages() -> None:
    assert [size(None), size(0), size(3 << 20)] == [None, "0 B", "3.0 MiB"]
    assert [age(None), age(0.25), age(42), age(600), age(7200), age(3 * 86400)] == [
        None,
        "0.2s",
        "42s",
        "10m",
        "2h",
        "3d",
    ]


def _args(tmp_path: Path, token: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(admin_token=token, data_dir=tmp_path)


def test_the_admin_token_from_the_flag_the_environment_or_the_data_dir(tmp_path: Path) -> None:
    assert admin_token(_args(tmp_path, "ma_flag"), {ADMIN_TOKEN_ENV: "ma_env"}) == "ma_flag"
    assert admin_token(_args(tmp_path), {ADMIN_TOKEN_ENV: "ma_env"}) == "ma_env"
    with pytest.raises(Unauthenticated, match="needs the admin token"):
        admin_token(_args(tmp_path), {})
    made = ensure_user_credentials(tmp_path)
    assert admin_token(_args(tmp_path), {}) == made.admin_token


def _client(status: int, body: object) -> AdminClient:
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.headers["authorization"] == "Bearer ma_t"
        return httpx.Response(status, json=body)

    return AdminClient("http://tracker", "ma_t", transport=httpx.MockTransport(answer))


def test_the_admin_client_says_what_went_wrong() -> None:
    assert _client(200, {"nodes": []}).get("/admin/nodes") == {"nodes": []}
    with pytest.raises(Unauthenticated, match="refused the admin token"):
        _client(401, {"error": {"message": "no"}}).get("/admin/nodes")
    with pytest.raises(MeshnetError, match="HTTP 503: the database is down"):
        _client(503, {"error": {"message": "the database is down"}}).get("/admin/nodes")
    with pytest.raises(MeshnetError, match="not an object"):
        _client(200, [1, 2]).get("/admin/nodes")

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    client = AdminClient("http://tracker", "ma_t", transport=httpx.MockTransport(down))
    with pytest.raises(MeshnetError, match="cannot reach the tracker at http://tracker"):
        client.get("/admin/nodes")


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshnet {metadata.version('meshnet')}"
