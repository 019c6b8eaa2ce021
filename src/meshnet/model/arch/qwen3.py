"""qwen3: Qwen 3 dense (llama.cpp ``models/qwen3.cpp``): NeoX rotary, RMSNorm of each query
and key head before it."""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(name="qwen3", rope_style="halves", qk_norm=True)
