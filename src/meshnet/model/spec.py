"""The hyperparameters of a model, read from GGUF metadata for any supported family.

Common keys are read here under the file's architecture prefix; what a family
does differently comes from its module in ``model/arch`` as data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from meshnet.errors import ModelFileError, UnsupportedArchitecture
from meshnet.model.arch import Architecture, FfnActivation, Shape, architecture
from meshnet.model.arch.base import ExpertGating
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.metadata import float_value, int_value, optional_int
from meshnet.model.mla import Mla, read_mla
from meshnet.model.rope import Rope
from meshnet.model.yarn import Yarn, resolved_attn_factor

F32 = np.float32
_Key = Callable[[str], str]  # a key under the architecture's prefix
_SCALINGS = frozenset({"none", "linear", "yarn"})  # rope.scaling.type values we compute exactly


@dataclass(frozen=True)
class ModelSpec:
    """Shape and constants of a model; identical on every shard of it."""

    architecture: str
    n_layers: int
    d_model: int  # embedding width
    d_ff: int  # feed-forward hidden width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when fewer)
    head_dim: int  # width of one head (may differ from d_model / n_heads)
    rms_eps: float
    vocab_size: int
    context_length: int
    tied_head: bool  # the output head reuses the token embedding
    bos_id: int | None
    eos_id: int
    rope: Rope  # global layers' rotary
    rope_local: Rope  # windowed layers' rotary (the same as ``rope`` in most families)
    window: int  # sliding-window length of windowed layers; 0: none
    windowed: tuple[bool, ...]  # per layer: attends only the last ``window`` positions
    attn_scale: float  # scores = q . k * attn_scale
    attn_softcap: float  # scores = c * tanh(scores / c) when c > 0
    final_softcap: float  # logits = c * tanh(logits / c) when c > 0
    embed_scale: float  # token embeddings are multiplied by this
    qk_norm: bool  # RMSNorm over each head of q and k before rotary
    post_norms: bool  # RMSNorm of attention / FFN outputs before the residual
    ffn_activation: FfnActivation
    fused_gate_up: bool  # ffn_up is [gate | up]
    fused_qkv: bool  # one attn_qkv matrix instead of attn_q/k/v
    qkv_bias: bool  # the Q/K/V projections add biases
    experts: Experts | None = None  # the mixture of experts of the layers that have one
    ffn_norm_name: str = "ffn_norm"  # the pre-feed-forward norm's tensor (gpt-oss names it apart)
    mla: Mla | None = None  # multi-head latent attention (``head_dim`` is then its cache width)

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    def layer_rope(self, layer: int) -> Rope:
        """The rotary of model layer ``layer``."""
        return self.rope_local if self.is_windowed(layer) else self.rope

    def is_windowed(self, layer: int) -> bool:
        return bool(self.windowed) and self.windowed[layer]

    def layer_window(self, layer: int) -> int:
        """Positions model layer ``layer`` attends back over (itself included); 0: all."""
        return self.window if self.is_windowed(layer) else 0


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts feed-forward: a router picks ``n_used`` of ``n_experts`` gated
    FFNs of width ``d_ff`` for each row and sums their outputs by its weights."""

    n_experts: int
    n_used: int
    d_ff: int  # one expert's hidden width
    gating: ExpertGating
    normalize: bool  # the chosen weights are divided by their sum
    scale: float = 1.0  # then multiplied by this (expert_weights_scale)
    # The experts in ``n_groups`` equal groups: a row picks among the experts of its
    # ``n_groups_used`` best groups, a group scored by its two best (DeepSeek-V3); 0: none.
    n_groups: int = 0
    n_groups_used: int = 0
    shared_d_ff: int = 0  # the shared experts' width (ffn_*_shexp); 0: none
    selection_bias: bool = False  # a layer's ``exp_probs_b`` (where it has one) biases the choice

    @property
    def grouped(self) -> bool:
        return self.n_groups > 1


