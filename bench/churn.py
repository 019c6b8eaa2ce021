"""Exact answers while nodes are killed: a supervised mesh under churn, on the bundled model.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/churn.py [--requests 96] [--concurrency 16]
        [--kill-every 4] [--layout 0:15,15:30,0:15,15:30] [--max-tokens 48] [--runs 1]

`meshnet up --layout LAYOUT` starts a tracker and a node per range and restarts
any process that dies. First every request's answer is taken alone on the quiet
mesh (greedy ids with its own seed). Then the requests are sent again,
--concurrency at a time, while a killer sends SIGKILL to a random node every
--kill-every seconds (its pid from /admin/nodes: processes this script started
through `meshnet up`). Each answer is exact (the same ids), a typed error (an
OpenAI-shaped body with a code), or hung (no answer within --timeout). Printed:
the share of exact answers against the goal (>= 95%), the error codes seen,
and the kills made.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from meshnet.local_mesh import free_port

GOAL = 0.95


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kill-every", type=float, default=4.0)
    p.add_argument("--layout", default="0:15,15:30,0:15,15:30")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one answer may take")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--model", help="GGUF file (default: the bundled model)")
    p.add_argument("--up-args", default="", help='more `meshnet up` flags, e.g. "--queue-wait 10"')
    p.add_argument("--keep", action="store_true", help="keep the meshes' data and logs")
    args = p.parse_args()
    if args.keep:
        tmp = tempfile.mkdtemp(prefix="churn-")
        print(f"data and logs in {tmp}")
        shares = [_run(args, Path(tmp) / f"run{i}") for i in range(args.runs)]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            shares = [_run(args, Path(tmp) / f"run{i}") for i in range(args.runs)]
    print(f"exact share per run: {', '.join(f'{s:.1%}' for s in shares)} (goal >= {GOAL:.0%})")
    print(f"worst run / goal: {min(shares) / GOAL:.3f}x")


def _run(args: argparse.Namespace, data_dir: Path) -> float:
    port = free_port()
    cmd = [sys.executable, "-m", "meshnet.cli.main", "up", "--layout", args.layout]
    cmd += ["--port", str(port), "--data-dir", str(data_dir)]
    cmd += ["--model", args.model] if args.model else []
    cmd += args.up_args.split()
    url = f"http://127.0.0.1:{port}"
    log = (data_dir.parent / f"{data_dir.name}.log").open("wb")
    up = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        creds = _wait_serving(url, data_dir, up)
        api = {"Authorization": f"Bearer {creds['api_key']}"}
        admin = {"Authorization": f"Bearer {creds['admin_token']}"}
        models = httpx.get(f"{url}/v1/models", headers=api, timeout=10).json()["data"]
        bodies = [_body(models[0]["id"], i, args.max_tokens) for i in range(args.requests)]
        with httpx.Client(timeout=args.timeout) as client:
            expected = [
                _ids(client.post(f"{url}/v1/completions", json=b, headers=api)) for b in bodies
            ]
        stop = threading.Event()
        kills: list[str] = []
        killer = threading.Thread(
            target=_kill_loop, args=(url, admin, args.kill_every, stop, kills)
        )
        killer.start()
        try:
            with ThreadPoolExecutor(args.concurrency) as pool:
                outcomes = list(pool.map(lambda b: _ask(url, api, b, args.timeout), bodies))
        finally:
            stop.set()
            killer.join()
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()
    exact = sum(o == e for o, e in zip(outcomes, expected, strict=True))
    errors = Counter(o.split(":")[0] for o in outcomes if isinstance(o, str))
    for first in {o.split(":")[0]: o for o in outcomes if isinstance(o, str)}.values():
        print(f"  e.g. {first[:300]}")
    print(
        f"{args.requests} requests, {args.concurrency} at a time, {len(kills)} kills "
        f"({', '.join(kills)}): {exact} exact, errors {dict(errors)}"
    )
    return exact / args.requests


def _body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    prompt = f"Request {i}: tell me one fact about the number {i}."
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": i,
    }


def _ids(r: httpx.Response) -> list[int]:
    if r.status_code != 200:
        raise SystemExit(f"the quiet mesh answered {r.status_code}: {r.text}")
    return list(r.json()["meshnet"]["ids"])


def _ask(url: str, api: dict[str, str], body: dict[str, Any], timeout: float) -> list[int] | str:
    """The answer's ids, or its error code ("hung" for none in time)."""
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, headers=api, timeout=timeout)
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError as e:
        return f"transport: {type(e).__name__}"
    if r.status_code == 200:
        return list(r.json()["meshnet"]["ids"])
    try:
        error = r.json()["error"]
        return f"{r.status_code} {error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} untyped"


def _kill_loop(
    url: str, admin: dict[str, str], every_s: float, stop: threading.Event, kills: list[str]
) -> None:
    rng = random.Random(20261206)
    while not stop.wait(every_s):
        try:
            nodes = httpx.get(f"{url}/admin/nodes", headers=admin, timeout=10).json()["nodes"]
        except (httpx.HTTPError, ValueError, KeyError):
            continue
        live = [n for n in nodes if n["state"] == "up" and n.get("pid")]
        if not live:
            continue
        victim = rng.choice(live)
        try:
            os.kill(int(victim["pid"]), signal.SIGKILL)  # a node `meshnet up` started for us
            kills.append(victim["node_id"])
        except ProcessLookupError:
            pass


def _wait_serving(url: str, data_dir: Path, up: subprocess.Popen[bytes]) -> dict[str, str]:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if up.poll() is not None:
            raise SystemExit(f"meshnet up exited with {up.returncode}")
        try:
            health = httpx.get(f"{url}/healthz", timeout=2).json()
            creds = data_dir / "credentials.json"
            if health.get("route_complete") and creds.exists():
                return dict(json.loads(creds.read_text()))
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("the mesh did not serve within 600 s")


if __name__ == "__main__":
    main()
