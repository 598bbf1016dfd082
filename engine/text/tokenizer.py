"""The engine's tokenizer: Hugging Face ``tokenizers`` plus the settings around it.

A model folder brings ``tokenizer.json`` and, beside it, ``tokenizer_config.json``
(special tokens, whether to add BOS/EOS, the chat template), maybe
``special_tokens_map.json`` and ``chat_template.jinja``/``.json``. A GGUF file brings its
own vocabulary as metadata (see ``gguf_vocab``). Either way the result answers the same
questions: encode, decode, which ids end a turn, which template renders a chat.

``clean_up_tokenization_spaces`` follows transformers 5: off unless tokenizer_config.json
turns it on, and even then skipped for BPE models (transformers decided it corrupts their
text) unless ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``
is set too. transformers never turns it on for a tokenizer read from GGUF.

End-of-turn ids from config.json and generation_config.json are not read here; the
model host unions them with ``eos_token_ids``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import cached_property
from itertools import groupby
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelLoadError, TemplateError
from engine.files import TEMPLATE_LIMIT, TOKENIZER_LIMIT, check_size, read_text_bounded
from engine.text.chat_template import pick_template
from engine.text.cleanup import clean_up_tokenization
from engine.text.detokenizer import StreamingDetokenizer
from engine.text.gguf_vocab import vocab_from_gguf

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


def _token_text(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_text_bounded(path, TEMPLATE_LIMIT, "a tokenizer's settings", ModelLoadError))
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"Cannot read {path}: {exc}. Check the file or download the model again.") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); download the model again."
        ) from None


class Tokenizer:
    """Encode and decode text for one model; build with ``from_dir`` or ``from_gguf``."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        byte_fallback: bool = False,
        clean_up_tokenization_spaces: bool = False,
    ):
        self._tok = tokenizer
        self._truncating: dict[int, HFTokenizer] = {}  # max_length -> a copy that truncates
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._special = {k: v for k, v in (special_tokens or {}).items() if isinstance(v, str)}
        self._eos_ids = set(eos_token_ids)
        self.chat_template = chat_template
        # The instruct format ("v3", "v7", ...) of a tekken.json folder: the chat renders in
        # Mistral's own layout when no Jinja template comes with it.
        self.mistral_format: str | None = None
        # tekken decodes the text between special tokens run by run, so bytes of one
        # character split by a skipped special token do not join.
        self.split_runs_at_special = False
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self._special_ids = frozenset(i for i, t in added.items() if t.special)
        # Byte-fallback pieces (<0xE4>) only become text together with their neighbours.
        self.byte_token_ids: frozenset[int] = frozenset()
        if byte_fallback:
            vocab = tokenizer.get_vocab(with_added_tokens=False)
            self.byte_token_ids = frozenset(i for t, i in vocab.items() if _BYTE_PIECE.match(t))

    # ---- construction ---------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file() and (path / "tekken.json").is_file():
            return cls.from_tekken(path / "tekken.json")
        if not tok_file.is_file():
            raise ModelLoadError(
                f"No tokenizer.json in {path}. The engine needs the fast-tokenizer file; "
                "download the full model repository (tokenizer.model alone is not enough)."
            )
        check_size(tok_file, TOKENIZER_LIMIT, "a tokenizer", ModelLoadError)
        try:
            hf = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise ModelLoadError(
                f"Cannot load {tok_file}: {' '.join(str(exc).split())}. Download the model again."
            ) from None
        byte_fallback = bool(getattr(hf.model, "byte_fallback", False))

        config = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").is_file() else {}
        smap = _read_json(path / "special_tokens_map.json") if (path / "special_tokens_map.json").is_file() else {}
        special = {}
        for name in _SPECIAL_NAMES:
            text = _token_text(config.get(name))
            if text is None:
                text = _token_text(smap.get(name))
            if text is not None:
                special[name] = text

        cls._add_missing_tokens(hf, config.get("added_tokens_decoder") or {})
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if add_bos is not None or add_eos is not None:
            cls._set_post_processor(hf, special, bool(add_bos), bool(add_eos))

        eos_ids = set()
        if "eos_token" in special and (eid := hf.token_to_id(special["eos_token"])) is not None:
            eos_ids.add(eid)
        return cls(
            hf,
            special_tokens=special,
            eos_token_ids=eos_ids,
            chat_template=cls._find_template(path, config),
            byte_fallback=byte_fallback,
            clean_up_tokenization_spaces=cls._cleans_up_spaces(hf, config),
        )

    @classmethod
    def from_tekken(cls, tekken_file: str | Path) -> Tokenizer:
        """A Mistral folder's tekken.json; the chat renders in Mistral's instruct format
        unless the folder brings its own Jinja template."""
        from engine.text.tekken import read_tekken

        tekken_file = Path(tekken_file)
        vocab = read_tekken(tekken_file)
        hf = vocab.tokenizer
        special = vocab.special_names
        cls._set_post_processor(hf, special, True, False)  # mistral-common starts every text with BOS
        eos = hf.token_to_id(special["eos_token"]) if "eos_token" in special else None
        folder = tekken_file.parent
        config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        tok = cls(
            hf,
            special_tokens=special,
            eos_token_ids=[eos] if eos is not None else [],
            chat_template=cls._find_template(folder, config),
        )
        tok.mistral_format = vocab.version
        tok.split_runs_at_special = True
        return tok

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        vocab = vocab_from_gguf(metadata)
        hf = vocab.tokenizer
        special = {}
        for name, tid in (
            ("bos_token", vocab.bos_token_id),
            ("eos_token", (vocab.eos_token_ids or [None])[0]),
            ("unk_token", vocab.unk_token_id),
            ("pad_token", vocab.pad_token_id),
        ):
            if tid is not None:
                special[name] = hf.id_to_token(tid)
        cls._set_post_processor(hf, special, vocab.add_bos_token, vocab.add_eos_token)
        return cls(
            hf,
            special_tokens=special,
            eos_token_ids=vocab.eos_token_ids,
            chat_template=vocab.chat_template,
            byte_fallback=vocab.byte_fallback,
        )

    @staticmethod
    def _cleans_up_spaces(hf: HFTokenizer, config: Mapping[str, Any]) -> bool:
        """Whether transformers' ``decode`` would clean up spaces for this folder."""
        if not config.get("clean_up_tokenization_spaces", False):
            return False
        if type(hf.model).__name__ == "BPE":
            return bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        return True

    @staticmethod
    def _add_missing_tokens(hf: HFTokenizer, decoder: Mapping[str, Any]) -> None:
        """tokenizer_config's added_tokens_decoder entries that tokenizer.json lacks."""
        missing = []
        for tid, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = _token_text(entry)
            if content is None or hf.token_to_id(content) is not None:
                continue
            missing.append(
                AddedToken(
                    content,
                    single_word=bool(entry.get("single_word", False)),
                    lstrip=bool(entry.get("lstrip", False)),
                    rstrip=bool(entry.get("rstrip", False)),
                    normalized=bool(entry.get("normalized", not entry.get("special", False))),
                    special=bool(entry.get("special", False)),
                )
            )
        for token in missing:
            if token.special:
                hf.add_special_tokens([token])
            else:
                hf.add_tokens([token])

    @staticmethod
    def _set_post_processor(hf: HFTokenizer, special: Mapping[str, str], add_bos: bool, add_eos: bool) -> None:
        """Make ``encode(..., add_special_tokens=True)`` add exactly the BOS/EOS the settings ask for."""
        single, pair, tokens = ["$A:0"], ["$A:0", "$B:1"], []
        for flag, name, at_start in ((add_bos, "bos_token", True), (add_eos, "eos_token", False)):
            text = special.get(name)
            tid = hf.token_to_id(text) if text is not None else None
            if not flag or tid is None:
                continue
            tokens.append((text, tid))
            if at_start:
                single.insert(0, f"{text}:0")
                pair = [f"{text}:0", *pair[:1], f"{text}:1", *pair[1:]]
            else:
                single.append(f"{text}:0")
                pair = [*pair[:-1], f"{text}:0", pair[-1], f"{text}:1"]
        hf.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(dict.fromkeys(tokens))
        )

    @staticmethod
    def _find_template(path: Path, config: Mapping[str, Any]) -> str | None:
        jinja = path / "chat_template.jinja"
        if jinja.is_file():
            try:
                return read_text_bounded(jinja, TEMPLATE_LIMIT, "a chat template", ModelLoadError)
            except (OSError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"Cannot read {jinja}: {' '.join(str(exc).split())}") from None
        json_file = path / "chat_template.json"
        if json_file.is_file():
            data = _read_json(json_file)
            if isinstance(data, Mapping) and data.get("chat_template"):
                return pick_template(data["chat_template"], str(json_file))
        value = config.get("chat_template")
        if value and not isinstance(value, (str, list)):
            raise ModelLoadError(
                f"{path / 'tokenizer_config.json'} says chat_template is {value!r}; it must be the template's "
                "text or a list of named templates: the file is damaged"
            )
        if value:
            try:
                return pick_template(config["chat_template"], str(path / "tokenizer_config.json"))
            except TemplateError:
                return None  # several named templates and no "default": leave the choice to the caller
        return None

    # ---- properties --------------------------------------------------------

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos/eos/unk/pad token strings, as chat templates receive them."""
        return dict(self._special)

    @property
    def bos_token(self) -> str | None:
        return self._special.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos_ids)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that ``decode(..., skip_special_tokens=True)`` leaves out."""
        return self._special_ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def add_bos_token(self) -> bool:
        """Whether ``encode`` (with special tokens) starts with BOS."""
        bos = self.bos_token_id
        if bos is None:
            return False
        ids = self._tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == bos

    # ---- encode / decode ----------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Ids of ``text``; ``split_special_tokens`` encodes text spelt like a special token
        (``[INST]``) as ordinary text, as mistral-common and tiktoken do."""
        if not split_special_tokens:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        self._tok.encode_special_tokens = True
        try:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self._tok.encode_special_tokens = False

    def encode_truncated(self, text: str, max_length: int | None) -> list[int]:
        """``encode`` cut to ``max_length`` tokens the way transformers' tokenizers cut (what
        sentence-transformers does): the text is shortened, its added BOS/EOS are kept."""
        if max_length is None:
            return self.encode(text)
        truncating = self._truncating.get(max_length)
        if truncating is None:  # a copy: the shared tokenizer keeps encoding whole texts
            truncating = self._truncating[max_length] = HFTokenizer.from_str(self._tok.to_str())
            truncating.enable_truncation(max_length)
        return truncating.encode(text, add_special_tokens=True).ids

    def decode(
        self, ids: Iterable[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool | None = None
    ) -> str:
        """Text of ``ids``; ``clean_up_tokenization_spaces=None`` follows the tokenizer's setting."""
        ids = list(ids)
        special = self._special_ids
        if skip_special_tokens and self.split_runs_at_special:
            runs = (list(g) for is_special, g in groupby(ids, special.__contains__) if not is_special)
            text = "".join(self._tok.decode(run, skip_special_tokens=False) for run in runs)
        else:
            if skip_special_tokens:
                # Filter here: the library misses special tokens declared "normalized" (Llama 2's <s>).
                ids = [i for i in ids if i not in special]
            text = self._tok.decode(ids, skip_special_tokens=False)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return clean_up_tokenization(text) if clean_up_tokenization_spaces else text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        added = self._added.get(token_id)
        return added if added is not None else self._tok.id_to_token(token_id)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming decoder whose pieces join to ``decode(ids, skip_special_tokens)``."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)
