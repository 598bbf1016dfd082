"""Build a ``tokenizers`` tokenizer from the vocabulary a GGUF file carries.

GGUF stores the vocabulary as metadata (``tokenizer.ggml.*``). Two kinds matter for
the llama family:

* ``llama``: a SentencePiece BPE vocabulary (pieces, scores, token types). It becomes a
  byte-fallback BPE whose merges are ranked by the score of the merged piece, which is
  how SentencePiece picks merges; a ``▁`` is prepended to each run of text and spaces
  become ``▁``, as Llama 2's SentencePiece model does.
* ``gpt2``: a byte-level BPE vocabulary with explicit merges, split into words by the
  regular expression named in ``tokenizer.ggml.pre``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import UnsupportedModelError

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_SPACE = "\u2581"  # SentencePiece's visible space

# Word-splitting expressions of the byte-level vocabularies, by tokenizer.ggml.pre.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BYTE_LEVEL_SPLITS = {
    "default": None,
    "gpt-2": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}


def plain(value: Any) -> Any:
    """A metadata value as plain Python: MLX/NumPy arrays become lists or scalars."""
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


@dataclass
class GGUFVocab:
    """What the tokenizer wrapper needs from a GGUF vocabulary."""

    tokenizer: HFTokenizer
    bos_token_id: int | None
    eos_token_ids: list[int]
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_template: str | None
    byte_fallback: bool


def _token_id(meta: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    value = plain(meta.get(key))
    if isinstance(value, list):
        value = value[0] if value else None
    if isinstance(value, (int, float)) and 0 <= int(value) < vocab_size:
        return int(value)
    return None  # absent, or the 0xFFFFFFFF "none" marker


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every way to build each ordinary piece from two ordinary pieces, best score first.

    SentencePiece BPE repeatedly joins the adjacent pair whose union has the highest
    score; ranking merges by that score reproduces it in a rank-based BPE.
    """
    ids = {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind == NORMAL and tok not in ids:
            ids[tok] = i
    ranked = []
    for piece, pid in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[pid], pid, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _vocab_dict(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a duplicated piece keeps its first id
    return vocab


def _add_marked_tokens(tok: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (CONTROL, UNKNOWN) and t
    ]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED and t]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)


def _build_spm(
    tokens: list[str],
    scores: list[float],
    types: list[int],
    unk_id: int | None,
    add_space_prefix: bool,
    remove_extra_whitespaces: bool,
) -> HFTokenizer:
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(
        vocab=_vocab_dict(tokens),
        merges=_spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(model)
    steps = []
    if remove_extra_whitespaces:  # SentencePiece's option: trim, and squeeze runs of spaces
        steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if add_space_prefix:
        steps.append(normalizers.Prepend(_SPACE))
    steps.append(normalizers.Replace(" ", _SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    _add_marked_tokens(tok, tokens, types)
    return tok


def _build_byte_level(tokens: list[str], merges: list[str], types: list[int], pre: str) -> HFTokenizer:
    if pre not in _BYTE_LEVEL_SPLITS:
        raise UnsupportedModelError(
            f"GGUF byte-level vocabulary with pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_BYTE_LEVEL_SPLITS))}); use the model's Hugging Face folder instead."
        )
    pairs = []
    for line in merges:
        left, sep, right = line.partition(" ")
        if sep:
            pairs.append((left, right))
    tok = HFTokenizer(models.BPE(vocab=_vocab_dict(tokens), merges=pairs, fuse_unk=False))
    split = _BYTE_LEVEL_SPLITS[pre]
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    _add_marked_tokens(tok, tokens, types)
    return tok


def vocab_from_gguf(metadata: Mapping[str, Any]) -> GGUFVocab:
    """Read ``tokenizer.ggml.*`` metadata (as ``mx.load(..., return_metadata=True)`` gives it)."""
    kind = plain(metadata.get("tokenizer.ggml.model"))
    tokens = plain(metadata.get("tokenizer.ggml.tokens"))
    if not kind or not isinstance(tokens, list) or not tokens:
        raise UnsupportedModelError("This GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens).")
    tokens = [t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t) for t in tokens]
    n = len(tokens)
    types = plain(metadata.get("tokenizer.ggml.token_type")) or [NORMAL] * n
    if len(types) != n:
        raise UnsupportedModelError("GGUF vocabulary is inconsistent: token_type and tokens differ in length.")
    types = [int(t) for t in types]

    bos = _token_id(metadata, "tokenizer.ggml.bos_token_id", n)
    eos = _token_id(metadata, "tokenizer.ggml.eos_token_id", n)
    eot = _token_id(metadata, "tokenizer.ggml.eot_token_id", n)
    unk = _token_id(metadata, "tokenizer.ggml.unknown_token_id", n)
    pad = _token_id(metadata, "tokenizer.ggml.padding_token_id", n)

    if kind == "llama":
        scores = plain(metadata.get("tokenizer.ggml.scores"))
        if not isinstance(scores, list) or len(scores) != n:
            raise UnsupportedModelError("GGUF SentencePiece vocabulary has no scores for its pieces.")
        # Both flags are absent from older files; these defaults are llama.cpp's.
        space_prefix = plain(metadata.get("tokenizer.ggml.add_space_prefix"))
        squeeze = plain(metadata.get("tokenizer.ggml.remove_extra_whitespaces"))
        tok = _build_spm(
            tokens,
            [float(s) for s in scores],
            types,
            unk,
            add_space_prefix=True if space_prefix is None else bool(space_prefix),
            remove_extra_whitespaces=bool(squeeze),
        )
        default_add_bos, byte_fallback = True, True
    elif kind == "gpt2":
        merges = plain(metadata.get("tokenizer.ggml.merges"))
        if not isinstance(merges, list):
            raise UnsupportedModelError("GGUF byte-level vocabulary has no merges (tokenizer.ggml.merges).")
        pre = plain(metadata.get("tokenizer.ggml.pre")) or "default"
        tok = _build_byte_level(tokens, [str(m) for m in merges], types, str(pre))
        default_add_bos, byte_fallback = False, False
    else:
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'llama', 'gpt2').")

    add_bos = plain(metadata.get("tokenizer.ggml.add_bos_token"))
    add_eos = plain(metadata.get("tokenizer.ggml.add_eos_token"))
    template = plain(metadata.get("tokenizer.chat_template"))
    return GGUFVocab(
        tokenizer=tok,
        bos_token_id=bos,
        eos_token_ids=[i for i in dict.fromkeys((eos, eot)) if i is not None],
        unk_token_id=unk,
        pad_token_id=pad,
        add_bos_token=default_add_bos if add_bos is None else bool(add_bos),
        add_eos_token=bool(add_eos) if add_eos is not None else False,
        chat_template=template if isinstance(template, str) and template else None,
        byte_fallback=byte_fallback,
    )
