"""Training data: mlx-lm's four row shapes, tokenized, with the tokens each row is trained on.

A dataset is a ``.jsonl`` file, or a folder holding ``train.jsonl`` (and optionally
``valid.jsonl``). Each line is one JSON object of one shape:

* ``{"text": ...}``: tokenized as ``generate --prompt`` tokenizes (the tokenizer's own
  settings, BOS where it adds one), the tokenizer's EOS appended; every token is a target.
* ``{"prompt": ..., "completion": ...}``: rendered with the chat template as a user and an
  assistant message (without a template: prompt + completion as plain text, EOS appended).
* ``{"messages": [...]}`` and ``{"messages": [...], "tools": [...]}``: the whole
  conversation rendered with the chat template (tools passed to it).

With ``mask_prompt`` only the completion (or, for messages, the assistant turns) are
targets; otherwise every token after the first. A row that is not one of these shapes, is
not JSON, or renders to fewer than two tokens is a ``BadRow`` with its line number: the
caller reports each and trains on the rest (or refuses when none is left).
Rows longer than ``max_seq_len`` are cut to it (and reported), as mlx-lm does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.training.adapters import TrainingError


@dataclass
class Row:
    ids: list[int]
    targets: list[bool]  # per token: whether predicting it counts in the loss (index 0 never does)
    line: int


@dataclass
class BadRow:
    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file} line {self.line}: {self.reason}"


@dataclass
class Encoder:
    """How rows become tokens: the model's tokenizer and chat template."""

    encode: Callable[[str], list[int]]  # plain text, as generate --prompt tokenizes
    encode_rendered: Callable[[str], list[int]]  # rendered template text (no specials added)
    render: Callable[..., str] | None  # chat template: render(messages, tools=, add_generation_prompt=)
    eos_id: int | None


TEXT_SUFFIXES = (".txt", ".md")


def text_folder_rows(folder: Path) -> str:
    """The .txt and .md files of a folder as ``{"text"}`` rows, one per paragraph (runs of
    lines between blank lines), files in name order: the JSON Lines text of them."""
    lines = []
    for file in sorted(p for p in folder.iterdir() if p.suffix.lower() in TEXT_SUFFIXES and p.is_file()):
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TrainingError(f"Cannot read {file}: {exc}") from None
        for paragraph in text.replace("\r\n", "\n").split("\n\n"):
            if paragraph.strip():
                lines.append(json.dumps({"text": paragraph.strip()}, ensure_ascii=False))
    return "".join(line + "\n" for line in lines)


def data_files(path: str | Path) -> tuple[Path, Path | None]:
    """(train file, validation file or None) for a .jsonl file, a folder with train.jsonl,
    or a folder of .txt/.md files (written as rows to a temporary train.jsonl, never into
    the user's folder)."""
    path = Path(path)
    if path.is_dir():
        train = path / "train.jsonl"
        if not train.is_file() and any(p.suffix.lower() in TEXT_SUFFIXES for p in path.iterdir()):
            import tempfile

            rows = Path(tempfile.mkdtemp(prefix="text-rows-"))
            (rows / "train.jsonl").write_text(text_folder_rows(path), encoding="utf-8")
            return rows / "train.jsonl", None
        if not train.is_file():
            raise TrainingError(
                f"--data {path} is a folder without train.jsonl or .txt/.md files; add train.jsonl (and valid.jsonl)."
            )
        valid = path / "valid.jsonl"
        return train, valid if valid.is_file() else None
    if not path.is_file():
        raise TrainingError(f"--data {path} does not exist; give a .jsonl file or a folder with train.jsonl.")
    return path, None


def _with_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _messages_row(row: Mapping[str, Any], enc: Encoder, mask_prompt: bool) -> tuple[list[int], list[bool]]:
    if enc.render is None:
        raise ValueError("a 'messages' row needs a chat template, and this model has none")
    messages, tools = row["messages"], row.get("tools")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("'messages' must be a non-empty list of message objects")
    if tools is not None and not isinstance(tools, list):
        raise ValueError("'tools' must be a list")
    ids = enc.encode_rendered(enc.render(messages, tools=tools, add_generation_prompt=False))
    if not mask_prompt:
        return ids, [i > 0 for i in range(len(ids))]
    targets = [False] * len(ids)
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start = len(enc.encode_rendered(enc.render(messages[:i], tools=tools, add_generation_prompt=True)))
        end = len(enc.encode_rendered(enc.render(messages[: i + 1], tools=tools, add_generation_prompt=False)))
        for t in range(max(1, start), min(end, len(ids))):
            targets[t] = True
    if not any(targets):
        raise ValueError("--mask-prompt leaves nothing to train on: the row has no assistant message")
    return ids, targets


