"""Tokenizers reproduce published test vectors (../shared/data/tokenizers, see its PROVENANCE.md).

swift-transformers vectors are encodings with the tokenizer's own special tokens (Llama 2
gets BOS); llama.cpp vectors list ids without BOS, one line per input string.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from engine.text.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "tokenizers"

FOLDERS = {"gpt2": "gpt2_encoded_tokens", "llama2": "llama_encoded", "falcon": "falcon_encoded"}
LLAMA_CPP_FOR_FOLDER = {"gpt2": "gpt-2", "llama2": "llama-spm", "falcon": "falcon"}


def llama_cpp_vectors(data: Path, name: str) -> list[tuple[str, list[int]]]:
    base = data / "tokenizers" / "test_vectors" / "llama.cpp" / f"ggml-vocab-{name}.gguf"
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()  # the file ends with a separator
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines) > 40
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def gguf_metadata(path: Path) -> dict:
    return mx.load(str(path), return_metadata=True)[1]


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_swift_transformers_vectors(shared_data, folder):
    vec = json.loads(
        (shared_data / "tokenizers/test_vectors/swift-transformers" / f"{FOLDERS[folder]}.json").read_text(
            encoding="utf-8"
        )
    )
    tok = Tokenizer.from_dir(shared_data / "tokenizers" / folder)
    assert tok.encode(vec["text"]) == vec["token_ids"]
    assert [tok.id_to_token(i) for i in tok.encode(vec["text"], add_special_tokens=False)] == vec["bpe_tokens"]
    assert tok.decode(vec["token_ids"]) == vec["decoded_text"]


@pytest.mark.parametrize("folder", sorted(FOLDERS))
def test_llama_cpp_vectors_from_tokenizer_json(shared_data, folder):
    tok = Tokenizer.from_dir(shared_data / "tokenizers" / folder)
    for text, ids in llama_cpp_vectors(shared_data, LLAMA_CPP_FOR_FOLDER[folder]):
        assert tok.encode(text, add_special_tokens=False) == ids, repr(text)


@pytest.mark.parametrize("name", ["llama-spm", "gpt-2", "phi-3"])
def test_llama_cpp_vectors_from_gguf_vocab(shared_data, name):
    tok = Tokenizer.from_gguf(gguf_metadata(shared_data / "tokenizers/gguf_vocab" / f"ggml-vocab-{name}.gguf"))
    for text, ids in llama_cpp_vectors(shared_data, name):
        assert tok.encode(text, add_special_tokens=False) == ids, repr(text)
        if name == "gpt-2":  # byte-level BPE decodes back to the input exactly
            assert tok.decode(ids) == text


def test_gguf_spm_matches_tokenizer_json(shared_data):
    """The Llama 2 vocabulary built from GGUF decodes like Hugging Face's own tokenizer.json."""
    gguf = Tokenizer.from_gguf(gguf_metadata(shared_data / "tokenizers/gguf_vocab/ggml-vocab-llama-spm.gguf"))
    ref = Tokenizer.from_dir(shared_data / "tokenizers/llama2")
    for text, _ in llama_cpp_vectors(shared_data, "llama-spm"):
        ids = ref.encode(text)
        assert gguf.encode(text) == ids
        assert gguf.decode(ids) == ref.decode(ids)
        assert gguf.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert gguf.vocab_size == ref.vocab_size == 32000


def test_gguf_special_tokens(shared_data):
    tok = Tokenizer.from_gguf(gguf_metadata(shared_data / "tokenizers/gguf_vocab/ggml-vocab-phi-3.gguf"))
    assert tok.bos_token == "<s>" and tok.bos_token_id == 1 and tok.add_bos_token
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_ids == {32000}
    assert tok.chat_template is not None and "<|user|>" in tok.chat_template
    # Control tokens in text become their ids, as llama.cpp parses them.
    assert tok.encode("<|user|>\nHi<|end|>", add_special_tokens=False)[0] == 32010
    assert 32007 in tok.encode("<|user|>\nHi<|end|>", add_special_tokens=False)

    gpt2 = Tokenizer.from_gguf(gguf_metadata(shared_data / "tokenizers/gguf_vocab/ggml-vocab-gpt-2.gguf"))
    assert not gpt2.add_bos_token
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.eos_token_ids == {50256}


