"""How transformers decodes with ``clean_up_tokenization_spaces`` on, off and unset.

For each tokenizer, each tokenizer_config.json variant is written next to the tokenizer's
tokenizer.json in a scratch folder, loaded with ``AutoTokenizer`` and asked to decode id
sequences whose text holds every pattern the cleanup removes (" .", " ?", " !", " ,",
" ' ", " n't", " 'm", " 's", " 've", " 're"), chains where one removal makes the next
("  ' ve"), trailing spaces and special tokens. The variants and texts go to
tests/golden/tokenizers/cleanup_spaces.json; the tests write the same folders and decode
the same ids with the engine.

Tokenizers: GPT-2, Llama 2 and Falcon from ../shared/data/tokenizers (all BPE, where
transformers 5 skips the cleanup unless
``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` is set too),
the GPT-2 and Llama 2 vocabularies read from GGUF, and two small non-BPE tokenizers this
script builds and saves in tests/golden/tokenizers (a word-level one whose decode joins
tokens with spaces, and a Unigram one with SentencePiece's visible-space decoder).

Run from the repository root with transformers installed (no network):

    python tests/golden/make_cleanup_goldens.py [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer

HERE = Path(__file__).resolve().parent / "tokenizers"
OUT = HERE / "cleanup_spaces.json"

BPE_OVERRIDE = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"

TEXTS = [
    "Hello , world . How are you ? Great !",
    "I do n't know , I 'm sure it 's fine .",
    "We 've said they 're here , have n't we ?",
    "The ' quoted ' word and a ' b",
    "Chains  ' ve and  ' s and  ' re and  ' m",
    "Twice  . and  , and  ? and  ! here",
    "Ends with a space . ",
    "trailing n",
    "no cleanup needed: it's fine, isn't it?",
    "Grüße , naïve ! 你好 . 👋 ?",
    " ' ",
    "x 'v y 'r z n'",
]

SPECIAL_SANDWICH = "Hello , world"  # a special token goes between this and SANDWICH_TAIL
SANDWICH_TAIL = " . and ' s"


def build_wordlevel(out: Path) -> None:
    """Whole-word tokens, no decoder: decode joins them with spaces, as cleanup expects."""
    # Every word of the texts is in the vocabulary: how [UNK] decodes is not the question here.
    words = ["[UNK]", "[CLS]", "[SEP]"]
    words += dict.fromkeys(w for t in [*TEXTS, SPECIAL_SANDWICH, SANDWICH_TAIL] for w in t.split())
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("[CLS]", special=True), AddedToken("[SEP]", special=True)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))


def build_unigram(out: Path) -> None:
    """SentencePiece-style pieces: spaces live inside pieces ("▁."), and "▁" alone is a piece."""
    pieces = [
        "<unk>",
        "<s>",
        "</s>",
        "▁",
        "▁.",
        ".",
        "▁,",
        ",",
        "▁?",
        "?",
        "▁!",
        "!",
        "▁'",
        "'",
        "▁n",
        "n",
        "'t",
        "t",
        "'m",
        "m",
        "'s",
        "s",
        "'ve",
        "ve",
        "v",
        "'re",
        "re",
        "r",
        "e",
        "▁Hello",
        "▁world",
        "▁How",
        "▁are",
        "▁you",
        "▁Great",
        "▁I",
        "▁do",
        "▁know",
        "▁sure",
        "▁it",
        "▁fine",
        "▁We",
        "▁said",
        "▁they",
        "▁here",
        "▁have",
        "▁we",
        "▁The",
        "▁quoted",
        "▁word",
        "▁and",
        "▁a",
        "▁b",
        "▁x",
        "▁y",
        "▁z",
        "▁Chains",
        "▁Twice",
        "▁Ends",
        "▁with",
        "▁space",
        "▁trailing",
        "▁no",
        "▁cleanup",
        "▁needed",
        ":",
        "▁its",
        "▁isn",
        "▁Grüße",
        "▁naïve",
        "▁你好",
        "▁👋",
        "a",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "i",
        "k",
        "l",
        "o",
        "p",
        "u",
        "w",
        "x",
        "y",
        "z",
    ]
    vocab = [(p, 0.0 if p in ("<unk>", "<s>", "</s>") else -1.0 - len(pieces) / 100 + len(p)) for p in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))


def id_sequences(tok, special_id: int, inner_specials: bool = True) -> list[list[int]]:
    seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    head = tok.encode(SPECIAL_SANDWICH, add_special_tokens=False)
    tail = tok.encode(SANDWICH_TAIL, add_special_tokens=False)
    if inner_specials:
        seqs.append([special_id, *head, special_id, *tail, special_id])
    else:
        seqs.append([special_id, *head, *tail])
    return seqs


def decoded(tok, seqs: list[list[int]], variant: str, config: dict | None) -> dict:
    return {
        "variant": variant,
        "config": config,
        "texts": [tok.decode(ids) for ids in seqs],
        "texts_skip_special": [tok.decode(ids, skip_special_tokens=True) for ids in seqs],
    }


def config_variants(shipped: dict) -> dict[str, dict]:
    on = {**shipped, "clean_up_tokenization_spaces": True}
    on.pop(BPE_OVERRIDE, None)
    off = {**on, "clean_up_tokenization_spaces": False}
    missing = {k: v for k, v in on.items() if k != "clean_up_tokenization_spaces"}
    return {"shipped": shipped, "on": on, "on_bpe_override": {**on, BPE_OVERRIDE: True}, "off": off, "missing": missing}


def folder_case(name: str, tokenizer_json: Path, shipped: dict, special: str, inner_specials: bool = True) -> dict:
    case: dict = {"tokenizer": name, "ids": None, "variants": []}
    for variant, config in config_variants(shipped).items():
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(tokenizer_json, Path(tmp) / "tokenizer.json")
            (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
            tok = AutoTokenizer.from_pretrained(tmp)
            if case["ids"] is None:  # the same ids for every variant: encoding does not depend on the key
                case["ids"] = id_sequences(tok, tok.convert_tokens_to_ids(special), inner_specials)
            case["variants"].append(decoded(tok, case["ids"], variant, config))
    return case


def gguf_case(data: Path, name: str, special: str) -> dict:
    tok = AutoTokenizer.from_pretrained(str(data / "tokenizers" / "gguf_vocab"), gguf_file=f"ggml-vocab-{name}.gguf")
    ids = id_sequences(tok, tok.convert_tokens_to_ids(special))
    return {"tokenizer": f"gguf:{name}", "ids": ids, "variants": [decoded(tok, ids, "gguf", None)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2].parent / "shared" / "data")
    args = parser.parse_args()
    shared = args.data / "tokenizers"
    build_wordlevel(HERE / "cleanup_wordlevel")
    build_unigram(HERE / "cleanup_unigram")

    cases = []
    # Llama 2's <s> only leads: transformers 5 rebuilds LlamaTokenizer's normalizer as a
    # pre-tokenizer, which changes the spaces beside special tokens inside the text. That
    # is a matter of its own, apart from the cleanup.
    for name, special, inner in (
        ("gpt2", "<|endoftext|>", True),
        ("llama2", "<s>", False),
        ("falcon", "<|endoftext|>", True),
    ):
        shipped = json.loads((shared / name / "tokenizer_config.json").read_text(encoding="utf-8"))
        cases.append(folder_case(name, shared / name / "tokenizer.json", shipped, special, inner))
    cases.append(
        folder_case("cleanup_wordlevel", HERE / "cleanup_wordlevel" / "tokenizer.json", {"unk_token": "[UNK]"}, "[SEP]")
    )
    cases.append(
        folder_case(
            "cleanup_unigram",
            HERE / "cleanup_unigram" / "tokenizer.json",
            {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
            "<s>",
        )
    )
    cases += [gguf_case(args.data, "gpt-2", "<|endoftext|>"), gguf_case(args.data, "llama-spm", "<s>")]
    OUT.write_text(
        json.dumps({"made_by": f"transformers {transformers.__version__}", "cases": cases}, ensure_ascii=False) + "\n",
        encoding="utf-8",
    )
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
