"""tekken.json read into the engine's Tokenizer, against mistral-common's Tekkenizer.

tests/golden/make_tekken_goldens.py wrote a small tekken.json in the schema of Mistral's
files (576 ranked tokens learnt on mixed English, code, accented Latin, CJK and emoji,
the last 20 cut off by default_vocab_size; Voxtral's special tokens with four filler
ones left for the loader) and recorded mistral-common's encodings and decodings.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.text.tokenizer import Tokenizer

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "tekken"
VECTORS = json.loads((GOLDEN / "vectors.json").read_text(encoding="utf-8"))
TEXTS = [e["text"] for e in VECTORS["strings"]]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_tekken(GOLDEN / "tekken.json")


@pytest.mark.parametrize("entry", VECTORS["strings"], ids=range(len(TEXTS)))
def test_plain_text_encodes_and_decodes_as_mistral_common(tok, entry):
    ids = tok.encode(entry["text"], add_special_tokens=False, split_special_tokens=True)
    assert ids == entry["ids"]
    assert tok.encode(entry["text"], split_special_tokens=True) == entry["ids_bos"]
    assert tok.decode(ids, skip_special_tokens=True) == entry["decoded"]
    assert tok.decode([tok.bos_token_id, *ids]) == entry["decoded_bos_keep"]


@pytest.mark.parametrize("entry", VECTORS["id_runs"], ids=range(len(VECTORS["id_runs"])))
def test_id_runs_decode_as_mistral_common(tok, entry):
    """Split characters, specials between the bytes of one character, random ids."""
    assert tok.decode(entry["ids"], skip_special_tokens=True) == entry["decoded"]
    assert tok.decode(entry["ids"]) == entry["decoded_keep"]


def test_special_tokens_sit_first_and_the_vocabulary_is_cut_where_the_config_says(tok):
    data = json.loads((GOLDEN / "tekken.json").read_text(encoding="utf-8"))
    n_special = data["config"]["default_num_special_tokens"]
    assert tok.vocab_size == data["config"]["default_vocab_size"] == n_special + len(data["vocab"]) - 20
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (1, {2}, True)
    assert [tok.id_to_token(i) for i in (0, 3, 24, 25, 34, 36, 39)] == [
        "<unk>",
        "[INST]",
        "[AUDIO]",
        "[BEGIN_AUDIO]",
        "[TRANSCRIBE]",
        "<SPECIAL_36>",
        "<SPECIAL_39>",
    ]
    assert tok.special_token_ids == frozenset(range(n_special))
    # A rendered prompt's markers are special tokens; the same text as plain text is not.
    marked = tok.encode("[INST]hi[/INST]", add_special_tokens=False)
    assert (marked[0], marked[-1]) == (3, 4) and 3 not in marked[1:-1]
    assert 3 not in tok.encode("[INST]", add_special_tokens=False, split_special_tokens=True)
    assert tok.encode("[INST]") == [1, 3]  # the switch is reset after use
    # The cut-off merges are never produced: no id reaches past the vocabulary.
    every = [i for text in TEXTS for i in tok.encode(text, split_special_tokens=True)]
    assert max(every) < tok.vocab_size


def stream(tok: Tokenizer, ids: list[int], skip: bool) -> str:
    detok = tok.detokenizer(skip_special_tokens=skip)
    pieces = [detok.add(i) for i in ids]
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in tok.decode(ids, skip_special_tokens=skip)
    return "".join(pieces) + detok.finalize()


@pytest.mark.parametrize("skip", [False, True])
def test_streaming_detokenization_joins_to_the_full_decode(tok, skip):
    for text in TEXTS:
        ids = tok.encode(text)
        assert stream(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip)
    rng = random.Random(7)
    tricky = sorted(tok.special_token_ids) + list(range(40 + 0x80, 40 + 0x100))
    tricky += tok.encode(" \n  👍🏽 é 你 ", add_special_tokens=False)
    for _ in range(150):
        ids = [
            rng.choice(tricky) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randint(0, 30))
        ]
        for skip in (False, True):
            assert stream(tok, ids, skip) == tok.decode(ids, skip_special_tokens=skip), ids


def test_a_folder_with_only_tekken_json_loads(tmp_path):
    shutil.copy(GOLDEN / "tekken.json", tmp_path / "tekken.json")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.mistral_format == "v7" and tok.chat_template is None
    assert tok.encode("Hello, world!", split_special_tokens=True) == VECTORS["strings"][0]["ids_bos"]
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(tmp_path).chat_template.startswith("{{ bos_token }}")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["config"].update(version="v99"), "version"),
        (lambda d: d["config"].update(default_vocab_size=10**6), "fewer than"),
        (lambda d: d["vocab"][5].update(token_bytes="AAAA"), "out of order"),
        (lambda d: d["vocab"][300].update(token_bytes="not base64!"), "base64"),
        (lambda d: d["config"].pop("pattern"), "pattern"),
        (lambda d: d["special_tokens"].append(dict(d["special_tokens"][0], rank=36)), "repeated"),
    ],
)
def test_broken_files_are_refused_with_one_line(tmp_path, change, message):
    data = json.loads((GOLDEN / "tekken.json").read_text(encoding="utf-8"))
    change(data)
    (tmp_path / "tekken.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=message) as info:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(info.value)
