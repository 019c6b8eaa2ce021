"""The ranges `meshnet up` gives its nodes: ``--nodes N`` split by bytes, ``--layout`` as
given (checked against the model), and the line it prints for each node."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from meshnet.cli import up
from meshnet.cli.main import build_parser
from meshnet.cli.table import size
from meshnet.errors import LayerRangeError
from meshnet.layer_range import LayerRange, split_evenly
from meshnet.model.bundled import bundled_model_path
from meshnet.model.gguf_file import open_gguf
from meshnet.model.layer_bytes import LayerBytes, model_layer_bytes
from meshnet.model.spec import read_spec


def _up(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def _sizes(path: Path) -> LayerBytes:
    f = open_gguf(path)
    return model_layer_bytes(f, read_spec(f))


@pytest.fixture(scope="module")
def bundled_sizes() -> LayerBytes:
    return _sizes(bundled_model_path())


def test_three_nodes_of_the_bundled_model_are_split_by_bytes(bundled_sizes: LayerBytes) -> None:
    # SmolLM2's 49k-token embedding weighs as much as ~13 of its 30 layers, and the tied
    # head puts it on the last node too: the end nodes take fewer layers.
    layout = up.plan_layout(_up("--nodes", "3"), bundled_sizes)
    assert layout == [LayerRange(0, 6), LayerRange(6, 25), LayerRange(25, 30)]
    heaviest = max(bundled_sizes.range_bytes(r) for r in split_evenly(30, 3))
    by_bytes = max(bundled_sizes.range_bytes(r) for r in layout if r is not None)
    assert by_bytes < 0.9 * heaviest  # an even split: ~23.6 layers' bytes on each end node


def test_each_node_s_line_gives_its_range_bytes_and_kv(bundled_sizes: LayerBytes) -> None:
    layout = up.plan_layout(_up("--layout", "0:15,15:30,empty"), bundled_sizes)
    lines = up.layout_lines(layout, bundled_sizes)
    held = bundled_sizes.range_bytes(LayerRange(0, 15))
    kv = bundled_sizes.kv_bytes_per_token(LayerRange(0, 15))
    assert lines[0] == f"  node-0: layers [0, 15) {size(held)}, KV {size(kv)} per token"
    assert lines[1].startswith("  node-1: layers [15, 30) ")
    assert lines[2] == "  node-2: empty"


@pytest.mark.parametrize("argv", [("--layout", "0:20,20:31"), ("--nodes", "31")])
def test_a_layout_the_model_cannot_take_is_refused_before_anything_starts(
    bundled_sizes: LayerBytes, argv: tuple[str, str]
) -> None:
    with pytest.raises(LayerRangeError):
        up.plan_layout(_up(*argv), bundled_sizes)
