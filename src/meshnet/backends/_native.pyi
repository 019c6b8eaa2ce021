"""The C extension's interface (native/module.c), for the type checker.

Arrays are passed as buffers: C-contiguous, of the dtype each kernel names in its
docstring; ``out`` and ``x`` arguments are written in place. A matrix is
``(packed, rows, nb, type code)`` as ``quant.native_args`` gives it; a handle is
an opaque capsule.
"""

from collections.abc import Sequence

import numpy as np

Matrix = tuple[np.ndarray, int, int, int]
# (keys, values, first, count, row[, ring]): one sequence's cache and rows of a step.
# (keys, values, first, count, row[, ring[, pages' addresses]]): module.c read_entries
Entry = (
    tuple[np.ndarray, np.ndarray, int, int, int]
    | tuple[np.ndarray, np.ndarray, int, int, int, int]
    | tuple[np.ndarray, np.ndarray, int, int, int, int, np.ndarray | None]
)

def isa() -> str: ...
def matmul(
    packed: np.ndarray,
    x: np.ndarray,
    out: np.ndarray,
    rows: int,
    nb: int,
    t: int,
    code: int,
    threads: int,
    wide: bool = True,
    /,
) -> None: ...
def rows(
    packed: np.ndarray, ids: np.ndarray, out: np.ndarray, rows: int, nb: int, code: int, /
) -> None: ...
def attend(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    entries: Sequence[Entry],
    t: int,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    threads: int,
    scale: float = ...,
    softcap: float = 0.0,
    window: int = 0,
    sinks: np.ndarray | None = None,
    /,
) -> None: ...
def experts(
    router: Matrix,
    router_bias: np.ndarray | None,
    gate_ups: tuple[tuple[Matrix, ...], ...],
    downs: tuple[Matrix, ...],
    biases: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None],
    d: int,
    d_ff: int,
    n_used: int,
    gating: int,
    normalize: bool,
    act: int,
    /,
) -> object: ...
def block(
    qkv: tuple[Matrix, ...],
    wo: Matrix,
    gate_up: tuple[Matrix, ...],
    down: Matrix | None,
    vectors: tuple[np.ndarray | None, ...],
    eps: float,
    n_heads: int,
    n_kv: int,
    head_dim: int,
    d: int,
    d_ff: int,
    rope_pairs: int,
    traits: tuple[bool, int, float, float, int],
    experts: object | None = None,
    /,
) -> object: ...
def run_block(
    block: object,
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    entries: Sequence[Entry],
    threads: int,
    wide: bool = True,
    keep: bool = False,
    /,
) -> None: ...
def release_scratch() -> None: ...
def rope(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    t: int,
    heads: int,
    head_dim: int,
    pairs: int,
    halves: bool = False,
    /,
) -> None: ...
def glu(
    gate_up: np.ndarray, out: np.ndarray, t: int, d_ff: int, threads: int, act: int = 0, /
) -> None: ...
