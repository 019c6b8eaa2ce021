"""phi3: Phi-3 / Phi-3.5 mini (llama.cpp ``models/phi3.cpp``): NeoX rotary, one fused Q/K/V
matrix (``attn_qkv``) and a fused gate/up (``ffn_up`` holds [gate | up]).

llama.cpp runs Phi-3 without its sliding window, and so do we.
"""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(name="phi3", rope_style="halves", fused_gate_up=True)
