"""Time to first token of 8 clients sharing a 2,000-token system prompt (issue 34).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/prefix_cache.py [--rounds 3]

Eight clients send completions at once, each the same ~2,000-token system
prompt and a question of its own, in rounds (new questions every round); the
first round fills the caches, the others are timed. Each side's figure is the
mean time to first token of a round, its best round. Sides, on the same GGUF
(the bundled model by default) and threads: meshnet (tracker + one node) with
its prefix cache on, the same with it off (goal: on <= 0.2x of off), and
``llama-server -np 8`` with ``cache_prompt`` (its slots' prompt caches), when
bench/build_llamacpp.sh's build is there. Every process started is stopped.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from meshnet.benchmark.llamacpp import find_llamacpp
from meshnet.benchmark.prefix_ttft import (
    PrefixSetup,
    SideResult,
    llama_server_side,
    meshnet_side,
    system_prompt,
)
from meshnet.benchmark.quiet import Quiet
from meshnet.model.bundled import bundled_model_path
from meshnet.model.info import load_model_info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the bundled model)")
    p.add_argument("--llamacpp", help="directory of llama.cpp's binaries")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="the first fills the caches")
    p.add_argument("--threads", type=int, default=2, help="the node's and llama-server's")
    p.add_argument("--quiet-wait", type=float, default=20.0, help="seconds to wait for idle CPUs")
    p.add_argument("--retries", type=int, default=1, help="tries again of a disturbed round")
    p.add_argument("--logs", help="keep the processes' logs here (default: a temp dir)")
    args = p.parse_args()
    model = Path(args.model) if args.model else bundled_model_path()
    info = load_model_info(model)
    system = system_prompt(info.tokenizer, args.system_tokens)
    shared = len(info.tokenizer.encode(system))
    with tempfile.TemporaryDirectory(prefix="meshnet-prefix-") as tmp:
        setup = PrefixSetup(
            model=model,
            bin_dir=find_llamacpp(args.llamacpp),
            data_dir=Path(args.logs or tmp),
            n_layers=info.spec.n_layers,
            system_tokens=args.system_tokens,
            clients=args.clients,
            rounds=args.rounds,
            threads=args.threads,
            quiet=Quiet(max_wait_s=args.quiet_wait, retries=args.retries),
        )
        print(
            f"{setup.clients} clients at once, a {shared}-token system prompt each and a "
            f"question of their own; {setup.rounds - 1} timed rounds after one that fills "
            f"the caches; {setup.threads} threads each side; * = every try disturbed"
        )
        sides: list[SideResult] = [meshnet_side(setup, system, True)]
        sides.append(meshnet_side(setup, system, False))
        if setup.bin_dir is not None:
            sides.append(llama_server_side(setup, system, shared + 256))
        else:
            print("no llama.cpp build (bench/build_llamacpp.sh): meshnet's sides alone")
        _report(sides, setup.quiet)


def _report(sides: list[SideResult], quiet: Quiet) -> None:
    best = {s.name: s.best(quiet) for s in sides}
    for s in sides:
        tries = ", ".join(f"{m.value * 1000:.0f} ms ({m.others:.0%} others)" for m in s.tries)
        print(f"  {s.name}: mean TTFT per round {tries}")
    print()
    for name, (value, calm) in best.items():
        print(f"{name:34s} {value * 1000:9.1f} ms{'' if calm else ' *'}")
    on = best["meshnet, prefix cache on"][0]
    off = best["meshnet, prefix cache off"][0]
    print(f"\ncache on / cache off: {on / off:.3f}x  (goal <= 0.2x)")
    peer = best.get("llama-server, cache_prompt")
    if peer is not None:
        print(f"cache on / llama-server cache_prompt: {on / peer[0]:.3f}x")


if __name__ == "__main__":
    main()
