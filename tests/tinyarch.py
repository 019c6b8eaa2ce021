"""Tiny random-weight GGUF files of every supported architecture, float32 throughout.

Each carries what its family's block has that llama's does not (Q/K/V biases,
per-head Q/K norms, fused Q/K/V and gate/up, post-norms, a head width other than
d / n_heads, sliding windows, soft-capping, rope factors), small enough that
llama.cpp and both backends run it in milliseconds. The same name and seed write
the same bytes: ``scripts/record_arch_oracles.py`` records llama.cpp's outputs
on these files and the tests compare with them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tinymodel import add_tokenizer, finish, vocabulary


@dataclass(frozen=True)
class ArchCase:
    """One tiny model: its family and the shape that exercises it."""

    name: str  # the case's name (file stem)
    architecture: str
    n_layers: int = 4
    d_model: int = 64
    d_ff: int = 96
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    context_length: int = 256
    tied_head: bool = False
    seed: int = 0
    n_experts: int = 0  # a mixture of experts in every layer's feed-forward when > 0
    n_used: int = 0  # experts each row goes through
    d_ff_expert: int = 0  # one expert's hidden width
    shared_expert: bool = False  # plus a sigmoid-gated shared expert (Qwen2-MoE)
    # DeepSeek's latent attention when kv_lora_rank > 0: the query latent (0: attn_q), the
    # kv latent, the rotary and no-rotary dims of a head (head_dim is their sum), a value
    # head's width
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    n_dense_lead: int = 0  # leading layers with a dense feed-forward (d_ff wide)
    n_shared_experts: int = 0  # ungated shared experts, d_ff_expert wide each
    sigmoid_router: bool = False  # sigmoid + exp_probs_b, normalised, scaled by 2.5
    expert_groups: tuple[int, int] = (0, 0)  # (groups, groups used)
    yarn_log_multiplier: float = 0.0  # YaRN x4 with DeepSeek's magnitude rule when > 0


CASES: dict[str, ArchCase] = {
    c.name: c
    for c in (
        ArchCase("llama3", "llama"),  # + rope_freqs (Llama 3.1 factors)
        ArchCase("qwen2", "qwen2"),  # + Q/K/V biases
        ArchCase("qwen3", "qwen3", head_dim=32),  # + per-head Q/K norms, wider heads
        ArchCase("phi3", "phi3", n_kv_heads=4),  # fused Q/K/V, fused gate/up
        ArchCase("gemma2", "gemma2", head_dim=32, tied_head=True),  # windows, soft-caps
        ArchCase("gemma3", "gemma3", head_dim=32, n_layers=6, tied_head=True),  # local rope
        # mixtures of experts: more experts than used, rows routed apart
        ArchCase("mixtral", "llama", d_ff=64, n_experts=6, n_used=2, d_ff_expert=64),
        ArchCase("qwen2moe", "qwen2moe", n_experts=8, n_used=3, d_ff_expert=32, shared_expert=True),
        ArchCase("qwen3moe", "qwen3moe", head_dim=32, n_experts=8, n_used=3, d_ff_expert=64),
        # + sinks, Q/K/V/O and expert biases, windows, YaRN, the clamped SwiGLU
        ArchCase("gpt-oss", "gpt-oss", head_dim=32, n_experts=4, n_used=2, d_ff_expert=64),
        # latent attention (value heads narrower than key heads), a dense first layer, then
        # experts with shared ones: V2-Lite's direct queries and softmax router ...
        ArchCase("deepseek2-lite", "deepseek2", n_kv_heads=1, head_dim=48, n_experts=8,
                 n_used=3, d_ff_expert=32, kv_lora_rank=32, rope_dim=16, v_head_dim=24,
                 n_dense_lead=1, n_shared_experts=2),
        # ... and V3's query latent, sigmoid router with selection bias in groups, YaRN
        ArchCase("deepseek3", "deepseek2", n_kv_heads=1, head_dim=48, n_experts=12,
                 n_used=3, d_ff_expert=32, q_lora_rank=32, kv_lora_rank=32, rope_dim=16,
                 v_head_dim=16, n_dense_lead=1, n_shared_experts=1, sigmoid_router=True,
                 expert_groups=(4, 2), yarn_log_multiplier=0.0707),
    )
}  # fmt: skip
ROUTER_SCALE = 6.0  # router logits spread wide: a row's k-th and next experts are no near tie

# Quantized files of the mixtures, as llama-quantize writes them from the float32 case
# (K-quant rows are whole super-blocks of 256): the case and the quantization (Q4_K_M:
# Q4_K and Q6_K; MXFP4_MOE: MXFP4 experts, Q8_0 elsewhere, as gpt-oss is published).
QUANT_CASES: dict[str, tuple[ArchCase, str]] = {
    c.name: (c, kind)
    for c, kind in (
        (ArchCase("mixtral-q4km", "llama", 2, 256, 256, 4, 2, 64, n_experts=4, n_used=2,
                  d_ff_expert=256), "Q4_K_M"),
        (ArchCase("qwen2moe-q4km", "qwen2moe", 2, 256, 256, 4, 2, 64, n_experts=6, n_used=2,
                  d_ff_expert=256, shared_expert=True), "Q4_K_M"),
        (ArchCase("qwen3moe-q4km", "qwen3moe", 2, 256, 256, 4, 2, 64, n_experts=6, n_used=3,
                  d_ff_expert=256), "Q4_K_M"),
        (ArchCase("gpt-oss-mxfp4", "gpt-oss", 2, 256, 256, 4, 2, 64, n_experts=4, n_used=2,
                  d_ff_expert=256), "MXFP4_MOE"),
    )
}  # fmt: skip

WINDOW = 8  # short, so that a test prompt runs past it


# A tensor's values as written, from its name and the values drawn for it.
Values = Callable[[str, np.ndarray], np.ndarray]


class _Tensors:
    """The writer's tensors, each passed through ``values`` on its way."""

    def __init__(self, w: gguf.GGUFWriter, values: Values | None) -> None:
        self._w, self._values = w, values

    def add_tensor(self, name: str, array: np.ndarray) -> None:
        self._w.add_tensor(name, array if self._values is None else self._values(name, array))


