"""A node's resident memory is about the bytes of the layers it serves plus its KV.

A Q4_K_M-style file (Q4_K matrices, Q6_K values / down projections / head) is loaded
the way ``meshnet node`` loads its range, in a process of its own, and a prompt is
run through it; the growth of its resident set must stay within ~15% of the file
bytes of the tensors it serves plus the KV the prompt took. A whole ``meshnet
generate`` run of a model with Gemma 3's 262k-token vocabulary is held to the same
bound plus the tokenizer's compact tables, and a sequence's KV to what its tokens
need, whatever the context.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from large_vocab import LargeVocabConfig, prompt_text, write_large_vocab_gguf
from tinymodel import TinyConfig, write_tiny_gguf

from meshnet.engine.local import load_local_model
from meshnet.kv.cache import GRANULE
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf

pytest.importorskip("meshnet.backends._native")  # the numba fallback keeps raw copies

Q4_K_M = TinyConfig(
    n_layers=8,
    d_model=1024,
    d_ff=4096,
    n_heads=16,
    n_kv_heads=4,
    context_length=512,
    matrix_type=QT.Q4_K,
    embedding_type=QT.Q4_K,
    tied_head=False,
    role_types={"attn_v": QT.Q6_K, "ffn_down": QT.Q6_K, "output": QT.Q6_K},
)
PROMPT = 200
SLACK = 12 << 20  # scratch of a forward, rotary tables, allocator rounding

PROBE = """
import json, sys
import numpy as np
from meshnet.backends.base import BatchEntry
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf
from meshnet.backends.shard import load_shard, warm_up
from meshnet.model.spec import read_spec

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

path, layers, prompt = sys.argv[1], LayerRange.parse(sys.argv[2]), int(sys.argv[3])
f = open_gguf(path)
spec = read_spec(f)
before = rss()
shard = load_shard(f, spec, layers)
kv = shard.backend.new_kv()
if shard.is_first:
    x = np.arange(prompt) % spec.vocab_size
else:
    x = np.zeros((prompt, spec.d_model), np.float32)
shard.forward(x, [BatchEntry(kv, prompt)])
print(json.dumps({"growth": rss() - before, "kv": kv.nbytes}))
"""


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("q4km") / "q4km.gguf", Q4_K_M)


def _served_bytes(path: Path, layers: LayerRange, n_layers: int) -> int:
    """File bytes of the tensors a shard of ``layers`` reads."""
    f = open_gguf(path)
    total = 0
    for name, t in f.tensors.items():
        if name.startswith("blk."):
            serves = int(name.split(".")[1]) in range(layers.start, layers.end)
        else:
            serves = (name == "token_embd.weight" and layers.is_first()) or (
                name.startswith("output") and layers.is_last(n_layers)
            )
        total += int(t.n_bytes) if serves else 0
    return total


@pytest.mark.parametrize("layers", ["0:8", "2:6", "5:8"])
def test_resident_memory_is_the_served_bytes_plus_kv(q4_k_m: Path, layers: str) -> None:
    served = _served_bytes(q4_k_m, LayerRange.parse(layers), Q4_K_M.n_layers)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(q4_k_m), layers, str(PROMPT)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    bound = 1.15 * served + figures["kv"] + SLACK
    assert figures["growth"] <= bound, (figures, served)


# ~20 MB of header, as a 128k-token vocabulary and its merges take as strings
LARGE_HEADER = replace(Q4_K_M, n_layers=4, header_strings=600_000)
NODE_PROBE = """
import json, sys
from meshnet.layer_range import LayerRange
from meshnet.backends.shard import load_shard_file

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

