"""The model a node is to serve: its file, architecture, tokenizer, layers, tensors, sha256.

Checked with the loader's own functions, so that what fails here is what loading
would refuse, with the same typed error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant
from meshnet.backends.shard import kv_item_bytes
from meshnet.errors import ModelError, TokenizerError
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import GGUFFile, open_gguf
from meshnet.model.layer_bytes import LayerBytes, file_bytes, float32_bytes, model_layer_bytes
from meshnet.model.spec import ModelSpec, read_spec
from meshnet.model.weights import load_shard_weights
from meshnet.node.preflight.result import Check, fail, ok, size, skip


def check_model_dirs(dirs: tuple[str, ...]) -> Check:
    missing = [d for d in dirs if not os.path.isdir(d)]
    if missing:
        return fail("model dirs", f"not a directory: {', '.join(missing)}", "fix --model-dir")
    return ok("model dirs", ", ".join(dirs) if dirs else "--model's directory only")


@dataclass(frozen=True)
class ModelFacts:
    """What the other checks need to know of a model that passed its checks."""

    path: Path
    spec: ModelSpec
    fingerprint: str
    weight_bytes: int  # what the node's backend holds for its layers
    kv_bytes_per_token: int = 0  # KV of one position of one sequence on its layers


def check_model(
    path: Path, layers: LayerRange, backend: str
) -> tuple[list[Check], ModelFacts | None]:
    """The file, its architecture, tokenizer, the layer range, tensor types and sha256."""
    try:
        f = open_gguf(path)
    except ModelError as e:
        return [fail("model file", e.message, "--model PATH of a readable GGUF file")], None
    checks = [ok("model file", f"{path} ({size(path.stat().st_size)})")]
    try:
        spec = read_spec(f)
    except ModelError as e:
        return [*checks, fail("architecture", e.message, "use a GGUF meshnet supports")], None
    experts = spec.experts
    mixture = f", {experts.n_experts} experts ({experts.n_used} used)" if experts else ""
    checks.append(ok("architecture", f"{spec.architecture}, {spec.n_layers} layers{mixture}"))
    from meshnet.model.tokenizer import load_tokenizer  # a node started empty never loads it

    try:
        load_tokenizer(f)
        checks.append(ok("tokenizer", str(f.value_or("tokenizer.ggml.model", "?"))))
    except (TokenizerError, ModelError) as e:
        checks.append(fail("tokenizer", e.message, "use a GGUF with a supported tokenizer"))
    layers_check, sizes = _check_layers(f, spec, layers, backend)
    checks.append(layers_check)
    if sizes is None:
        return [*checks, skip("tensors", "no valid layers")], None
    try:
        load_shard_weights(f, spec, layers, _matrix_check(backend))
    except ModelError as e:
        fix = "use a GGUF whose tensors are of supported types (or --backend numpy)"
        return [*checks, fail("tensors", e.message, fix)], None
    checks.append(ok("tensors", f"{layers}: every tensor readable by the {backend} backend"))
    try:
        fingerprint = f.fingerprint()
    except OSError as e:
        fix = "--model a readable file"
        return [*checks, fail("sha256", f"cannot read {path}: {e}", fix)], None
    checks.append(ok("sha256", fingerprint))
    failed = any(c.failed for c in checks)
    held, kv = sizes.range_bytes(layers), sizes.kv_bytes_per_token(layers)
    facts = ModelFacts(path, spec, fingerprint, held, kv)
    return checks, None if failed else facts


def _check_layers(
    f: GGUFFile, spec: ModelSpec, layers: LayerRange, backend: str
) -> tuple[Check, LayerBytes | None]:
    """The range within the model, with the bytes its tensors take as ``backend`` holds
    them (file bytes for the fast kernels, four per weight for numpy) and its KV per
    position; the model's ``LayerBytes`` when it passed."""
    try:
        layers.check_within(spec.n_layers)
    except ModelError as e:
        fix = f"--layers START:END with 0 <= START < END <= {spec.n_layers}"
        return fail("layers", e.message, fix), None
    try:
        held_as = float32_bytes if backend == "numpy" else file_bytes
        sizes = model_layer_bytes(f, spec, held_as, kv_item_bytes(backend))
    except ModelError as e:
        return fail("layers", e.message, "use a GGUF whose tensors are of its layers"), None
    held, kv = sizes.range_bytes(layers), sizes.kv_bytes_per_token(layers)
    detail = f"{layers} of {spec.n_layers}: {size(held)}, KV {size(kv)} per token"
    return ok("layers", detail), sizes


def _matrix_check(backend: str) -> Callable[[GGUFFile, gguf.ReaderTensor, tuple[int, int]], None]:
    """A matrix reader for ``load_shard_weights`` that checks a matrix as ``backend`` would
    take it and reads none of its bytes (the fast kernels get zeros the OS never maps in)."""

    def fast(f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int]) -> None:
        qtype = QT(t.tensor_type)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        zeros = np.zeros(shape[0] * shape[1] // block * size, np.uint8)
        quant.from_blocks(zeros, qtype, shape, native=False, name=t.name)

    def numpy(f: GGUFFile, t: gguf.ReaderTensor, shape: tuple[int, int]) -> None:
        return None  # checked_tensor has checked its type and shape: numpy reads them all

    return numpy if backend == "numpy" else fast