def write_arch_gguf(
    path: Path, case: ArchCase, values: Values | None = None, window: int = WINDOW
) -> Path:
    """Write ``case`` as a float32 GGUF at ``path`` and return it. ``values`` replaces
    each tensor's drawn values (the quantized oracles' dequantized weights); ``window``:
    the sliding window of a family that has one."""
    rng = np.random.default_rng(case.seed)
    arch = case.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(case.n_layers)
    w.add_context_length(case.context_length)
    w.add_embedding_length(case.d_model)
    w.add_feed_forward_length(case.d_ff)
    w.add_head_count(case.n_heads)
    w.add_head_count_kv(case.n_kv_heads)
    if case.kv_lora_rank:
        _mla_keys(w, case)
    elif case.head_dim * case.n_heads != case.d_model:
        w.add_key_length(case.head_dim)
        w.add_value_length(case.head_dim)
    w.add_rope_dimension_count(case.rope_dim or case.head_dim)
    w.add_rope_freq_base(10000.0 if arch != "gemma3" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if case.n_experts:
        w.add_expert_count(case.n_experts)
        w.add_expert_used_count(case.n_used)
        if arch != "llama":  # Mixtral's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(case.d_ff_expert)
        if case.shared_expert:
            w.add_expert_shared_feed_forward_length(case.d_ff)
    if arch == "deepseek2":
        _deepseek2_keys(w, case)
    _FAMILY_KEYS.get(arch, _no_keys)(w, window)
    add_tokenizer(w)
    _write_tensors(_Tensors(w, values), rng, case, len(vocabulary()[0]))
    finish(w)
    return path


def _write_tensors(w: _Tensors, rng: np.random.Generator, case: ArchCase, vocab: int) -> None:
    d, hd, ff = case.d_model, case.head_dim, case.d_ff
    q, kv = case.n_heads * hd, case.n_kv_heads * hd
    arch = case.architecture

    def matrix(name: str, rows: int, cols: int, scale: float = 1.0) -> None:
        w.add_tensor(
            name, (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)
        )

    def vector(name: str, size: int, mean: float = 1.0, spread: float = 0.1) -> None:
        w.add_tensor(name, (mean + spread * rng.standard_normal(size)).astype(np.float32))

    w.add_tensor("token_embd.weight", (0.4 * rng.standard_normal((vocab, d))).astype(np.float32))
    if arch == "llama":  # Llama 3.1-style factors: high frequencies kept, low ones slowed
        w.add_tensor("rope_freqs.weight", np.linspace(1.0, 8.0, hd // 2).astype(np.float32))
    for i in range(case.n_layers):
        p = f"blk.{i}."
        vector(p + "attn_norm.weight", d)
        if case.kv_lora_rank:
            _write_mla(w, rng, case, p)
        elif arch == "phi3":
            matrix(p + "attn_qkv.weight", q + 2 * kv, d, 1.0)
        else:
            for part, rows in (("q", q), ("k", kv), ("v", kv)):
                matrix(p + f"attn_{part}.weight", rows, d, 1.0)
                if arch in ("qwen2", "qwen2moe", "gpt-oss"):
                    vector(p + f"attn_{part}.bias", rows, 0.0, 0.5)
        if arch in ("qwen3", "gemma3", "qwen3moe"):
            vector(p + "attn_q_norm.weight", hd)
            vector(p + "attn_k_norm.weight", hd)
        heads_out = case.n_heads * case.v_head_dim if case.kv_lora_rank else q
        matrix(p + "attn_output.weight", d, heads_out)
        if arch == "gpt-oss":
            vector(p + "attn_output.bias", d, 0.0, 0.5)
            vector(p + "attn_sinks.weight", case.n_heads, 0.0, 2.0)
        vector(p + ("post_attention_norm.weight" if arch == "gpt-oss" else "ffn_norm.weight"), d)
        moe = case.n_experts and i >= case.n_dense_lead
        if moe:
            _write_experts(w, rng, case, p)
        elif arch == "phi3":
            matrix(p + "ffn_up.weight", 2 * ff, d, 1.0)
        if not moe:
            if arch != "phi3":
                matrix(p + "ffn_gate.weight", ff, d, 1.0)
                matrix(p + "ffn_up.weight", ff, d, 1.0)
            matrix(p + "ffn_down.weight", d, ff)
        if arch.startswith("gemma"):
            vector(p + "post_attention_norm.weight", d)
            vector(p + "post_ffw_norm.weight", d)
    vector("output_norm.weight", d)
    if not case.tied_head:
        matrix("output.weight", vocab, d, 4.0)


def _write_experts(w: _Tensors, rng: np.random.Generator, case: ArchCase, p: str) -> None:
    """A layer's router, its experts as 3-D tensors [n_experts, rows, cols], and the shared
    expert where the case has one."""
    d, e, ff = case.d_model, case.n_experts, case.d_ff_expert

    def tensor(name: str, shape: tuple[int, ...], scale: float) -> None:
        values = rng.standard_normal(shape) * scale / np.sqrt(shape[-1])
        w.add_tensor(name, values.astype(np.float32))

    # a sigmoid's router logits near 0: apart from the saturated ends, where experts tie
    tensor(p + "ffn_gate_inp.weight", (e, d), 1.5 if case.sigmoid_router else ROUTER_SCALE)
    if case.sigmoid_router:
        tensor(p + "exp_probs_b.bias", (e,), 0.3)
    tensor(p + "ffn_gate_exps.weight", (e, ff, d), 1.0)
    tensor(p + "ffn_up_exps.weight", (e, ff, d), 1.0)
    tensor(p + "ffn_down_exps.weight", (e, d, ff), 1.0)
    if case.architecture == "gpt-oss":  # biases on the router and on every expert
        tensor(p + "ffn_gate_inp.bias", (e,), 1.0)
        tensor(p + "ffn_gate_exps.bias", (e, ff), 0.5 * np.sqrt(ff))
        tensor(p + "ffn_up_exps.bias", (e, ff), 0.5 * np.sqrt(ff))
        tensor(p + "ffn_down_exps.bias", (e, d), 0.5 * np.sqrt(d))
    if case.shared_expert:
        tensor(p + "ffn_gate_inp_shexp.weight", (d,), 2.0 * np.sqrt(d))  # gate . h ~ N(0, 4)
        tensor(p + "ffn_gate_shexp.weight", (case.d_ff, d), 1.0)
        tensor(p + "ffn_up_shexp.weight", (case.d_ff, d), 1.0)
        tensor(p + "ffn_down_shexp.weight", (d, case.d_ff), 1.0)
    if case.n_shared_experts:
        shared = case.n_shared_experts * ff
        tensor(p + "ffn_gate_shexp.weight", (shared, d), 1.0)
        tensor(p + "ffn_up_shexp.weight", (shared, d), 1.0)
        tensor(p + "ffn_down_shexp.weight", (d, shared), 1.0)


def _write_mla(w: _Tensors, rng: np.random.Generator, case: ArchCase, p: str) -> None:
    """A layer's latent attention: queries (direct or through their latent), the kv
    latent with the shared rotary part, and the per-head k_b [r, n] and v_b [v, r]."""
    d, heads, r, rope = case.d_model, case.n_heads, case.kv_lora_rank, case.rope_dim
    nope, q_rows = case.head_dim - rope, case.n_heads * case.head_dim

    def tensor(name: str, shape: tuple[int, ...], scale: float = 1.0) -> None:
        values = rng.standard_normal(shape) * scale / np.sqrt(shape[-1])
        w.add_tensor(name, values.astype(np.float32))

    if case.q_lora_rank:
        tensor(p + "attn_q_a.weight", (case.q_lora_rank, d))
        w.add_tensor(p + "attn_q_a_norm.weight", _norm(rng, case.q_lora_rank))
        tensor(p + "attn_q_b.weight", (q_rows, case.q_lora_rank))
    else:
        tensor(p + "attn_q.weight", (q_rows, d))
    tensor(p + "attn_kv_a_mqa.weight", (r + rope, d))
    w.add_tensor(p + "attn_kv_a_norm.weight", _norm(rng, r))
    tensor(p + "attn_k_b.weight", (heads, r, nope))
    tensor(p + "attn_v_b.weight", (heads, case.v_head_dim, r))


def _norm(rng: np.random.Generator, size: int) -> np.ndarray:
    return (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32)


def _mla_keys(w: gguf.GGUFWriter, case: ArchCase) -> None:
    """What llama.cpp's converter writes for latent attention: one kv head of [c | k_pe]."""
    w.add_q_lora_rank(case.q_lora_rank)
    w.add_kv_lora_rank(case.kv_lora_rank)
    w.add_key_length(case.kv_lora_rank + case.rope_dim)
    w.add_value_length(case.kv_lora_rank)
    w.add_key_length_mla(case.head_dim)
    w.add_value_length_mla(case.v_head_dim)


def _deepseek2_keys(w: gguf.GGUFWriter, case: ArchCase) -> None:
    w.add_leading_dense_block_count(case.n_dense_lead)
    w.add_expert_shared_count(case.n_shared_experts)
    if case.sigmoid_router:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(2.5)
    if case.expert_groups[0]:
        w.add_expert_group_count(case.expert_groups[0])
        w.add_expert_group_used_count(case.expert_groups[1])
    if case.yarn_log_multiplier:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_rope_scaling_yarn_log_mul(case.yarn_log_multiplier)


def _gemma2_keys(w: gguf.GGUFWriter, window: int) -> None:
    w.add_sliding_window(window)
    w.add_attn_logit_softcapping(3.0)  # far below Gemma's 50: small scores must feel it
    w.add_final_logit_softcapping(5.0)


def _gemma3_keys(w: gguf.GGUFWriter, window: int) -> None:
    w.add_sliding_window(window)
    w.add_sliding_window_pattern(3)  # layers 0, 1, 3, 4 local; 2, 5 global
    w.add_rope_freq_base_swa(10000.0)


def _gpt_oss_keys(w: gguf.GGUFWriter, window: int) -> None:
    w.add_sliding_window(window)  # even layers local
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(64)


def _no_keys(w: gguf.GGUFWriter, window: int) -> None:
    pass


_FAMILY_KEYS: dict[str, Callable[[gguf.GGUFWriter, int], None]] = {
    "gemma2": _gemma2_keys,
    "gemma3": _gemma3_keys,
    "gpt-oss": _gpt_oss_keys,
}
