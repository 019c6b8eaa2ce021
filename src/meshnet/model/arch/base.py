"""What a model family's decoder block does differently from llama's, as data.

The shared kernels read these traits; they never branch on a family's name.
Which tensors are present (fused Q/K/V, Q/K/V biases) is read from the file
itself, as llama.cpp does for every family.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from meshnet.model.rope import RopeStyle

FfnActivation = Literal["silu", "gelu", "swiglu_oai"]  # gelu: the tanh approximation
# How a mixture of experts turns router logits into the chosen experts' weights:
# "softmax": a softmax over every expert, the top k kept (Mixtral, Qwen MoE);
# "softmax_chosen": the top k logits, then a softmax over those alone (gpt-oss);
# "sigmoid": each expert's own sigmoid, the top k kept (DeepSeek-V3, GLM-4.7-Lite).
ExpertGating = Literal["softmax", "softmax_chosen", "sigmoid"]


@dataclass(frozen=True)
class Shape:
    """The few hyperparameters a family's rules are written in terms of."""

    n_layers: int
    d_model: int
    n_heads: int
    head_dim: int  # a key head's width (multi-head latent attention: before absorption)
    freq_scale: float = 1.0  # the rope's position scale (1 / its scaling factor)
    attn_factor: float = 1.0  # the rope's magnitude factor as llama.cpp resolves it
    yarn_log_multiplier: float = 0.0  # DeepSeek's mscale_all_dim (rope.scaling.yarn_log_multiplier)


def inverse_sqrt_head_dim(shape: Shape) -> float:
    """The usual attention scale, ``1 / sqrt(head_dim)``."""
    return 1.0 / math.pow(shape.head_dim, 0.5)  # math.pow: float ** float types as Any


@dataclass(frozen=True)
class Architecture:
    """One family's traits (llama.cpp's ``src/models/<arch>.cpp`` says each)."""

    name: str  # general.architecture
    rope_style: RopeStyle  # "pairs" (llama.cpp NORM) or "halves" (NEOX)
    rope_freqs: bool = False  # a ``rope_freqs`` tensor divides the frequencies (Llama 3.1+)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary
    post_norms: bool = False  # RMSNorm of the attention and FFN outputs before each residual
    ffn_activation: FfnActivation = "silu"
    fused_gate_up: bool = False  # ffn_up holds [gate | up] and there is no ffn_gate
    scale_embedding: bool = False  # token embeddings are multiplied by sqrt(d_model)
    window_pattern: int = 0  # n: layer i attends in a window when i % n < n - 1; 0: never
    default_window: int = 0  # window length when the file names none
    default_attn_softcap: float = 0.0  # tanh soft-capping of attention scores; 0: none
    local_rope_base: float | None = None  # windowed layers' rope base if the file names none
    attention_scale: Callable[[Shape], float] = inverse_sqrt_head_dim
    # Mixtures of experts (a layer is one where the file has ``blk.N.ffn_gate_inp``):
    expert_gating: ExpertGating = "softmax"
    expert_weights_norm: bool = False  # the chosen experts' weights divided by their sum
    ffn_norm_name: str = "ffn_norm"  # the tensor of the norm before the feed-forward
    # The file's expert_gating_func, expert_weights_norm and expert_weights_scale keys and
    # each layer's ``exp_probs_b`` selection bias say how the router weighs (DeepSeek);
    # ``unkeyed_gating(n_layers, vocab)``: the gating of a file without the gating key.
    expert_router_keys: bool = False
    unkeyed_gating: Callable[[int, int], ExpertGating] | None = None
    mla: bool = False  # multi-head latent attention (``model/mla.py``)
    yarn_log_multiplier: bool = False  # reads rope.scaling.yarn_log_multiplier (DeepSeek)
