"""Mistral's ``tekken.json`` read into an equivalent ``tokenizers`` byte-level BPE.

tekken.json holds a tiktoken vocabulary: a pre-tokenizer regex, a list of token byte
strings (base64) whose position is their merge rank, and a list of special tokens that
take the first ids, so a regular token's id is its rank plus the number of specials.
``config.default_vocab_size`` cuts the regular vocabulary short: the model was trained
on the first ``default_vocab_size - default_num_special_tokens`` ranks only.

tiktoken merges, within each piece the regex cut, the adjacent pair whose joined bytes
have the lowest rank, and takes a piece that is itself a token as it is. A BPE with
``ignore_merges`` and, for every token, one merge per way to split it into two tokens
(ranked by the token's rank) does exactly that.

tiktoken never reads special tokens out of text; here they are added tokens so that a
rendered prompt (``<s>[INST]...``) encodes as the model expects. ``Tokenizer.encode``
with ``split_special_tokens=True`` gives mistral-common's plain-text encoding.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelLoadError
from engine.files import TOKENIZER_LIMIT, read_text_bounded

# Before format v7 a file may omit its special tokens: these were the first twenty.
_LEGACY_SPECIALS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
)
_VERSIONS = ("v1", "v2", "v3", "v7", "v11", "v13", "v15")


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte, the alphabet of byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTE_CHARS = _byte_chars()


def _as_text(token: bytes) -> str:
    return "".join(_BYTE_CHARS[b] for b in token)


@dataclass
class TekkenVocab:
    """What tekken.json says, ready for the engine's Tokenizer."""

    tokenizer: HFTokenizer
    special_tokens: list[str]  # by id
    version: str  # "v3", "v7", "v11", ... : which instruct format the model was trained on
    audio: dict[str, Any] | None = None  # the file's audio section, when the model hears
    special_names: dict[str, str] = field(default_factory=dict)  # bos/eos/unk/pad -> text


def _fail(path: Path, what: str) -> ModelLoadError:
    return ModelLoadError(f"{path} is not a usable tekken tokenizer: {what}. Download the model again.")


def _ranked_bytes(path: Path, vocab: Any, limit: int) -> list[bytes]:
    if not isinstance(vocab, list) or len(vocab) < limit:
        raise _fail(path, f"its vocabulary has fewer than the {limit} tokens its config names")
    out = []
    for rank, entry in enumerate(vocab[:limit]):
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (KeyError, TypeError, binascii.Error):
            raise _fail(path, f"token {rank} has no valid base64 token_bytes") from None
        if entry.get("rank", rank) != rank or (rank < 256 and token != bytes([rank])) or not token:
            raise _fail(path, f"token {rank} is out of order (the first 256 must be the single bytes)")
        out.append(token)
    return out


def _merges(ranked: list[bytes]) -> list[tuple[str, str]]:
    """Every split of each token into two tokens, in the order tiktoken would join them."""
    rank_of = {token: rank for rank, token in enumerate(ranked)}
    merges = []
    for rank, token in enumerate(ranked):
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in rank_of and token[i:] in rank_of]
        splits.sort(key=lambda lr: (rank_of[lr[0]], rank_of[lr[1]]))
        merges.extend((_as_text(a), _as_text(b)) for a, b in splits)
    return merges


def read_tekken(path: str | Path) -> TekkenVocab:
    path = Path(path)
    try:
        data = json.loads(read_text_bounded(path, TOKENIZER_LIMIT, "a tokenizer", ModelLoadError))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, " ".join(str(exc).split())) from None
    config = data.get("config") if isinstance(data, Mapping) else None
    if not isinstance(config, Mapping):
        raise _fail(path, "it has no config section")
    version = config.get("version")
    if version not in _VERSIONS:
        raise _fail(path, f"its version {version!r} is not one of {', '.join(_VERSIONS)}")
    try:
        pattern = str(config["pattern"])
        vocab_size = int(config["default_vocab_size"])
        n_special = int(config["default_num_special_tokens"])
    except (KeyError, TypeError, ValueError):
        raise _fail(path, "its config lacks pattern, default_vocab_size or default_num_special_tokens") from None

    listed = data.get("special_tokens")
    if listed is None:
        names = list(_LEGACY_SPECIALS)
    else:
        try:
            names = [str(t["token_str"]) for t in sorted(listed, key=lambda t: int(t["rank"]))]
        except (KeyError, TypeError, ValueError):
            raise _fail(path, "a special token lacks rank or token_str") from None
    if len(names) > n_special or len(set(names)) != len(names):
        raise _fail(path, "its special tokens are repeated or more than default_num_special_tokens")
    names += [f"<SPECIAL_{i}>" for i in range(len(names), n_special)]  # tekken's own filler names

    ranked = _ranked_bytes(path, data.get("vocab"), vocab_size - n_special)
    vocab = {name: i for i, name in enumerate(names)}
    shadowed = set()
    for rank, token in enumerate(ranked):
        text = _as_text(token)
        if text in vocab:  # a regular token spelt like a special one: the special keeps the name
            shadowed.add(text)
            continue
        vocab[text] = rank + n_special
    merges = [m for m in _merges(ranked) if m[0] + m[1] not in shadowed]

    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)
    hf = HFTokenizer(bpe)
    try:
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    except Exception as exc:  # the regex engine reports a bad pattern as a plain Exception
        raise _fail(path, f"its pattern does not compile ({' '.join(str(exc).split())})") from None
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    special_names = {
        key: text
        for key, text in (("unk_token", "<unk>"), ("bos_token", "<s>"), ("eos_token", "</s>"), ("pad_token", "<pad>"))
        if text in vocab
    }
    audio = data.get("audio") if isinstance(data.get("audio"), Mapping) else None
    return TekkenVocab(hf, names, version, dict(audio) if audio else None, special_names)