before = rss()
shard = load_shard_file(sys.argv[1], LayerRange.parse(sys.argv[2]))
print(json.dumps({"growth": rss() - before}))
"""


@pytest.fixture(scope="module")
def large_header(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("header") / "header.gguf", LARGE_HEADER)


def test_a_node_keeps_nothing_of_a_large_header(large_header: Path) -> None:
    """A node loads its range from a file whose header is ~20 MB (a 128k-token
    vocabulary and its merges are ~8 MB on disk, several times that as strings): the
    header's pages and parsed values are gone once the shard is loaded, so the growth
    from before the file was opened is the middle layers' bytes."""
    layers = "1:3"
    served = _served_bytes(large_header, LayerRange.parse(layers), LARGE_HEADER.n_layers)
    out = subprocess.run(
        [sys.executable, "-c", NODE_PROBE, str(large_header), layers],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    assert growth <= 1.15 * served + SLACK, (growth, served)


# A whole `meshnet generate` run (engine.local + engine.generate) of a model whose
# vocabulary is Gemma 3's size: 262k SentencePiece tokens, a Q8_0 embedding tied to the
# head (~71 MB of its ~73 MB), Q4_K_M-style layers.
LARGE_VOCAB = LargeVocabConfig()
# The tokenizer's tables (model/string_table.py), per token: its UTF-8 bytes (~12 here),
# an 8-byte offset, an 8-byte hash, two 4-byte index slots, a 4-byte score. The
# tokenizers-library build this replaced held ~400 bytes a token beside the file's
# parsed vocabulary: ~100 MB here.
TOKENIZER_BYTES_PER_TOKEN = 40
GENERATE_PROBE = """
import json, sys
from meshnet.backends.kernel_threads import set_threads
from meshnet.engine.generate import generate
from meshnet.engine.local import load_local_model
from meshnet.model.sampling import SamplingParams

set_threads(1)  # a team of threads spins for seconds on two busy cores; memory is the same

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

path, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = rss()
model = load_local_model(path)
held = []  # every cache the run makes, kept past the end of its request
new_sequence = model.chain.new_sequence
def keep():
    kv = new_sequence()
    held.extend(kv)
    return kv
model.chain.new_sequence = keep
ids = model.tokenizer.encode(prompt)
out = generate(model.chain, model.tokenizer, ids, SamplingParams(max_tokens=max_tokens))
print(json.dumps({"growth": rss() - before, "kv": sum(k.nbytes for k in held),
                  "positions": held[0].length, "generated": len(out.ids)}))
"""


@pytest.fixture(scope="module")
def large_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_large_vocab_gguf(tmp_path_factory.mktemp("vocab") / "vocab.gguf", LARGE_VOCAB)


def test_a_generate_run_holds_its_tensors_kv_and_a_compact_tokenizer(large_vocab: Path) -> None:
    """From before the file is opened to the end of a generation, the process grows by
    the tensors' bytes (+15%), the KV the run holds, the tokenizer's compact tables and
    SLACK: nothing of the parsed header, no second copy of the vocabulary."""
    tensors = sum(int(t.n_bytes) for t in open_gguf(large_vocab).tensors.values())
    out = subprocess.run(
        [sys.executable, "-c", GENERATE_PROBE, str(large_vocab), prompt_text(40), "32"],
        capture_output=True,
        text=True,
        timeout=300,
        env={"OPENBLAS_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=True,
    )
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["generated"] == 32 and figures["positions"] > 32  # a prompt, then 32 ids
    tokenizer = TOKENIZER_BYTES_PER_TOKEN * LARGE_VOCAB.n_tokens
    bound = 1.15 * tensors + figures["kv"] + tokenizer + SLACK
    assert figures["growth"] <= bound, (figures, tensors)


def test_kv_held_grows_with_the_tokens_not_the_context(tmp_path: Path) -> None:
    """A model of a 128k-token context: after its prompt and each generated token, a
    sequence's caches hold its positions plus at most an eighth of them (at least
    GRANULE), never room sized by the context or by how many tokens may follow."""
    path = write_tiny_gguf(tmp_path / "long.gguf", replace(TinyConfig(), context_length=131_072))
    chain = load_local_model(path, split=2, backend="numpy").chain  # every backend's KV alike
    kv = chain.new_sequence()
    per_position = sum(k.per_position for k in kv)
    logits = chain.forward(np.arange(3, 203, dtype=np.int64), [kv], [200])
    for _ in range(300):  # past several growths
        length = kv[0].length
        held = sum(k.nbytes for k in kv)
        assert length * per_position <= held <= (length + max(GRANULE, length // 8)) * per_position
        logits = chain.forward(np.asarray([int(np.argmax(logits[0]))]), [kv], [1])
    assert kv[0].length == 500
