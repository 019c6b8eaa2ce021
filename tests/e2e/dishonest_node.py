"""A dishonest node for the verification tests: the normal ``meshnet node``, patched in
its own process before it starts, that claims the honest fingerprint and range while
computing something else. No hook in production code: the patches replace functions
of the node's engine and loader the way a cheater editing their copy would.

Run as ``python dishonest_node.py CHEAT AFTER -- python -m meshnet.cli.main node ...``
(the ``LocalMesh.start_node`` prefix): CHEAT is one of the kinds below, AFTER the
forwards it computes honestly first (2: honest on its calibration's two inputs, then
cheating).

- ``weights``: one tensor differs (the token embedding's rows, one channel, +1e-3);
- ``skip-layer``: runs its range without its last layer;
- ``cached``: answers a new input with the output it cached for the first input of
  the same shape;
- ``ulp``: every output row one ulp off in one channel;
- ``sometimes``: ``ulp``, on one forward in four;
- ``first``: ``ulp`` on its first AFTER forwards, honest from then on (a node whose
  operator mended it: it fails a calibration, then passes one);
- ``file:PATH``: computes with the weights of another GGUF of the same shape (another
  quantization of the model, or another model) while its fingerprint is the file it
  was started with;
- ``decouple``: commits to its honest rows but sends the next hop other rows (one ulp
  off), so that the next hop's rows differ from the verifier's;
- ``sample``: computes honestly, but as a last hop picks the id after the sampler's
  (calibration samples nothing, so AFTER counts picks, not forwards);
- ``unpenalised``: computes honestly, but as a last hop samples as if the request
  asked for no presence / frequency penalty and no logit bias (AFTER is ignored);
- ``silent``: computes honestly, but sends no commitment of what it computes after its
  AFTER forwards (no check could reach its work).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

import meshnet.backends.shard as shard_file
import meshnet.node.autorun_stream as autorun_stream
import meshnet.node.configure as configure
import meshnet.node.engine_forward as engine_forward
import meshnet.node.forward_steps as forward_steps
from meshnet.cli.main import main
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf

_honest_forward = engine_forward.forward_committed
_honest_load = shard_file.load_shard
_honest_chunks = forward_steps.step_chunks


def _bent(rows: np.ndarray) -> np.ndarray:
    out = np.array(rows, dtype=np.float32, copy=True)
    out[:, 0] = np.nextafter(out[:, 0], np.float32(np.inf))
    return out


def patch(cheat: str, after: int) -> None:
    calls = [0]
    cache: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def forward(
        shard: Any, x: np.ndarray, batch: Any, split: Any = None
    ) -> tuple[np.ndarray, np.ndarray]:
        calls[0] += 1
        honest = calls[0] > after if cheat == "first" else calls[0] <= after
        if cheat == "weights" and not honest and shard.is_first:
            hidden = shard.backend.embed(x)
            hidden[:, 0] += np.float32(1e-3)
            hidden = shard.backend.run_layers(hidden, batch)
            if shard.is_last:
                return _honest_forward(shard, x, batch, split)
            return hidden, hidden
        out, boundary = _honest_forward(shard, x, batch, split)
        if honest:
            return out, boundary
        if cheat == "cached":
            return cache.setdefault(tuple(x.shape), (out, boundary))
        if cheat == "decouple" and not shard.is_last:
            return _bent(out), boundary
        if cheat in ("ulp", "first") or (cheat == "sometimes" and calls[0] % 4 == 0):
            bent = _bent(boundary)
            return (bent, bent) if not shard.is_last else (out, bent)
        return out, boundary

    def load_shard(f: Any, spec: Any, layers: LayerRange, backend: str) -> Any:
        if cheat.startswith("file:"):
            other = _honest_load(open_gguf(cheat.removeprefix("file:")), spec, layers, backend)
            return dataclasses.replace(other, fingerprint=f.fingerprint())  # claims the file
        if cheat != "skip-layer" or len(layers) < 2:
            return _honest_load(f, spec, layers, backend)
        shard = _honest_load(f, spec, LayerRange(layers.start, layers.end - 1), backend)
        return dataclasses.replace(shard, layers=layers)  # claims the whole range

    class Sampler(forward_steps.Sampler):
        def sample(self, logits: np.ndarray, history: Any, *, generated_from: int) -> int:
            honest = super().sample(logits, history, generated_from=generated_from)
            calls[0] += 1
            return honest if calls[0] <= after else (honest + 1) % len(logits)

    class Unpenalised(forward_steps.Sampler):
        def __init__(self, params: Any, draws: int = 0) -> None:
            plain = dataclasses.replace(
                params, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=()
            )
            super().__init__(plain, draws)

    def chunks(work: Any) -> list[Any]:
        return _honest_chunks(work) if calls[0] <= after else []

    if cheat == "sample":
        autorun_stream.Sampler = forward_steps.Sampler = Sampler  # type: ignore[misc]
        return
    if cheat == "unpenalised":
        autorun_stream.Sampler = forward_steps.Sampler = Unpenalised  # type: ignore[misc]
        return
    if cheat == "silent":
        forward_steps.step_chunks = chunks  # what a step's answer commits to
    engine_forward.forward_committed = forward
    shard_file.load_shard = load_shard  # what a node's start loads its layers with
    configure.load_shard = load_shard  # a T3 configure loads its layers there


if __name__ == "__main__":
    cheat, after, sep, *rest = sys.argv[1:]
    assert sep == "--"
    argv = rest[rest.index("meshnet.cli.main") + 1 :]  # after `python -m meshnet.cli.main`
    patch(cheat, int(after))
    sys.exit(main(argv))
