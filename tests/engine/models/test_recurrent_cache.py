"""The recurrent cache: exact rollback from per-position states and snapshots, refusal
(never a wrong state) where no copy exists, bounded snapshots, and the memory plan."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from model_goldens import GOLDEN
from test_hybrid_families import build

from engine.artifacts.config import config_from_dict
from engine.models.kv_cache import load_prompt_cache, save_prompt_cache
from engine.models.recurrent_cache import COPIES_KEPT, MAX_SNAPSHOTS, STEP_WINDOW, RecurrentCache
from engine.runtime.memory import plan_memory


def run(model, ids, cache):
    return model(mx.array([ids]), cache=cache)[0, -1]


def same_logits(a, b):
    return mx.allclose(a, b, atol=1e-4).item()


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_trim_after_a_short_pass_is_exact(name):
    """Feed a few drafts in one pass, drop the rejected ones: the state equals never having
    fed them (a wrong rollback would change the next logits)."""
    model, expected = build(name)
    prompt = expected["prompt_ids"][:30]
    drafts = [5, 17, 99, 42]
    cache = model.make_cache()
    run(model, prompt, cache)
    run(model, drafts, cache)  # one verification pass of 4 tokens
    assert all(c.can_trim(2) for c in cache if isinstance(c, RecurrentCache))
    assert all(c.trim(2) == 2 for c in cache)  # keep 2 of the 4
    reference = model.make_cache()
    run(model, prompt + drafts[:2], reference)
    assert same_logits(run(model, [7], cache), run(model, [7], reference))
    # Going back to the wrong position would not match.
    wrong = model.make_cache()
    run(model, prompt + drafts[:3], wrong)
    assert not same_logits(run(model, [7], wrong), run(model, [7], reference))


def test_trim_without_a_copy_is_refused_and_changes_nothing():
    model, expected = build("qwen3_5")
    prompt = expected["prompt_ids"]
    cache = model.make_cache()
    run(model, prompt[:40], cache)  # a long pass records no per-position states
    run(model, prompt[40:60], cache)
    layer = next(c for c in cache if isinstance(c, RecurrentCache))
    before = [mx.array(a) for a in layer.arrays]
    assert not layer.can_trim(5)
    assert layer.trim(5) == 0 and layer.offset == 60
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, layer.arrays))
    assert layer.nearest(59) == 0  # nor is the state before the last (long) pass


def test_snapshots_roll_back_and_stay_bounded():
    model, expected = build("qwen3_next")
    prompt = expected["prompt_ids"]
    cache = model.make_cache()
    marks = []
    for end in range(10, 10 * (MAX_SNAPSHOTS + 3), 10):
        run(model, prompt[end - 10 : end], cache)
        for c in cache:
            getattr(c, "checkpoint", lambda: None)()
        marks.append(end)
    layer = next(c for c in cache if isinstance(c, RecurrentCache))
    assert len(layer._snapshots) == MAX_SNAPSHOTS  # the oldest went first
    assert layer.nearest(marks[0]) == 0 and layer.nearest(marks[-2] + 3) == marks[-2]
    target = marks[-3]
    assert all(c.trim(c.offset - target) == c.offset - target or c.offset == target for c in cache)
    reference = model.make_cache()
    run(model, prompt[:target], reference)
    assert same_logits(run(model, [9], cache), run(model, [9], reference))
    # Snapshots past the point gone back to belong to the abandoned text.
    assert max(layer._snapshots) <= target + 1


def test_passes_longer_than_the_step_window_record_nothing():
    cache = RecurrentCache(1)
    assert cache.begin(STEP_WINDOW) and not cache.begin(STEP_WINDOW + 1)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe"])
def test_memory_plan_counts_the_state_as_fixed_bytes(name):
    raw = json.loads((GOLDEN / name / "config.json").read_text())
    plan = plan_memory(config_from_dict(raw), weights_bytes=1000, budget=10**9, dtype_bytes=2)
    model, _ = build(name)
    attention = sum(1 for layer in model.layers if not getattr(layer, "is_linear", False))
    recurrent = len(model.layers) - attention
    assert 0 < attention < len(model.layers) and recurrent > 0
    args = model.args
    n_kv, head_dim = args.num_key_value_heads, args.head_dim
    assert plan.kv_bytes_per_token == attention * 2 * n_kv * head_dim * 2  # only attention grows
    # The fixed part: what the live caches hold after a prompt, with room for the snapshots.
    cache = model.make_cache()
    run(model, [3, 4, 5], cache)
    live = sum(c.nbytes for c in cache if isinstance(c, RecurrentCache))
    live_fp16 = sum(
        a.nbytes // (2 if a.ndim == 3 else 1) for c in cache if isinstance(c, RecurrentCache) for a in c.arrays
    )  # conv state in fp16, delta-rule state stays fp32
    assert live > 0 and plan.state_bytes == live_fp16 * COPIES_KEPT
    assert plan.kv_bytes(1) == plan.kv_bytes_per_token + plan.state_bytes
    assert plan.kv_bytes(1000) - plan.kv_bytes(500) == 500 * plan.kv_bytes_per_token


@pytest.mark.parametrize("name", ["qwen3_5_moe", "lfm2"])
def test_saved_hybrid_cache_continues_identically(tmp_path, name):
    model, expected = build(name)
    prompt = expected["prompt_ids"]
    cache = model.make_cache()
    run(model, prompt[:30], cache)
    path = tmp_path / "turn.safetensors"
    save_prompt_cache(path, cache, {"model": name})
    loaded, meta = load_prompt_cache(path)
    assert meta == {"model": name} and [type(c) for c in loaded] == [type(c) for c in cache]
    assert [c.offset for c in loaded] == [c.offset for c in cache] == [30] * len(cache)
    for t in prompt[30:34]:
        assert same_logits(run(model, [t], cache), run(model, [t], loaded))
