"""``serve --paged-kv``: /health shows the KV block pool, and a second request with the
same system prompt takes the first one's blocks from the pool."""

from __future__ import annotations

import json
import urllib.request

from .conftest import start_server

SYSTEM = "You are a careful assistant. " * 12


def post(base: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def health(base: str) -> dict:
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        return json.loads(r.read())


def test_health_shows_the_pool_and_requests_share_a_system_prompt(tiny_model, tmp_path):
    server = start_server(tiny_model, tmp_path / "log", "--paged-kv", "--paged-kv-block-size", "16")
    try:
        state = health(server.base)
        assert state["kv_pool"]["used"] == 0
        replies = []
        for question in ("hello there", "what is the capital"):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            replies.append(
                post(
                    server.base,
                    "/v1/chat/completions",
                    {"model": state["model"], "messages": messages, "max_tokens": 4},
                )
            )
        pool = health(server.base)["kv_pool"]
        assert pool["block_size"] == 16 and pool["used"] + pool["cached"] > 0
        cached = replies[1]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        assert cached >= 16 * (len(SYSTEM) // 64), (replies[1]["usage"], pool)
    finally:
        server.stop()
    assert "kv_pool" not in json.dumps(replies)
