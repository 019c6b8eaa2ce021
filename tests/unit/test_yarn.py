"""YaRN rotary scaling: the tables against a float64 transcription of llama.cpp's
formulas, and what a file's ``rope.scaling.*`` keys become."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest

from meshnet.errors import ModelFileError, UnsupportedArchitecture
from meshnet.model.gguf_file import open_gguf
from meshnet.model.rope import Rope, RopeTables
from meshnet.model.spec import read_spec
from meshnet.model.yarn import Yarn, corr_dims, resolved_attn_factor

POSITIONS = np.array([0, 1, 2, 5, 17, 100, 1000, 4095, 4096, 10000, 50000])


def _float64_yarn(positions, dim, base, factor, orig, beta_fast, beta_slow, attn=1.0):  # type: ignore[no-untyped-def]
    """cos, sin [T, dim / 2] in float64: ggml's rope_yarn with ext_factor 1 and
    ``ggml_rope_yarn_corr_dims``, written from the formulas."""

    def corr_dim(turns: float) -> float:
        return dim * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(dim - 1.0, math.ceil(corr_dim(beta_slow)))
    i = np.arange(dim // 2)
    ramp = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)  # 1: keep, 0: interpolate
    extrap = positions[:, None] * base ** (-2.0 * i / dim)
    theta = extrap / factor * (1 - ramp) + extrap * ramp
    mscale = attn * (1 + 0.1 * math.log(factor))
    return np.cos(theta) * mscale, np.sin(theta) * mscale, theta


@pytest.mark.parametrize(
    ("dim", "base", "factor", "orig", "betas"),
    [
        (64, 150000.0, 32.0, 4096, (32.0, 1.0)),  # gpt-oss
        (128, 10000.0, 4.0, 2048, (32.0, 1.0)),
        (32, 500000.0, 8.0, 8192, (16.0, 2.0)),
        (16, 10000.0, 2.5, 4096, (32.0, 1.0)),
    ],
)
def test_tables_follow_llama_cpps_formulas(
    dim: int, base: float, factor: float, orig: int, betas: tuple[float, float]
) -> None:
    scale = 1.0 / factor
    yarn = Yarn(orig, 1.0, resolved_attn_factor(scale, 1.0, 1.0, 1.0), *betas)
    cos, sin = Rope("halves", dim, base, scale, yarn=yarn).tables(POSITIONS)
    want_cos, want_sin, theta = _float64_yarn(POSITIONS, dim, base, factor, orig, *betas)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == (len(POSITIONS), dim // 2)
    # float32 angles: the position times base^(-2/dim) i times, one rounding each
    slack = np.abs(theta) * (np.arange(dim // 2) + 3) * 2.0**-23 + 2.0**-22
    mscale = 1 + 0.1 * math.log(factor)
    assert np.all(np.abs(cos - want_cos) <= mscale * slack)
    assert np.all(np.abs(sin - want_sin) <= mscale * slack)


def test_gpt_oss_ramp_runs_between_pairs_8_and_18() -> None:
    assert corr_dims(64, 150000.0, Yarn(4096)) == (8.0, 18.0)
    assert corr_dims(64, 150000.0, Yarn(4096, beta_fast=1e6, beta_slow=1e-12)) == (0.0, 63.0)


def test_the_magnitude_is_llama_cpps_and_plain_interpolation_keeps_the_files() -> None:
    for factor in (1.0, 2.0, 32.0, 40.0):
        assert resolved_attn_factor(1 / factor, 1.0, 1.0, 1.0) == pytest.approx(1.0, abs=1e-7)
    assert resolved_attn_factor(1 / 32, 1.0, 5.0, 0.5) == pytest.approx(0.5)  # blend: not 5
    assert resolved_attn_factor(1 / 32, 0.0, 1.25, 2.0) == 2.5
    rope = Rope("pairs", 8, 10000.0, 1 / 32, yarn=Yarn(4096, 0.0, 1.25))
    cos, sin = rope.tables(np.array([0, 3, 64]))
    plain = Rope("pairs", 8, 10000.0, 1 / 32).tables(np.array([0, 3, 64]))
    assert np.allclose(cos, 1.25 * plain[0], atol=1e-6)
    assert np.allclose(sin, 1.25 * plain[1], atol=1e-6)
    assert np.allclose(np.hypot(cos, sin), 1.25)  # ext_factor 0: no YaRN magnitude


def test_rope_tables_of_a_yarn_rope_are_the_same_numbers_whatever_asks() -> None:
    rope = Rope("halves", 64, 150000.0, 1 / 32, yarn=Yarn(4096))
    assert len({rope, Rope("halves", 64, 150000.0, 1 / 32, yarn=Yarn(4096))}) == 1
    tables = RopeTables(rope)
    late = np.array([70000, 3, 1023, 1024, 5000])
    cos, sin = tables.at(late)
    again = [tables.at(np.array([p])) for p in late]
    assert np.array_equal(cos, np.concatenate([c for c, _ in again]))
    assert np.array_equal(sin, np.concatenate([s for _, s in again]))


def _yarn_file(path: Path, arch: str = "llama", **keys: object) -> Path:
    """A tiny file of ``arch`` with 4 heads of 16 and the given ``rope.*`` keys."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(131072)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(2)
    for key, value in keys.items():
        name = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_float32(name, float(value))  # type: ignore[arg-type]
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GPT_OSS_ROPE = {
    "rope.freq_base": 150000.0,
    "rope.scaling.type": "yarn",
    "rope.scaling.factor": 32.0,
    "rope.scaling.original_context_length": 4096,
}


