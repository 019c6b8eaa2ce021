"""Builds the optional AVX2 kernel extensions; everything else is in pyproject.toml.

The extensions are optional: where they cannot be compiled (no compiler, no x86-64),
the fast backend falls back to its numba kernels.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "meshnet.backends._qkernels",
            ["src/meshnet/backends/_qkernels.c"],
            extra_compile_args=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
        Extension(
            "meshnet.backends._attention",
            ["src/meshnet/backends/_attention.c"],
            extra_compile_args=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            optional=True,
        ),
    ]
)
