"""Reading the small files a model folder or a command line names, never without a bound.

A settings file (config.json, generation_config.json, tokenizer_config.json, an adapter's
config, a chat template, a messages file) is kilobytes, at most a few megabytes. A path
that names /dev/zero, an endless pipe, or a 40 GB file that only calls itself
config.json must be refused at once with one line, not read until memory runs out. So
every such read goes through ``read_bytes_bounded``: a regular file's size is checked
before reading, anything else is read up to the limit plus one byte and refused past it.
Files handed whole to a library (tokenizer.json to the tokenizers crate) are checked with
``check_size`` first. The limits are far above any real file of the kind.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import EngineError

MiB = 1024 * 1024
SETTINGS_LIMIT = 64 * MiB  # config.json (with per-module quantization), indexes, adapter configs
TEMPLATE_LIMIT = 16 * MiB  # a chat template, or a tokenizer_config.json that holds one
MESSAGES_LIMIT = 64 * MiB  # a conversation handed to ``template --messages``
TOKENIZER_LIMIT = 512 * MiB  # tokenizer.json / tekken.json of the largest vocabularies are ~40 MB
IMAGE_FILE_LIMIT = 512 * MiB  # 120 megapixels (image_limits.MAX_PIXELS) as an uncompressed TIFF is 360 MB
WAV_FILE_LIMIT = 4 * 1024 * MiB  # a RIFF file's own 32-bit size field
_CHUNK = MiB  # what a pipe or device is read in


def _size_text(limit: int) -> str:
    return f"{limit // MiB:,} MB" if limit >= MiB else f"{limit:,} bytes"


def _too_large(path: Path, limit: int, what: str, error: type[EngineError]) -> EngineError:
    return error(
        f"{path} is larger than {_size_text(limit)}, too large to be {what}: check the path "
        "(it may name a device, a pipe or the wrong file) or download the file again"
    )


def check_size(path: str | Path, limit: int, what: str, error: type[EngineError] = EngineError) -> None:
    """Refuse a file another library will read whole when it is not a regular file of at
    most ``limit`` bytes."""
    path = Path(path)
    try:
        info = os.stat(path)
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path} is not a regular file, so it cannot be {what}: check the path")
    if info.st_size > limit:
        raise _too_large(path, limit, what, error)


def require_regular_file(path: str | Path, what: str, error: type[EngineError] = EngineError) -> None:
    """Refuse a device or pipe where a file is read to its end (hashed, decoded): /dev/zero
    as an image would be read forever."""
    path = Path(path)
    try:
        info = os.stat(path)
    except OSError:
        return  # missing or unreadable: the reader that follows words that itself
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path} is not a regular file, so it cannot be {what}: check the path")


def read_bytes_bounded(path: str | Path, limit: int, what: str, error: type[EngineError] = EngineError) -> bytes:
    """The file's bytes, refused with ``error`` when it holds more than ``limit``.

    A pipe or device (``--messages /dev/stdin``) is read too, but never past the limit.
    OSError (missing file, a folder, no permission) passes through for the caller to word.
    """
    path = Path(path)
    chunks: list[bytes] = []
    held = 0
    with open(path, "rb") as f:
        info = os.fstat(f.fileno())
        if stat.S_ISREG(info.st_mode) and info.st_size > limit:
            raise _too_large(path, limit, what, error)
        # A regular file in one read of its size (plus one byte, to see it grew); anything
        # else in pieces, since read(limit + 1) reserves the whole limit up front.
        regular = stat.S_ISREG(info.st_mode)
        step = info.st_size + 1 if regular else _CHUNK
        while held <= limit:
            asked = min(step, limit + 1 - held)
            chunk = f.read(asked)
            chunks.append(chunk)
            held += len(chunk)
            if not chunk or (regular and len(chunk) < asked):  # a short read of a file is its end
                break
            step = _CHUNK
    if held > limit:
        raise _too_large(path, limit, what, error)
    return b"".join(chunks)


def read_text_bounded(path: str | Path, limit: int, what: str, error: type[EngineError] = EngineError) -> str:
    """``read_bytes_bounded`` decoded as UTF-8 (UnicodeDecodeError passes through)."""
    return read_bytes_bounded(path, limit, what, error).decode("utf-8")
