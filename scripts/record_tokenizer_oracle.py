"""Record llama.cpp's own tokenization of test texts into tests/fixtures/tokenizer_llamacpp.json.

For every GGUF in ``tests/vocab_gguf.CASES`` (the real Llama-2, Llama-3 and
Qwen3 vocabularies, and a 20k-token cut of Llama-3 under each pre-tokenizer
checked), the ids ``llama-tokenize`` gives for every text in ``TEXTS``, with
the BOS the file asks for and special tokens parsed, as a prompt is tokenized.
CI has no llama.cpp; tests/unit/test_tokenizer_vocab.py compares meshnet with
this file. Remake it (after bench/build_llamacpp.sh has built llama.cpp) with::

    .venv/bin/python scripts/record_tokenizer_oracle.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from vocab_gguf import CASES, FAMILIES, family_dir, fetch_vocabularies, write_case_gguf  # noqa: E402

OUT = REPO / "tests" / "fixtures" / "tokenizer_llamacpp.json"
LLAMA_TOKENIZE = Path.home() / ".cache" / "meshnet" / "llama.cpp" / "bin" / "llama-tokenize"

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "hello  world\n\n\t x",
    "   leading and trailing   ",
    "multiple\n\n\nnewlines\r\nand CRLF\n",
    "1234567890 3.14159 1,000,000 12345678 007",
    "Punctuation!?... (parens) [brackets] {braces} <angles> \"quotes\" 'single' --dashes--",
    "café naïve résumé Ångström façade",
    "日本語のテキストと中文字符，한국어",  # noqa: RUF001  (a full-width comma on purpose)
    "😀 emoji 🎉👍🏽 👨‍👩‍👧",
    "It's we're they'll I'd you've she'S HE'LL",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tprint(x)",
    "<|begin_of_text|>hi<|eot_id|>after",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<s>[INST] hello [/INST] answer</s>",
    "Ünïcödé ß ẞ Σίσυφος",
    "ﬁ ligature ① ½ ²",
    "a" * 40 + " " + "ab" * 20,
    " ",
    "",
    "\n",
    "  \n  ",
    "email@example.com https://example.com/path?q=1&r=2",
    "Русский текст и العربية и עברית",
    "mixed123numbers456and789letters",
]


def llama_tokenize(binary: Path, gguf: Path, text: str) -> list[int]:
    """llama.cpp's ids for ``text`` as a prompt: BOS as the file says, specials parsed."""
    done = subprocess.run(
        [str(binary), "-m", str(gguf), "--stdin", "--ids", "--no-escape", "--log-disable"],
        input=text.encode("utf-8"),
        capture_output=True,
        check=True,
        timeout=120,
    )
    return [int(x) for x in json.loads(done.stdout.decode().strip().splitlines()[-1])]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-tokenize", type=Path, default=LLAMA_TOKENIZE)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    cache = fetch_vocabularies()
    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            gguf = write_case_gguf(cache, case, Path(tmp) / "vocab.gguf")
            cases[case.key] = [llama_tokenize(args.llama_tokenize, gguf, t) for t in TEXTS]
            print(f"{case.key}: {len(TEXTS)} texts", file=sys.stderr)
    record = {
        "recorded_with": "llama-tokenize of bench/build_llamacpp.sh (llama_cpp_python 0.3.36)",
        "vocabularies": {
            name: sha256(family_dir(cache, name) / "tokenizer.json") for name in FAMILIES
        },
        "texts": TEXTS,
        "cases": cases,
    }
    args.out.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(args.out)


if __name__ == "__main__":
    main()
