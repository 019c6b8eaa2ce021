"""The hyperparameters of a llama-family model, read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass

from meshnet.errors import ModelFileError, UnsupportedArchitecture
from meshnet.model.gguf_file import GGUFFile

SUPPORTED_ARCHITECTURES = frozenset({"llama"})


@dataclass(frozen=True)
class ModelSpec:
    """Shape and constants of a model; identical on every shard of it."""

    architecture: str
    n_layers: int
    d_model: int  # embedding width
    d_ff: int  # feed-forward hidden width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention when fewer)
    head_dim: int
    rope_dim: int  # leading dims of each head that are rotated
    rope_base: float
    rms_eps: float
    vocab_size: int
    context_length: int
    tied_head: bool  # the output head reuses the token embedding
    bos_id: int | None
    eos_id: int

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim


def read_spec(f: GGUFFile) -> ModelSpec:
    """Build the ``ModelSpec`` of ``f``; raise on an architecture other than llama."""
    arch = str(f.value("general.architecture"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{f.path.name}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    d_model = int(f.value(f"{arch}.embedding_length"))
    n_heads = int(f.value(f"{arch}.attention.head_count"))
    n_kv_heads = int(f.value_or(f"{arch}.attention.head_count_kv", n_heads))
    if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads or d_model % n_heads:
        raise ModelFileError(
            f"{f.path.name}: inconsistent heads (d={d_model}, heads={n_heads}, kv={n_kv_heads})"
        )
    head_dim = d_model // n_heads
    tensors = f.tensors
    vocab = tensors.get("token_embd.weight")
    if vocab is None:
        raise ModelFileError(f"{f.path.name}: tensor 'token_embd.weight' is missing")
    spec = ModelSpec(
        architecture=arch,
        n_layers=int(f.value(f"{arch}.block_count")),
        d_model=d_model,
        d_ff=int(f.value(f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dim=int(f.value_or(f"{arch}.rope.dimension_count", head_dim)),
        rope_base=float(f.value_or(f"{arch}.rope.freq_base", 10000.0)),
        rms_eps=float(f.value(f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab.shape[1]),
        context_length=int(f.value_or(f"{arch}.context_length", 2048)),
        tied_head="output.weight" not in tensors,
        bos_id=_optional_int(f, "tokenizer.ggml.bos_token_id"),
        eos_id=int(f.value("tokenizer.ggml.eos_token_id")),
    )
    if spec.n_layers <= 0 or spec.rope_dim > head_dim or spec.rope_dim % 2:
        raise ModelFileError(f"{f.path.name}: inconsistent hyperparameters {spec}")
    return spec


def _optional_int(f: GGUFFile, key: str) -> int | None:
    return int(f.value(key)) if f.has(key) else None
