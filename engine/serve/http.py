"""HTTP plumbing on the standard library's ``http.server``: one thread per connection,
JSON in and out, server-sent events, OpenAI- and Anthropic-shaped error bodies.

The standard library is enough here: requests are few and long (a generation each), a
thread per connection costs nothing next to a forward pass, and a blocking handler can
watch its socket to notice a client that has gone. No CORS headers are ever sent, so a
web page in a browser cannot read the answers; POSTs must say ``application/json`` (a
browser cannot send that cross-site without a preflight that this server refuses), and
while bound to loopback the Host header must name loopback (no DNS rebinding).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import re
import select
import socket
import sys
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from engine.errors import EngineError

DEFAULT_MAX_BODY = 32 * 1024 * 1024  # enough for a few photos as data: URLs
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
LISTEN_BACKLOG = 512  # connections the kernel holds while every thread is busy accepting (a burst)
# A request body must arrive within this many seconds, plus one per megabyte: a client that
# sends less than its Content-Length (or trickles) is answered 408, not waited on forever.
BODY_TIMEOUT_S = 30.0
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how JSON spells half of a UTF-16 pair


class ModelLoading(EngineError):
    """A request came before the model finished loading."""


class EngineDown(EngineError):
    """The engine cannot serve: it stopped and was not restarted, or its model failed to
    load. Every model request is refused (503)."""


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


class ApiError(Exception):
    """Ends a request with ``status`` and an error body saying ``message``."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def engine_error(kind: str, message: str) -> ApiError:
    """An ErrorEvent from the worker as an HTTP error: the caller's fault (400) unless the
    engine itself failed (500) or has no model yet (503)."""
    if kind in ("InternalError", "Fatal"):
        return ApiError(500, message, "server_error")
    if kind in ("NoModelLoaded", "ModelLoading", "OutOfKVRoom"):
        return ApiError(503, message, "server_error")
    if kind == "OutOfMemoryBudget":
        return ApiError(400, message, "invalid_request_error", code="context_length_exceeded")
    return ApiError(400, message)


Route = Callable[["Handler", Any], None]


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        backend: Any,
        *,
        api_key: str | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        routes: dict[tuple[str, str], Route] | None = None,
        on_request: Callable[[dict[str, Any]], None] | None = None,
        body_timeout: float = BODY_TIMEOUT_S,
    ):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)
        self.backend = backend
        self.api_key = api_key
        self.max_body = max_body
        self.body_timeout = body_timeout
        self.routes = routes or {}
        self.loopback = address[0] in LOOPBACK_HOSTS
        # One dict per finished request (method, path, status, seconds, client): the log.
        self.on_request = on_request or _log_line


