"""`meshnet generate` on the tiny model: the JSON contract and typed failures."""

import json
from pathlib import Path

import pytest

from meshnet.cli.main import main


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main(["generate", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_has_the_documented_fields(tiny_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = _run_json(capsys, "--model", str(tiny_path), "--max-tokens", "5", "--prompt", "the cat")
    assert set(out) == {"prompt_ids", "ids", "text", "finish_reason", "timings"}
    assert set(out["timings"]) == {"load_s", "prefill_tok_s", "decode_tok_s"}
    assert len(out["ids"]) == 5 and out["finish_reason"] == "length"
    assert out["timings"]["prefill_tok_s"] > 0 and out["timings"]["decode_tok_s"] > 0


def test_messages_use_the_chat_template_and_split_changes_nothing(tiny_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    msgs = json.dumps([{"role": "user", "content": "hi"}])
    one = _run_json(
        capsys,
        "--model",
        str(tiny_path),
        "--messages",
        msgs,
        "--split",
        "1",
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--max-tokens",
        "8",
    )
    three = _run_json(
        capsys,
        "--model",
        str(tiny_path),
        "--messages",
        msgs,
        "--split",
        "3",
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--max-tokens",
        "8",
    )
    # <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n: two starts, one end
    assert one["prompt_ids"][0] == 1
    assert one["prompt_ids"].count(1) == 2 and one["prompt_ids"].count(2) == 1
    assert one["ids"] == three["ids"] and one["prompt_ids"] == three["prompt_ids"]


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        (["--messages", "not json"], "bad-request"),
        (["--messages", "[]"], "bad-request"),
        (["--prompt", "x", "--temperature", "-1"], "bad-request"),
        (["--prompt", "x", "--split", "9"], "layer-range-invalid"),
    ],
)
def test_bad_input_exits_2_with_its_kind(tiny_path: Path, capsys, argv, kind) -> None:  # type: ignore[no-untyped-def]
    assert main(["generate", "--model", str(tiny_path), *argv]) == 2
    assert f"meshnet: error: {kind}:" in capsys.readouterr().err


def test_corrupt_model_exits_2(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 100)
    assert main(["generate", "--model", str(bad), "--prompt", "x"]) == 2
    assert "model-file-invalid" in capsys.readouterr().err


def test_plain_output_streams_text(tiny_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["generate", "--model", str(tiny_path), "--prompt", "a", "--max-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "[length] 4 tokens" in captured.err
