"""A node's resident memory against what it must hold: its tensors' file bytes and its KV.

The goal the issue sets is RSS within ~15% of the bytes of the layers a node
serves plus its KV. What a shard holds (its blocks ``blk.{i}.*``, the token
embedding on the first range, the output norm and head on the last, the
embedding again when the head is tied to it, and the small tensors every layer
reads) is the product's count, ``model/layer_bytes.py``; this harness measures
against it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from meshnet.errors import MeshnetError
from meshnet.layer_range import LayerRange
from meshnet.model.layer_bytes import kv_bytes, kv_layer_token, layer_bytes_of
from meshnet.model.spec import ModelSpec


@dataclass(frozen=True)
class Rss:
    """Resident set of a process from ``/proc/PID/status``, in bytes."""

    total: int
    anon: int  # heap: arrays, repacked weights, KV, the interpreter
    file: int  # mapped files: the GGUF pages touched, shared libraries

    @staticmethod
    def of(pid: int) -> Rss:
        fields: dict[str, int] = {}
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError as e:
            raise MeshnetError(f"cannot read the memory of process {pid}: {e}") from e
        for line in text.splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(rest.split()[0]) * 1024
        return Rss(fields.get("VmRSS", 0), fields.get("RssAnon", 0), fields.get("RssFile", 0))


def planned_layout(names: Mapping[str, int], n_layers: int, nodes: int) -> list[LayerRange]:
    """The ranges ``meshnet up --nodes`` gives ``nodes`` nodes of the model whose tensors
    are ``names`` (name -> bytes): the largest holding the fewest bytes."""
    return layer_bytes_of(names, n_layers, tied_head="output.weight" not in names).split(nodes)


def shard_file_bytes(names: Mapping[str, int], layers: LayerRange, n_layers: int) -> int:
    """File bytes of the tensors a node serving ``layers`` holds (``names``: name -> bytes)."""
    sizes = layer_bytes_of(names, n_layers, tied_head="output.weight" not in names)
    return sizes.range_bytes(layers)


def session_kv_bytes(layers: LayerRange, spec: ModelSpec, positions: int) -> int:
    """Bytes of KV one sequence of ``positions`` positions holds on the node serving
    ``layers``: windowed layers only their window (``layer_bytes.kv_bytes``)."""
    windows = [spec.layer_window(i) for i in range(layers.start, layers.end)]
    return kv_bytes(windows, kv_layer_token(spec), positions)
