"""Downloads through huggingface_hub from a local server that answers as the Hub does
(tests/fake_hub.py: 127.0.0.1, a thread of this test). No network is used."""

from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest
from tiny_checkpoints import PROMPT, write_checkpoint

from engine.artifacts.hub import DownloadCancelled, HubError, download, scan_local_models, search_hub
from engine.runtime.loading import load_model
from tests.fake_hub import COMMIT, FakeHub


@pytest.fixture
def hub(tmp_path):
    with FakeHub() as server:
        yield server


def model_files(folder: Path) -> dict[str, bytes]:
    files = {f.name: f.read_bytes() for f in sorted(folder.iterdir())}
    files["modeling_evil.py"] = b"raise SystemExit('never run model code')\n"
    return files


def test_download_reports_progress_and_loads(tmp_path, hub):
    ckpt = write_checkpoint(tmp_path / "src", shards=2, generation_config={"eos_token_id": 2})
    hub.repos["mlx-community/Tiny"] = model_files(ckpt.path)
    cache = tmp_path / "cache"
    seen: list[tuple[int, int]] = []
    snap = download(
        "mlx-community/Tiny", progress=lambda d, t: seen.append((d, t)), cache_dir=cache, endpoint=hub.endpoint
    )
    total = sum(len(b) for n, b in hub.repos["mlx-community/Tiny"].items() if not n.endswith(".py"))
    assert snap == cache / "models--mlx-community--Tiny" / "snapshots" / COMMIT
    assert (cache / "models--mlx-community--Tiny" / "refs" / "main").read_text() == COMMIT
    assert not (snap / "modeling_evil.py").exists()
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))
    loaded = load_model(snap)
    assert mx.array_equal(loaded.model(PROMPT), ckpt.logits()).item()
    [entry] = scan_local_models(cache_dir=cache)
    assert entry.repo_id == "mlx-community/Tiny" and entry.error is None

    again: list[tuple[int, int]] = []
    download("mlx-community/Tiny", progress=lambda d, t: again.append((d, t)), cache_dir=cache, endpoint=hub.endpoint)
    assert again[-1] == (total, total)
    assert max(hub.gets.values()) == 1  # nothing fetched twice


def test_cancel_between_files_then_resume(tmp_path, hub):
    ckpt = write_checkpoint(tmp_path / "src", shards=3)
    files = model_files(ckpt.path)
    hub.repos["org/Tiny"] = files
    cache = tmp_path / "cache"
    cancel = threading.Event()
    first = next(iter(files))  # files download in listing order

    def progress(done, total):
        if done >= len(files[first]):
            cancel.set()

    with pytest.raises(DownloadCancelled, match="cancelled; start it again to continue"):
        download("org/Tiny", progress=progress, cancel=cancel, cache_dir=cache, endpoint=hub.endpoint)
    assert dict(hub.gets) == {first: 1}
    snap = download("org/Tiny", cache_dir=cache, endpoint=hub.endpoint)
    assert hub.gets[first] == 1 and all(hub.gets[n] == 1 for n in files if not n.endswith(".py"))
    assert mx.array_equal(load_model(snap).model(PROMPT), ckpt.logits()).item()


def test_cancel_inside_a_file(tmp_path, hub):
    big = bytes(range(256)) * (25 * 4096)  # 25 MiB: several of huggingface_hub's 10 MiB chunks
    hub.repos["org/Big"] = {"model-Q8_0.gguf": big}
    cache = tmp_path / "cache"
    cancel = threading.Event()
    seen = []

    def progress(done, total):
        seen.append(done)
        if done > 0:
            cancel.set()

    with pytest.raises(DownloadCancelled):
        download(
            "org/Big",
            progress=progress,
            cancel=cancel,
            allow_patterns=["*.gguf"],
            cache_dir=cache,
            endpoint=hub.endpoint,
        )
    assert 0 < seen[-1] < len(big)
    blobs = cache / "models--org--Big" / "blobs"
    assert not any(p.stat().st_size == len(big) for p in blobs.iterdir())
    # The bytes fetched so far stay for the next attempt (test_hub_resume.py continues them).
    [partial] = blobs.glob("*.incomplete")
    assert partial.stat().st_size == seen[-1]


def test_unknown_repo_and_search(tmp_path, hub):
    hub.repos["mlx-community/Qwen3-0.6B-4bit"] = {"config.json": b"{}"}
    hub.repos["mlx-community/Llama-3.2-1B-4bit"] = {"config.json": b"{}"}
    with pytest.raises(HubError, match="cannot list nobody/nothing"):
        download("nobody/nothing", cache_dir=tmp_path / "cache", endpoint=hub.endpoint)
    results = search_hub("qwen", limit=5, endpoint=hub.endpoint)
    assert [m.repo_id for m in results] == ["mlx-community/Qwen3-0.6B-4bit"]
    assert results[0].library == "mlx" and results[0].downloads == 200
    assert len(search_hub("4bit", endpoint=hub.endpoint, library="mlx")) == 2


def test_refused_search_is_a_hub_error(hub):
    hub.refuse_search = True
    with pytest.raises(HubError, match="searching the Hugging Face Hub failed"):
        search_hub("x", endpoint=hub.endpoint)
