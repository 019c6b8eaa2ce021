"""``meshnet generate``: one generation in this process, optionally split into K shards.

Interface (relied on by later tooling)::

    meshnet generate [--model PATH] [--max-tokens N] [--temperature T] [--seed S]
                     [--split K] [--json] (--prompt TEXT | --messages JSON)

``--json`` prints one object: prompt_ids, ids, text, finish_reason, timings.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshnet.backends.shard import BACKENDS, DEFAULT_BACKEND
from meshnet.cli.model_ref import MODEL_HELP, whole_model
from meshnet.cli.options import BACKEND_HELP
from meshnet.engine.generate import Generation, generate
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.errors import RequestError
from meshnet.model.chat import parse_messages
from meshnet.model.sampling import SamplingParams


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="generate text in this process")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--split", type=int, default=1, help="run as K chained in-process shards")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS, help=BACKEND_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text, no chat template")
    source.add_argument("--messages", help='JSON array of {"role", "content"}')
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    model = load_local_model(whole_model(args.model), split=args.split, backend=args.backend)
    prompt_ids = _prompt_ids(model, args)
    if args.json:
        result = generate(model.chain, model.tokenizer, prompt_ids, params)
        print(json.dumps(to_json(result, model.load_s)))
    else:
        result = generate(
            model.chain, model.tokenizer, prompt_ids, params, on_text=lambda _, text: _echo(text)
        )
        print()
        t = to_json(result, model.load_s)["timings"]
        print(
            f"[{result.finish_reason}] {len(result.ids)} tokens; prefill "
            f"{t['prefill_tok_s']:.1f} tok/s, decode {t['decode_tok_s']:.1f} tok/s",
            file=sys.stderr,
        )
    return 0


def _prompt_ids(model: LocalModel, args: argparse.Namespace) -> list[int]:
    if args.prompt is not None:
        return model.tokenizer.encode(args.prompt)
    try:
        raw = json.loads(args.messages)
    except json.JSONDecodeError as e:
        raise RequestError(f"--messages is not valid JSON: {e}") from None
    text = model.template.render(parse_messages(raw), add_generation_prompt=True)
    return model.tokenizer.encode(text)


def to_json(g: Generation, load_s: float) -> dict[str, Any]:
    decoded = max(len(g.ids) - 1, 0)  # the first token comes out of the prefill
    return {
        "prompt_ids": g.prompt_ids,
        "ids": g.ids,
        "text": g.text,
        "finish_reason": g.finish_reason,
        "timings": {
            "load_s": round(load_s, 4),
            "prefill_tok_s": round(len(g.prompt_ids) / g.prefill_s, 2) if g.prefill_s else 0.0,
            "decode_tok_s": round(decoded / g.decode_s, 2) if g.decode_s else 0.0,
        },
    }


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
