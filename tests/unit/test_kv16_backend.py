"""The q8-kv16 backend: q8 with a float16 KV cache, as llama.cpp's default cache. Its greedy
ids on the bundled model are llama.cpp's with ``-ctk f16 -ctv f16`` wherever llama.cpp's
top two are apart; its cache takes half q8's bytes; its rows keep the engine's contracts
(split, batched, chunked, recomputed: the same bits); its KV moves between its nodes and
is refused, unkept, by a node whose cache is float32."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from invariants import assert_split_batched_chunked_identical, step_logits
from kv_nodes import exported_frames, node_service, put_frames, run_steps

from meshnet.backends import quant
from meshnet.backends.shard import kv_item_bytes
from meshnet.engine.local import load_local_model
from meshnet.model.layer_bytes import model_layer_bytes
from meshnet.node.service import NodeService

pytestmark = pytest.mark.skipif(quant.NATIVE is None, reason="the native kernels are not built")

ORACLE = Path(__file__).parents[1] / "fixtures" / "kv16_oracle.json"
# q8's noise on the bundled model's logits (test_q8_models.py): closer top two are a tie.
MARGIN = 0.5
PROMPT = [5, 80, 99, 120, 7, 3, 200, 41, 17, 250, 3, 90, 11, 64, 65, 66, 1, 2, 3, 4]


def test_bundled_model_ids_are_llama_cpps_with_a_float16_cache() -> None:
    recorded = json.loads(ORACLE.read_text())
    model = load_local_model(backend="q8-kv16")
    path = Path(model.file.path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == recorded["meta"]["sha256"]
    steps = recorded["steps"]["f16"]
    ids = [s["id"] for s in steps]
    got = step_logits(model.chain, recorded["prompt_ids"], ids[:-1])
    compared = 0
    for step, s in enumerate(steps):
        (_, first), (_, second) = s["top"][:2]
        if first - second < MARGIN:
            continue
        assert int(np.argmax(got[step])) == s["id"], step
        compared += 1
    assert compared >= 40


def test_its_cache_holds_half_the_bytes_and_rounds_what_it_holds(tiny_path: Path) -> None:
    q8 = load_local_model(tiny_path, backend="q8")
    kv16 = load_local_model(tiny_path, backend="q8-kv16")
    logits, caches = [], []
    for model in (q8, kv16):
        kv = model.chain.new_sequence()
        logits.append(model.chain.forward(np.asarray(PROMPT), [kv], [len(PROMPT)])[0])
        caches.append(kv[0])
    wide, half = caches
    assert half.dtype == np.float16 and wide.dtype == np.float32
    assert 2 * half.nbytes == wide.nbytes and 2 * half.per_position == wide.per_position
    assert not np.array_equal(logits[0], logits[1])  # the rounding reaches the logits
    assert np.abs(logits[0] - logits[1]).max() < 0.05 * np.abs(logits[0]).max()
    spec = q8.spec
    sizes = model_layer_bytes(q8.file, spec, kv_item=kv_item_bytes("q8-kv16"))
    assert 2 * sizes.kv_layer_token == model_layer_bytes(q8.file, spec).kv_layer_token


def test_its_rows_are_the_same_bits_split_batched_chunked_and_recomputed(tiny_path: Path) -> None:
    whole = load_local_model(tiny_path, backend="q8-kv16")
    split = load_local_model(tiny_path, split=2, backend="q8-kv16")
    assert_split_batched_chunked_identical(whole.chain, split.chain, PROMPT, [7, 8, 9, 10])


@pytest.fixture
def three(tiny_path: Path) -> Iterator[tuple[NodeService, ...]]:
    nodes = (
        node_service(tiny_path, "q8-kv16", "a"),
        node_service(tiny_path, "q8-kv16", "b"),
        node_service(tiny_path, "q8", "c"),
    )
    yield nodes
    for node in nodes:
        node.engine.stop()


def test_its_kv_moves_between_its_nodes_and_a_float32_node_refuses_it(
    three: tuple[NodeService, ...],
) -> None:
    a, b, c = three
    for node in (a, c):
        node.engine.sessions.open("s", 1).result(5)
        run_steps(node.engine, "s", [[5, 6, 7, 8, 9], [10], [11]])
    frames, wide = exported_frames(a), exported_frames(c)
    assert (frames[0].header.dtype, wide[0].header.dtype) == ("float16", "float32")
    assert 2 * frames[0].header.total_bytes == wide[0].header.total_bytes
    moved = put_frames(b, frames)
    assert moved.imported, moved.failure
    assert np.array_equal(run_steps(a.engine, "s", [[12]], 3), run_steps(b.engine, "s", [[12]], 3))
    for sender, receiver in ((c, b), (a, c)):  # float32 into float16, and the other way
        held = receiver.engine.stats().kv_bytes
        reply = put_frames(receiver, exported_frames(sender))
        assert not reply.imported
        assert (reply.failure.kind, reply.reason) == ("kv-import-failed", "wrong-shape")
        assert receiver.engine.stats().kv_bytes <= held
