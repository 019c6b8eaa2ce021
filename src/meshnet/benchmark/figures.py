"""Throughput figures of one side of ``meshnet bench``, and the best over rounds."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Throughput:
    prefill_tok_s: float  # one prompt of the benchmark's prompt length
    decode_tok_s: dict[int, float]  # batch size -> aggregate decode tokens per second
    # One sequence's decode right after the prompt (at a depth of the prompt's length,
    # llama-bench's ``-d``): where attention over a long context shows; None: not run.
    deep_decode_tok_s: float | None = None

    @staticmethod
    def best(rounds: Sequence[Throughput]) -> Throughput:
        """Each figure's fastest round: on a shared machine the slow ones measure the
        neighbours."""
        batches = {b for r in rounds for b in r.decode_tok_s}
        deep = [r.deep_decode_tok_s for r in rounds if r.deep_decode_tok_s is not None]
        return Throughput(
            max(r.prefill_tok_s for r in rounds),
            {
                b: max(r.decode_tok_s[b] for r in rounds if b in r.decode_tok_s)
                for b in sorted(batches)
            },
            max(deep) if deep else None,
        )
