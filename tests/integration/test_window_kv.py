"""Sliding-window layers keep only their window: on a Gemma-3-shaped tiny model (window 8,
layers 2 and 5 global) a session past the window holds rings of its windowed layers, its
bytes and its export shrink accordingly, and every logit equals the dense cache's, bit
for bit: decoding, exported and imported (into either layout), and rewound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinyarch import CASES, WINDOW, write_arch_gguf

from meshnet.engine.chain import ChainKV, ShardChain
from meshnet.engine.local import load_local_model
from meshnet.errors import CacheMiss
from meshnet.kv.cache import SequenceKV

pytest.importorskip("meshnet.backends._native")

PROMPT = [(7 * i) % 90 + 3 for i in range(190)]
FOLLOW = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> ShardChain:
    path = write_arch_gguf(tmp_path_factory.mktemp("win") / "gemma3.gguf", CASES["gemma3"])
    return load_local_model(Path(path), backend="fast", split=2).chain


def _dense(chain: ShardChain) -> ChainKV:
    return [_layout(kv, rings=False) for kv in chain.new_sequence()]


def _layout(kv: SequenceKV, rings: bool) -> SequenceKV:
    return SequenceKV(kv.n_layers, kv.n_kv_heads, kv.head_dim, windows=kv.windows, rings=rings)


def _run(chain: ShardChain, seq: ChainKV, ids: list[int], chunk: int) -> list[np.ndarray]:
    out = []
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        out.append(chain.forward(np.asarray(piece), [seq], [len(piece)])[0])
    return out


def test_rings_hold_the_window_and_give_the_dense_cache_bits(chain: ShardChain) -> None:
    rings, dense = chain.new_sequence(), _dense(chain)
    assert all(kv.rings for kv in rings)
    got = _run(chain, rings, PROMPT, 40) + _run(chain, rings, FOLLOW, 1)
    want = _run(chain, dense, PROMPT, 40) + _run(chain, dense, FOLLOW, 1)
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    length = len(PROMPT) + len(FOLLOW)
    for kv in rings:
        for layer, window in enumerate(kv.windows):
            keys, _ = kv.buffers(layer)
            if window:  # the window and a step's rows (and the rewind room), whole tiles
                assert keys.shape[1] <= 128 < length
            else:
                assert keys.shape[1] >= length
    assert sum(kv.nbytes for kv in rings) < 0.6 * sum(kv.nbytes for kv in dense)


def test_export_keeps_the_window_and_resumes_exactly_in_either_layout(chain: ShardChain) -> None:
    seq = chain.new_sequence()
    _run(chain, seq, PROMPT, 64)
    payloads = [bytes(kv.export_bytes()) for kv in seq]
    for kv, payload in zip(seq, payloads, strict=True):
        dense_bytes = kv.per_position * kv.length
        windowed = sum(1 for w in kv.windows if w)
        kept = (kv.n_layers - windowed) * kv.length + windowed * WINDOW
        assert len(payload) == dense_bytes * kept // (kv.n_layers * kv.length)
        assert len(payload) == kv.payload_bytes(kv.length)
    want = _run(chain, seq, FOLLOW, 1)
    for rings in (True, False):
        resumed = [_layout(kv, rings) for kv in chain.new_sequence()]
        for kv, payload in zip(resumed, payloads, strict=True):
            kv.load_bytes(len(PROMPT), payload)
        got = _run(chain, resumed, FOLLOW, 1)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        again = [bytes(kv.export_bytes()) for kv in _rewound(resumed, len(PROMPT))]
        assert again == payloads  # the same bytes (and so hashes) as the first export


def _rewound(seq: ChainKV, length: int) -> ChainKV:
    for kv in seq:
        kv.truncate(length)
    return seq


def test_a_rewind_within_the_ring_is_exact_and_past_it_a_cache_miss(chain: ShardChain) -> None:
    seq = chain.new_sequence()
    _run(chain, seq, PROMPT, 40)  # rings of 64 positions: they went round
    want = _run(chain, seq, FOLLOW, 1)
    _rewound(seq, len(PROMPT))  # 8 positions back: the ring still holds the window
    assert all(np.array_equal(a, b) for a, b in zip(_run(chain, seq, FOLLOW, 1), want, strict=True))
    with pytest.raises(CacheMiss):
        _rewound(seq, 20)
    imported = chain.new_sequence()
    for kv, old in zip(imported, seq, strict=True):
        kv.load_bytes(old.length, bytes(old.export_bytes()))
    with pytest.raises(CacheMiss):  # an import holds the window only
        _rewound(imported, imported[0].length - 1)
