"""``serve --paged-kv``: /health shows the KV block pool, a second request with the same
system prompt takes the first one's blocks from the pool, and requests decode together."""

from __future__ import annotations

import json
import threading
import time
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


def test_paged_requests_decode_together_and_a_short_one_reuses_the_long_ones_blocks(tiny_model, tmp_path):
    server = start_server(tiny_model, tmp_path / "log", "--paged-kv", "--paged-kv-block-size", "16")
    try:
        model = health(server.base)["model"]

        def ask(question: str, max_tokens: int) -> dict:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            return post(server.base, "/v1/chat/completions", body)

        alone = ask("write a story", 300)
        long_reply: list[dict] = []
        worker = threading.Thread(target=lambda: long_reply.append(ask("write a story", 300)))
        worker.start()
        for _ in range(500):  # bounded: 5 s
            if health(server.base)["decoding"] >= 1:
                break
            time.sleep(0.01)
        short = ask("hello", 3)
        still_decoding = worker.is_alive()
        worker.join(120)
    finally:
        server.stop()
    assert still_decoding, "the short request waited for the long one: paged requests did not batch"
    assert long_reply[0]["choices"][0]["message"] == alone["choices"][0]["message"]
    assert alone["usage"]["completion_tokens"] == 300
    assert short["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) >= 16 * (len(SYSTEM) // 64)


def test_requests_arriving_together_with_one_system_prompt_reply_as_alone(tiny_model, tmp_path):
    """Four requests with one new system prompt at once: the batch prefills it once and holds
    it once (engine/decode/batch_cache.py); each reply equals the same request sent alone."""
    server = start_server(tiny_model, tmp_path / "log", "--paged-kv", "--paged-kv-block-size", "16")
    questions = ("hello", "write a story", "what is the capital", "count to ten")
    try:
        model = health(server.base)["model"]

        def ask(question: str) -> dict:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            body = {"model": model, "messages": messages, "max_tokens": 24, "temperature": 0}
            return post(server.base, "/v1/chat/completions", body)

        together: dict[str, dict] = {}
        workers = [threading.Thread(target=lambda q=q: together.update({q: ask(q)})) for q in questions]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        alone = {q: ask(q) for q in questions}
    finally:
        server.stop()
    for q in questions:
        assert together[q]["choices"][0]["message"] == alone[q]["choices"][0]["message"], q
