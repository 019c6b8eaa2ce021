"""The model families meshnet runs, one module each, and the registry naming them.

Adding a family is its module and one line here.
"""

from __future__ import annotations

from meshnet.errors import UnsupportedArchitecture
from meshnet.model.arch import (
    deepseek2,
    gemma,
    gpt_oss,
    llama,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
)
from meshnet.model.arch.base import Architecture, FfnActivation, Shape

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        llama.ARCH,
        qwen2.ARCH,
        qwen3.ARCH,
        phi3.ARCH,
        gemma.GEMMA2,
        gemma.GEMMA3,
        qwen2moe.ARCH,
        qwen3moe.ARCH,
        gpt_oss.ARCH,
        deepseek2.ARCH,
    )
}

__all__ = ["ARCHITECTURES", "Architecture", "FfnActivation", "Shape", "architecture"]


def architecture(name: str, file_name: str) -> Architecture:
    """The family ``name``; ``UnsupportedArchitecture`` naming it when meshnet has none."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise UnsupportedArchitecture(
            f"{file_name}: architecture {name!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    return arch
