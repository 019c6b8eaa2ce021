"""llama: Llama 1/2/3/3.1/3.2, Mistral, TinyLlama, SmolLM (llama.cpp ``models/llama.cpp``).

The common decoder block; Llama 3.1+ long-context frequencies come from the
file's ``rope_freqs`` tensor, read with the rope.
"""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(name="llama", rope_style="pairs", rope_freqs=True)
