"""qwen2moe: Qwen1.5-MoE / Qwen2-57B-A14B (llama.cpp ``models/qwen2moe.cpp``): Qwen 2's block
(NeoX rotary, Q/K/V biases) with a mixture of experts whose top-k softmax weights are
kept as they are, plus a shared expert scaled by ``sigmoid(ffn_gate_inp_shexp . h)``."""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(name="qwen2moe", rope_style="halves")
