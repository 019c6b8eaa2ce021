"""Time to first token of clients sharing a long system prompt: the prefix cache's figure.

``clients`` clients each send a completion whose prompt is one long system
prompt (about ``system_tokens`` tokens) and a short question of their own, all
at once, in rounds; every round asks new questions. The first round fills the
caches (each side as it would in service); the later rounds are timed, and
each side's figure is the mean time to first token over their requests, of the
best round. Three sides on the same GGUF and threads, one after the other:

- meshnet, tracker + one node, prefix cache on (its default);
- the same with the nodes' prefix cache off (``--prefix-cache-mb 0``);
- ``llama-server -np clients`` with ``cache_prompt`` (each slot keeps its last
  prompt's KV, and its host-memory prompt cache lends prompts between slots),
  when llama.cpp's build is there.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from meshnet.benchmark.llama_server import llama_server
from meshnet.benchmark.quiet import Measured, Quiet
from meshnet.benchmark.running_mesh import running_mesh, served_model
from meshnet.benchmark.streams import StreamRecord, run_streams
from meshnet.layer_range import LayerRange
from meshnet.model.tokenizer import TextTokenizer

_TOPICS = ("billing", "privacy", "safety", "tone", "format", "sources", "refusals", "code")


@dataclass(frozen=True)
class PrefixSetup:
    model: Path
    bin_dir: Path | None  # llama.cpp's binaries; None: meshnet's sides alone
    data_dir: Path  # logs of every process started
    n_layers: int
    system_tokens: int = 2000  # the shared system prompt's length, about
    clients: int = 8  # concurrent clients, llama-server's -np
    rounds: int = 3  # the first fills the caches; the rest are timed
    threads: int = 2  # the node's kernel threads, llama-server's -t
    max_tokens: int = 4  # each answer's length: the first token is what is timed
    quiet: Quiet = field(default_factory=Quiet)


def system_prompt(tokenizer: TextTokenizer, tokens: int) -> str:
    """A deterministic system prompt of about ``tokens`` tokens (rules, one a line)."""
    lines = ["You are the support assistant of a large online shop. Follow these rules."]
    i = 0
    while len(tokenizer.encode("\n".join(lines))) < tokens:
        topic = _TOPICS[i % len(_TOPICS)]
        lines.append(
            f"Rule {i + 1} ({topic}): when a customer asks about {topic}, answer in at most "
            f"{3 + i % 5} sentences, cite section {i * 7 % 97} of the handbook, and never "
            f"promise anything the handbook does not say about case {i * 13 % 101}."
        )
        i += 1
    return "\n".join(lines) + "\n\n"


def bodies(
    model: str,
    system: str,
    clients: int,
    round_no: int,
    tokens: int,
    extra: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One streamed greedy request per client, each its own question this round;
    ``extra`` adds a peer's own fields (meshnet's API refuses fields it does not know)."""
    return [
        {
            "model": model,
            "prompt": f"{system}Customer {c} asks (visit {round_no}): where is order "
            f"{1000 * round_no + c}?\nAssistant:",
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
        for c in range(clients)
    ]


def mean_ttft(records: Sequence[StreamRecord]) -> float:
    """Seconds from each request sent to its first token chunk, averaged."""
    return statistics.fmean(r.arrivals[0] - r.sent for r in records)


@dataclass
class SideResult:
    name: str
    tries: list[Measured] = field(default_factory=list)  # every timed try of every round

    def best(self, quiet: Quiet) -> tuple[float, bool]:
        """The lowest mean TTFT undisturbed by other processes (True), else of all."""
        return quiet.best(self.tries, "lower")


def _rounds(
    name: str,
    url: str,
    model: str,
    setup: PrefixSetup,
    system: str,
    headers: Mapping[str, str] | None,
    extra: Mapping[str, Any] | None = None,
) -> SideResult:
    result = SideResult(name)
    for round_no in range(setup.rounds):
        sent = bodies(model, system, setup.clients, round_no, setup.max_tokens, extra)
        run: Callable[[], list[StreamRecord]] = partial(run_streams, url, sent, headers)
        if round_no == 0:
            run()  # fills the caches
            continue
        for records, others in setup.quiet.tries(run):
            result.tries.append(Measured(mean_ttft(records), others))
    return result


def meshnet_side(setup: PrefixSetup, system: str, cache: bool) -> SideResult:
    """Tracker + one node of every layer, its prefix cache on or off."""
    name = "meshnet, prefix cache " + ("on" if cache else "off")
    args = [] if cache else ["--prefix-cache-mb", "0"]
    data = setup.data_dir / ("cache-on" if cache else "cache-off")
    layout = [LayerRange(0, setup.n_layers)]
    # Eight 2,000-token prompts at once share every forward: on a busy host one of
    # them can take minutes, past the default step deadline (30 s and 50 ms a row).
    tracker = ["--step-timeout", "600"]
    with running_mesh(
        data, setup.model, layout, setup.threads, node_args=args, tracker_args=tracker
    ) as mesh:
        return _rounds(name, mesh.url, served_model(mesh), setup, system, mesh.api_headers)


def llama_server_side(setup: PrefixSetup, system: str, slot_ctx: int) -> SideResult:
    """``llama-server -np clients`` with ``cache_prompt`` in every request."""
    assert setup.bin_dir is not None
    log = setup.data_dir / "llama-server.log"
    with llama_server(
        setup.bin_dir, setup.model, setup.threads, setup.clients, slot_ctx, log
    ) as url:
        keep = {"cache_prompt": True}  # llama-server's own field
        return _rounds("llama-server, cache_prompt", url, "m", setup, system, None, keep)
