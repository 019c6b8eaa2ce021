"""qwen3moe: Qwen3-30B-A3B / 235B-A22B (llama.cpp ``models/qwen3moe.cpp``): Qwen 3's block
(NeoX rotary, per-head Q/K norms) with a mixture of experts for its feed-forward: a
softmax router whose top-k weights are divided by their sum."""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(name="qwen3moe", rope_style="halves", qk_norm=True, expert_weights_norm=True)
