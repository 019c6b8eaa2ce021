"""The dashboard in a real headless browser: Chromium (Debian's package, installed by
scripts/install_chromium.sh) driven over the DevTools protocol on a pipe, against a
running 3-node mesh. It draws the topology, takes the token from the URL fragment and
wipes it, refuses a wrong token, and shows a node killed as down within seconds,
without a reload.

Set ``MESHNET_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to keep the screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NO_ROOM, MeshFactory

from meshnet.local_mesh import LocalMesh

ROOT = Path(__file__).resolve().parents[2]
CDP_TIMEOUT_S = 30.0


def _browser() -> str:
    """Chromium's path, installing it first when it is missing; skip if that fails."""
    script = ROOT / "scripts" / "install_chromium.sh"
    try:
        done = subprocess.run(
            ["bash", str(script)], capture_output=True, text=True, timeout=600, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.skip("installing Chromium took more than 10 minutes")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).exists():
        pytest.skip(f"Chromium could not be installed: {done.stderr.strip()[-500:]}")
    return lines[-1]


class Browser:
    """A headless Chromium and one page, over the DevTools protocol on a pipe (fd 3 in,
    fd 4 out, messages ending in NUL): no port, no extra package."""

    def __init__(self, executable: str, profile: Path) -> None:
        to_chrome_r, self._out = os.pipe()
        self._in, from_chrome_w = os.pipe()
        flags = [
            "--headless",
            "--no-sandbox",  # the tests may run as root
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
        ]
        shell = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}'
        self.proc = subprocess.Popen(
            ["bash", "-c", shell, executable, *flags],
            pass_fds=(to_chrome_r, from_chrome_w),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.session = ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        os.close(self._out)
        os.close(self._in)

    def call(self, method: str, session: bool = True, **params: Any) -> dict[str, Any]:
        """Send one command (to the page's session unless ``session`` is False); its result."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session and self.session:
            message["sessionId"] = self.session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + CDP_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})  # type: ignore[no-any-return]
        raise TimeoutError(f"{method}: no answer in {CDP_TIMEOUT_S} s")

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the pipe")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)  # type: ignore[no-any-return]

    def open(self, url: str) -> None:
        """A new tab (its own sessionStorage) at ``url``, 1280 pixels wide."""
        target = self.call("Target.createTarget", session=False, url="about:blank")
        attached = self.call(
            "Target.attachToTarget", session=False, targetId=target["targetId"], flatten=True
        )
        self.session = attached["sessionId"]
        self.call("Page.enable")
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=1280,
            height=960,
            deviceScaleFactor=1,
            mobile=False,
        )
        self.call("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"never true in {timeout_s} s: {expression}")

    def screenshot(self, path: Path) -> None:
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    b = Browser(_browser(), tmp_path_factory.mktemp("chromium"))
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    # The nodes offer no memory for more layers: a dead node's range stays a gap.
    return mesh_factory("0:2,2:3,3:4", model=tiny_path, node_args=NO_ROOM)


NODE_STATES = """JSON.stringify(Object.fromEntries(
  [...document.querySelectorAll('#nodes tbody tr')].map(r => [r.dataset.node, r.dataset.state])))"""
LANES = """[...document.querySelectorAll('#topology .lane')]
  .map(l => l.dataset.node + ' ' + l.querySelector('.span').textContent).join('|')"""
REPLICAS = """[...document.querySelectorAll('#coverage .layer')]
  .map(l => l.dataset.replicas).join(',')"""

CARDS = """[...document.querySelectorAll('#totals .card')]
  .map(c => c.querySelector('b').textContent + ' ' + c.lastChild.textContent)"""


def _chat(mesh: LocalMesh) -> int:
    """One chat through the mesh; the tokens it generated (sampled: an end-of-generation
    id may come before ``max_tokens``)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=60
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["completion_tokens"])


def test_a_wrong_token_gets_the_login_form(mesh: LocalMesh, browser: Browser) -> None:
    browser.open(f"{mesh.url}/dashboard#token=ma_not-the-token")
    error = browser.wait_for("document.getElementById('login-error').textContent")
    assert "refused" in error
    assert browser.eval("document.getElementById('board').hidden") is True
    assert browser.eval("sessionStorage.length") == 0  # a refused token is not kept


def test_the_dashboard_shows_the_mesh_and_a_node_dying(
    mesh: LocalMesh, browser: Browser, tmp_path: Path
) -> None:
    generated = _chat(mesh)
    browser.open(f"{mesh.url}/dashboard#token={mesh.credentials.admin_token}")
    states = '{"node-0":"up","node-1":"up","node-2":"up"}'
    browser.wait_for(f"{NODE_STATES} === '{states}'")
    # The token left the address bar at once; the page keeps it for this tab only.
    assert browser.eval("location.hash") == ""
    assert browser.eval("location.href").endswith("/dashboard")
    lanes = browser.eval(LANES)
    dash = "\N{EN DASH}"
    assert lanes == f"node-0 0{dash}2|node-1 2{dash}3|node-2 3{dash}4", lanes
    assert browser.eval(REPLICAS) == "1,1,1,1"
    assert browser.eval("document.getElementById('route').textContent") == "route complete"
    assert browser.wait_for(f"{CARDS}.includes('{generated} generated tokens')")
    first_update = float(browser.eval("document.body.dataset.updated"))

    mesh.kill_node("node-1", signal.SIGKILL)
    down = '{"node-0":"up","node-1":"down","node-2":"up"}'
    browser.wait_for(f"{NODE_STATES} === '{down}'", timeout_s=30)
    assert browser.wait_for(f"{REPLICAS} === '1,1,0,1'")
    assert browser.eval("document.getElementById('route').textContent") == "no route"
    event = browser.wait_for(
        "document.querySelector('#events tr[data-event=\"node-down\"]')?.textContent"
    )
    assert "node-1" in event
    assert float(browser.eval("document.body.dataset.updated")) > first_update  # no reload
    # The state change came over the event stream too (GET /admin/events), as it happened.
    change = browser.wait_for(
        'document.querySelector(\'#changes tr[data-kind="node"][data-state="down"]\')?.textContent'
    )
    assert "node-1" in change and "up" in change

    shot = tmp_path / "dashboard.png"
    browser.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("MESHNET_DASHBOARD_SCREENSHOT")
    if keep:
        shutil.copyfile(shot, keep)
