"""Decode tok/s with a JSON schema enforced against without, and against llama-server's.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/structured_outputs.py [--rounds 3]

One tracker + one node serving the whole bundled model (``--threads`` kernel
threads), and, when bench/build_llamacpp.sh has run, ``llama-server`` on the
same GGUF with the same threads. Each side streams greedy completions of the
same prompt, free and under a JSON schema (meshnet: ``response_format``;
llama-server: its ``json_schema`` field, its own grammar engine); the rate is
tokens after the first over their time (the prefill left out), the best of the
rounds, the runs alternating so every figure sees the same machine. Prints the
ratio schema/free per side (goal for meshnet >= 0.9) and meshnet's schema rate
against llama-server's.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from pathlib import Path
from typing import Any

from meshnet.benchmark.llama_server import llama_server
from meshnet.benchmark.llamacpp import find_llamacpp
from meshnet.benchmark.running_mesh import running_mesh, served_model
from meshnet.benchmark.streams import decode_tok_s, run_streams
from meshnet.layer_range import LayerRange
from meshnet.model.bundled import bundled_model_path
from meshnet.model.info import load_model_info

PROMPT = "Here are the readings of the sensor, one a minute, as JSON: "
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "sensor": {"type": "string", "maxLength": 16},
        "readings": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 48,
            "maxItems": 48,
        },
    },
    "required": ["sensor", "readings"],
    "additionalProperties": False,
}


def _body(model: str, tokens: int, schema_field: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if schema_field == "response_format":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "readings", "schema": SCHEMA, "strict": True},
        }
    elif schema_field == "json_schema":
        body["json_schema"] = SCHEMA
    return body


def _rate(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[float, int]:
    (record,) = run_streams(url, [body], headers)
    return decode_tok_s(record), record.tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    model_path = bundled_model_path()
    n_layers = load_model_info(model_path).spec.n_layers
    best: dict[str, float] = {}
    counts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        data = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        mesh = stack.enter_context(
            running_mesh(data / "mesh", model_path, [LayerRange(0, n_layers)], args.threads)
        )
        sides = [("meshnet", mesh.url, served_model(mesh), mesh.api_headers, "response_format")]
        bin_dir = find_llamacpp()
        if bin_dir is not None and (bin_dir / "llama-server").is_file():
            log = data / "llama-server.log"
            url = stack.enter_context(
                llama_server(bin_dir, model_path, args.threads, 1, 2 * args.tokens + 128, log)
            )
            sides.append(("llama-server", url, "llama", {}, "json_schema"))
        for _name, url, model, headers, field in sides:  # warm: grammar caches, JIT
            _rate(url, _body(model, 16, field), headers)
        for r in range(args.rounds):
            for name, url, model, headers, field in sides if r % 2 == 0 else sides[::-1]:
                for kind, f in (("free", None), ("schema", field)):
                    rate, tokens = _rate(url, _body(model, args.tokens, f), headers)
                    key = f"{name} {kind}"
                    best[key] = max(best.get(key, 0.0), rate)
                    counts[key] = tokens
    print(f"greedy decode tok/s after the first token, best of {args.rounds} alternating rounds")
    for key, rate in best.items():
        print(f"{key:20s}: {rate:7.1f} tok/s ({counts[key]} tokens)")
    for name, *_ in sides:
        ratio = best[f"{name} schema"] / best[f"{name} free"]
        goal = " (goal >= 0.9x)" if name == "meshnet" else ""
        print(f"{name} schema/free: {ratio:.3f}x{goal}")
    if len(sides) > 1:
        ratio = best["meshnet schema"] / best["llama-server schema"]
        print(f"meshnet schema / llama-server schema: {ratio:.3f}x")


if __name__ == "__main__":
    main()
