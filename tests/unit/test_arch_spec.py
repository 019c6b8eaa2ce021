"""What each family's file says becomes the spec the kernels run: windows, rotary
bases, scales, caps, fused and optional tensors; what meshnet cannot run is refused
with its name."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from tinyarch import CASES, WINDOW, write_arch_gguf

from meshnet.errors import ModelFileError, UnsupportedArchitecture
from meshnet.model.gguf_file import open_gguf
from meshnet.model.spec import ModelSpec, read_spec


def _spec(name: str, tmp_path: Path) -> ModelSpec:
    return read_spec(open_gguf(write_arch_gguf(tmp_path / f"{name}.gguf", CASES[name])))


def test_gemma3_local_layers_have_their_window_and_rope_base(tmp_path: Path) -> None:
    s = _spec("gemma3", tmp_path)
    assert s.windowed == (True, True, False, True, True, False)
    assert [s.layer_window(i) for i in range(6)] == [WINDOW, WINDOW, 0, WINDOW, WINDOW, 0]
    assert s.layer_rope(0).base == 10000.0 and s.layer_rope(2).base == 1000000.0
    assert s.rope.style == "halves" and s.qk_norm and s.post_norms
    assert s.embed_scale == pytest.approx(8.0) and s.attn_scale == pytest.approx(32**-0.5)
    assert s.head_dim == 32 and s.q_width == 128 != s.d_model


def test_gemma2_alternates_windows_and_caps_scores_and_logits(tmp_path: Path) -> None:
    s = _spec("gemma2", tmp_path)
    assert s.windowed == (True, False, True, False)
    assert (s.attn_softcap, s.final_softcap) == (3.0, 5.0)
    assert s.ffn_activation == "gelu" and s.tied_head


def test_fused_and_optional_tensors_come_from_the_file(tmp_path: Path) -> None:
    phi3, qwen2, llama = (_spec(n, tmp_path) for n in ("phi3", "qwen2", "llama3"))
    assert phi3.fused_qkv and phi3.fused_gate_up and not phi3.qkv_bias
    assert qwen2.qkv_bias and not qwen2.fused_qkv and qwen2.rope.style == "halves"
    assert llama.rope.style == "pairs" and llama.rope.factors is not None
    assert llama.windowed == () and llama.layer_window(3) == 0


def test_mixtures_read_their_experts_and_routing_from_the_file(tmp_path: Path) -> None:
    mixtral, qwen2moe, gpt_oss = (_spec(n, tmp_path) for n in ("mixtral", "qwen2moe", "gpt-oss"))
    assert mixtral.experts is not None and mixtral.architecture == "llama"
    assert (mixtral.experts.n_experts, mixtral.experts.n_used, mixtral.experts.d_ff) == (6, 2, 64)
    assert mixtral.experts.normalize and mixtral.experts.gating == "softmax"
    assert qwen2moe.experts is not None and not qwen2moe.experts.normalize
    assert qwen2moe.d_ff == CASES["qwen2moe"].d_ff  # the shared expert's width
    assert gpt_oss.experts is not None and gpt_oss.experts.gating == "softmax_chosen"
    assert gpt_oss.ffn_activation == "swiglu_oai" and gpt_oss.d_ff == 0
    assert gpt_oss.windowed == (True, False, True, False)
    assert gpt_oss.rope.yarn is not None and gpt_oss.ffn_norm_name == "post_attention_norm"
    assert _spec("qwen3", tmp_path).experts is None


def test_a_mixture_without_its_experts_is_a_model_file_error(tmp_path: Path) -> None:
    path = _minimal(tmp_path / "m.gguf", "qwen3moe", expert_count=8, expert_used_count=2)
    with pytest.raises(ModelFileError, match="no expert tensors"):
        read_spec(open_gguf(path))
    path = _minimal(tmp_path / "n.gguf", "qwen3moe", expert_count=2, expert_used_count=3)
    with pytest.raises(ModelFileError, match="3 experts used of 2"):
        read_spec(open_gguf(path))


def test_deepseek2_reads_latent_attention_and_its_router_from_the_file(tmp_path: Path) -> None:
    lite, v3 = _spec("deepseek2-lite", tmp_path), _spec("deepseek3", tmp_path)
    assert lite.mla is not None and v3.mla is not None
    widths = (lite.mla.q_rank, lite.mla.kv_rank, lite.mla.nope_dim, lite.mla.rope_dim)
    assert widths == (0, 32, 32, 16)
    assert lite.mla.v_dim == 24 and v3.mla.q_rank == 32
    # the cache: one kv head of [c | k_pe]; the scale: the key head's width before absorption
    assert (lite.n_kv_heads, lite.head_dim, lite.rope.dim) == (1, 48, 16)
    assert lite.attn_scale == pytest.approx(48**-0.5) and lite.rope.style == "pairs"
    assert lite.d_ff == 96 and lite.experts is not None and lite.experts.shared_d_ff == 64
    assert lite.experts.gating == "softmax" and not lite.experts.normalize
    assert lite.experts.scale == 1.0 and not lite.experts.grouped
    e = v3.experts
    assert e is not None and (e.gating, e.normalize, e.scale) == ("sigmoid", True, 2.5)
    assert (e.n_groups, e.n_groups_used, e.shared_d_ff) == (4, 2, 32) and e.selection_bias
    # YaRN x4 with mscale_all_dim 0.707: the rope's magnitude cancelled to 1 (the kernel's
    # 1 + 0.1 ln 4 undone), the scores scaled by DeepSeek's mscale^2 / sqrt(48)
    assert v3.rope.yarn is not None and v3.rope.yarn.log_multiplier == pytest.approx(0.707)
    assert v3.rope.yarn.attn_factor == pytest.approx(1 / (1 + 0.1 * np.log(4.0)))
    mscale = 1 + 0.1 * 0.707 * np.log(4.0)
    assert v3.attn_scale == pytest.approx(mscale**2 / 48**0.5, rel=1e-6)


def test_the_deepseek2_gating_without_its_key_is_softmax_but_sigmoid_for_glm_lite() -> None:
    from meshnet.model.arch.deepseek2 import unkeyed_gating

    assert unkeyed_gating(27, 102400) == "softmax"
    assert unkeyed_gating(47, 154880) == "sigmoid"


def _mla(path: Path, **keys: object) -> Path:
    mla = {"attention.head_count_kv": 1, "attention.kv_lora_rank": 32, "rope.dimension_count": 8}
    mla |= {"attention.key_length": 40, "attention.value_length": 32}
    mla |= {"attention.key_length_mla": 24, "attention.value_length_mla": 16}
    return _minimal(path, "deepseek2", **(mla | keys))


def test_deepseek2_variants_it_cannot_run_are_refused_by_name(tmp_path: Path) -> None:
    legacy = _minimal(tmp_path / "legacy.gguf", "deepseek2", **{"attention.kv_lora_rank": 32})
    with pytest.raises(UnsupportedArchitecture, match="legacy fused attn_kv_b"):
        read_spec(open_gguf(legacy))
    path = _mla(tmp_path / "softplus.gguf", expert_count=4, expert_used_count=2)
    path = _with_experts(path, expert_gating_func=4)
    with pytest.raises(UnsupportedArchitecture, match="expert_gating_func 4"):
        read_spec(open_gguf(path))
    mistral = _mla(tmp_path / "temperature.gguf", **{"attention.temperature_scale": 1})
    with pytest.raises(UnsupportedArchitecture, match="temperature"):
        read_spec(open_gguf(mistral))
    mtp = _mla(tmp_path / "mtp.gguf", nextn_predict_layers=1)
    with pytest.raises(UnsupportedArchitecture, match="nextn_predict_layers"):
        read_spec(open_gguf(mtp))
    bad = _mla(tmp_path / "bad.gguf", **{"attention.value_length": 40})
    with pytest.raises(ModelFileError, match="one kv head"):
        read_spec(open_gguf(bad))


def test_yarn_log_multiplier_is_refused_where_the_family_does_not_read_it(tmp_path: Path) -> None:
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4}
    keys |= {"rope.scaling.yarn_log_multiplier": 1}
    path = _minimal(tmp_path / "q.gguf", "qwen2", **keys)
    with pytest.raises(UnsupportedArchitecture, match="yarn_log_multiplier"):
        read_spec(open_gguf(path))


def _with_experts(path: Path, **keys: int) -> Path:
    """``path`` written again with 3-D expert tensors (4 experts) and ``keys``."""
    f = open_gguf(path)
    arch = str(f.value("general.architecture"))
    out = path.with_suffix(".experts.gguf")
    w = gguf.GGUFWriter(str(out), arch)
    for name, field in gguf.GGUFReader(str(path)).fields.items():
        if name.startswith(arch + "."):
            w.add_uint32(name, int(field.contents()))  # type: ignore[arg-type]
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(2)
    for key, value in keys.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.add_tensor("blk.0.ffn_down_exps.weight", np.zeros((4, 64, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _minimal(path: Path, arch: str, **keys: object) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_eos_token_id(2)
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", int(value))  # type: ignore[call-overload]
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["mamba", "gptneox", "deepseek"])
def test_an_unsupported_family_is_refused_by_name(tmp_path: Path, arch: str) -> None:
    with pytest.raises(UnsupportedArchitecture, match=repr(arch)):
        read_spec(open_gguf(_minimal(tmp_path / "m.gguf", arch)))


def test_rope_scaling_it_cannot_compute_is_refused_by_name(tmp_path: Path) -> None:
    path = _minimal(tmp_path / "longrope.gguf", "qwen2", **{"rope.scaling.type": "longrope"})
    with pytest.raises(UnsupportedArchitecture, match="'longrope'"):
        read_spec(open_gguf(path))


@pytest.mark.parametrize(
    "keys",
    [
        {"attention.key_length": 16, "attention.value_length": 32},  # unequal head widths
        {"rope.dimension_count": 17},  # an odd rotary width
        {"attention.head_count_kv": 3},  # 4 heads do not split into 3 groups
    ],
)
def test_inconsistent_shapes_are_model_file_errors(tmp_path: Path, keys: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ModelFileError):
        read_spec(open_gguf(_minimal(tmp_path / "bad.gguf", "llama", **keys)))
