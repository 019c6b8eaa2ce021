"""A Llama-3-architecture GGUF of a real model's shape with seeded random weights.

meshnet has to be measured on a model of the size people run, and no such
model can be shipped or downloaded here; random weights at realistic scales
take the same time and memory as trained ones. The file is written as
llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama-3.2 checkpoint: the same
metadata keys, tensor names, F32 norms, a tied embedding (no ``output.weight``),
and the llama3 rope scaling as the ``rope_freqs.weight`` tensor of
per-dimension frequency divisors (the converter writes no ``rope.scaling.*``
key for it: llama.cpp would read ``rope.scaling.factor`` as a linear scale of
every frequency on top of the divisors). The tokenizer is the real Llama-3 one
(see ``meshnet.benchmark.llama3_vocab``).

Writing streams tensor by tensor (a 1B model is 2.5 GB in F16) through
``meshnet.benchmark.seeded_gguf``: each tensor is drawn from its own seeded
generator, so its values depend only on the seed and its name, never on the
order of writing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from meshnet.benchmark.llama3_vocab import Vocabulary
from meshnet.benchmark.seeded_gguf import F32, WEIGHT_TYPES, TensorPlan, write_gguf
from meshnet.errors import ModelError

__all__ = [
    "WEIGHT_TYPES",
    "Llama3RopeScaling",
    "LlamaShape",
    "TensorPlan",
    "llama3_rope_factors",
    "tensor_plan",
    "write_model",
]


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The ``rope_scaling`` block of a Llama-3.1/3.2 ``config.json`` (rope_type llama3)."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@dataclass(frozen=True)
class LlamaShape:
    """Hyperparameters of a llama-architecture model; the defaults are Llama-3.2-1B's."""

    n_layers: int = 16
    d_model: int = 2048
    d_ff: int = 8192
    n_heads: int = 32
    n_kv_heads: int = 8
    vocab_size: int = 128256
    context_length: int = 131072
    rope_base: float = 500000.0
    rms_eps: float = 1e-5
    rope_scaling: Llama3RopeScaling | None = field(default_factory=Llama3RopeScaling)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def check(self) -> None:
        """Raise ``ModelError`` on a shape no llama model can have."""
        sizes = (self.n_layers, self.d_model, self.d_ff, self.n_heads, self.n_kv_heads)
        if min(sizes) <= 0 or self.vocab_size <= 0 or self.context_length <= 0:
            raise ModelError(f"every size of a model must be positive: {self}")
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ModelError(f"heads do not divide the model width evenly: {self}")


def llama3_rope_factors(head_dim: int, base: float, scaling: Llama3RopeScaling) -> np.ndarray:
    """Per rotated pair, the divisor of its rope frequency under llama3 scaling.

    Frequencies whose wavelength is short next to the original context are
    kept (1), long ones divided by ``factor``, and those between blended
    smoothly, as Meta's reference and llama.cpp's converter compute them.
    """
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=F32) / head_dim))
    low_wavelen = scaling.original_context / scaling.low_freq_factor
    high_wavelen = scaling.original_context / scaling.high_freq_factor
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(scaling.factor)
        else:
            smooth = (scaling.original_context / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / scaling.factor + smooth))
    return np.asarray(factors, dtype=F32)


def tensor_plan(shape: LlamaShape) -> list[TensorPlan]:
    """Every tensor of the file, in the order written (the converter's order)."""
    d, kv = shape.d_model, shape.n_kv_heads * shape.head_dim
    plan = []
    if shape.rope_scaling is not None:
        plan.append(TensorPlan("rope_freqs.weight", (shape.head_dim // 2,), "rope_freqs"))
    plan.append(TensorPlan("token_embd.weight", (shape.vocab_size, d), "weight"))
    for i in range(shape.n_layers):
        b = f"blk.{i}"
        plan += [
            TensorPlan(f"{b}.attn_norm.weight", (d,), "norm"),
            TensorPlan(f"{b}.attn_q.weight", (d, d), "weight"),
            TensorPlan(f"{b}.attn_k.weight", (kv, d), "weight"),
            TensorPlan(f"{b}.attn_v.weight", (kv, d), "weight"),
            TensorPlan(f"{b}.attn_output.weight", (d, d), "weight"),
            TensorPlan(f"{b}.ffn_norm.weight", (d,), "norm"),
            TensorPlan(f"{b}.ffn_gate.weight", (shape.d_ff, d), "weight"),
            TensorPlan(f"{b}.ffn_up.weight", (shape.d_ff, d), "weight"),
            TensorPlan(f"{b}.ffn_down.weight", (d, shape.d_ff), "weight"),
        ]
    plan.append(TensorPlan("output_norm.weight", (d,), "norm"))
    return plan


def write_model(
    path: Path,
    shape: LlamaShape,
    vocab: Vocabulary,
    seed: int = 0,
    weight_type: str = "f16",
    name: str = "llama3-synthetic",
    progress: Callable[[str], None] | None = None,
) -> None:
    """Write the GGUF to ``path`` atomically (a temporary name, then a rename).

    Matrices are stored as ``weight_type``; norms and rope factors stay F32
    as the converter keeps 1-D tensors. Peak memory is one tensor.
    """
    shape.check()
    computed: dict[str, np.ndarray] = {}
    if shape.rope_scaling is not None:
        computed["rope_freqs.weight"] = _rope_freqs(shape)

    def metadata(w: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
        _add_metadata(w, shape, vocab, name, file_type)

    plan = tensor_plan(shape)
    write_gguf(path, "llama", plan, metadata, seed, weight_type, computed, progress)


def _add_metadata(
    w: gguf.GGUFWriter,
    shape: LlamaShape,
    vocab: Vocabulary,
    name: str,
    file_type: gguf.LlamaFileType,
) -> None:
    w.add_type("model")
    w.add_name(name)
    w.add_size_label(_size_label(shape))
    w.add_vocab_size(shape.vocab_size)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.d_model)
    w.add_feed_forward_length(shape.d_ff)
    w.add_block_count(shape.n_layers)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.add_to(w, shape.vocab_size)


def _size_label(shape: LlamaShape) -> str:
    kv = shape.n_kv_heads * shape.head_dim
    per_layer = 2 * shape.d_model * (shape.d_model + kv) + 3 * shape.d_model * shape.d_ff
    params = shape.n_layers * per_layer + shape.vocab_size * shape.d_model
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"


def _rope_freqs(shape: LlamaShape) -> np.ndarray:
    if shape.rope_scaling is None:
        raise ModelError("rope_freqs.weight is only written with llama3 rope scaling")
    return llama3_rope_factors(shape.head_dim, shape.rope_base, shape.rope_scaling)
