"""bench --paged-kv and --shared-prefix at a tiny scale (the real shapes are for a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, ok: bool = True) -> dict | str:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "bench", "--shape", "tiny", "-g", "4", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if not ok:
        assert proc.returncode != 0
        return proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_chats_sharing_a_prompt_hold_it_once_when_paged():
    unpaged = _bench("-p", "256", "--shared-prefix", "4")["shared_prefix"]
    paged = _bench("-p", "256", "--shared-prefix", "4", "--paged-kv", "--paged-kv-block-size", "32")
    shared = paged["shared_prefix"]
    assert paged["paged_kv"] == {"block_size": 32} and shared["paged"] and not unpaged["paged"]
    assert shared["pool"]["cached"] + shared["pool"]["used"] >= 256 // 32
    # Unpaged, four chats hold four copies of the prompt (and the warm-up chat's is freed).
    assert shared["kv_bytes_held"] < unpaged["kv_bytes_held"] / 2


def test_paged_decode_runs_alone_and_batched():
    out = _bench("-p", "64", "--paged-kv")
    assert out["engine"]["generated_tokens"] == 4
    batched = _bench("-p", "64", "--paged-kv", "--concurrent", "2")
    assert batched["paged_kv"] == {"block_size": 64} and batched["concurrent"][0]["engine"]["streams"] == 2


def test_the_paged_bench_times_the_unpaged_cache_in_the_same_run():
    out = _bench("-p", "64", "--paged-kv", "--repeat", "2")
    unpaged = out["unpaged"]
    assert len(unpaged["runs"]) == 2 and unpaged["generated_tokens"] == 4
    ratio = out["engine"]["generation_tps"] / unpaged["generation_tps"]
    assert abs(unpaged["paged_ratio"]["generation"] - ratio) < 1e-9
    assert unpaged["request_end_ms"] > 0  # each paged request's end, timed apart too


def test_the_unpaged_loop_sets_the_pool_aside_and_puts_it_back():
    import mlx.core as mx

    from engine.cli.bench import _ours, _ours_unpaged, build_model
    from engine.models.paged_kv import pool_for

    model, _, _ = build_model("tiny", 16, 64)
    pool = pool_for(model, 32)
    prompt = mx.arange(40, dtype=mx.uint32)
    assert len(list(_ours_unpaged(model, prompt, 3))) == 3
    assert model.kv_pool is pool and pool._next == 0  # no block was ever allocated
    assert len(list(_ours(model, prompt, 3))) == 3
    assert pool._next > 0


# A 256-token prompt the streams share, paged in blocks of 32.
SHARED_PROMPT_PAGED = ("-p", "256", "--paged-kv", "--paged-kv-block-size", "32")


def test_concurrent_streams_after_a_shared_prompt_against_mlx_lm_prompt_cache():
    """``--concurrent N --shared-prompt``: N streams after one cached prompt, each with its
    own question: the engine's batch holding it once, the same batch with own copies, and
    mlx-lm's BatchGenerator from its prompt cache, on the same ids."""
    import pytest

    pytest.importorskip("mlx_lm")
    out = _bench(
        *SHARED_PROMPT_PAGED,
        "--concurrent",
        "1,3",
        "--shared-prompt",
        "--vs",
        "mlx-lm",
    )
    for n, row in zip((1, 3), out["concurrent"], strict=True):
        assert {"engine", "own-copy", "mlx-lm"} <= set(row)
        for side in ("engine", "own-copy", "mlx-lm"):
            assert row[side]["streams"] == n and row[side]["generated_tokens"] == 4 * n
            assert row[side]["peak_gb"] > 0
        assert row["same_tokens_as_own_copy"]  # the prefix held once changes no id
    assert out["concurrent"][0]["same_tokens_as_mlx_lm"]  # one stream, same weights, greedy


def test_a_shared_prompt_needs_concurrent_streams():
    assert "--shared-prompt" in _bench("-p", "64", "--shared-prompt", ok=False)
    assert "--prompts" in _bench("-p", "64", "--concurrent", "2", "--prompts", "2", ok=False)


def test_streams_after_two_cached_prompts_in_turn():
    """``--prompts 2``: streams alternate between two cached prompts (two kinds of agent):
    the batch holds both once, and the ids equal own copies' and mlx-lm's from its cache."""
    import pytest

    pytest.importorskip("mlx_lm")
    out = _bench(*SHARED_PROMPT_PAGED, "--concurrent", "4", "--shared-prompt", "--prompts", "2", "--vs", "mlx-lm")
    (row,) = out["concurrent"]
    assert {"engine", "own-copy", "mlx-lm"} <= set(row) and row["engine"]["generated_tokens"] == 16
    assert row["same_tokens_as_own_copy"]


def test_streams_arriving_together_with_a_new_prompt_prefill_it_once():
    """``--shared-prompt cold``: nothing cached; paged, the engine prefills the common prompt
    once for the streams arriving together, where rows with their own copies prefill it each."""
    out = _bench(
        *SHARED_PROMPT_PAGED,
        "--concurrent",
        "4",
        "--shared-prompt",
        "cold",
        "--profile",
    )
    (row,) = out["concurrent"]

    def prefilled(side: str) -> float:
        p = row[side]["profile"]
        return p["prefill_passes"] * p["prefill_tokens_per_pass"]

    assert prefilled("own-copy") == 4 * (256 + 32 - 1)
    assert prefilled("engine") == 256 + 32 - 1 + 3 * (32 - 1)  # the others: their question but its last token
