"""Multi-head latent attention's shape (DeepSeek-V2, Liu et al. 2024), read from a file.

Each position's keys and values come from one latent ``c`` of ``kv_rank`` dims (normed)
and one rotated part ``k_pe`` of ``rope_dim`` dims shared by every head. Head ``h``'s
key is ``[W_kb[h] c | k_pe]`` (``nope_dim + rope_dim``) and its value ``W_vb[h] c``
(``v_dim``). Run as llama.cpp runs a file with the split ``attn_k_b`` / ``attn_v_b``
tensors, "absorbed": a query head's no-rotary part is multiplied by ``W_kb[h]``
beforehand (``q . W_kb c == (W_kb^T q) . c``), so every head attends over the same
cached ``[c | k_pe]`` of ``kv_rank + rope_dim`` dims, one kv head (multi-query), and
its output over the ``c`` part goes through ``W_vb[h]`` afterwards. The cache then
holds ``kv_rank + rope_dim`` floats a position and layer instead of a key and a value
per head.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.errors import ModelFileError, UnsupportedArchitecture
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.metadata import int_value


@dataclass(frozen=True)
class Mla:
    """The widths of a model's latent attention (the same in every layer)."""

    q_rank: int  # the queries' low-rank latent (attn_q_a -> norm -> attn_q_b); 0: attn_q
    kv_rank: int  # the keys' and values' latent c
    nope_dim: int  # a query / key head's dims without rotary
    rope_dim: int  # its rotated dims (the key's are shared by every head)
    v_dim: int  # a value head's width

    @property
    def key_dim(self) -> int:
        """A key head's width before absorption (the attention scale's)."""
        return self.nope_dim + self.rope_dim

    @property
    def cache_dim(self) -> int:
        """What a position caches per layer: ``[c | k_pe]``."""
        return self.kv_rank + self.rope_dim


def read_mla(f: GGUFFile, prefix: str) -> Mla:
    """The file's latent attention; ``UnsupportedArchitecture`` for a file with the legacy
    fused ``attn_kv_b`` (converted before llama.cpp split it), which llama.cpp runs
    decompressed and meshnet does not run, or with Mistral-Large's per-position query
    temperature; ``ModelFileError`` for inconsistent widths."""
    name = f.path.name

    def key(k: str) -> int:
        return int_value(f, f"{prefix}.{k}", 0)

    if "blk.0.attn_kv_b.weight" in f.tensors or not f.has(f"{prefix}.attention.key_length_mla"):
        raise UnsupportedArchitecture(
            f"{name}: the legacy fused attn_kv_b (no attn_k_b / attn_v_b) is not supported"
        )
    if f.value_or(f"{prefix}.attention.temperature_scale", 0):
        raise UnsupportedArchitecture(
            f"{name}: attention temperature scaling (attention.temperature_scale) is not supported"
        )
    rope = key("rope.dimension_count")
    q_rank = key("attention.q_lora_rank") if "blk.0.attn_q_a.weight" in f.tensors else 0
    mla = Mla(
        q_rank=q_rank,
        kv_rank=key("attention.kv_lora_rank"),
        nope_dim=key("attention.key_length_mla") - rope,
        rope_dim=rope,
        v_dim=key("attention.value_length_mla"),
    )
    if min(mla.kv_rank, mla.nope_dim, mla.rope_dim, mla.v_dim) <= 0 or mla.rope_dim % 2:
        raise ModelFileError(f"{name}: latent attention widths {mla} are not usable")
    if "blk.0.attn_q_a.weight" in f.tensors and q_rank <= 0:
        raise ModelFileError(f"{name}: attn_q_a without a positive attention.q_lora_rank")
    cached = (key("attention.key_length"), key("attention.value_length"))
    if key("attention.head_count_kv") != 1 or cached != (mla.cache_dim, mla.kv_rank):
        raise ModelFileError(
            f"{name}: latent attention caches one kv head of [c | k_pe] "
            f"({mla.cache_dim} / {mla.kv_rank} wide), the file says {cached}"
        )
    return mla
