"""qwen2: Qwen 1.5 / 2 / 2.5 (llama.cpp ``models/qwen2.cpp``): NeoX rotary and Q/K/V biases
(read from the file's ``attn_q.bias`` etc.)."""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(name="qwen2", rope_style="halves")
