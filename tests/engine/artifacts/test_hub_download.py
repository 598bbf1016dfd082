"""Downloads through huggingface_hub from a local server that answers as the Hub does.

The server (127.0.0.1, a thread of this test) serves the endpoints huggingface_hub
calls: ``/api/models/{repo}/revision/{rev}`` for the file list, HEAD and GET
``/{repo}/resolve/{rev}/{file}`` with X-Repo-Commit, ETag and Content-Length, and
``/api/models`` for search. No network is used.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

import mlx.core as mx
import pytest

from engine.artifacts.hub import DownloadCancelled, HubError, download, scan_local_models, search_hub
from engine.artifacts.loader import load_model

from tiny_checkpoints import PROMPT, write_checkpoint

COMMIT = "c0ffee" + "0" * 34


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gets: Counter[str] = Counter()
        self.refuse_search = False
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_HEAD(self):
                self.answer(body=False)

            def do_GET(self):
                self.answer(body=True)

            def answer(self, body: bool):
                url = urlparse(self.path)
                path = unquote(url.path)
                if path == "/api/models":
                    if hub.refuse_search:
                        return self.missing("Forbidden", status=403)
                    return self.search(parse_qs(url.query))
                for repo, files in hub.repos.items():
                    if path.startswith(f"/api/models/{repo}/revision/"):
                        return self.listing(repo, files)
                    prefix = f"/{repo}/resolve/"
                    if path.startswith(prefix):
                        _rev, _, name = path[len(prefix):].partition("/")
                        if name in files:
                            return self.file(repo, name, files[name], body)
                        return self.missing("EntryNotFound")
                return self.missing("RepoNotFound")

            def send_json(self, data):
                raw = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def listing(self, repo, files):
                siblings = [{"rfilename": n, "size": len(b), "blobId": hashlib.sha1(b).hexdigest()}
                            for n, b in files.items()]
                self.send_json({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                "downloads": 0, "likes": 0, "tags": ["mlx"], "siblings": siblings})

            def search(self, query):
                term = query.get("search", [""])[0]
                library = query.get("filter", [""])[0]
                rows = [{"id": r, "modelId": r, "downloads": 100 * (i + 1), "likes": i, "library_name": "mlx",
                         "tags": ["mlx"], "private": False}
                        for i, r in enumerate(sorted(hub.repos)) if term.lower() in r.lower()]
                self.send_json(rows if library in ("mlx", "") else [])

            def file(self, repo, name, data, body):
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    hub.gets[name] += 1
                    try:
                        for start in range(0, len(data), 1 << 20):
                            self.wfile.write(data[start : start + (1 << 20)])
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client cancelled

            def missing(self, code, status=404):
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


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
    snap = download("mlx-community/Tiny", progress=lambda d, t: seen.append((d, t)),
                    cache_dir=cache, endpoint=hub.endpoint)
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
        download("org/Big", progress=progress, cancel=cancel, allow_patterns=["*.gguf"],
                 cache_dir=cache, endpoint=hub.endpoint)
    assert 0 < seen[-1] < len(big)
    blobs = cache / "models--org--Big" / "blobs"
    assert not blobs.exists() or not any(p.stat().st_size == len(big) for p in blobs.iterdir())


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
