"""Record llama.cpp's outputs on the tiny model of every architecture (tests/tinyarch.py).

For each case: write its float32 GGUF, serve it with llama.cpp's ``llama-server``
(float32 KV cache, flash attention off: float32 throughout), send a fixed prompt
as token ids, decode greedily and keep every step's token and top log-probs.
The fixture (tests/fixtures/arch_oracle.json) also records each file's sha256,
so a test knows its writer still makes the bytes llama.cpp saw.

Remake it (after ``bash bench/build_llamacpp.sh``) whenever tests/tinyarch.py
changes:

    OPENBLAS_NUM_THREADS=1 .venv/bin/python scripts/record_arch_oracles.py

``--cases NAME ...`` records only those cases and keeps the fixture's others as they
are (a new family's case, without rewriting the rest's last digits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from tinyarch import CASES, write_arch_gguf  # noqa: E402

from meshnet.benchmark.llamacpp import DEFAULT_HOME  # noqa: E402

PROMPT = [7, 40, 81, 122, 163, 204, 245, 19, 60, 101, 142, 183, 224, 265, 33, 74, 115, 156, 197]
STEPS = 12
TOP = 8
# llama-server reports a step only once the text so far is whole UTF-8, so the byte
# tokens of bytes >= 0x80 (tinymodel's ids 3 + byte) are banned, and the special ids
# (end of generation among them); a test masks the same ids before comparing.
BANNED = [0, 1, 2, *range(3 + 0x80, 3 + 0x100)]
OUT = ROOT / "tests" / "fixtures" / "arch_oracle.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", type=Path, default=DEFAULT_HOME / "bin")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), help="only these cases")
    args = parser.parse_args()
    server = args.bin / "llama-server"
    if not server.is_file():
        sys.exit(f"{server} is missing: run bash bench/build_llamacpp.sh first")
    cases = {}
    if args.cases and args.out.is_file():
        cases = json.loads(args.out.read_text())["cases"]
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in CASES.items():
            if args.cases and name not in args.cases:
                continue
            path = write_arch_gguf(Path(tmp) / f"{name}.gguf", case)
            cases[name] = {
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "prompt_ids": PROMPT,
                "banned_ids": BANNED,
                "steps": greedy(server, path),
            }
            print(name, [s["id"] for s in cases[name]["steps"]])
    meta = {"llama_server": llama_version(server), "command": "scripts/record_arch_oracles.py"}
    ordered = {name: cases[name] for name in CASES if name in cases}
    args.out.write_text(json.dumps({"meta": meta, "cases": ordered}, indent=1) + "\n")
    print(f"wrote {args.out}")


def greedy(
    server: Path,
    model: Path,
    top: int = TOP,
    cache: str = "f32",
    prompt: list[int] = PROMPT,
    steps: int = STEPS,
    banned: list[int] = BANNED,
    context: int = 256,
) -> list[dict[str, object]]:
    """Greedy steps of llama.cpp on ``model`` with a KV cache of ``cache`` ("f32" or
    "f16"), flash attention off: each step's id and top log-probs."""
    port = _free_port()
    cmd = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(context), "-np", "1", "-t", "2", "-fa", "off", "-ctk", cache, "-ctv", cache,
           "--no-warmup"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        body = {"prompt": prompt, "n_predict": steps, "temperature": 0.0, "n_probs": top,
                "cache_prompt": False, "logit_bias": [[i, False] for i in banned]}  # fmt: skip
        reply = httpx.post(f"{url}/completion", json=body, timeout=120).json()
        if "completion_probabilities" not in reply:
            raise RuntimeError(f"llama-server answered {reply}")
        return [
            {"id": p["id"], "top": [[t["id"], t["logprob"]] for t in p["top_logprobs"]]}
            for p in reply["completion_probabilities"]
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server did not become ready")


def llama_version(server: Path) -> str:
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    return (out.stdout + out.stderr).strip().splitlines()[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