def test_a_yarn_file_reads_as_llama_cpp_resolves_it(tmp_path: Path) -> None:
    spec = read_spec(open_gguf(_yarn_file(tmp_path / "yarn.gguf", **GPT_OSS_ROPE)))
    rope = spec.rope
    assert (rope.dim, rope.base, rope.scale, rope.factors) == (16, 150000.0, 1 / 32, None)
    assert rope.yarn == Yarn(4096, 1.0, resolved_attn_factor(1 / 32, 1.0, 1.0, 1.0), 32.0, 1.0)
    cos, sin = rope.tables(np.array([0]))
    assert np.allclose(cos, 1 + 0.1 * math.log(32)) and not sin.any()


def test_a_yarn_files_own_betas_and_factors_are_read(tmp_path: Path) -> None:
    keys = {
        **GPT_OSS_ROPE,
        "rope.scaling.yarn_beta_fast": 16.0,
        "rope.scaling.yarn_beta_slow": 2.0,
        "rope.scaling.yarn_ext_factor": 0.5,
        "rope.scaling.attn_factor": 0.75,
    }
    keys.pop("rope.scaling.original_context_length")
    rope = read_spec(open_gguf(_yarn_file(tmp_path / "betas.gguf", **keys))).rope
    attn = resolved_attn_factor(1 / 32, 0.5, 1.0, 0.75)
    assert rope.yarn == Yarn(131072, 0.5, attn, 16.0, 2.0)  # the training context
    assert attn == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("keys", "error", "match"),
    [
        ({"rope.scaling.type": "longrope"}, UnsupportedArchitecture, "'longrope'"),
        (
            {**GPT_OSS_ROPE, "rope.scaling.yarn_log_multiplier": 0.1},
            UnsupportedArchitecture,
            "log_mul",
        ),
        ({**GPT_OSS_ROPE, "rope.scaling.factor": -4.0}, ModelFileError, "factor"),
        ({**GPT_OSS_ROPE, "rope.scaling.yarn_beta_fast": math.inf}, ModelFileError, "beta"),
    ],
)
def test_scalings_it_cannot_compute_are_refused_by_name(
    tmp_path: Path, keys: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        read_spec(open_gguf(_yarn_file(tmp_path / "bad.gguf", **keys)))
