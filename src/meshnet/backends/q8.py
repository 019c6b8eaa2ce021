"""The q8 backend: the fast backend with 8-bit activations, as llama.cpp multiplies.

Each matmul input row is quantized to 8 bits the way llama.cpp does for the weight type
(Q8_0 or Q8_1 blocks of 32, Q8_K super-blocks of 256) and multiplied by integer dot
products (``native/q8.c``); a weight matrix of Q4_0, Q4_1, Q8_0, Q4_K or Q6_K is held in
the q8 variant of the native layout, the other types in the fast backend's own layout and
multiplied by its float32 kernels. Everything else (norms, rotary, attention, the block
in one native call, the bit-identity contracts) is the fast backend's. Where the
extension is not built, the q8 backend computes exactly as the fast one does.
"""

from __future__ import annotations

import gguf
import numpy as np

from meshnet.backends import quant
from meshnet.backends.fast import FastBackend, expert_matrices
from meshnet.backends.quant import QuantMatrix
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.spec import ModelSpec
from meshnet.model.weights import ShardWeights, load_shard_weights


class Q8Backend(FastBackend):
    """The fast backend on matrices in the q8 layout: 8-bit activations, integer dots."""

    name = "q8"


class Q8HalfKVBackend(Q8Backend):
    """q8 with a float16 KV cache, as llama.cpp's default one: keys and values are stored
    rounded to float16 and read widened, so the cache (and what parks, snapshots and
    migrates of it) takes half the memory and a decode step deep in a context reads half
    the bytes. Its bits differ from q8's; its own contracts (alone, batched, chunked,
    split, resumed: the same bits) hold as q8's do. Needs the native attention."""

    name = "q8-kv16"
    kv_dtype = np.float16


def load_q8_weights(f: GGUFFile, spec: ModelSpec, layers: LayerRange) -> ShardWeights[QuantMatrix]:
    """``layers``' weights, each matrix in the q8 layout where its type has a q8 kernel."""
    return load_shard_weights(f, spec, layers, quant.from_gguf_q8, _q8_experts)


def _q8_experts(
    f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int, int]
) -> tuple[QuantMatrix, ...]:
    return expert_matrices(f, t, shape, q8=True)
