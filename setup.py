"""Builds the optional AVX2 kernel extension; everything else is in pyproject.toml.

The extension is optional: where it cannot be compiled (no compiler, no x86-64),
the fast backend falls back to its numba kernels.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshnet.backends._native",
            [
                f"src/meshnet/backends/native/{name}.c"
                for name in (
                    "module",
                    "matmul",
                    "dequant",
                    "attention",
                    "block",
                    "ffn",
                    "moe",
                    "q8",
                    "isa",
                )
            ],
            depends=[
                "src/meshnet/backends/native/native.h",
                "src/meshnet/backends/native/isa.h",
                "src/meshnet/backends/native/kscales.h",
                "src/meshnet/backends/native/matmul_tile.h",
                "src/meshnet/backends/native/q8_tile.h",
                "src/meshnet/backends/native/q8_avx2.h",
                "src/meshnet/backends/native/q8_quantize.h",
                "src/meshnet/backends/native/split.h",
                "src/meshnet/backends/native/fp4.h",
            ],
            extra_compile_args=[
                "-O3",
                "-mavx2",
                "-mfma",
                "-mf16c",
                "-ffp-contract=off",
                "-fopenmp",
            ],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
)
