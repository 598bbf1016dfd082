"""Memory plans of sliding-window models, held against the bytes real caches take.

Each tiny config runs through its real model with the caches ``make_prompt_cache`` gives
it; the plan must predict what the key/value buffers hold after N tokens, N below and
past the window. Full-attention caches grow to ``buffer_tokens`` (whole steps and a few
spare tokens), so they may hold up to a step and those tokens more than the plan counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from tiny_checkpoints import write_checkpoint

from engine import models
from engine.api import UNLIMITED_CONTEXT, KVWindow, MemoryPlan
from engine.artifacts.config import config_from_dict
from engine.errors import OutOfMemoryBudget
from engine.models.cache_buffers import buffer_tokens
from engine.models.kv_cache import KVCache, RotatingKVCache, make_prompt_cache
from engine.runtime.memory import check_fits, plan_memory
from engine.runtime.model_info import format_inspect, inspect_model

GOLDEN_MODELS = Path(__file__).resolve().parents[2] / "golden" / "models"
ROOT = Path(__file__).resolve().parents[3]


def golden_config(name: str, **changes) -> dict:
    config = json.loads((GOLDEN_MODELS / name / "config.json").read_text(encoding="utf-8"))
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


WINDOW = 8  # every golden config below uses an 8-token window
CONFIGS = {
    "llama": golden_config("llama"),
    "mistral-window": golden_config("mistral"),  # every layer slides
    "gemma2": golden_config("gemma2"),  # sliding, full
    # Gemma 3 by its pattern (no layer_types): every second layer is full here.
    "gemma3-pattern": golden_config("gemma3_text", layer_types=None, sliding_window_pattern=2),
    # Qwen 2: layers from max_window_layers on slide, when use_sliding_window is on.
    "qwen2-window": golden_config(
        "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, layer_types=None
    ),
}
# (full-attention layers, sliding layers) each config should have
LAYOUT = {"llama": (2, 0), "mistral-window": (0, 2), "gemma2": (1, 1), "gemma3-pattern": (2, 2), "qwen2-window": (1, 1)}


def tiny_model(name: str):
    raw = CONFIGS[name]
    family = models.get_family(raw["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config_from_dict(raw).raw))
    model.set_dtype(mx.bfloat16)
    return model


def per_layer_token_bytes(raw: dict) -> int:
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return 2 * raw["num_key_value_heads"] * head_dim * 2  # K and V, bf16


def run_tokens(model, n: int, prefill: int, chunk: int = 5) -> list:
    """``prefill`` tokens in chunks, then single decode steps up to ``n``."""
    cache = make_prompt_cache(model)
    ids = [(7 * i + 3) % 100 + 4 for i in range(n)]
    pos = 0
    while pos < n:
        step = min(chunk, prefill - pos) if pos < prefill else 1
        model(mx.array([ids[pos : pos + step]]), cache=cache)
        pos += step
    mx.eval([c.keys for c in cache] + [c.values for c in cache])
    return cache


def split_bytes(cache: list) -> tuple[int, int]:
    full = sum(c.nbytes for c in cache if isinstance(c, KVCache))
    rotating = sum(c.nbytes for c in cache if isinstance(c, RotatingKVCache))
    assert len(cache) == sum(isinstance(c, (KVCache, RotatingKVCache)) for c in cache)
    return full, rotating


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_plan_layout_matches_the_caches_the_model_makes(name):
    plan = plan_memory(config_from_dict(CONFIGS[name]), weights_bytes=1000, budget=10**9)
    cache = make_prompt_cache(tiny_model(name))
    per_layer = per_layer_token_bytes(CONFIGS[name])
    full_layers = sum(isinstance(c, KVCache) for c in cache)
    windows = [c.max_size for c in cache if isinstance(c, RotatingKVCache)]
    assert plan.kv_bytes_per_token == full_layers * per_layer
    assert plan.kv_windows == (
        [KVWindow(tokens=WINDOW, layers=len(windows), bytes_per_token=len(windows) * per_layer)] if windows else []
    )
    assert set(windows) <= {WINDOW}
    assert (full_layers, len(windows)) == LAYOUT[name]
    assert plan.kv_window_bytes == len(windows) * per_layer * WINDOW


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("n", [3, WINDOW, 13, 27])
def test_plan_predicts_cache_bytes_after_prefill(name, n):
    """Chunked prefill keeps windowed buffers at exactly min(n, window) tokens."""
    plan = plan_memory(config_from_dict(CONFIGS[name]), weights_bytes=1000, budget=10**9)
    full, rotating = split_bytes(run_tokens(tiny_model(name), n, prefill=n))
    windowed = plan.kv_bytes(n) - plan.kv_bytes_per_token * n
    assert rotating == windowed == sum(w.bytes_per_token * min(n, w.tokens) for w in plan.kv_windows)
    if n > WINDOW:
        assert rotating == plan.kv_window_bytes  # the windows are full and stop growing
    assert full == plan.kv_bytes_per_token * buffer_tokens(n)
    assert plan.kv_bytes(n) <= full + rotating <= plan.kv_bytes(buffer_tokens(n))


@pytest.mark.parametrize("name", ["gemma2", "mistral-window", "gemma3-pattern"])
def test_plan_bounds_cache_bytes_while_decoding_past_the_window(name):
    model = tiny_model(name)
    plan = plan_memory(config_from_dict(CONFIGS[name]), weights_bytes=1000, budget=10**9)
    for n in (6, WINDOW + 1, 3 * WINDOW):
        full, rotating = split_bytes(run_tokens(model, n, prefill=4))
        # A rotating buffer grows by steps too, but never past its window.
        assert plan.kv_bytes(n) - plan.kv_bytes_per_token * n <= rotating <= plan.kv_window_bytes
        if n > WINDOW:
            assert rotating == plan.kv_window_bytes
        assert plan.kv_bytes(n) <= full + rotating <= plan.kv_bytes(buffer_tokens(n))


# ---- the longest context that fits ----------------------------------------------------


def plan_with(per_token: int, windows: list[KVWindow], spare: int) -> MemoryPlan:
    return MemoryPlan(
        weights_bytes=5000,
        kv_bytes_per_token=per_token,
        budget_bytes=5000 + spare,
        total_bytes=10**9,
        kv_windows=windows,
    )


@pytest.mark.parametrize("context", [0, 1, 7, 8, 9, 100, 4096])
def test_max_context_is_the_longest_that_fits(context):
    windows = [KVWindow(tokens=8, layers=1, bytes_per_token=64), KVWindow(tokens=32, layers=2, bytes_per_token=128)]
    for per_token in (0, 256):
        plan = plan_with(per_token, windows, spare=0)
        plan.budget_bytes = plan.weights_bytes + plan.kv_bytes(context)
        if per_token == 0 and context >= 32:
            assert plan.max_context == UNLIMITED_CONTEXT and not plan.kv_limits_context
            continue
        # Exactly enough for `context` tokens: the answer is `context`, one more does not fit.
        assert plan.max_context == context and plan.kv_limits_context
        assert plan.kv_bytes(plan.max_context + 1) > plan.budget_bytes - plan.weights_bytes


def test_full_attention_plan_is_unchanged():
    plan = plan_with(512, [], spare=512 * 1000 + 17)
    assert plan.max_context == 1000 and plan.kv_bytes(1000) == 512 * 1000 and plan.kv_window_bytes == 0


def test_all_sliding_model_is_not_limited_by_its_cache():
    plan = plan_memory(config_from_dict(CONFIGS["mistral-window"]), weights_bytes=10_000, budget=10**6)
    assert plan.kv_bytes_per_token == 0 and plan.kv_window_bytes > 0
    assert not plan.kv_limits_context and plan.max_context == UNLIMITED_CONTEXT
    check_fits(plan, context_tokens=10**9)
    # The windows themselves must still fit: with room for 5 tokens of them, 5 is the limit.
    tight = plan_memory(
        config_from_dict(CONFIGS["mistral-window"]), weights_bytes=10_000, budget=10_000 + plan.kv_bytes(5)
    )
    assert tight.max_context == 5 and tight.kv_limits_context
    with pytest.raises(OutOfMemoryBudget, match="at most 5 tokens"):
        check_fits(tight, context_tokens=6)


def test_check_fits_counts_a_window_once():
    plan = plan_memory(config_from_dict(CONFIGS["gemma2"]), weights_bytes=10_000, budget=10**9)
    per_layer = per_layer_token_bytes(CONFIGS["gemma2"])
    assert plan.kv_bytes(10_000) == per_layer * 10_000 + per_layer * WINDOW
    exact = MemoryPlan(**{**plan.__dict__, "budget_bytes": 10_000 + plan.kv_bytes(10_000) + 1})
    check_fits(exact, context_tokens=10_000)
    with pytest.raises(OutOfMemoryBudget, match="at most 10,000 tokens"):
        check_fits(exact, context_tokens=10_001)


# ---- what inspect prints ----------------------------------------------------------------


def test_inspect_prints_windows_and_the_context_they_allow(tmp_path):
    ckpt = write_checkpoint(tmp_path / "gemma2", config=CONFIGS["gemma2"])
    info = inspect_model(ckpt.path, memory_budget=10**9)
    text = format_inspect(info)
    per_layer = per_layer_token_bytes(CONFIGS["gemma2"])
    assert f"KV per token  {per_layer} B" in text
    assert per_layer * 8 == 1024
    assert "KV window     1 layer keeps at most 8 tokens: 1.0 KB at most" in text
    assert "max context   256 tokens (the model's full context)" in text

    tight = inspect_model(ckpt.path, memory_budget=info.plan.weights_bytes + info.plan.kv_bytes(100))
    assert tight.plan.max_context == 100
    assert "max context   100 tokens\n" in format_inspect(tight) + "\n"


def test_cli_inspect_of_an_all_sliding_model(tmp_path):
    ckpt = write_checkpoint(tmp_path / "mistral", config=CONFIGS["mistral-window"])
    budget = 10**8
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "inspect", str(ckpt.path), "--memory-budget", str(budget)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "KV per token  0 B" in proc.stdout
    assert "KV window     2 layers keep at most 8 tokens" in proc.stdout
    # Not limited by its cache: the model's own context is the limit.
    assert "max context   256 tokens (the model's full context)" in proc.stdout
