"""llama: Llama 1/2/3/3.1/3.2, Mistral, TinyLlama, SmolLM, and Mixtral (llama.cpp
``models/llama.cpp``).

The common decoder block; Llama 3.1+ long-context frequencies come from the
file's ``rope_freqs`` tensor, read with the rope. A file with experts
(``llama.expert_count``, ``ffn_*_exps``: Mixtral) routes each row to its top-k
experts by a softmax whose chosen weights are divided by their sum.
"""

from meshnet.model.arch.base import Architecture

ARCH = Architecture(name="llama", rope_style="pairs", rope_freqs=True, expert_weights_norm=True)
