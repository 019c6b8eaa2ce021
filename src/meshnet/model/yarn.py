"""YaRN rotary scaling (Peng et al. 2023), computed as llama.cpp computes it.

A YaRN file stretches its context by ``factor``. Each rotated pair blends two
angles: the extrapolated one (the plain rotary angle, kept by the fast-turning
pairs) and the interpolated one (``angle / factor``, taken by the slow pairs),
with a linear ramp between the pair indices where a pair turns ``beta_fast``
and ``beta_slow`` times over the original context. cos and sin are then both
multiplied by a magnitude ``mscale``, which scales every attention score by
``mscale^2``.

Everything is float32 in llama.cpp's order of operations (ggml-cpu ``rope_yarn``,
``ggml_rope_yarn_corr_dims``; llama-context's defaults), down to the angle of pair
``i`` being the position multiplied by ``base^(-2 / dim)`` ``i`` times over, one
rounding each time: at positions in the tens of thousands one rounding of the angle
is thousandths of a radian, so the same roundings are what makes the tables llama.cpp's.
ggml is built with FMA and GCC's default contraction, so its ``a * b + c`` are fused:
the blend and the ``1 + 0.1 ln`` magnitudes here are too (``fma32``; the unfused
blend moved 1 ulp of the angle in a third of the ramp's pairs). pow and log are
evaluated in float64 and rounded once; cos and sin too, which differs from glibc's
``cosf``/``sinf`` (not correctly rounded) by 1 ulp in about 1% of the entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

F32 = np.float32


@dataclass(frozen=True)
class Yarn:
    """A file's YaRN parameters, resolved as llama.cpp resolves them for a context."""

    orig_context: int  # the context the pairs' ramp is measured over (n_ctx_orig_yarn)
    ext_factor: float = 1.0  # weight of the ramp's blend; 0: plain interpolation
    attn_factor: float = 1.0  # magnitude before YaRN's own (llama.cpp's yarn_attn_factor)
    beta_fast: float = 32.0  # pairs turning more often than this keep their angle
    beta_slow: float = 1.0  # pairs turning less often than this are fully interpolated
    log_multiplier: float = 0.0  # DeepSeek's mscale_all_dim (the attention scale's); 0: none


def resolved_attn_factor(
    freq_scale: float,
    ext_factor: float,
    yarn_attn_factor: float,
    rope_attn_factor: float,
    deepseek_log_multiplier: bool = False,
) -> float:
    """llama.cpp's ``cparams.yarn_attn_factor``.

    With a blend (``ext_factor != 0``) it is ``get_mscale(factor) / (1 + 0.1 ln factor)``,
    about 1, so that the kernel's own ``1 + 0.1 ln(1 / freq_scale)`` is the magnitude
    (llama.cpp PR 17945); without, the file's ``yarn_attn_factor``. Either way times the
    file's ``rope.scaling.attn_factor``. float32 throughout, as there. A DeepSeek-V2 file
    with ``yarn_log_multiplier`` (``deepseek_log_multiplier``) has ``mscale`` equal to its
    ``mscale_all_dim`` there, so ``get_mscale`` is divided by itself: 1 (the attention
    scale carries DeepSeek's magnitude instead: ``arch/deepseek2.py``).
    """
    attn = F32(yarn_attn_factor)
    if ext_factor != 0:
        factor = F32(1.0) / F32(freq_scale)
        log_factor = F32(math.log(float(factor)))
        plain = factor <= 1 or deepseek_log_multiplier
        mscale = F32(1.0) if plain else fma32(F32(0.1), log_factor, F32(1.0))
        cancel = F32(1.0) / fma32(F32(0.1), log_factor, F32(1.0))
        attn = mscale * cancel
    return float(attn * F32(rope_attn_factor))


def corr_dims(dim: int, base: float, yarn: Yarn) -> tuple[np.float32, np.float32]:
    """The pair indices (as dims ``i0 / 2``) where the ramp starts and ends, clamped to
    ``[0, dim - 1]`` (``ggml_rope_yarn_corr_dims``)."""

    def corr_dim(turns: float) -> np.float32:
        # dim * ln(orig / (turns * 2 pi)) / (2 ln base): the pair turning ``turns`` times
        ratio = F32(yarn.orig_context) / (F32(turns) * F32(2.0) * F32(math.pi))
        return F32(dim) * F32(math.log(float(ratio))) / (F32(2.0) * F32(math.log(base)))

    start = F32(math.floor(corr_dim(yarn.beta_fast)))
    end = F32(math.ceil(corr_dim(yarn.beta_slow)))
    return max(F32(0.0), start), min(F32(dim - 1), end)


def yarn_tables(
    positions: np.ndarray,
    dim: int,
    base: float,
    freq_scale: float,
    factors: tuple[float, ...] | None,
    yarn: Yarn,
) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [len(positions), dim / 2] of YaRN's angles, magnitude included."""
    pairs = dim // 2
    theta_scale = F32(math.pow(base, float(F32(-2.0) / F32(dim))))
    extrap: np.ndarray = np.empty((len(positions), pairs), F32)  # [T, pairs]
    theta = positions.astype(F32)
    for i in range(pairs):  # pair i's angle: the position times theta_scale, i roundings
        extrap[:, i] = theta
        theta = theta * theta_scale
    if factors is not None:
        extrap = extrap / np.asarray(factors, dtype=F32)
    scale = F32(freq_scale)
    interp = scale * extrap
    mscale = F32(yarn.attn_factor)
    if yarn.ext_factor != 0:
        low, high = corr_dims(dim, base, yarn)
        y = (np.arange(pairs).astype(F32) - low) / max(F32(0.001), high - low)  # [pairs]
        mix = (F32(1.0) - np.minimum(F32(1.0), np.maximum(F32(0.0), y))) * F32(yarn.ext_factor)
        angles = fma32(interp, F32(1.0) - mix, extrap * mix)  # interp (1 - mix) + extrap mix
        log_inverse = F32(math.log(float(F32(1.0) / scale)))
        mscale = mscale * fma32(F32(0.1), log_inverse, F32(1.0))
    else:
        angles = interp
    wide = angles.astype(np.float64)
    cos = np.cos(wide).astype(F32) * mscale
    sin = np.sin(wide).astype(F32) * mscale
    return cos, sin


def fma32(a: ArrayLike, b: ArrayLike, c: ArrayLike) -> Any:
    """float32 ``a * b + c`` rounded once, as an FMA instruction gives it.

    The product of two float32 is exact in float64; the float64 sum's own error is
    recovered exactly (Knuth's two-sum) and decides the rare sum that lands on a
    float32 halfway point, which a second rounding would otherwise break to even.
    """
    product = np.multiply(a, b, dtype=np.float64)
    addend = np.asarray(c, dtype=np.float64)
    total = product + addend
    back = total - product
    error = (product - (total - back)) + (addend - back)  # product + addend == total + error
    mantissa, _ = np.frexp(total)
    bits25 = mantissa * 2.0**25  # an odd integer: halfway between two float32
    halfway = (bits25 == np.round(bits25)) & (np.mod(bits25, 2.0) == 1.0) & (error != 0)
    toward = np.where(error > 0, np.inf, -np.inf)
    return np.where(halfway, np.nextafter(total, toward), total).astype(F32)