def _log_line(entry: dict[str, Any]) -> None:
    print(
        f"{entry['client']} {entry['method']} {entry['path']} {entry['status']} {entry['seconds']:.2f}s",
        file=sys.stderr,
        flush=True,
    )


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # A connection that sends nothing for this long is closed: idle keep-alive connections
    # and slow senders do not hold a thread forever. (Generating never waits on the socket.)
    timeout = 120
    server: ApiServer
    server_version = "mlx-desk"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request comes from _dispatch instead

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def __getattr__(self, name: str) -> Any:
        """Any other method (TRACE, HEAD, ...) is answered as an unknown route is: a 404 or
        405 in the JSON error shape rather than the standard library's 501."""
        if name.startswith("do_") and name[3:].isalpha():
            return lambda: self._dispatch(name[3:])
        raise AttributeError(name)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The standard library's own refusals (a malformed request line, an unknown method,
        an oversized header) in the API's JSON error shape rather than an HTML page; the
        connection closes, since the request may not have been read to its end."""
        self.close_connection = True
        self.anthropic, self.streaming = False, False
        with contextlib.suppress(OSError):
            self.send_json(code, error_payload(ApiError(code, message or "Bad request."), False))

    # ---- dispatch -------------------------------------------------------------------

    def _dispatch(self, method: str) -> None:
        start = time.monotonic()
        path = (urlsplit(self.path).path.rstrip("/") or "/") if self.path.startswith("/") else self.path
        self._body_read = False
        self.status = 0
        self.anthropic = path.startswith("/v1/messages")
        self.streaming = False
        if method == "HEAD":  # the answer has a body, which a HEAD client does not read: no reuse
            self.close_connection = True
        try:
            try:
                self._check_target()
                self._check_host()
                route = self.server.routes.get((method, path))
                if route is None and path.count("/") > 1:  # /v1/models/{id}: a route ending in "/*"
                    route = self.server.routes.get((method, path.rsplit("/", 1)[0] + "/*"))
                if route is None:
                    if any(p == path for _, p in self.server.routes):
                        raise ApiError(405, f"{method} is not allowed on {path}.")
                    raise ApiError(404, f"No such endpoint: {method} {path}.", code="not_found")
                if path not in ("/health", "/openapi.json"):  # neither says anything private
                    self._check_key()
                if method == "POST":
                    body = self._read_json()
                else:  # a body on a GET means nothing here, but must not be read as the next request
                    body = None
                    self._discard_body()
                route(self, body)
            except ApiError as e:
                self._discard_body()
                self.send_error_body(e)
            except (ModelLoading, EngineDown) as e:
                self._discard_body()
                self.send_error_body(ApiError(503, str(e), "server_error"))
            except EngineError as e:
                self._discard_body()
                self.send_error_body(ApiError(400, str(e)))
        except ClientGone:
            self.close_connection = True
            self.status = self.status or 499
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
            self.status = self.status or 499
        except Exception as e:  # noqa: BLE001 - a server bug answers 500, the server stays up
            if not self.streaming:
                self.send_error_body(ApiError(500, f"Internal error: {type(e).__name__}: {e}", "server_error"))
            self.close_connection = True
        entry = {
            "method": method,
            "path": path,
            "status": self.status,
            "client": self.client_address[0],
            "seconds": time.monotonic() - start,
        }
        with contextlib.suppress(Exception):  # a broken log must not break requests
            self.server.on_request(entry)

    def _check_target(self) -> None:
        """Only origin-form targets ("/v1/models"): an absolute URL or "*" names a proxy's
        job, and its host part would bypass the Host check."""
        if not self.path.startswith("/") or self.path.startswith("//"):
            raise ApiError(400, "The request target must be a path such as /v1/models, not a full URL.")
        hosts = self.headers.get_all("Host") or []
        if len(hosts) > 1:
            raise ApiError(400, "The request has more than one Host header.")

    def _check_host(self) -> None:
        if not self.server.loopback:
            return
        host = (self.headers.get("Host") or "").strip()
        if host and host_name(host) not in LOOPBACK_HOSTS:
            raise ApiError(
                403, f"This server answers only requests addressed to this machine (Host {host!r}).", "permission_error"
            )

    def _check_key(self) -> None:
        key = self.server.api_key
        if not key:
            return
        auth = self.headers.get("Authorization") or ""
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else (self.headers.get("x-api-key") or "")
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(
                401,
                "Missing or wrong API key: send it as 'Authorization: Bearer KEY'.",
                "authentication_error",
                code="invalid_api_key",
            )

    def _read_json(self) -> Any:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            self.close_connection = True
            raise ApiError(411, "Send the request body with a Content-Length (chunked bodies are not taken).")
        lengths = self.headers.get_all("Content-Length") or []
        text = (lengths[0] if lengths else "0").strip()
        if len(set(lengths)) > 1 or not (text.isascii() and text.isdigit()):
            self.close_connection = True  # where this body ends is unknown: the connection cannot be reused
            raise ApiError(
                400, f"The Content-Length header must be one non-negative number (got {', '.join(lengths)})."
            )
        length = int(text)
        if length > self.server.max_body:
            self.close_connection = True  # the body is not read: the connection cannot be reused
            raise ApiError(
                413,
                f"The request body is {length} bytes; this server takes at most {self.server.max_body}.",
                code="request_too_large",
            )
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        raw = self._read_body(length)
        if ctype != "application/json":
            raise ApiError(415, "Send the request body as JSON (Content-Type: application/json).")
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"The request body is not valid JSON: {e}.") from None
        if _SURROGATE_ESCAPE.search(raw):  # rare: only then walk the body for a lone half of a pair
            check_text(body)
        return body

    def _read_body(self, length: int) -> bytes:
        """Exactly ``length`` bytes, within the body deadline (408 and the connection closed
        when they do not come)."""
        self._body_read = True
        deadline = time.monotonic() + self.server.body_timeout + length / 1e6
        chunks, got = [], 0
        try:
            while got < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self.connection.settimeout(min(left, self.timeout))
                chunk = self.rfile.read1(min(length - got, 1 << 20))
                if not chunk:
                    raise ClientGone()
                chunks.append(chunk)
                got += len(chunk)
        except TimeoutError:
            self.close_connection = True
            raise ApiError(
                408, f"The request body did not arrive: {got} of the {length} bytes its Content-Length announced."
            ) from None
        finally:
            with contextlib.suppress(OSError):
                self.connection.settimeout(self.timeout)
        return b"".join(chunks)

    def _discard_body(self) -> None:
        """After an error before the body was read: read it off (or drop the connection),
        so the next request on this connection starts where it should."""
        if self._body_read or self.close_connection:
            return
        text = (self.headers.get("Content-Length") or "0").strip()
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower() or not (
            text.isascii() and text.isdigit()
        ):
            self.close_connection = True
            return
        length = int(text)
        if length > self.server.max_body:
            self.close_connection = True
            return
        try:
            self._read_body(length)
        except ApiError:
            self.close_connection = True

    # ---- responses ------------------------------------------------------------------

    def send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.status = status
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_body(self, error: ApiError) -> None:
        if self.streaming:  # headers are out: the error goes into the stream
            self.send_event(error_payload(error, self.anthropic), "error" if self.anthropic else None)
            return
        if self.anthropic:
            kind = {
                401: "authentication_error",
                403: "permission_error",
                404: "not_found_error",
                413: "request_too_large",
                503: "overloaded_error",
            }.get(error.status, error.kind)
            if error.status >= 500 and error.status != 503:
                kind = "api_error"
            self.send_json(error.status, {"type": "error", "error": {"type": kind, "message": error.message}})
        else:
            self.send_json(error.status, error_payload(error, False))

    def start_stream(self) -> None:
        """Headers for server-sent events; the connection closes when the stream ends."""
        if self.streaming:
            return
        self.streaming = True
        self.status = 200
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()

    def send_event(self, payload: Any, event: str | None = None) -> None:
        self.start_stream()
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        head = f"event: {event}\n" if event else ""
        try:
            self.wfile.write(f"{head}data: {data}\n\n".encode())
            self.wfile.flush()
        except OSError:
            raise ClientGone() from None

    def client_gone(self) -> bool:
        """Whether the client closed the connection (checked while its request waits)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


