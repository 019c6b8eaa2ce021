"""A Gemma-3-architecture GGUF of Gemma 3 270M's shape with seeded random weights.

The long-context benchmark (``meshnet bench --at-depth``) runs a model whose
attention is Gemma 3's: one KV head of 256 shared by 4 query heads, five of
every six layers attending in a 512-token window. No Gemma file can be shipped
or downloaded here; random weights of the real shapes cost the same time and
memory as trained ones. The file is written as llama.cpp's converter writes a
Gemma 3 checkpoint (``Gemma3Model``, read by ``src/models/gemma3.cpp``):
architecture ``gemma3``; the keys ``attention.key_length``/``value_length``
(the head width is not d / heads), ``rope.freq_base`` (global layers) and
``rope.freq_base_swa`` (local ones), ``attention.sliding_window`` and no
``sliding_window_pattern`` key (llama.cpp's gemma3 default, 6, applies: layer
``i`` is local when ``i % 6 < 5``); per block the RMS-normed query and key heads
(``attn_q_norm``/``attn_k_norm``), and norms after attention and after the
feed-forward (``post_attention_norm``, ``post_ffw_norm``) as well as before;
the embedding tied to the head (no ``output.weight``). Norm gains are drawn
around 1: the converter stores Gemma's ``1 + w`` gains. The vocabulary is a
synthetic one of Gemma's size and layout (``meshnet.benchmark.gemma_vocab``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf

from meshnet.benchmark.gemma_vocab import GEMMA3_VOCAB_SIZE, MIN_VOCAB_SIZE, synthetic_vocabulary
from meshnet.benchmark.realistic_model import DEFAULT_QUANT, MODEL_CACHE, quantized_once
from meshnet.benchmark.seeded_gguf import TensorPlan, parameter_counts, plan_bytes, write_gguf
from meshnet.errors import ModelError

ARCH = "gemma3"
SOURCE_TYPE = "f32"  # llama-quantize's input: K-quants made from full precision
WINDOW_PATTERN = 6  # llama.cpp's for gemma3: of each 6 layers, the first 5 are local


@dataclass(frozen=True)
class GemmaShape:
    """Hyperparameters of a Gemma 3 model; the defaults are Gemma 3 270M's
    (its ``config.json``): ~268M parameters, 168M of them the embedding."""

    n_layers: int = 18
    d_model: int = 640
    n_heads: int = 4
    n_kv_heads: int = 1
    head_dim: int = 256
    d_ff: int = 2048
    vocab_size: int = GEMMA3_VOCAB_SIZE
    context_length: int = 32_768
    sliding_window: int = 512
    rope_base: float = 1_000_000.0  # the global layers'
    local_rope_base: float = 10_000.0  # the windowed layers'
    rms_eps: float = 1e-6

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_windowed(self, layer: int) -> bool:
        """Whether ``layer`` attends in the sliding window (else to the whole context)."""
        return layer % WINDOW_PATTERN < WINDOW_PATTERN - 1

    def check(self) -> None:
        """Raise ``ModelError`` on a shape no Gemma 3 model (or its vocabulary) can have."""
        sizes = (self.n_layers, self.d_model, self.n_heads, self.n_kv_heads, self.head_dim)
        if min(*sizes, self.d_ff, self.context_length, self.sliding_window) <= 0:
            raise ModelError(f"every size of a model must be positive: {self}")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ModelError(f"query heads must group evenly over the KV heads: {self}")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ModelError(f"the vocabulary needs at least {MIN_VOCAB_SIZE} ids: {self}")


def tensor_plan(shape: GemmaShape) -> list[TensorPlan]:
    """Every tensor of the file in numpy order (rows last but one), in the order
    llama.cpp's gemma3.cpp creates them; the output norm last."""
    d, hd = shape.d_model, shape.head_dim
    plan = [TensorPlan("token_embd.weight", (shape.vocab_size, d), "weight")]
    for i in range(shape.n_layers):
        b = f"blk.{i}"
        plan += [
            TensorPlan(f"{b}.attn_norm.weight", (d,), "norm"),
            TensorPlan(f"{b}.attn_q.weight", (shape.q_width, d), "weight"),
            TensorPlan(f"{b}.attn_k.weight", (shape.kv_width, d), "weight"),
            TensorPlan(f"{b}.attn_v.weight", (shape.kv_width, d), "weight"),
            TensorPlan(f"{b}.attn_output.weight", (d, shape.q_width), "weight"),
            TensorPlan(f"{b}.post_attention_norm.weight", (d,), "norm"),
            TensorPlan(f"{b}.attn_k_norm.weight", (hd,), "norm"),
            TensorPlan(f"{b}.attn_q_norm.weight", (hd,), "norm"),
            TensorPlan(f"{b}.ffn_norm.weight", (d,), "norm"),
            TensorPlan(f"{b}.ffn_gate.weight", (shape.d_ff, d), "weight"),
            TensorPlan(f"{b}.ffn_up.weight", (shape.d_ff, d), "weight"),
            TensorPlan(f"{b}.ffn_down.weight", (d, shape.d_ff), "weight"),
            TensorPlan(f"{b}.post_ffw_norm.weight", (d,), "norm"),
        ]
    plan.append(TensorPlan("output_norm.weight", (d,), "norm"))
    return plan