def read_spec(f: GGUFFile) -> ModelSpec:
    """Build the ``ModelSpec`` of ``f``; raise on an unsupported architecture or bad values."""
    name = str(f.value("general.architecture"))
    arch = architecture(name, f.path.name)

    def key(k: str) -> str:
        return f"{name}.{k}"

    d_model = int_value(f, key("embedding_length"))
    n_heads = int_value(f, key("attention.head_count"))
    n_kv_heads = int_value(f, key("attention.head_count_kv"), n_heads)
    if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
        raise ModelFileError(f"{f.path.name}: inconsistent heads ({n_heads} / {n_kv_heads} kv)")
    mla = read_mla(f, name) if arch.mla else None
    head_dim = mla.cache_dim if mla is not None else _head_dim(f, key, d_model, n_heads)
    n_layers = int_value(f, key("block_count"))
    if n_layers <= 0:
        raise ModelFileError(f"{f.path.name}: block_count must be positive")
    if int_value(f, key("nextn_predict_layers"), 0):  # llama.cpp reads it for every family
        raise UnsupportedArchitecture(
            f"{f.path.name}: multi-token prediction blocks (nextn_predict_layers) are not supported"
        )
    tensors = f.tensors
    vocab = tensors.get("token_embd.weight")
    if vocab is None:
        raise ModelFileError(f"{f.path.name}: tensor 'token_embd.weight' is missing")
    rope = _read_rope(f, arch, key, head_dim)
    key_dim = mla.key_dim if mla is not None else head_dim
    shape = _shape(f, arch, key, Shape(n_layers, d_model, n_heads, key_dim), rope)
    window, windowed = _read_windows(f, arch, key, n_layers)
    experts = _read_experts(f, arch, key, n_layers, int(vocab.shape[1]))
    return ModelSpec(
        architecture=name,
        n_layers=n_layers,
        d_model=d_model,
        d_ff=_dense_ff(f, key, experts),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rms_eps=float(f.value(key("attention.layer_norm_rms_epsilon"))),
        vocab_size=int(vocab.shape[1]),
        context_length=int_value(f, key("context_length"), 2048),
        tied_head="output.weight" not in tensors,
        bos_id=optional_int(f, "tokenizer.ggml.bos_token_id"),
        eos_id=int(f.value("tokenizer.ggml.eos_token_id")),
        rope=rope,
        rope_local=_local_rope(f, arch, key, rope) if windowed else rope,
        window=window,
        windowed=windowed,
        attn_scale=arch.attention_scale(shape),
        attn_softcap=float(f.value_or(key("attn_logit_softcapping"), arch.default_attn_softcap)),
        final_softcap=float(f.value_or(key("final_logit_softcapping"), 0.0)),
        embed_scale=float(np.sqrt(np.float32(d_model))) if arch.scale_embedding else 1.0,
        qk_norm=arch.qk_norm,
        post_norms=arch.post_norms,
        ffn_activation=arch.ffn_activation,
        fused_gate_up=arch.fused_gate_up,
        fused_qkv="blk.0.attn_qkv.weight" in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        experts=experts,
        ffn_norm_name=arch.ffn_norm_name,
        mla=mla,
    )


def _head_dim(f: GGUFFile, key: _Key, d_model: int, n_heads: int) -> int:
    """One head's width: ``attention.key_length``, else ``d / n_heads``; values the same."""
    default_hd = d_model // n_heads if d_model % n_heads == 0 else 0
    head_dim = int_value(f, key("attention.key_length"), default_hd)
    if head_dim <= 0 or int_value(f, key("attention.value_length"), head_dim) != head_dim:
        raise ModelFileError(f"{f.path.name}: keys and values must have one positive head width")
    return head_dim


def _shape(f: GGUFFile, arch: Architecture, key: _Key, shape: Shape, rope: Rope) -> Shape:
    """``shape`` with the rope's scale and magnitude, as the attention scale reads them
    (llama.cpp's ``freq_scale`` and ``cparams.yarn_attn_factor``). Without YaRN a family
    whose scale reads the magnitude (DeepSeek's) takes 1: a file that sets another is
    refused by name, as meshnet's rotary would not scale by it."""
    attn_factor = rope.yarn.attn_factor if rope.yarn is not None else 1.0
    if rope.yarn is None and arch.yarn_log_multiplier:
        for name in ("yarn_attn_factor", "attn_factor"):
            if float_value(f, key(f"rope.scaling.{name}"), 1.0) != 1.0:
                raise UnsupportedArchitecture(
                    f"{f.path.name}: rope.scaling.{name} without YaRN is not supported"
                )
    log_mul = rope.yarn.log_multiplier if rope.yarn is not None else 0.0
    return replace(
        shape, freq_scale=rope.scale, attn_factor=attn_factor, yarn_log_multiplier=log_mul
    )