@pytest.fixture(scope="module")
def stories_metadata(shared_data):
    return gguf_metadata(shared_data / "tiny_llm/stories260K.gguf")


@pytest.fixture(scope="module")
def stories_golden():
    return json.loads((GOLDEN / "tok512_sentencepiece.json").read_text(encoding="utf-8"))


class TestStories260K:
    """stories260K.gguf's 512-piece vocabulary against SentencePiece on tok512.model."""

    def test_encodes_like_sentencepiece(self, stories_metadata, stories_golden):
        metadata, golden = stories_metadata, stories_golden
        tok = Tokenizer.from_gguf(metadata)
        assert tok.vocab_size == 512
        for case in golden["cases"]:
            text = case["text"]
            if text != " ".join(text.split(" ")) or text.strip(" ") != text or "  " in text:
                continue  # whitespace squeezing: see the next test
            assert tok.encode(text, add_special_tokens=False) == case["ids"], repr(text)
            assert tok.encode(text) == [golden["bos_id"], *case["ids"]]
            assert tok.decode(case["ids"]) == text

    def test_whitespace_squeezing_when_the_file_asks_for_it(self, stories_metadata, stories_golden):
        metadata, golden = stories_metadata, stories_golden
        # tok512.model squeezes runs of spaces (SentencePiece's remove_extra_whitespaces);
        # this GGUF does not record that flag and llama.cpp reads it as off. Files that
        # carry it get SentencePiece's behaviour.
        tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.remove_extra_whitespaces": True})
        for case in golden["cases"]:
            assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], repr(case["text"])
        plain = Tokenizer.from_gguf(metadata)
        assert plain.encode("  a", add_special_tokens=False) != tok.encode("  a", add_special_tokens=False)

    def test_accepts_plain_python_metadata(self, stories_metadata):
        metadata = stories_metadata
        plain_meta = {k: (v.tolist() if isinstance(v, mx.array) else v) for k, v in metadata.items()}
        assert isinstance(plain_meta["tokenizer.ggml.scores"], list)
        a, b = Tokenizer.from_gguf(metadata), Tokenizer.from_gguf(plain_meta)
        text = "Once upon a time, Lily saw a big red ball."
        assert a.encode(text) == b.encode(text)
        assert b.bos_token_id == 1 and b.eos_token_ids == {2}


def test_gguf_byte_level_word_splits(shared_data):
    """tokenizer.ggml.pre picks the word split: GPT-2 leaves digit runs to the merges, Llama 3
    cuts them by three, Qwen2 into single digits."""
    meta = gguf_metadata(shared_data / "tokenizers/gguf_vocab/ggml-vocab-gpt-2.gguf")
    text = "Order 1234567 shipped, naïve 👋 test"
    expected_digits = {
        "gpt-2": ["Ġ123", "45", "67"],
        "llama-bpe": ["Ġ", "123", "456", "7"],
        "qwen2": ["Ġ", "1", "2", "3", "4", "5", "6", "7"],
    }
    for pre, digits in expected_digits.items():
        tok = Tokenizer.from_gguf({**meta, "tokenizer.ggml.pre": pre})
        pieces = [tok.id_to_token(i) for i in tok.encode(text)]
        assert pieces[1 : 1 + len(digits)] == digits and pieces[1 + len(digits)] == "Ġshipped"
        assert tok.decode(tok.encode(text)) == text


def test_gguf_refusals():
    from engine.errors import UnsupportedModelError

    base = {"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(UnsupportedModelError, match="'bert' is not supported"):
        Tokenizer.from_gguf({**base, "tokenizer.ggml.model": "bert"})
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf({**base, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(UnsupportedModelError, match="no tokenizer vocabulary"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "llama"})
    with pytest.raises(UnsupportedModelError, match="no scores"):
        Tokenizer.from_gguf({**base, "tokenizer.ggml.model": "llama"})
    tiny = Tokenizer.from_gguf({**base, "tokenizer.ggml.model": "gpt2"})
    assert tiny.encode("ab") == [2] and tiny.bos_token_id is None and tiny.eos_token_ids == set()
