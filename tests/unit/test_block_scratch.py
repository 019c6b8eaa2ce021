"""A forward's blocks share one thread's scratch: a long prompt chunk's is faulted in
once a forward and given back after it, not once a block (released after every block,
a 256-token prompt of the bundled model faulted ~57k pages, a 1B model's prefill lost
~15% to it). Scratch past what a thread keeps has pages of its own: from the heap, a
4-8 MB chunk's stayed resident after its forward under the node's allocator policy
(memory.settle: blocks under 8 MB freed are kept for the next step)."""

from __future__ import annotations

import resource
import threading
from pathlib import Path

import numpy as np
import pytest

from meshnet.benchmark.engine import bench_prompt
from meshnet.engine.local import LocalModel
from meshnet.memory import settle

pytest.importorskip("meshnet.backends._native")

PROMPT = 256  # rows whose block scratch (~5.3 MB here) is past what a decode keeps
SCRATCH_PAGES = PROMPT * (576 + 3 * 1536) * 4 // 4096  # one block's: h, gate/up, act


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_a_long_prompt_faults_its_scratch_in_once_and_gives_it_back(bundled: LocalModel) -> None:
    chain = bundled.chain
    ids = np.asarray(bench_prompt(bundled, PROMPT), np.int64)
    settle()  # the node's allocator policy (every shard load applies it too)
    chain.forward(ids[:16], [chain.new_sequence()], [16])  # first-use costs, kept scratch
    seen: dict[str, int] = {}

    def forward() -> None:  # a thread of its own: its scratch starts empty
        kv = chain.new_sequence()
        faults, resident = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt, _resident()
        chain.forward(ids, [kv], [PROMPT])
        seen["faults"] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults
        seen["grown"] = _resident() - resident - sum(k.nbytes for k in kv)

    thread = threading.Thread(target=forward)
    thread.start()
    thread.join()
    assert seen["faults"] < 5 * SCRATCH_PAGES  # 30 blocks: once, not 30 times
    assert seen["grown"] < 4096 * SCRATCH_PAGES // 2  # and it went back before the return
