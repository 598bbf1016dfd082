"""SentencePiece reference encodings for the stories260K vocabulary.

``../shared/data/tiny_llm/tok512.model`` is the SentencePiece model whose pieces and
scores stories260K.gguf embeds. The engine builds its tokenizer from the GGUF metadata
alone; this script records what SentencePiece itself does with the same vocabulary, so
the tests can compare without sentencepiece installed.

Run from the repository root with sentencepiece installed:

    python tests/golden/make_tokenizer_goldens.py [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import sentencepiece

OUT = Path(__file__).resolve().parent / "tokenizers" / "tok512_sentencepiece.json"

EXTRA_TEXTS = [
    "",
    " ",
    "  leading spaces",
    "trailing spaces   ",
    "Tabs\tand\nnewlines\n\n",
    "Grüße aus Zürich — 你好，世界! 👋🏽",
    "Numbers 3.14159 and 1,000,000.",
    "ALL CAPS and MiXeD case",
    "Ünïcödé ñ ß ø",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2].parent / "shared" / "data")
    args = parser.parse_args()
    sp = sentencepiece.SentencePieceProcessor(model_file=str(args.data / "tiny_llm" / "tok512.model"))
    story = (args.data / "tiny_llm" / "stories260K.md").read_text(encoding="utf-8")
    sample = re.search(r"-t 0\.0\n(.*?)\n```", story, re.S).group(1)
    texts = sample.split("\n") + EXTRA_TEXTS
    cases = [{"text": t, "ids": sp.encode(t)} for t in texts]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "made_by": f"sentencepiece {sentencepiece.__version__}",
                "bos_id": sp.bos_id(),
                "eos_id": sp.eos_id(),
                "cases": cases,
            },
            ensure_ascii=False,
        )
        + "\n",
        encoding="utf-8",
    )
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
