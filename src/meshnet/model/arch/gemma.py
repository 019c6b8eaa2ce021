"""gemma2 and gemma3 (llama.cpp ``models/gemma2.cpp``, ``models/gemma3.cpp``).

Both: embeddings scaled by sqrt(d), RMSNorm after attention and after the
feed-forward as well as before, a GELU-gated feed-forward, NeoX rotary, local
(sliding-window) and global layers. Gemma 2 soft-caps attention scores and
logits; Gemma 3 normalises each query and key head instead and gives its local
layers their own rope base. The converter stores the norms as ``1 + w``, so
they are plain RMSNorm weights here.
"""

import math
from collections.abc import Callable

from meshnet.model.arch.base import Architecture, Shape, inverse_sqrt_head_dim

_LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}


def _attention_scale(name: str) -> Callable[[Shape], float]:
    def scale(shape: Shape) -> float:
        # The 27B models scale by d / n_heads, not the head width (gemma_pytorch's config).
        if shape.n_layers == _LAYERS_OF_27B[name]:
            return 1.0 / math.pow(shape.d_model // shape.n_heads, 0.5)
        return inverse_sqrt_head_dim(shape)

    return scale


GEMMA2 = Architecture(
    name="gemma2",
    rope_style="halves",
    post_norms=True,
    ffn_activation="gelu",
    scale_embedding=True,
    window_pattern=2,
    default_window=4096,
    default_attn_softcap=50.0,
    attention_scale=_attention_scale("gemma2"),
)

GEMMA3 = Architecture(
    name="gemma3",
    rope_style="halves",
    qk_norm=True,
    post_norms=True,
    ffn_activation="gelu",
    scale_embedding=True,
    window_pattern=6,
    local_rope_base=10000.0,
    attention_scale=_attention_scale("gemma3"),
)
