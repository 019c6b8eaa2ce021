"""gpt-oss: OpenAI's gpt-oss-20b / 120b (llama.cpp ``models/openai-moe.cpp``).

NeoX rotary with YaRN scaling (read with the rope), biases on Q/K/V and the attention
output, a learned attention sink per head (``attn_sinks``), a sliding window on every
other layer (the even ones), and a mixture of experts in every layer: the router adds
its bias, keeps the top-k logits and takes a softmax over those alone; each expert adds
biases to its gate, up and down projections and gates with the clamped SwiGLU (alpha
1.702, limit 7). Its pre-FFN norm is stored as ``post_attention_norm``.
"""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(
    name="gpt-oss",
    rope_style="halves",
    ffn_activation="swiglu_oai",
    window_pattern=2,
    default_window=128,
    expert_gating="softmax_chosen",
    ffn_norm_name="post_attention_norm",
)
