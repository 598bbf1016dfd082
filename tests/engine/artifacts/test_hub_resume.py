"""A download stopped inside a file continues from its last byte (Range request) when it
is started again, against a local server that answers as the Hub does (tests/fake_hub.py).
The referee for the cache layout is huggingface_hub's own ``hf_hub_download``. No network."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import threading
from pathlib import Path

import pytest

from engine.artifacts import hub_resume
from engine.artifacts.hub import DownloadCancelled, HubError, download
from tests.fake_hub import COMMIT, FakeHub

REPO = "org/Big"
BIG = "model.safetensors"
CONFIG = b'{"model_type": "llama"}'


@pytest.fixture
def hub():
    with FakeHub() as server:
        # 25 MiB: huggingface_hub reads 10 MiB at a time, so a cancel lands inside the file.
        server.repos[REPO] = {"config.json": CONFIG, BIG: random.Random(0).randbytes(25 << 20)}
        yield server


def blobs(cache: Path) -> Path:
    return cache / ("models--" + REPO.replace("/", "--")) / "blobs"


def partials(cache: Path) -> list[Path]:
    return sorted(blobs(cache).glob("*.incomplete")) if blobs(cache).is_dir() else []


def stop_inside_big_file(hub: FakeHub, cache: Path) -> tuple[int, list[tuple[int, int]]]:
    """Start a download and cancel it after the first chunk of the big file; returns the
    bytes of that file kept on disk and the progress seen."""
    cancel = threading.Event()
    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        if done > len(CONFIG):
            cancel.set()

    with pytest.raises(DownloadCancelled, match="start it again to continue"):
        download(REPO, progress=progress, cancel=cancel, cache_dir=cache, endpoint=hub.endpoint)
    [partial] = partials(cache)
    kept = partial.stat().st_size
    assert partial.name == hashlib.sha256(hub.repos[REPO][BIG]).hexdigest() + ".incomplete"
    assert 0 < kept < len(hub.repos[REPO][BIG])
    assert seen[-1][0] == len(CONFIG) + kept  # what was reported is what is on disk
    return kept, seen


def layout(cache: Path) -> dict[str, str]:
    """Every entry below the cache (locks aside): folders, link targets, file hashes."""
    found = {}
    for p in sorted(cache.rglob("*")):
        rel = p.relative_to(cache).as_posix()
        if rel.startswith(".locks"):
            continue
        if p.is_symlink():
            found[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def clean_download(hub: FakeHub, cache: Path) -> dict[str, str]:
    from huggingface_hub import hf_hub_download

    for name in hub.repos[REPO]:
        hf_hub_download(REPO, name, cache_dir=str(cache), endpoint=hub.endpoint)
    return layout(cache)


def monotonic(seen: list[tuple[int, int]]) -> bool:
    return all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_restart_continues_inside_the_file(tmp_path, hub):
    cache = tmp_path / "cache"
    kept, first = stop_inside_big_file(hub, cache)
    assert monotonic(first)

    again: list[tuple[int, int]] = []
    snap = download(REPO, progress=lambda d, t: again.append((d, t)), cache_dir=cache, endpoint=hub.endpoint)
    total = sum(len(b) for b in hub.repos[REPO].values())
    assert hub.ranges == {BIG: [kept]}  # the server was asked only for the rest
    assert again[0] == (len(CONFIG) + kept, total)  # the bar starts where it stopped
    assert monotonic(again) and again[-1] == (total, total)
    assert (snap / BIG).read_bytes() == hub.repos[REPO][BIG]
    assert partials(cache) == []
    assert layout(cache) == clean_download(hub, tmp_path / "clean")


def test_server_that_ignores_range_restarts_the_file(tmp_path, hub):
    cache = tmp_path / "cache"
    kept, _ = stop_inside_big_file(hub, cache)
    hub.ignore_range = True  # answers 200 with the whole file, as some proxies do

    again: list[tuple[int, int]] = []
    snap = download(REPO, progress=lambda d, t: again.append((d, t)), cache_dir=cache, endpoint=hub.endpoint)
    assert hub.ranges == {BIG: [kept]}
    assert monotonic(again) and again[-1][0] == again[-1][1]
    assert (snap / BIG).read_bytes() == hub.repos[REPO][BIG]  # not the old prefix plus the whole file
    assert partials(cache) == []
    assert layout(cache) == clean_download(hub, tmp_path / "clean")


def test_file_changed_upstream_discards_the_partial(tmp_path, hub):
    cache = tmp_path / "cache"
    stop_inside_big_file(hub, cache)
    hub.repos[REPO][BIG] = random.Random(1).randbytes(24 << 20)
    hub.commit = "d" * 40

    snap = download(REPO, cache_dir=cache, endpoint=hub.endpoint)
    assert hub.ranges == {}  # the old bytes were not continued
    assert snap.name == "d" * 40
    assert (snap / BIG).read_bytes() == hub.repos[REPO][BIG]
    assert partials(cache) == []
    # The first run's snapshot (its config.json) stays, as huggingface_hub leaves old revisions.
    ours = {k: v for k, v in layout(cache).items() if COMMIT not in k}
    assert ours == clean_download(hub, tmp_path / "clean")


def test_damaged_partial_is_fetched_again_whole(tmp_path, hub):
    cache = tmp_path / "cache"
    kept, _ = stop_inside_big_file(hub, cache)
    [partial] = partials(cache)
    with open(partial, "r+b") as f:  # same name, wrong bytes: only the hash can tell
        f.write(b"\0" * 4096)

    snap = download(REPO, cache_dir=cache, endpoint=hub.endpoint)
    assert hub.ranges == {BIG: [kept]}
    assert hub.gets[BIG] == 3  # stopped, continued (bad), then whole
    assert (snap / BIG).read_bytes() == hub.repos[REPO][BIG]
    assert partials(cache) == []


def test_full_disk_keeps_the_partial(tmp_path, hub, monkeypatch):
    cache = tmp_path / "cache"
    kept, _ = stop_inside_big_file(hub, cache)
    real = shutil.disk_usage
    monkeypatch.setattr(
        hub_resume.shutil, "disk_usage", lambda p: real(p)._replace(free=1000)
    )  # what a full drive reports

    with pytest.raises(
        HubError,
        match=r"model.safetensors of org/Big failed: the disk is full .* "
        r"free some space and start the download again",
    ):
        download(REPO, cache_dir=cache, endpoint=hub.endpoint)
    [partial] = partials(cache)
    assert partial.stat().st_size == kept

    monkeypatch.setattr(hub_resume.shutil, "disk_usage", real)
    snap = download(REPO, cache_dir=cache, endpoint=hub.endpoint)
    assert hub.ranges == {BIG: [kept]}
    assert (snap / BIG).read_bytes() == hub.repos[REPO][BIG]
