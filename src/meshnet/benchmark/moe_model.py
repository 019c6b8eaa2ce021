"""A Qwen3-MoE-architecture GGUF of a realistic shape with seeded random weights.

The mixture-of-experts benchmark needs a model of the size people run on one
machine, and none can be shipped or downloaded here; random weights cost the
same time and memory as trained ones. The file is written as llama.cpp's
``convert_hf_to_gguf.py`` writes a Qwen3-MoE checkpoint (``Qwen3MoeModel``,
read by ``src/models/qwen3moe.cpp``): architecture ``qwen3moe``; the
converter's keys (``expert_count``, ``expert_used_count``,
``expert_feed_forward_length``, ``attention.key_length``/``value_length``,
``rope.freq_base``, no ``rope.dimension_count``); per block the attention
with RMS-normed query and key heads (``attn_q_norm``/``attn_k_norm``), the
router ``ffn_gate_inp`` [n_expert, d] kept F32, and the experts stacked into
3-D ``ffn_gate_exps``/``ffn_up_exps`` [n_expert, ff, d] and ``ffn_down_exps``
[n_expert, d, ff]; an untied ``output.weight``, as every Qwen3-MoE has. The
tokenizer is the real Llama-3 one (``meshnet.benchmark.llama3_vocab``): the
only real byte-level vocabulary the benchmarks already fetch.

The router is drawn wider than the projections: its logits are
``W_r @ rmsnorm(x)``, a sum of ``d`` products of unit-RMS activations, so a
spread of ``router_logit_std / sqrt(d)`` gives logits of about that standard
deviation. At 2 the softmax over 64 experts is peaked (the top expert ~0.3 of
the mass, the top 8 ~0.75), as trained routers are, rather than near-uniform
as the projections' 0.02 would make it (~0.06 and ~0.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf

from meshnet.benchmark.llama3_vocab import Vocabulary, llama3_tokenizer_dir, read_hf_vocabulary
from meshnet.benchmark.realistic_model import DEFAULT_QUANT, MODEL_CACHE, quantized_once
from meshnet.benchmark.seeded_gguf import TensorPlan, parameter_counts, plan_bytes, write_gguf
from meshnet.errors import ModelError

ARCH = "qwen3moe"
SOURCE_TYPE = "f32"  # llama-quantize's input: K-quants made from full precision
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class MoeShape:
    """Hyperparameters of a Qwen3-MoE model; the defaults are the benchmark's.

    Qwen3-30B-A3B's proportions at a size this machine holds: 24 layers, a
    query width twice the model width (16 heads of 128 over d 1024, as 32 x 128
    over 2048), 64 experts of which 8 are used, each expert half the model
    width wide (ff 512, a multiple of the K-quants' 256-value rows). That is
    ~2.8B parameters, ~0.56B read per token (0.43B in the blocks, 0.13B head).
    """

    n_layers: int = 24
    d_model: int = 1024
    n_heads: int = 16
    n_kv_heads: int = 4
    head_dim: int = 128
    n_experts: int = 64
    n_experts_used: int = 8
    d_ff_expert: int = 512
    vocab_size: int = 128256
    context_length: int = 40960  # Qwen3-MoE's max_position_embeddings
    rope_base: float = 1_000_000.0
    rms_eps: float = 1e-6
    router_logit_std: float = 2.0  # the spread of the router's logits (module docstring)

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def router_std(self) -> float:
        return self.router_logit_std / math.sqrt(self.d_model)

    def check(self) -> None:
        """Raise ``ModelError`` on a shape no Qwen3-MoE model can have."""
        sizes = (self.n_layers, self.d_model, self.n_heads, self.n_kv_heads, self.head_dim)
        experts = (self.n_experts, self.n_experts_used, self.d_ff_expert)
        if min(*sizes, *experts, self.vocab_size, self.context_length) <= 0:
            raise ModelError(f"every size of a model must be positive: {self}")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ModelError(f"query heads must group evenly over the KV heads: {self}")
        if self.n_experts_used > self.n_experts:
            raise ModelError(f"a token cannot use more experts than there are: {self}")


# A shape llama.cpp loads in a second: the harness's and the tests' smoke model (3
# layers: a 3-node split has one each).
TINY = MoeShape(
    n_layers=3,
    d_model=256,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    n_experts=8,
    n_experts_used=2,
    d_ff_expert=256,
    context_length=4096,
)


def tensor_plan(shape: MoeShape) -> list[TensorPlan]:
    """Every tensor of the file in numpy order (rows last but one), in writing order."""
    d, e, ff = shape.d_model, shape.n_experts, shape.d_ff_expert
    plan = [TensorPlan("token_embd.weight", (shape.vocab_size, d), "weight")]
    for i in range(shape.n_layers):
        b = f"blk.{i}"
        plan += [
            TensorPlan(f"{b}.attn_norm.weight", (d,), "norm"),
            TensorPlan(f"{b}.attn_q.weight", (shape.q_width, d), "weight"),
            TensorPlan(f"{b}.attn_k.weight", (shape.kv_width, d), "weight"),
            TensorPlan(f"{b}.attn_v.weight", (shape.kv_width, d), "weight"),
            TensorPlan(f"{b}.attn_q_norm.weight", (shape.head_dim,), "norm"),
            TensorPlan(f"{b}.attn_k_norm.weight", (shape.head_dim,), "norm"),
            TensorPlan(f"{b}.attn_output.weight", (d, shape.q_width), "weight"),
            TensorPlan(f"{b}.ffn_norm.weight", (d,), "norm"),
            TensorPlan(f"{b}.ffn_gate_inp.weight", (e, d), "router", shape.router_std),
            TensorPlan(f"{b}.ffn_gate_exps.weight", (e, ff, d), "weight"),
            TensorPlan(f"{b}.ffn_up_exps.weight", (e, ff, d), "weight"),
            TensorPlan(f"{b}.ffn_down_exps.weight", (e, d, ff), "weight"),
        ]
    plan += [
        TensorPlan("output_norm.weight", (d,), "norm"),
        TensorPlan("output.weight", (shape.vocab_size, d), "weight"),
    ]
    return plan


def write_moe_model(
    path: Path,
    shape: MoeShape,
    vocab: Vocabulary,
    seed: int = 0,
    weight_type: str = "f32",
    name: str = "qwen3moe-synthetic",
    progress: Callable[[str], None] | None = None,
) -> None:
    """Write the GGUF to ``path`` atomically; peak memory is one tensor (a layer's
    stacked experts: 134 MB in F32 at the default shape)."""
    shape.check()
    plan = tensor_plan(shape)

    def metadata(w: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
        _add_metadata(w, shape, vocab, name, gguf.size_label(*parameter_counts(plan)), file_type)

    write_gguf(path, ARCH, plan, metadata, seed, weight_type, progress=progress)


def _add_metadata(
    w: gguf.GGUFWriter,
    shape: MoeShape,
    vocab: Vocabulary,
    name: str,
    size_label: str,
    file_type: gguf.LlamaFileType,
) -> None:
    """The keys in the converter's order: ``TextModel.set_gguf_parameters``, then
    ``Qwen2MoeModel``'s expert width, then the vocabulary."""
    w.add_type("model")
    w.add_name(name)
    w.add_size_label(size_label)
    w.add_block_count(shape.n_layers)
    w.add_context_length(shape.context_length)
    w.add_embedding_length(shape.d_model)
    # HF's intermediate_size: the dense width the experts used together replace
    w.add_feed_forward_length(shape.n_experts_used * shape.d_ff_expert)
    w.add_head_count(shape.n_heads)
    w.add_head_count_kv(shape.n_kv_heads)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_expert_count(shape.n_experts)
    w.add_expert_used_count(shape.n_experts_used)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_file_type(file_type)
    w.add_expert_feed_forward_length(shape.d_ff_expert)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab.add_to(w, shape.vocab_size)


def model_stem(shape: MoeShape, seed: int) -> str:
    """A file name that changes with anything that changes the file's contents."""
    s = shape
    return (
        f"{ARCH}-synthetic-L{s.n_layers}-d{s.d_model}-h{s.n_heads}kv{s.n_kv_heads}x{s.head_dim}"
        f"-e{s.n_experts}u{s.n_experts_used}ff{s.d_ff_expert}-v{s.vocab_size}"
        f"-ctx{s.context_length}-rope{s.rope_base:g}-eps{s.rms_eps:g}"
        f"-router{s.router_logit_std:g}-s{seed}"
    )


def ensure_moe_model(
    shape: MoeShape = MoeShape(),
    seed: int = 0,
    quant: str = DEFAULT_QUANT,
    out_dir: Path = MODEL_CACHE,
    quantize_bin: Path | None = None,
    log: Callable[[str], None] = print,
    vocab: Vocabulary | None = None,
) -> Path:
    """The quantized file, made if missing: the F32 source is written (streaming),
    quantized by ``quantize_bin`` (llama.cpp's ``llama-quantize``) and deleted (11 GB
    at the default shape; the quantized file, 1.7 GB, is what is kept and measured).
    ``vocab``: the tokenizer written, the real Llama-3 one (fetched if missing) when
    None; the name of the file does not say which, so a test passes its own folder."""
    stem = model_stem(shape, seed)

    def write(source: Path) -> None:
        tokens = vocab or read_hf_vocabulary(llama3_tokenizer_dir())
        write_moe_model(source, shape, tokens, seed, SOURCE_TYPE, name=stem)

    source_bytes = plan_bytes(tensor_plan(shape), SOURCE_TYPE)
    return quantized_once(stem, quant, out_dir, quantize_bin, source_bytes, write, log)
