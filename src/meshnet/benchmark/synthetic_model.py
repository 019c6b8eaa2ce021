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

Writing streams tensor by tensor (a 1B model is 2.5 GB in F16): each tensor is
drawn from its own seeded generator, so its values depend only on the seed and
its name, never on the order of writing.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from meshnet.benchmark.llama3_vocab import Vocabulary
from meshnet.errors import ModelError

F32 = np.float32
WEIGHT_STD = 0.02  # the usual initializer scale of Llama-family projections
NORM_STD = 0.02  # norm gains drawn around 1
_ROWS_PER_CHUNK = 4096  # rows drawn at a time: bounds the float32 scratch of the embedding

# The tensor types the writer can store, and the GGUF ``general.file_type`` each makes.
WEIGHT_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}


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


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its GGUF name, row-major shape and how it is drawn."""

    name: str
    shape: tuple[int, ...]  # numpy order: (rows, columns) for a matrix
    kind: str  # "weight" N(0, WEIGHT_STD), "norm" N(1, NORM_STD), "rope_freqs" computed


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
    if weight_type not in WEIGHT_TYPES:
        raise ModelError(f"weight type {weight_type!r} is not one of {sorted(WEIGHT_TYPES)}")
    qtype, file_type = WEIGHT_TYPES[weight_type]
    plan = tensor_plan(shape)
    tmp = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        _add_metadata(writer, shape, vocab, name, file_type)
        for t in plan:
            stored = qtype if t.kind == "weight" else gguf.GGMLQuantizationType.F32
            nbytes = _stored_nbytes(t.shape, stored)
            writer.add_tensor_info(t.name, t.shape, np.dtype(F32), nbytes, raw_dtype=stored)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            stored = qtype if t.kind == "weight" else gguf.GGMLQuantizationType.F32
            writer.write_tensor_data(_draw(t, shape, seed, stored))
            if progress is not None:
                progress(t.name)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)


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


def _stored_nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ModelError(f"a row of {shape[-1]} values is not whole {qtype.name} blocks of {block}")
    return math.prod(shape[:-1]) * shape[-1] // block * type_size


def _draw(
    t: TensorPlan, shape: LlamaShape, seed: int, stored: gguf.GGMLQuantizationType
) -> np.ndarray:
    """The stored values (F32, F16) or blocks (quantized) of one tensor.

    Rows are drawn a chunk at a time into the preallocated result, so the
    float32 scratch stays small next to the 128k-row embedding.
    """
    if t.kind == "rope_freqs":
        return _rope_freqs(shape)
    rng = np.random.default_rng([seed, _name_key(t.name)])
    mean, std = (1.0, NORM_STD) if t.kind == "norm" else (0.0, WEIGHT_STD)
    rows = t.shape[0] if len(t.shape) == 2 else 1
    cols = t.shape[-1]
    out = _empty_stored(rows, cols, stored)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        n = min(_ROWS_PER_CHUNK, rows - start)
        values = rng.standard_normal((n, cols), dtype=F32)
        values *= F32(std)
        values += F32(mean)
        out[start : start + n] = _encode(values, stored)
    return out.reshape(t.shape) if len(t.shape) == 1 else out


def _rope_freqs(shape: LlamaShape) -> np.ndarray:
    if shape.rope_scaling is None:
        raise ModelError("rope_freqs.weight is only written with llama3 rope scaling")
    return llama3_rope_factors(shape.head_dim, shape.rope_base, shape.rope_scaling)


def _empty_stored(rows: int, cols: int, stored: gguf.GGMLQuantizationType) -> np.ndarray:
    if stored == gguf.GGMLQuantizationType.F32:
        return np.empty((rows, cols), F32)
    if stored == gguf.GGMLQuantizationType.F16:
        return np.empty((rows, cols), np.float16)
    return np.empty((rows, _stored_nbytes((cols,), stored)), np.uint8)


def _encode(values: np.ndarray, stored: gguf.GGMLQuantizationType) -> np.ndarray:
    if stored == gguf.GGMLQuantizationType.F32:
        return values
    if stored == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, stored)


def _name_key(name: str) -> int:
    """A stable 64-bit key of a tensor name (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