def _completion_row(row: Mapping[str, Any], enc: Encoder, mask_prompt: bool) -> tuple[list[int], list[bool]]:
    prompt, completion = row["prompt"], row["completion"]
    if not isinstance(prompt, str) or not isinstance(completion, str):
        raise ValueError("'prompt' and 'completion' must be strings")
    if enc.render is not None:
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        ids = enc.encode_rendered(enc.render(messages, add_generation_prompt=False))
        head = len(enc.encode_rendered(enc.render(messages[:1], add_generation_prompt=True)))
    else:
        ids = _with_eos(enc.encode(prompt + completion), enc.eos_id)
        head = len(enc.encode(prompt))
    first = max(1, head) if mask_prompt else 1
    return ids, [i >= first for i in range(len(ids))]


def encode_row(row: Any, enc: Encoder, mask_prompt: bool) -> tuple[list[int], list[bool]]:
    """(ids, targets) for one parsed row; ValueError saying what is wrong with it."""
    if not isinstance(row, dict):
        raise ValueError("a row must be a JSON object")
    if "messages" in row:
        return _messages_row(row, enc, mask_prompt)
    if "prompt" in row and "completion" in row:
        return _completion_row(row, enc, mask_prompt)
    if "text" in row:
        if not isinstance(row["text"], str):
            raise ValueError("'text' must be a string")
        ids = _with_eos(enc.encode(row["text"]), enc.eos_id)
        return ids, [i > 0 for i in range(len(ids))]
    raise ValueError(f"unknown row shape (keys {sorted(row)}); use text, prompt+completion, messages or messages+tools")


def load_rows(
    path: Path, enc: Encoder, *, mask_prompt: bool = False, max_seq_len: int = 2048
) -> tuple[list[Row], list[BadRow], int]:
    """(good rows, bad rows with their line numbers, how many rows were cut to max_seq_len)."""
    rows: list[Row] = []
    bad: list[BadRow] = []
    cut = 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainingError(f"Cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids, targets = encode_row(json.loads(line), enc, mask_prompt)
        except json.JSONDecodeError as exc:
            bad.append(BadRow(path.name, number, f"not JSON ({exc.msg})"))
            continue
        except (ValueError, TypeError, KeyError) as exc:
            bad.append(BadRow(path.name, number, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            continue
        except Exception as exc:  # noqa: BLE001 - a template that raises on this row
            bad.append(BadRow(path.name, number, f"the chat template failed: {str(exc).splitlines()[0]}"))
            continue
        if len(ids) > max_seq_len:
            ids, targets, cut = ids[:max_seq_len], targets[:max_seq_len], cut + 1
        if len(ids) < 2 or not any(targets[1:]):
            bad.append(BadRow(path.name, number, "fewer than two tokens to train on"))
            continue
        rows.append(Row(ids, targets, number))
    return rows, bad, cut


def batches(rows: Sequence[Row], batch_size: int, order: str, seed: int) -> Any:
    """Endless batches of ``batch_size`` rows. ``file``: consecutive rows in file order,
    cycling. ``shuffle``: as mlx-lm batches, rows sorted by length and cut into batches
    (so a batch pads little), the batches taken in an order shuffled by ``seed`` on every
    pass; every row is in one batch (the last may be smaller when the rows do not divide)."""
    import random

    n = len(rows)
    if order == "file":
        start = 0
        while True:
            yield [rows[(start + j) % n] for j in range(batch_size)]
            start = (start + batch_size) % n
    by_length = sorted(range(n), key=lambda i: len(rows[i].ids))
    groups = [by_length[i : i + batch_size] for i in range(0, n, batch_size)]
    rng = random.Random(seed)
    while True:
        for g in rng.sample(range(len(groups)), len(groups)):
            yield [rows[i] for i in groups[g]]
