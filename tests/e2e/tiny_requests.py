"""The requests the e2e tests send the "long" tiny model, and an OpenAI client of a mesh.

The long tiny model (``long_tiny`` in conftest.py: the tiny model with a context of
1024) never samples its eos from ``PROMPT`` at these seeds, so a completion runs its
whole ``max_tokens``: a fault injected after token n lands mid-stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import openai

from meshnet.local_mesh import LocalMesh

PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
LONG_CONTEXT = 1024  # the long tiny model's context


def long_completion(seed: int = 3, max_tokens: int = 120, **fields: Any) -> dict[str, Any]:
    """A sampled completion request of ``PROMPT`` to the long tiny model. It ignores
    end-of-generation ids, so it runs to ``max_tokens`` whatever backend computes it:
    the tests' kills and restarts must land mid-stream."""
    return {
        "model": "long",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "seed": seed,
        "ignore_eos": True,
        **fields,
    }


@contextmanager
def openai_client(mesh: LocalMesh) -> Iterator[openai.OpenAI]:
    """The official client of ``mesh``'s default tenant; it never retries on its own,
    so each answer a test reads is the mesh's first."""
    key = mesh.credentials.api_key
    with openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=key, max_retries=0) as client:
        yield client
