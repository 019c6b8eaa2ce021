"""Opening a fresh generation on cached prompt prefixes, every hop agreeing on one length.

Each hop of a route holds its own layers' KV of the prefixes it computed
(node/prefixes.py), and what one hop holds another may have evicted, so the
driver asks every hop for the longest cached prefix of the prompt at once (in
the open, no extra round trip) and each starts with what it has, up to the
limit asked. Where they all hold the same length (the usual case: they
computed the same prompts) that is the generation's: the prefix is its step 0,
logged at the first layer like a session's history, and the rest of the prompt
is step 1. Where they differ, the epoch is opened again with the shortest
length as the limit (the KV past it is not the others'); an eviction between
the two is met the same way, and the last try reuses nothing, which every hop
agrees with. A failover replays from that log exactly as for a session: the
prefix steps are recomputed from token zero where no survivor keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshnet.tracker.routing.epochs import EpochOpener
from meshnet.tracker.routing.generation import Generation

_TRIES = 3  # opens before the generation settles for no reuse


async def open_on_prefix(epochs: EpochOpener, gen: Generation, prompt_ids: Sequence[int]) -> int:
    """Open ``gen``'s first epoch on every hop, each starting with the same cached prefix
    of ``prompt_ids`` (at most all but its last id: a step must compute the row the
    first token is sampled from); the positions reused (0: none, the prompt is step 0)."""
    ids = np.asarray(prompt_ids, dtype=np.int64)
    reuse = max(len(ids) - 1, 0)
    for attempt in range(_TRIES):
        if attempt == _TRIES - 1:
            reuse = 0
        gen.links, _ = await epochs.open(gen, gen.route, {}, prefix=(ids, reuse))
        held = {link.positions for link in gen.links}
        if len(held) == 1:
            break
        for link in gen.links:
            link.close()
        gen.epoch += 1  # the hops that hold more are cut back by starting afresh
        reuse = min(held)
    reused = gen.links[0].positions
    if reused:
        gen.reused = reused
        gen.first_step = 1
        gen.record_input(0, 0, ids[:reused])
    return reused