def _no_constant(name: str) -> Any:
    """JSON has no NaN or Infinity (Python's parser takes them): refused as not JSON."""
    raise ValueError(f"{name} is not a JSON number")


def host_name(host: str) -> str:
    """The name in a Host header's value ("[::1]:8080" -> "::1"); "" when the value is not a
    name with an optional numeric port (userinfo, a path, a second colon)."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return ""
        name, rest = host[1:end], host[end + 1 :]
    else:
        name, colon, port = host.partition(":")
        rest = colon + port
    if rest and not (rest.startswith(":") and rest[1:].isdigit()):
        return ""
    if any(c in name for c in "@/\\?# ") or not name:
        return ""
    return name.lower()


def check_text(value: Any, where: str = "body") -> None:
    """400 for a string that is not Unicode text (a lone surrogate such as "\\ud800", which
    JSON can spell but no tokenizer can take), naming where it is."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(
                400, f"The request's {where} holds a lone UTF-16 surrogate (such as \\ud800), which is not text."
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, where)
            check_text(item, f"{where}.{key}" if where != "body" else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{where}[{i}]")


def error_payload(error: ApiError, anthropic: bool) -> dict[str, Any]:
    if anthropic:
        return {"type": "error", "error": {"type": error.kind, "message": error.message}}
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}
