"""The streaming detokenizer: its pieces always join to exactly the full decode.

The ``*-cleanup`` tokenizers decode with clean_up_tokenization_spaces applied (GPT-2 and
Llama 2 with transformers' override for BPE, and the small Unigram vocabulary in
tests/golden/tokenizers), so the cleanup's hold-back is held to the same invariant.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from engine.text.tokenizer import Tokenizer

MULTILINGUAL = [
    "Hello, world! How are you today?",
    "  Leading spaces,\ttabs\nand\n\nnewlines  ",
    "Grüße aus Zürich — naïve café, Ærøskøbing, ½ and ¾.",
    "你好，世界！日本語のテキストも。한국어 문장입니다.",
    "Emoji: 👋🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️‍🔥 and math ∑∫√∞ ≠ ≤.",
    "Кириллица и ελληνικά, עברית وعربي, हिन्दी.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code",
    "I do n't know , it 's fine . Is it ? Yes ! The ' quoted ' one ,  ' ve  . we 're , I 'm ",
]

GOLDEN_TOKENIZERS = Path(__file__).resolve().parents[2] / "golden" / "tokenizers"
CLEANUP_ON = {
    "clean_up_tokenization_spaces": True,
    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True,
}


def with_cleanup(tokenizer_json: Path, folder: Path, config: dict) -> Tokenizer:
    folder.mkdir()
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **CLEANUP_ON}), encoding="utf-8")
    tok = Tokenizer.from_dir(folder)
    assert tok.clean_up_tokenization_spaces
    return tok


@pytest.fixture(scope="module")
def tokenizers(shared_data, tmp_path_factory):
    found = {name: Tokenizer.from_dir(shared_data / "tokenizers" / name) for name in ("gpt2", "llama2", "falcon")}
    meta = mx.load(str(shared_data / "tiny_llm/stories260K.gguf"), return_metadata=True)[1]
    found["stories260K-gguf"] = Tokenizer.from_gguf(meta)
    tmp = tmp_path_factory.mktemp("cleanup")
    for name in ("gpt2", "llama2"):
        config = json.loads((shared_data / "tokenizers" / name / "tokenizer_config.json").read_text(encoding="utf-8"))
        found[f"{name}-cleanup"] = with_cleanup(
            shared_data / "tokenizers" / name / "tokenizer.json", tmp / name, config
        )
    found["unigram-cleanup"] = with_cleanup(
        GOLDEN_TOKENIZERS / "cleanup_unigram" / "tokenizer.json",
        tmp / "unigram",
        {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    )
    return found


NAMES = ["gpt2", "llama2", "falcon", "stories260K-gguf", "gpt2-cleanup", "llama2-cleanup", "unigram-cleanup"]


def stream(tok: Tokenizer, ids: list[int], skip: bool) -> tuple[list[str], str]:
    detok = tok.detokenizer(skip_special_tokens=skip)
    pieces = [detok.add(i) for i in ids]
    return pieces, detok.finalize()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("skip", [False, True])
def test_real_text_streams_to_the_full_decode(tokenizers, name, skip):
    tok = tokenizers[name]
    for text in MULTILINGUAL:
        ids = tok.encode(text)
        pieces, rest = stream(tok, ids, skip)
        assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)
        assert "\ufffd" not in "".join(pieces)  # no half characters shown along the way


@pytest.mark.parametrize("name", NAMES)
def test_random_ids_stream_to_the_full_decode(tokenizers, name):
    """Random sequences, weighted toward the hard cases: byte pieces, specials, spaces."""
    tok = tokenizers[name]
    rng = random.Random(1234)
    tricky = sorted(tok.byte_token_ids) + sorted(tok.special_token_ids)
    tricky += tok.encode(" \n  ▁ 👋 é 你", add_special_tokens=False)
    tricky += tok.encode(" . , ? ! ' n't 's 've 're 'm  n ' v", add_special_tokens=False)
    for _ in range(150):
        ids = [
            rng.choice(tricky) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(0, 30))
        ]
        for skip in (False, True):
            pieces, rest = stream(tok, ids, skip)
            assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip), ids


def test_byte_fallback_characters_come_out_whole(tokenizers):
    tok = tokenizers["llama2"]  # Llama 2 spells most emoji as four <0x..> pieces
    ids = tok.encode("a👋b", add_special_tokens=False)
    assert sum(i in tok.byte_token_ids for i in ids) == 4
    pieces, rest = stream(tok, ids, skip=False)
    assert [p for p in pieces if p] == [" a", "👋b"] or [p for p in pieces if p] == ["a", "👋b"]
    assert "".join(pieces) + rest == tok.decode(ids)


def test_byte_level_partial_characters_are_held(tokenizers):
    tok = tokenizers["gpt2"]  # byte-level BPE splits 👋 across tokens
    ids = tok.encode("hi 👋 there", add_special_tokens=False)
    pieces, rest = stream(tok, ids, skip=False)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + rest == "hi 👋 there"


def test_sentencepiece_spaces_are_kept_between_pieces(tokenizers):
    tok = tokenizers["llama2"]
    ids = tok.encode("Hello big world")  # <s> ▁Hello ▁big ▁world
    pieces, rest = stream(tok, ids, skip=True)
    assert pieces == ["", "Hello", " big", " world"] and rest == ""


def test_text_is_not_held_longer_than_needed(tokenizers):
    """ASCII text under a byte-level vocabulary is final as soon as its token arrives."""
    tok = tokenizers["gpt2"]
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    detok = tok.detokenizer()
    for n, token_id in enumerate(ids, 1):
        detok.add(token_id)
        assert detok.text == tok.decode(ids[:n])


@pytest.mark.parametrize("name", NAMES)
def test_decoding_work_grows_linearly(tokenizers, name, monkeypatch):
    """Each step decodes a few recent tokens, never the whole sequence again."""
    tok = tokenizers[name]
    ids = tok.encode(" ".join(MULTILINGUAL) * 8)
    decoded = []
    real_decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or real_decode(ids, **kw))
    detok = tok.detokenizer()
    for token_id in ids:
        detok.add(token_id)
    text = detok.text + detok.finalize()
    monkeypatch.undo()
    assert len(ids) > 400
    assert sum(decoded) <= 8 * len(ids)
    assert max(decoded) < 80  # the longest run of byte pieces, plus a token or two
    assert text == tok.decode(ids)
