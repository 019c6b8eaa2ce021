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


@pytest.mark.parametrize("arch", ["mamba", "gptneox", "deepseek2"])
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
