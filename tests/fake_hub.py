"""A local HTTP server on 127.0.0.1 that answers as the Hugging Face Hub does.

It serves the endpoints huggingface_hub calls: ``/api/models/{repo}/revision/{rev}``
for the file list, HEAD and GET ``/{repo}/resolve/{rev}/{file}`` with X-Repo-Commit,
ETag and Content-Length, and ``/api/models`` for search. Tests of the engine's
downloads and of the app's model browser share it; no network is used.

``hold(name)`` makes the server wait before sending that file's bytes until the
returned event is set, so a test can act (cancel) while a download is under way.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "c0ffee" + "0" * 34


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gets: Counter[str] = Counter()
        self.refuse_search = False
        self.held: dict[str, threading.Event] = {}
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
                    if name in hub.held:
                        hub.held[name].wait(30)
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
