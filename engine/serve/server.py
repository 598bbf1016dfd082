"""``python -m engine serve``: the loaded model behind OpenAI- and Anthropic-compatible HTTP.

The server binds first and loads the model in the background: /health answers 503 (and
every model endpoint 503) until the model is in, then 200. It listens on 127.0.0.1
unless told otherwise, and refuses to listen anywhere else without an API key.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from engine.errors import EngineError
from engine.serve import anthropic_api, completions_api, decide_api, embeddings_api, openai_api, openapi
from engine.serve.http import BODY_TIMEOUT_S, DEFAULT_MAX_BODY, LOOPBACK_HOSTS, ApiError, ApiServer, Handler


class ServeError(EngineError):
    """The server cannot start as asked."""


def health(handler: Handler, _: Any) -> None:
    backend = handler.server.backend
    stopped = backend.stopped
    if stopped is not None:  # the engine's loop has stopped: say so, and start a fresh one if we may
        if backend.revive():
            raise ApiError(503, f"The engine stopped ({stopped}); it is restarting with the model.", "server_error")
        raise ApiError(503, f"The engine stopped ({stopped}) and was not restarted.", "server_error")
    if backend.info is not None:
        # "decoding": the requests generating together right now (the batch's rows).
        # "restarts": fresh engines started since the server began (see Backend.revive).
        body = {"status": "ok", "model": backend.info.name, "decoding": backend.decoding, "restarts": backend.restarts}
        pool = backend.host.kv_pool_stats() if backend.host is not None else None
        if pool is not None:  # --paged-kv: the KV block pool (blocks used, shared, cached)
            body["kv_pool"] = pool
        handler.send_json(200, body)
    elif backend.load_error is not None:
        raise ApiError(503, f"The model failed to load: {backend.load_error}", "server_error")
    else:
        raise ApiError(503, "The model is loading.", "server_error")


ROUTES = {
    ("GET", "/health"): health,
    ("GET", "/v1/models"): openai_api.models,
    ("GET", "/v1/models/*"): openai_api.model,
    ("POST", "/v1/messages/count_tokens"): anthropic_api.count_tokens,
    ("GET", "/openapi.json"): openapi.document,
    ("POST", "/v1/chat/completions"): openai_api.chat_completions,
    ("POST", "/v1/completions"): completions_api.completions,
    ("POST", "/v1/embeddings"): embeddings_api.embeddings,
    ("POST", "/v1/messages"): anthropic_api.messages,
    ("POST", "/v1/decide"): decide_api.decide,
}


def check_exposure(host: str, api_key: str | None) -> None:
    if host not in LOOPBACK_HOSTS and not api_key:
        raise ServeError(
            f"--host {host} makes the server reachable from other machines; give it an --api-key KEY "
            "(or keep the default 127.0.0.1)."
        )


def make_server(
    backend: Any,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    api_key: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    on_request: Any = None,
    body_timeout: float = BODY_TIMEOUT_S,
) -> ApiServer:
    check_exposure(host, api_key)
    try:
        return ApiServer(
            (host, port),
            backend,
            api_key=api_key,
            max_body=max_body,
            routes=ROUTES,
            on_request=on_request,
            body_timeout=body_timeout,
        )
    except OSError as e:
        raise ServeError(f"Cannot listen on {host}:{port}: {e.strerror or e}. Pick another port.") from None


def address(server: ApiServer) -> str:
    host, port = server.server_address[:2]
    return f"http://[{host}]:{port}" if ":" in str(host) else f"http://{host}:{port}"


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    *,
    api_key: str | None = None,
    memory_budget: int | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    load_options: dict[str, Any] | None = None,
    model_host: Any = None,
) -> int:
    """Run until interrupted; a model that fails to load ends the command with its reason.
    ``model_host``: the ModelHost the worker uses (rank 0 of a sharded model), else a new one."""
    from engine.serve.backend import Backend  # the engine (and mlx) only once the command runs

    backend = Backend(host=model_host)
    server = make_server(backend, host, port, api_key=api_key, max_body=max_body)
    print(f"listening on {address(server)}", flush=True)
    backend.start(model, memory_budget, **(load_options or {}))
    thread = threading.Thread(target=server.serve_forever, name="serve-http", daemon=True)
    thread.start()
    try:
        backend.loaded.wait()
        if backend.load_error is not None:
            raise ServeError(f"Cannot serve {model}: {backend.load_error}")
        assert backend.info is not None
        print(f"serving {backend.info.name} at {address(server)}/v1", flush=True)
        thread.join()
    finally:
        server.shutdown()
        server.server_close()
        backend.shutdown()
    return 0


def run_command(args: Any) -> int:
    if not 0 <= args.port <= 65535:
        raise ServeError(f"--port must be between 0 and 65535 (got {args.port})")
    if args.max_request_bytes < 1024:
        raise ServeError("--max-request-bytes must be at least 1024")
    try:
        return serve(
            args.model,
            args.host,
            args.port,
            api_key=args.api_key,
            memory_budget=args.memory_budget,
            max_body=args.max_request_bytes,
            load_options={
                "kv_bits": args.kv_bits,
                "kv_group_size": args.kv_group_size,
                "context_cap": args.context_length,
                "resident_experts": getattr(args, "resident_experts", None),
                "paged_kv_block_size": getattr(args, "paged_kv_block_size", None),
                "paged_kv_where_possible": getattr(args, "paged_kv_where_possible", False),
            },
        )
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 0
