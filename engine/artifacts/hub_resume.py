"""One file from the Hub into the HF cache, resuming where an interrupted attempt stopped.

huggingface_hub writes each download to a temporary file of its own and deletes it when
the download fails or is cancelled, so a large shard stopped at 90% starts again from
zero. Here the bytes go to ``blobs/<etag>.incomplete`` in the repo's cache folder (the
name huggingface_hub itself used for partial blobs) and stay there when the download
stops; the next attempt asks for the rest with ``Range: bytes=N-`` through
huggingface_hub's ``http_get``, which also restarts cleanly when a server answers 200
instead of 206. The finished blob is checked against its size and the Hub's hash (sha256
for LFS files, the git blob id for the others) and moved to ``blobs/<etag>``, exactly the
blob ``hf_hub_download`` would write; ``hf_hub_download`` then finds it and links the
snapshot and writes the ref itself, so the cache layout is the library's own.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

PARTIAL_SUFFIX = ".incomplete"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID = re.compile(r"^[0-9a-f]{40}$")
_PARTIAL = re.compile(r"^(?:[0-9a-f]{40}|[0-9a-f]{64})\.incomplete$")  # ours; not the library's <etag>.<id>.incomplete


class DiskFull(Exception):
    """Not enough room for the rest of a file; the bytes fetched so far are kept."""


class ChecksumMismatch(Exception):
    """A finished file is not the one the Hub describes; it has been discarded."""


def partial_path(blobs: Path, etag: str) -> Path:
    return blobs / (etag + PARTIAL_SUFFIX)


def listed_etag(sibling: Any) -> str | None:
    """The blob name a file of a repo listing will have: LFS sha256, else the git blob id."""
    lfs = getattr(sibling, "lfs", None)
    if lfs is not None:
        sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
        if sha:
            return str(sha)
    return getattr(sibling, "blob_id", None)


def discard_stale_partials(blobs: Path, current: set[str]) -> list[Path]:
    """Delete partial blobs whose file is no longer in the repo (changed upstream): their
    bytes can never complete a file of the current revision."""
    removed = []
    if blobs.is_dir():
        for p in blobs.iterdir():
            if _PARTIAL.match(p.name) and p.name[: -len(PARTIAL_SUFFIX)] not in current:
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def fetch_blob(
    repo_id: str,
    filename: str,
    *,
    folder: Path,
    revision: str,
    endpoint: str | None,
    token: str | bool | None,
    position: Callable[[int], None],
) -> None:
    """Make sure ``folder/blobs/<etag>`` holds ``filename`` as the Hub serves it now.

    ``position(n)`` is told how many bytes of the file are on disk: first the resumed
    bytes, then after every chunk (it may raise to stop the download; the partial stays).
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import WeakFileLock, build_hf_headers

    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint)
    meta = get_hf_file_metadata(url, token=token, endpoint=endpoint)
    if not meta.etag:
        raise ValueError(f"the server sent no ETag for {filename}, so a download cannot be checked")
    if not (_SHA256.match(meta.etag) or _GIT_OID.match(meta.etag)):
        # The ETag becomes a file name below: only a content hash is safe ("../../x" is not).
        raise ChecksumMismatch(
            f"the server named {filename} {meta.etag[:80]!r}, not a content hash, "
            "so the download cannot be checked (is the endpoint really the Hub?)"
        )
    blobs = folder / "blobs"
    blob = blobs / meta.etag
    if blob.exists():
        position(meta.size or blob.stat().st_size)
        return
    blobs.mkdir(parents=True, exist_ok=True)
    headers = build_hf_headers(token=token)
    location = meta.location or url
    if urlparse(location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed CDN address: the token stays with the Hub
    # The library's lock for this blob: a second process (another app window, `hf download`)
    # must not append to the same partial file.
    lock = folder.parent / ".locks" / folder.name / f"{meta.etag}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(str(lock)):
        if blob.exists():
            return
        partial = partial_path(blobs, meta.etag)
        resumed = _fetch_into(partial, location, headers, meta.size, position)
        try:
            _verify(partial, meta.etag, meta.size)
        except ChecksumMismatch:
            partial.unlink(missing_ok=True)
            if not resumed:
                raise
            # The kept bytes were bad (a damaged disk, a server that sent something else):
            # fetch the whole file once more rather than fail.
            _fetch_into(partial, location, headers, meta.size, position)
            try:
                _verify(partial, meta.etag, meta.size)
            except ChecksumMismatch:
                partial.unlink(missing_ok=True)
                raise
        os.replace(partial, blob)


def _fetch_into(
    partial: Path, url: str, headers: dict[str, str], size: int | None, position: Callable[[int], None]
) -> bool:
    """Append the rest of the file to ``partial``; True when earlier bytes were reused."""
    from huggingface_hub.file_download import http_get

    have = partial.stat().st_size if partial.exists() else 0
    if size is not None and have > size:  # longer than the file: not a prefix of it
        partial.unlink()
        have = 0
    if size is not None:
        free = shutil.disk_usage(partial.parent).free
        if free < size - have:
            raise DiskFull(_disk_full_text(partial, size - have, free, have))
    position(have)
    try:
        with open(partial, "r+b" if have else "wb") as f:
            f.seek(have)
            http_get(url, f, resume_size=have, headers=headers, expected_size=size, tqdm_class=_bar_class(position))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        kept = partial.stat().st_size if partial.exists() else 0
        raise DiskFull(
            _disk_full_text(partial, (size or kept) - kept, shutil.disk_usage(partial.parent).free, kept)
        ) from None
    return have > 0


def _disk_full_text(partial: Path, needed: int, free: int, kept: int) -> str:
    return (
        f"the disk is full ({needed:,} more bytes are needed in {partial.parent}, {free:,} are free); "
        f"free some space and start the download again, the {kept:,} bytes fetched so far are kept"
    )


def _verify(path: Path, etag: str, size: int | None) -> None:
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise ChecksumMismatch(f"{path.name} has {actual:,} bytes, the Hub says {size:,}")
    if _SHA256.match(etag):
        digest = hashlib.sha256()
    elif _GIT_OID.match(etag):
        digest = hashlib.sha1(b"blob %d\0" % actual)
    else:
        return  # an ETag that is not a content hash (a mirror's): the size is all we can check
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != etag:
        raise ChecksumMismatch(
            f"the downloaded bytes do not match the Hub's hash {etag[:12]}…; "
            "the file may have changed upstream, start the download again"
        )


def _bar_class(position: Callable[[int], None]) -> type:
    """A tqdm stand-in for ``http_get``: turns its counts into bytes on disk, draws nothing.

    ``http_get`` builds it with ``initial`` set to where the file continues (0 when the
    server ignored the Range and the partial was emptied), then updates per chunk,
    before writing the chunk: raising here leaves the file at the last reported size.
    """
    from huggingface_hub.utils import tqdm as hf_tqdm

    class _Bar(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            kwargs.pop("name", None)
            self._at = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)
            position(self._at)

        def update(self, n: float | None = 1) -> bool | None:
            if n:
                position(self._at + int(n))
                self._at += int(n)
            return None

    return _Bar
