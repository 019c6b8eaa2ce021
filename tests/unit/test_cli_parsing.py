"""``meshnet``'s command line is parsed by its own command's parser alone: a node's
process never imports the tracker's HTTP stack, and a refused line reads as before."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshnet.cli.main import COMMANDS, build_parser, parse_args


def test_a_node_process_imports_no_tracker() -> None:
    code = (
        "import sys; from meshnet.cli.main import parse_args; "
        "a = parse_args(['node', '--tracker', 'http://t', '--empty']); "
        "print(a.command, 'meshnet.cli.tracker' in sys.modules, 'fastapi' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["node", "False", "False"]


def test_every_command_has_its_module() -> None:
    parser = build_parser()
    listed = next(a for a in parser._actions if a.dest == "command").choices
    assert set(COMMANDS) == set(listed or ())


def test_a_refused_line_prints_one_error_with_every_command_in_its_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["node", "--tracker", "t", "--empty", "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--no-such-flag" in err
    assert "tracker,up" in err  # the whole parser's usage


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "INFO", "nodes", "--json"],  # the command after an option's value
        ["tracker", "--port", "0"],
        ["node", "--tracker", "http://t", "--layers", "0:2", "--threads", "2"],
    ],
)
def test_a_line_parses_as_the_whole_parser_parses_it(argv: list[str]) -> None:
    own, whole = vars(parse_args(argv)), vars(build_parser().parse_args(argv))
    # Each parser makes its own runner closure: the same function, not the same object.
    assert own.pop("run").__qualname__ == whole.pop("run").__qualname__
    assert own == whole
