"""What each part of a model weighs, from its GGUF header alone: the bytes layer ranges
are planned and reported by.

Layers are not alike: a mixture-of-experts layer holds its experts (3-D tensors
``blk.N.ffn_*_exps.weight``, simply more bytes of layer N), a dense first layer
less, and a large vocabulary's embedding as much as several layers. So a range's
weight is counted in bytes, never in layers. The parts follow
``model/weights.py``'s ``load_shard_weights``:

- layer N: every tensor ``blk.N.*``;
- the embedding (``token_embd.*``): held by the first range, and by the last too
  when the head is tied to it (the head *is* the embedding there);
- the head (``output_norm.*``, ``output.*``): held by the last range;
- shared: any other tensor (``rope_freqs.weight``, read by every layer's rotary),
  held by every range.

Only tensor names, types and shapes are read (their byte counts come with the
header); no tensor data is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import gguf

from meshnet.errors import ModelFileError
from meshnet.layer_range import LayerRange, split_by_bytes
from meshnet.model.gguf_file import GGUFFile
from meshnet.model.spec import ModelSpec

_BLOCK = re.compile(r"blk\.(\d+)\.")
KV_ITEM = 4  # a KV cache of float32 keys and values (backends/shard.py kv_item_bytes)
TensorBytes = Callable[[gguf.ReaderTensor], int]  # what a node holds for one tensor


def file_bytes(t: gguf.ReaderTensor) -> int:
    """A tensor's bytes in the file: what the fast kernels hold (they multiply from them)."""
    return int(t.n_bytes)


def float32_bytes(t: gguf.ReaderTensor) -> int:
    """Four bytes per weight: what the numpy reference holds (it dequantizes everything)."""
    return int(t.n_elements) * 4


@dataclass(frozen=True)
class LayerBytes:
    """The bytes of a model's parts as a node holds them, and of any range of its layers."""

    layers: tuple[int, ...]  # layers[i]: bytes of the tensors blk.i.*
    embedding: int  # token_embd.*
    head: int  # output_norm.* and output.* (no output.* when the head is tied)
    shared: int  # tensors of no layer that every range holds (rope_freqs.weight)
    tied_head: bool  # the last range holds the embedding as its head
    kv_layer_token: int  # KV bytes of one layer for one position: 2 * n_kv_heads * head_dim * 4
    windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 for none (empty: none)
    context: int = 0  # the model's trained context, what a per-token figure averages over

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def last_bytes(self) -> int:
        """What the last range holds besides its layers (and the shared tensors)."""
        return self.head + (self.embedding if self.tied_head else 0)

    @property
    def total(self) -> int:
        """Every tensor once: the tensor bytes of the file (as held)."""
        return sum(self.layers) + self.embedding + self.head + self.shared

    def range_bytes(self, layers: LayerRange) -> int:
        """Bytes a node serving ``layers`` holds: its layers, the shared tensors, the
        embedding when first, the head when last (a tied head: the embedding, once).
        ``LayerRangeError`` when ``layers`` is outside the model."""
        layers.check_within(self.n_layers)
        first, last = layers.is_first(), layers.is_last(self.n_layers)
        held = sum(self.layers[layers.start : layers.end]) + self.shared
        if first or (last and self.tied_head):
            held += self.embedding
        return held + (self.head if last else 0)

    def kv_bytes(self, layers: LayerRange, positions: int) -> int:
        """KV bytes one sequence of ``positions`` positions takes on a node serving
        ``layers``, each windowed layer capped at its window (``kv_bytes``)."""
        layers.check_within(self.n_layers)
        windows = self.windows or (0,) * self.n_layers
        return kv_bytes(windows[layers.start : layers.end], self.kv_layer_token, positions)

    def kv_bytes_per_token(self, layers: LayerRange) -> int:
        """KV bytes a position takes on a node serving ``layers``, averaged over a sequence
        of the model's whole context (rounded up): the dense layers' rate, plus the
        windowed layers' windows spread over the context. With no window (or no known
        context) every layer's rate."""
        if not self.context:
            return self.kv_bytes(layers, 1)
        return -(-self.kv_bytes(layers, self.context) // self.context)

    def split(self, parts: int) -> list[LayerRange]:
        """``parts`` contiguous ranges whose largest holds the fewest bytes
        (``split_by_bytes``); ``LayerRangeError`` for a count outside ``[1, n_layers]``."""
        return split_by_bytes(self.layers, parts, self.embedding, self.last_bytes)


def kv_bytes(windows: Sequence[int], kv_layer_token: int, positions: int) -> int:
    """KV bytes of one sequence of ``positions`` positions on layers whose sliding windows
    are ``windows`` (0: the layer sees every position), ``kv_layer_token`` bytes a layer
    and a position: a windowed layer keeps only its last ``window`` positions
    (kv/cache.py). What ``meshnet up`` plans with, the node's preflight checks its KV
    budget with and ``meshnet bench`` measures a node's memory against."""
    return kv_layer_token * sum(min(positions, w) if w else positions for w in windows)


def model_layer_bytes(
    f: GGUFFile, spec: ModelSpec, held: TensorBytes = file_bytes, kv_item: int = KV_ITEM
) -> LayerBytes:
    """The parts of ``f`` (whose spec is ``spec``) as a node holds them (``held``: per
    tensor, the file's bytes by default; ``kv_item``: bytes per key or value element of
    its cache); ``ModelFileError`` for a tensor of a layer the model does not have."""
    sizes = {name: held(t) for name, t in f.tensors.items()}
    try:
        token = kv_layer_token(spec, kv_item)
        sized = layer_bytes_of(sizes, spec.n_layers, spec.tied_head, token)
    except ModelFileError as e:
        raise ModelFileError(f"{f.path.name}: {e.message}") from None
    windows = tuple(spec.layer_window(i) for i in range(spec.n_layers))
    return replace(sized, windows=windows, context=spec.context_length)


def kv_layer_token(spec: ModelSpec, kv_item: int = KV_ITEM) -> int:
    """KV bytes of one layer of ``spec`` for one position: keys and values of ``kv_item``
    bytes each (float32 by default)."""
    return 2 * spec.n_kv_heads * spec.head_dim * kv_item


def range_holds(name: str, layers: LayerRange, n_layers: int, tied_head: bool) -> bool:
    """Whether a node serving ``layers`` reads the tensor ``name`` (the parts above): what
    a node fetches of a model it does not have whole (``model_source.shard_store``)."""
    block = _BLOCK.match(name)
    if block is not None:
        return int(block.group(1)) in range(layers.start, layers.end)
    last = layers.is_last(n_layers)
    if name.startswith("token_embd."):
        return layers.is_first() or (last and tied_head)
    if name.startswith(("output_norm.", "output.")):
        return last
    return True


def layer_bytes_of(
    sizes: Mapping[str, int], n_layers: int, tied_head: bool, kv_layer_token: int = 0
) -> LayerBytes:
    """The parts of a model whose tensors are ``sizes`` (name -> bytes held)."""
    layers = [0] * n_layers
    embedding = head = shared = 0
    for name, n in sizes.items():
        block = _BLOCK.match(name)
        if block is not None:
            i = int(block.group(1))
            if i >= n_layers:
                raise ModelFileError(f"tensor {name!r} is of layer {i} of {n_layers}")
            layers[i] += n
        elif name.startswith("token_embd."):
            embedding += n
        elif name.startswith(("output_norm.", "output.")):
            head += n
        else:
            shared += n
    return LayerBytes(tuple(layers), embedding, head, shared, tied_head, kv_layer_token)
