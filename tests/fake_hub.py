"""A local HTTP server on 127.0.0.1 that answers as the Hugging Face Hub does.

It serves the endpoints huggingface_hub calls: ``/api/models/{repo}/revision/{rev}``
for the file list (sizes, git blob ids, LFS sha256 for weights), HEAD and GET
``/{repo}/resolve/{rev}/{file}`` with X-Repo-Commit, ETag and Content-Length (LFS files
also X-Linked-Etag / X-Linked-Size, as the Hub sends), and ``/api/models`` for search.
GET honours ``Range: bytes=N-`` with 206 and Content-Range. Tests of the engine's
downloads and of the app's model browser share it; no network is used.

The test suite runs huggingface_hub offline (tests/conftest.py), with its default endpoint
on a local port where nothing listens; while a FakeHub serves, the library is let online,
so calls that pass ``endpoint=`` reach this server and a call that forgets it still never
leaves the machine.

``hold(name)`` makes the server wait before sending that file's bytes until the
returned event is set, so a test can act (cancel) while a download is under way.
``ranges`` records the start of every Range request per file; ``ignore_range`` makes
the server answer 200 with the whole file, as some proxies do.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "c0ffee" + "0" * 34
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")  # stored in Git LFS on the Hub


def git_blob_id(data: bytes) -> str:
    """The git object id of a file: the ETag the Hub sends for files kept in git."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gets: Counter[str] = Counter()
        self.refuse_search = False
        self.commit = COMMIT
        self.ranges: dict[str, list[int]] = {}
        self.ignore_range = False
        self.held: dict[str, threading.Event] = {}
        self.etags: dict[str, str] = {}  # file name -> the ETag to send instead (hostile servers)
        handler = self._handler()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def hold(self, name: str) -> threading.Event:
        """Hold back the bytes of file ``name`` until the returned event is set."""
        self.held[name] = threading.Event()
        return self.held[name]

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
                        _rev, _, name = path[len(prefix) :].partition("/")
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
                siblings = []
                for n, b in files.items():
                    entry = {"rfilename": n, "size": len(b), "blobId": git_blob_id(b)}
                    if is_lfs(n):
                        entry["lfs"] = {"sha256": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}
                    siblings.append(entry)
                self.send_json(
                    {
                        "id": repo,
                        "modelId": repo,
                        "sha": hub.commit,
                        "private": False,
                        "downloads": 0,
                        "likes": 0,
                        "tags": ["mlx"],
                        "siblings": siblings,
                    }
                )

            def search(self, query):
                term = query.get("search", [""])[0]
                library = query.get("filter", [""])[0]
                rows = [
                    {
                        "id": r,
                        "modelId": r,
                        "downloads": 100 * (i + 1),
                        "likes": i,
                        "library_name": "mlx",
                        "tags": ["mlx"],
                        "private": False,
                    }
                    for i, r in enumerate(sorted(hub.repos))
                    if term.lower() in r.lower()
                ]
                self.send_json(rows if library in ("mlx", "") else [])

            def file(self, repo, name, data, body):
                start = 0
                asked = self.headers.get("Range") if body else None
                if asked:
                    hub.ranges.setdefault(name, []).append(int(asked.split("=")[1].split("-")[0]))
                    if not hub.ignore_range:
                        start = int(asked.split("=")[1].split("-")[0])
                        if start >= len(data):
                            return self.missing("RangeNotSatisfiable", status=416)
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", hub.commit)
                if is_lfs(name):  # the Hub's ETag names the pointer; the linked one the content
                    self.send_header("ETag", '"' + git_blob_id(b"pointer " + name.encode()) + '"')
                    linked = hub.etags.get(name, hashlib.sha256(data).hexdigest())
                    self.send_header("X-Linked-Etag", '"' + linked + '"')
                    self.send_header("X-Linked-Size", str(len(data)))
                elif name in hub.etags:
                    self.send_header("ETag", '"' + hub.etags[name] + '"')
                else:
                    self.send_header("ETag", '"' + git_blob_id(data) + '"')
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if body:
                    hub.gets[name] += 1
                    if name in hub.held:
                        hub.held[name].wait(30)
                    try:
                        for at in range(start, len(data), 1 << 20):
                            self.wfile.write(data[at : at + (1 << 20)])
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client cancelled

            def missing(self, code, status=404):
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler

    def __enter__(self):
        from huggingface_hub import constants

        self.thread.start()
        self._offline = constants.HF_HUB_OFFLINE
        constants.HF_HUB_OFFLINE = False  # online, towards this server (the default endpoint is dead)
        return self

    def __exit__(self, *exc):
        from huggingface_hub import constants

        constants.HF_HUB_OFFLINE = self._offline
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()
