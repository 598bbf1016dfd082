"""clean_up_tokenization_spaces decodes as transformers does, in full and when streamed.

The reference texts come from transformers (tests/golden/make_cleanup_goldens.py): the
real GPT-2, Llama 2 and Falcon tokenizers in ../shared/data/tokenizers and two small
non-BPE tokenizers in tests/golden/tokenizers, each with the key on, off, unset and with
transformers' BPE override, plus the GPT-2 and Llama 2 vocabularies read from GGUF.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from engine.text.cleanup import REPLACEMENTS, StreamingCleanup, clean_up_tokenization, is_settled
from engine.text.tokenizer import Tokenizer

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden" / "tokenizers"
GOLDEN = json.loads((GOLDEN_DIR / "cleanup_spaces.json").read_text(encoding="utf-8"))
CASES = {case["tokenizer"]: case for case in GOLDEN["cases"]}
IN_REPO = {"cleanup_wordlevel", "cleanup_unigram"}
BPE_OVERRIDE = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


def tokenizer_json(name: str, request) -> Path:
    if name in IN_REPO:
        return GOLDEN_DIR / name / "tokenizer.json"
    return request.getfixturevalue("shared_data") / "tokenizers" / name / "tokenizer.json"


def folder_tokenizer(tmp_path: Path, source: Path, config: dict) -> Tokenizer:
    shutil.copy(source, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return Tokenizer.from_dir(tmp_path)


def streamed(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    detok = tok.detokenizer(skip_special_tokens=skip)
    pieces = [detok.add(i) for i in ids]
    return "".join(pieces) + detok.finalize()


def check_against(tok: Tokenizer, ids: list[list[int]], variant: dict) -> None:
    for seq, text, text_skip in zip(ids, variant["texts"], variant["texts_skip_special"], strict=True):
        assert tok.decode(seq) == text, (variant["variant"], seq)
        assert tok.decode(seq, skip_special_tokens=True) == text_skip, (variant["variant"], seq)
        assert streamed(tok, seq, skip=False) == text, (variant["variant"], seq)
        assert streamed(tok, seq, skip=True) == text_skip, (variant["variant"], seq)


FOLDER_VARIANTS = [
    (name, v["variant"]) for name, case in CASES.items() if not name.startswith("gguf:") for v in case["variants"]
]


@pytest.mark.parametrize(("name", "variant"), FOLDER_VARIANTS)
def test_folder_tokenizers_decode_like_transformers(request, tmp_path, name, variant):
    case = CASES[name]
    golden = next(v for v in case["variants"] if v["variant"] == variant)
    tok = folder_tokenizer(tmp_path, tokenizer_json(name, request), golden["config"])
    check_against(tok, case["ids"], golden)


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm"])
def test_gguf_tokenizers_never_clean_up(shared_data, name):
    meta = mx.load(str(shared_data / "tokenizers/gguf_vocab" / f"ggml-vocab-{name}.gguf"), return_metadata=True)[1]
    tok = Tokenizer.from_gguf(meta)
    assert not tok.clean_up_tokenization_spaces
    case = CASES[f"gguf:{name}"]
    check_against(tok, case["ids"], case["variants"][0])


def test_goldens_exercise_the_cleanup():
    """The references differ between on and off where transformers cleans, so the checks can fail."""
    for name in ("gpt2", "llama2", "falcon", "cleanup_wordlevel", "cleanup_unigram"):
        variants = {v["variant"]: v["texts"] for v in CASES[name]["variants"]}
        assert variants["on_bpe_override"] != variants["off"] == variants["missing"]
        # transformers 5 skips the cleanup for BPE models unless told otherwise
        assert (variants["on"] == variants["off"]) == (name not in IN_REPO)
    for case in CASES.values():
        raw = "\n".join(case["variants"][-1]["texts"])  # off, missing or GGUF: nothing cleaned
        assert all(pattern in raw for pattern, _ in REPLACEMENTS), case["tokenizer"]


def test_setting_follows_the_config_and_the_model_kind(tmp_path):
    unigram = GOLDEN_DIR / "cleanup_unigram" / "tokenizer.json"
    wordlevel = GOLDEN_DIR / "cleanup_wordlevel" / "tokenizer.json"
    assert folder_tokenizer(tmp_path, unigram, {"clean_up_tokenization_spaces": True}).clean_up_tokenization_spaces
    assert not folder_tokenizer(tmp_path, unigram, {}).clean_up_tokenization_spaces
    tok = folder_tokenizer(tmp_path, wordlevel, {"clean_up_tokenization_spaces": True})
    ids = [tok.token_to_id(t) for t in ("Hello", ",", "world", ".")]
    assert tok.decode(ids) == "Hello, world."
    assert tok.decode(ids, clean_up_tokenization_spaces=False) == "Hello , world ."


# ---- the cleanup itself -------------------------------------------------------------


def test_chain_matches_sequential_replacement():
    # Later steps see what earlier ones made; one pass of replace leaves overlaps behind.
    assert clean_up_tokenization("a  ' ve") == "a've"
    assert clean_up_tokenization("a  .") == "a ."
    assert clean_up_tokenization("x ' ' y") == "x'' y"
    assert clean_up_tokenization("I do n't , we 're") == "I don't, we're"


def test_settled_prefixes_clean_independently_of_what_follows():
    """Exhaustive over short strings of the characters the patterns use.

    Heads of five characters reach chains such as "  ' v" + "e" (" ' " makes " 've").
    """
    alphabet = " .'ntve"  # enough for " .", " ' ", " n't", " 've" and their chains
    tails = ["".join(t) for n in range(3) for t in itertools.product(alphabet, repeat=n)]
    for n in range(6):
        for head in map("".join, itertools.product(alphabet, repeat=n)):
            if not is_settled(head):
                continue
            for tail in tails:
                assert clean_up_tokenization(head + tail) == clean_up_tokenization(head) + clean_up_tokenization(tail)


def test_streaming_cleanup_joins_to_the_whole():
    rng = random.Random(7)
    for _ in range(3000):
        text = "".join(rng.choice(" .'ntvrmse,?!x") for _ in range(rng.randint(0, 24)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = StreamingCleanup()
        out = "".join(stream.push(p) for p in parts) + stream.flush()
        assert out == clean_up_tokenization(text), (text, parts)


def test_a_trailing_space_waits_for_the_next_text():
    stream = StreamingCleanup()
    assert stream.push("Hello ") == "Hello"
    assert stream.push(".") == "."
    assert stream.push(" I do n") == " I do"
    assert stream.push("'t") == "n't"
    assert stream.push(" know ") == " know"
    assert stream.push("you") == " you"
    assert stream.flush() == ""


def test_streamed_pieces_under_a_unigram_vocabulary():
    """Pieces that end in a space are held until the next piece shows whether it stays."""
    tok = Tokenizer(Tokenizer.from_dir(GOLDEN_DIR / "cleanup_unigram").backend, clean_up_tokenization_spaces=True)
    ids = [tok.token_to_id(p) for p in ("▁Hello", "▁", ".", "▁", "▁n", "'t", "▁we", "▁")]
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    assert pieces == ["Hello", "", ".", "", "", " n't", " we", ""]
    assert detok.finalize() == " "
    assert detok.text == tok.decode(ids) == "Hello. n't we "
