"""Seeded random GGUF tensors, written one at a time: what the benchmark models share.

A benchmark model is a plan (every tensor's name, shape and how it is drawn)
and the metadata its converter would write. ``write_gguf`` writes the header
from the plan, then draws and writes each tensor in turn, so peak memory is one
tensor however large the file (a 3B model in F32 is 11 GB). Each tensor is drawn
from its own generator, seeded by the run's seed and the tensor's name, so its
values never depend on the order of writing or on the tensors around it: a
model with fewer layers is a prefix of a deeper one.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from meshnet.errors import ModelError

F32 = np.float32
WEIGHT_STD = 0.02  # the usual initializer scale of Llama-family projections
NORM_STD = 0.02  # norm gains drawn around 1
_ROWS_PER_CHUNK = 4096  # rows drawn at a time: bounds the float32 scratch of the embedding
_DISK_MARGIN = 1 << 30  # free bytes left over after a source and its quant

# The tensor types the writer can store, and the GGUF ``general.file_type`` each makes.
WEIGHT_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# Writes a model's metadata keys (everything but the tensors) for the file type given.
MetadataWriter = Callable[[gguf.GGUFWriter, gguf.LlamaFileType], None]


@dataclass(frozen=True)
class TensorPlan:
    """One tensor of the file: its GGUF name, row-major shape and how it is drawn."""

    name: str
    shape: tuple[int, ...]  # numpy order: (rows, columns) for a matrix, (experts, rows, columns)
    # "weight": N(0, std) stored in the file's matrix type; "norm": N(1, NORM_STD) in F32;
    # "router": N(0, std) kept F32 as converters keep MoE routers; "rope_freqs": computed
    kind: str
    std: float | None = None  # the spread drawn; None: WEIGHT_STD (NORM_STD for a norm)

    def stored(self, matrices: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
        """The type this tensor is stored in when the file's matrices are ``matrices``."""
        return matrices if self.kind == "weight" else gguf.GGMLQuantizationType.F32

    def mean_std(self) -> tuple[float, float]:
        if self.kind == "norm":
            return 1.0, NORM_STD if self.std is None else self.std
        return 0.0, WEIGHT_STD if self.std is None else self.std


def write_gguf(
    path: Path,
    arch: str,
    plan: Sequence[TensorPlan],
    metadata: MetadataWriter,
    seed: int,
    weight_type: str,
    computed: Mapping[str, np.ndarray] | None = None,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Write a GGUF of ``arch`` holding ``plan``'s tensors to ``path`` atomically.

    Matrices are stored as ``weight_type`` (a key of ``WEIGHT_TYPES``), every
    other tensor F32. ``computed`` gives the float32 values of the tensors that
    are not drawn (``rope_freqs``). The file appears under ``path`` only once
    complete; on any failure no partial file is left.
    """
    if weight_type not in WEIGHT_TYPES:
        raise ModelError(f"weight type {weight_type!r} is not one of {sorted(WEIGHT_TYPES)}")
    qtype, file_type = WEIGHT_TYPES[weight_type]
    values = computed or {}
    tmp = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    try:
        metadata(writer, file_type)
        for t in plan:
            nbytes = stored_nbytes(t.shape, t.stored(qtype))
            writer.add_tensor_info(
                t.name, t.shape, np.dtype(F32), nbytes, raw_dtype=t.stored(qtype)
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in plan:
            data = values[t.name] if t.name in values else draw(t, seed, t.stored(qtype))
            writer.write_tensor_data(data)
            if progress is not None:
                progress(t.name)
        writer.close()
        os.replace(tmp, path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)


def plan_bytes(plan: Sequence[TensorPlan], weight_type: str) -> int:
    """Bytes of tensor data a file of ``plan`` in ``weight_type`` holds (the header aside)."""
    qtype = WEIGHT_TYPES[weight_type][0]
    return sum(stored_nbytes(t.shape, t.stored(qtype)) for t in plan)


def check_disk(folder: Path, source_bytes: int) -> None:
    """Refuse before writing when an F32 source of ``source_bytes`` and its K-quant
    (~1/6 of it) would not fit in ``folder`` with a margin to spare."""
    need = source_bytes + source_bytes // 6 + _DISK_MARGIN
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ModelError(
            f"{folder}: {free / 1e9:.1f} GB free, the F32 source and its quant need "
            f"{need / 1e9:.1f} GB"
        )


def parameter_counts(plan: Sequence[TensorPlan]) -> tuple[int, int, int, int]:
    """(total, shared, one expert's, expert count) parameters, as the converter counts
    them for ``gguf.size_label``: an expert tensor's first axis is its experts."""
    total = shared = expert = 0
    counts = []
    for t in plan:
        size = math.prod(t.shape)
        total += size
        if "_exps." in t.name and len(t.shape) >= 3:
            expert += size // t.shape[0]
            counts.append(t.shape[0])
        else:
            shared += size
    return total, shared, expert, sum(counts) // len(counts) if counts else 0


def stored_nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ModelError(f"a row of {shape[-1]} values is not whole {qtype.name} blocks of {block}")
    return math.prod(shape[:-1]) * shape[-1] // block * type_size


def draw(t: TensorPlan, seed: int, stored: gguf.GGMLQuantizationType) -> np.ndarray:
    """The stored values (F32, F16) or blocks (quantized) of one tensor.

    Rows (every axis but the last, flattened) are drawn a chunk at a time into
    the preallocated result, so the float32 scratch stays small next to the
    128k-row embedding or a layer's stacked experts.
    """
    rng = np.random.default_rng([seed, name_key(t.name)])
    mean, std = t.mean_std()
    rows, cols = math.prod(t.shape[:-1]), t.shape[-1]
    out = _empty_stored(rows, cols, stored)
    for start in range(0, rows, _ROWS_PER_CHUNK):
        n = min(_ROWS_PER_CHUNK, rows - start)
        values = rng.standard_normal((n, cols), dtype=F32)
        values *= F32(std)
        values += F32(mean)
        out[start : start + n] = _encode(values, stored)
    return out.reshape(t.shape) if len(t.shape) == 1 else out


def _empty_stored(rows: int, cols: int, stored: gguf.GGMLQuantizationType) -> np.ndarray:
    if stored == gguf.GGMLQuantizationType.F32:
        return np.empty((rows, cols), F32)
    if stored == gguf.GGMLQuantizationType.F16:
        return np.empty((rows, cols), np.float16)
    return np.empty((rows, stored_nbytes((cols,), stored)), np.uint8)


def _encode(values: np.ndarray, stored: gguf.GGMLQuantizationType) -> np.ndarray:
    if stored == gguf.GGMLQuantizationType.F32:
        return values
    if stored == gguf.GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, stored)


def name_key(name: str) -> int:
    """A stable 64-bit key of a tensor name (``hash()`` is salted per process)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