def parameter_count(shape: GemmaShape) -> int:
    """The model's parameters, the tied head counted once (as the embedding)."""
    return sum(math.prod(t.shape) for t in tensor_plan(shape))


def write_gemma_model(
    path: Path,
    shape: GemmaShape,
    seed: int = 0,
    weight_type: str = "f32",
    name: str = "gemma3-synthetic",
    progress: Callable[[str], None] | None = None,
) -> None:
    """Write the GGUF to ``path`` atomically; peak memory is one tensor (the embedding,
    671 MB in F32 at the default shape) and the vocabulary."""
    shape.check()
    plan = tensor_plan(shape)
    vocab = synthetic_vocabulary(shape.vocab_size)

    def metadata(w: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
        w.add_type("model")
        w.add_name(name)
        w.add_size_label(gguf.size_label(*parameter_counts(plan)))
        _add_hyperparameters(w, shape)
        w.add_file_type(file_type)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab.add_to(w)

    write_gguf(path, ARCH, plan, metadata, seed, weight_type, progress=progress)


def _add_hyperparameters(w: gguf.GGUFWriter, shape: GemmaShape) -> None:
    """The keys in the converter's order: ``TextModel.set_gguf_parameters`` (the rope
    bases from ``rope_parameters``' full and sliding attention), then ``Gemma3Model``'s
    window (the keys it writes again are already here, with the same values)."""
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.d_model)
    w.add_feed_forward_length(shape.d_ff)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_rope_freq_base(shape.rope_base)
    w.add_rope_freq_base_swa(shape.local_rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_sliding_window(shape.sliding_window)


def model_stem(shape: GemmaShape, seed: int) -> str:
    """A file name that changes with anything that changes the file's contents: the
    270M's name for the default shape, else every size."""
    if shape == GemmaShape():
        return f"{ARCH}-270m-synthetic-s{seed}"
    s = shape
    return (
        f"{ARCH}-synthetic-L{s.n_layers}-d{s.d_model}-h{s.n_heads}kv{s.n_kv_heads}x{s.head_dim}"
        f"-ff{s.d_ff}-v{s.vocab_size}-ctx{s.context_length}-swa{s.sliding_window}"
        f"-rope{s.rope_base:g}-{s.local_rope_base:g}-eps{s.rms_eps:g}-s{seed}"
    )


def ensure_gemma_model(
    shape: GemmaShape = GemmaShape(),
    seed: int = 0,
    quant: str = DEFAULT_QUANT,
    out_dir: Path = MODEL_CACHE,
    quantize_bin: Path | None = None,
    log: Callable[[str], None] = print,
    threads: int = 2,
) -> Path:
    """The quantized file, made if missing: the F32 source is written (streaming),
    quantized by ``quantize_bin`` (llama.cpp's ``llama-quantize``, on ``threads``
    threads) and deleted (1.1 GB at the default shape; the Q4_K_M file kept is
    ~0.25 GB). At the default shape and seed 0 the file is
    ``~/.cache/meshnet/models/gemma3-270m-synthetic-s0-Q4_K_M.gguf``."""
    stem = model_stem(shape, seed)

    def write(source: Path) -> None:
        write_gemma_model(source, shape, seed, SOURCE_TYPE, name=stem)

    source_bytes = plan_bytes(tensor_plan(shape), SOURCE_TYPE)
    return quantized_once(stem, quant, out_dir, quantize_bin, source_bytes, write, log, threads)
