"""deepseek2: DeepSeek-V2 / V2-Lite / V3 / R1, Kimi-K2, GLM-4.7-Lite (llama.cpp
``models/deepseek2.cpp``).

Multi-head latent attention (``model/mla.py``): queries directly or through a low-rank
latent, keys and values decompressed from one shared latent per position with a rotary
part shared by every head; normal (pair) rotary on that part only. The feed-forward is
dense in the leading layers (``leading_dense_block_count``) and a mixture elsewhere, plus
ungated shared experts; the router's gating (softmax or sigmoid), the selection bias
(``exp_probs_b``), groups, normalisation and scale are the file's keys. YaRN files carry
DeepSeek's magnitude rule (``yarn_log_multiplier``), which scales the attention scores.
"""

from __future__ import annotations

import math

import numpy as np

from meshnet.model.arch.base import Architecture, ExpertGating, Shape
from meshnet.model.yarn import fma32

F32 = np.float32
_GLM_LITE_LAYERS = (47, 48)
_GLM_LITE_VOCAB = 154880


def attention_scale(shape: Shape) -> float:
    """``mscale^2 / sqrt(key width)`` as llama.cpp computes it, float32: the rope's magnitude
    with the kernel's own ``1 + 0.1 ln(1 / freq_scale)`` put back, times DeepSeek's
    ``1 + 0.1 mscale_all_dim ln(1 / freq_scale)`` (1 where the rope is unscaled)."""
    log_inverse = F32(math.log(float(F32(1.0) / F32(shape.freq_scale))))
    original = F32(shape.attn_factor) * fma32(F32(0.1), log_inverse, F32(1.0))
    log_mul = F32(0.1) * F32(shape.yarn_log_multiplier)
    mscale = F32(original * fma32(log_mul, log_inverse, F32(1.0)))
    return float(mscale * mscale / np.sqrt(F32(shape.head_dim)))


def unkeyed_gating(n_layers: int, vocab: int) -> ExpertGating:
    """The router of a file without ``expert_gating_func``: softmax (DeepSeek-V2 / V2.5's
    files) but sigmoid for GLM-4.7-Lite's, known by its layers and vocabulary."""
    if n_layers in _GLM_LITE_LAYERS and vocab == _GLM_LITE_VOCAB:
        return "sigmoid"
    return "softmax"


ARCH = Architecture(
    name="deepseek2",
    rope_style="pairs",
    attention_scale=attention_scale,
    expert_router_keys=True,
    unkeyed_gating=unkeyed_gating,
    mla=True,
    yarn_log_multiplier=True,
)