def _read_experts(
    f: GGUFFile, arch: Architecture, key: _Key, n_layers: int, vocab: int
) -> Experts | None:
    """The file's mixture of experts, or None for a dense model. The expert width is read
    off the experts' down projection (``[d_ff, d, n_experts]`` in GGUF order), as every
    family's converter writes it whatever key it names the width by; the shared experts'
    likewise. How the router's weights are made is the family's, or the file's keys where
    the family reads them (llama.cpp reads no gating key for the others); groups are read
    for every family, as llama.cpp reads them."""
    n_experts = int_value(f, key("expert_count"), 0)
    if n_experts == 0:
        return None
    n_used = int_value(f, key("expert_used_count"), 0)
    if not 0 < n_used <= n_experts:
        raise ModelFileError(f"{f.path.name}: {n_used} experts used of {n_experts}")
    down = next((t for n, t in f.tensors.items() if n.endswith(".ffn_down_exps.weight")), None)
    if down is None or len(down.shape) != 3 or int(down.shape[2]) != n_experts:
        raise ModelFileError(f"{f.path.name}: no expert tensors of {n_experts} experts")
    shared = next((t for n, t in f.tensors.items() if n.endswith(".ffn_down_shexp.weight")), None)
    experts = Experts(
        n_experts=n_experts,
        n_used=n_used,
        d_ff=int(down.shape[0]),
        gating=arch.expert_gating,
        normalize=arch.expert_weights_norm,
        n_groups=int_value(f, key("expert_group_count"), 0),
        n_groups_used=int_value(f, key("expert_group_used_count"), 0),
        shared_d_ff=int(shared.shape[0]) if shared is not None else 0,
    )
    if arch.expert_router_keys:
        experts = _router_keys(f, arch, key, experts, n_layers, vocab)
    _check_groups(f, experts)
    return experts


# llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*); 3 takes the
# top k logits, then a softmax over those: what gpt-oss's router does.
_GATING_FUNCS: dict[int, ExpertGating] = {1: "softmax", 2: "sigmoid", 3: "softmax_chosen"}


def _router_keys(
    f: GGUFFile, arch: Architecture, key: _Key, experts: Experts, n_layers: int, vocab: int
) -> Experts:
    """``experts`` as the file's router keys say (DeepSeek's): gating, norm and scale."""
    func = int_value(f, key("expert_gating_func"), 0)
    if func == 0:
        gating = arch.unkeyed_gating(n_layers, vocab) if arch.unkeyed_gating else arch.expert_gating
    elif func in _GATING_FUNCS:
        gating = _GATING_FUNCS[func]
    else:
        raise UnsupportedArchitecture(f"{f.path.name}: expert_gating_func {func} is not supported")
    scale = float_value(f, key("expert_weights_scale"), 0.0)
    return replace(
        experts,
        gating=gating,
        normalize=bool(f.value_or(key("expert_weights_norm"), False)),
        scale=scale if scale != 0 else 1.0,  # 0: not set (llama.cpp scales by neither 0 nor 1)
        selection_bias=True,
    )


def _check_groups(f: GGUFFile, e: Experts) -> None:
    """Groups as llama.cpp asserts them, and enough experts in the groups kept."""
    if not e.grouped:
        return
    per_group = e.n_experts // e.n_groups
    if (
        e.n_groups >= e.n_experts
        or e.n_experts % e.n_groups
        or not 0 < e.n_groups_used < e.n_groups
        or e.n_used > e.n_groups_used * per_group
    ):
        raise ModelFileError(
            f"{f.path.name}: {e.n_used} of {e.n_experts} experts in {e.n_groups} groups, "
            f"{e.n_groups_used} used, do not route"
        )


def _dense_ff(f: GGUFFile, key: _Key, experts: Experts | None) -> int:
    """The width of the layers' dense feed-forward: the file's ``feed_forward_length`` for a
    dense model or one whose leading layers are dense (DeepSeek's), else a shared expert's
    where a mixture has one (its key, else its tensor), 0 where a mixture has none."""
    if experts is None or int_value(f, key("leading_dense_block_count"), 0) > 0:
        return int_value(f, key("feed_forward_length"))
    if f.has(key("expert_shared_feed_forward_length")):
        return int_value(f, key("expert_shared_feed_forward_length"))
    return experts.shared_d_ff


