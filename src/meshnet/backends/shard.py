"""A shard: one layer range of one model, computed by one backend.

``load_shard`` reads only what the range needs. ``Shard.forward`` takes token
ids on the first shard and hidden states elsewhere; it returns hidden states,
or logits on the last shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from meshnet.backends.base import Backend, BatchEntry
from meshnet.backends.fast import FastBackend, load_fast_weights
from meshnet.backends.q8 import Q8Backend, Q8HalfKVBackend, load_q8_weights
from meshnet.backends.reference import ReferenceBackend
from meshnet.errors import ModelError
from meshnet.layer_range import LayerRange
from meshnet.memory import settle
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.layer_bytes import KV_ITEM
from meshnet.model.spec import ModelSpec, read_spec
from meshnet.model.weights import load_shard_weights

LogitsMode = Literal["last", "all"]
BACKENDS = ("fast", "q8", "q8-kv16", "numpy")
# "fast": quantized kernels, float32 activations; "q8": 8-bit activations as llama.cpp;
# "q8-kv16": q8 with a float16 KV cache (half the cache's bytes); "numpy" is the float32
# reference. q8 is the default: the faster of the two exact ones with a float32 cache
# (README, "The default backend").
DEFAULT_BACKEND = "q8"


def kv_item_bytes(backend: str) -> int:
    """Bytes of one key or value element in the KV cache of a node on ``backend`` (a
    name it does not know: float32's, what every other backend holds)."""
    if backend == Q8HalfKVBackend.name:
        return np.dtype(Q8HalfKVBackend.kv_dtype).itemsize
    return KV_ITEM


@dataclass(frozen=True)
class Shard:
    """Layers ``layers`` of the model ``spec``, identified by ``fingerprint``."""

    spec: ModelSpec
    layers: LayerRange
    backend: Backend
    fingerprint: str  # sha256 of the GGUF file
    source: str = ""  # the GGUF's path, when read from one (its tokenizer is there)

    @property
    def is_first(self) -> bool:
        return self.layers.is_first()

    @property
    def is_last(self) -> bool:
        return self.layers.is_last(self.spec.n_layers)

    def forward(
        self, x: np.ndarray, batch: Sequence[BatchEntry], logits: LogitsMode = "last"
    ) -> np.ndarray:
        """One batched step through this shard.

        ``x`` is ids [T] on the first shard, hidden states [T, d] otherwise. On
        the last shard returns logits: of each sequence's last row [len(batch),
        vocab] with ``"last"``, of every row [T, vocab] with ``"all"``. Other
        shards return hidden states [T, d]. Every entry's KV advances.
        """
        hidden = self.backend.embed(x) if self.is_first else x
        hidden = self.backend.run_layers(hidden, batch)
        if not self.is_last:
            return hidden
        if logits == "last":
            hidden = hidden[np.cumsum([e.n_new for e in batch]) - 1]  # [N, d]
        return self.backend.head(hidden)


def warm_up(shard: Shard) -> None:
    """Run one throwaway token through ``shard`` so JIT kernels are compiled (or loaded
    from their cache) now, not inside the first request's timings."""
    x = np.zeros(1, np.int64) if shard.is_first else np.zeros((1, shard.spec.d_model), np.float32)
    shard.forward(x, [BatchEntry(shard.backend.new_kv(), 1)])


def load_shard(
    f: GGUFFile, spec: ModelSpec, layers: LayerRange, backend: str = DEFAULT_BACKEND
) -> Shard:
    """Load ``layers`` of the model in ``f`` onto ``backend`` (one of ``BACKENDS``)."""
    settle()  # before the first large block is freed: glibc's thresholds stay where set
    if backend == "numpy":
        compute: Backend = ReferenceBackend(spec, load_shard_weights(f, spec, layers))
    elif backend == "fast":
        compute = FastBackend(spec, load_fast_weights(f, spec, layers))
    elif backend == "q8":
        compute = Q8Backend(spec, load_q8_weights(f, spec, layers))
    elif backend == "q8-kv16":
        compute = Q8HalfKVBackend(spec, load_q8_weights(f, spec, layers))
    else:
        raise ModelError(f"backend {backend!r} is not available (have: {', '.join(BACKENDS)})")
    shard = Shard(spec, layers, compute, f.fingerprint(), str(f.path))
    settle()  # the read and repacked copies of the tensors go back to the system now
    warm_up(shard)
    return shard


def load_shard_file(
    path: str, layers: LayerRange, backend: str = DEFAULT_BACKEND, fingerprint: str | None = None
) -> Shard:
    """``load_shard`` of ``layers`` of the GGUF at ``path``, as a node loads its range:
    the header's values (a 128k-token vocabulary and its merges are tens of MB of
    strings) go before it returns, and the memory they held is handed back, so a node
    holds its layers and little else. ``fingerprint``: the model's sha256 when ``path``
    holds only the range's tensors (``model_source.shard_store``)."""
    f = open_gguf(path, fingerprint)
    shard = load_shard(f, read_spec(f), layers, backend)
    del f
    settle()
    return shard