def _read_rope(f: GGUFFile, arch: Architecture, key: _Key, head_dim: int) -> Rope:
    dim = int_value(f, key("rope.dimension_count"), head_dim)
    if dim <= 0 or dim > head_dim or dim % 2:
        raise ModelFileError(f"{f.path.name}: rope dimension {dim} does not fit {head_dim}")
    scaling = str(f.value_or(key("rope.scaling.type"), "linear"))
    if scaling not in _SCALINGS:
        raise UnsupportedArchitecture(f"{f.path.name}: rope scaling {scaling!r} is not supported")
    factor = float(f.value_or(key("rope.scaling.factor"), f.value_or(key("rope.scale_linear"), 0)))
    if scaling == "yarn" and not (math.isfinite(factor) and factor >= 0):
        raise ModelFileError(f"{f.path.name}: rope.scaling.factor {factor} is not a YaRN factor")
    scale = 1.0 / factor if factor and scaling != "none" else 1.0  # llama.cpp's freq_scale
    factors = None
    freqs = f.tensors.get("rope_freqs.weight") if arch.rope_freqs else None
    if freqs is not None:
        values = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if values.size != dim // 2 or not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise ModelFileError(f"{f.path.name}: rope_freqs must hold {dim // 2} positive factors")
        factors = tuple(float(v) for v in values)
    if "blk.0.rope_factors_long.weight" in f.tensors:
        raise UnsupportedArchitecture(f"{f.path.name}: LongRoPE factors are not supported")
    base = float(f.value_or(key("rope.freq_base"), 10000.0))
    yarn = _read_yarn(f, arch, key, scale) if scaling == "yarn" else None
    return Rope(arch.rope_style, dim, base, scale, factors, yarn)


def _read_yarn(f: GGUFFile, arch: Architecture, key: _Key, freq_scale: float) -> Yarn:
    """YaRN's parameters as llama.cpp resolves them for a context that sets none of its
    own: the ramp over ``rope.scaling.original_context_length`` (else the training
    context), ``ext_factor`` 1 and betas 32 / 1 unless the file's ``yarn_*`` keys say
    otherwise, the magnitude from the factor (``yarn.resolved_attn_factor``).
    ``yarn_log_multiplier`` (DeepSeek's magnitude rule) is read where the family reads it
    and refused by name elsewhere."""

    def number(name: str, default: float) -> float:
        return float_value(f, key(f"rope.scaling.{name}"), default)

    log_mul = F32(number("yarn_log_multiplier", 0.0)) / F32(0.1)  # the converter's 0.1 undone
    if log_mul != 0 and not arch.yarn_log_multiplier:
        raise UnsupportedArchitecture(f"{f.path.name}: YaRN's yarn_log_multiplier is not supported")
    orig = int_value(f, key("rope.scaling.original_context_length"), 0)
    orig = orig or int_value(f, key("context_length"), 2048)
    if orig <= 0:
        raise ModelFileError(f"{f.path.name}: YaRN's original context length must be positive")
    ext = number("yarn_ext_factor", -1.0)
    ext = 1.0 if ext < 0 else ext  # negative: not set (llama.cpp: 1 for YaRN)
    attn = number("yarn_attn_factor", 1.0)
    attn = resolved_attn_factor(freq_scale, ext, attn, number("attn_factor", 1.0), log_mul != 0)
    fast, slow = number("yarn_beta_fast", 32.0), number("yarn_beta_slow", 1.0)
    return Yarn(orig, ext, attn, fast, slow, float(log_mul))


def _local_rope(f: GGUFFile, arch: Architecture, key: _Key, rope: Rope) -> Rope:
    """Windowed layers' rotary: the global one unless the family or the file gives them
    their own base (then unscaled, as llama.cpp has it)."""
    if arch.local_rope_base is None:
        return replace(rope, base=float(f.value_or(key("rope.freq_base_swa"), rope.base)))
    base = float(f.value_or(key("rope.freq_base_swa"), arch.local_rope_base))
    return Rope(rope.style, rope.dim, base)


def _read_windows(
    f: GGUFFile, arch: Architecture, key: _Key, n_layers: int
) -> tuple[int, tuple[bool, ...]]:
    """The window length and which layers use it (llama.cpp's ``set_swa_pattern``)."""
    if not arch.window_pattern:
        return 0, ()
    window = int_value(f, key("attention.sliding_window"), arch.default_window)
    if window <= 0:
        return 0, ()
    pattern = f.value_or(key("attention.sliding_window_pattern"), arch.window_pattern)
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise ModelFileError(f"{f.path.name}: sliding_window_pattern must list every layer")
        return window, tuple(bool(p) for p in pattern)
    n = int(pattern)
    return window, tuple(n == 0 or i % n < n - 1 for i in range(n_layers))
