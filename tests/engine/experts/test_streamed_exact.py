"""Experts read from the file give the fully resident model's output exactly.

For each MoE family and stored layout: greedy ids identical and log-probs within 1e-5 of
the fully resident model with half, a quarter and one slot per layer of the experts held
(one slot is fewer than a token's experts: a pass then runs its experts in groups).
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.models import expert_store
from engine.models.expert_store import FREQUENCY_DECAY
from tests.engine.experts.moe_folders import CONVERTED, FAMILIES, golden, load, run_greedy, store_of

RESIDENCIES = [0.5, 0.25, 0.01]  # 0.01: one slot per layer


@pytest.fixture(scope="module")
def reference():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = run_greedy(load(golden(name)))
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_streamed_equals_resident(name, reference):
    want_ids, want_lp = reference(name)
    for fraction in RESIDENCIES:
        model = load(golden(name), fraction)
        store = store_of(model)
        assert store is not None and store.layers, "the experts were not streamed"
        assert all(layer.slots < layer.num_experts for layer in store.layers)
        ids, lp = run_greedy(model)
        assert ids == want_ids, f"{name} at {fraction}"
        np.testing.assert_allclose(lp, want_lp, atol=1e-5, rtol=0)
        assert store.stats.read_bytes > 0  # something was really read from the file
        store.close()


def test_one_slot_reads_on_every_miss_and_counts_hits():
    model = load(golden("qwen3_moe"), 0.01)
    store = store_of(model)
    run_greedy(model, n=6)
    stats = store.stats
    assert 0 <= stats.hits < stats.lookups
    assert stats.read_bytes >= (stats.lookups - stats.hits) * sum(s.nbytes for s in store.layers[0].sources.values())
    store.close()


def test_full_residency_streams_nothing():
    model = load(golden("qwen3_moe"), 1.0)
    assert store_of(model) is None


def test_the_reader_reads_ahead_what_the_next_layers_pick():
    """gpt-oss routes every layer; after a few tokens, misses are found already read."""
    model = load(golden("gpt_oss"), 0.25)
    store = store_of(model)
    run_greedy(model, n=16)
    assert store.stats.read_ahead > 0
    store.read_ahead(False)
    before = store.stats.read_ahead
    run_greedy(model, n=4)
    assert store.stats.read_ahead == before
    store.close()


def test_only_experts_routed_in_most_recent_passes_are_guessed():
    """A guess costs a read whether or not it is routed: an expert routed once lately is
    not read ahead, one routed in the last two passes is (decayed counts 1 and 1.8)."""
    model = load(golden("gpt_oss"), 0.25)
    store = store_of(model)
    layer = store.layers[0]
    outside = [e for e in range(layer.num_experts) if layer.slot_of[e] < 0][:2]
    layer.frequency[:] = 0
    layer.frequency[outside[0]] = 1.0
    assert layer.guesses(4) == []
    layer.frequency[outside[1]] = 1.0 + FREQUENCY_DECAY
    assert layer.guesses(4) == [outside[1]]
    store.close()


# gemma4's router reads the block's input h, its experts a norm of h: the guess asks the
# router about the normed input, right but for the norm's per-dimension weights.
ROUTER_SEES_THE_EXPERTS_INPUT = sorted(n for n in FAMILIES if not n.startswith("gemma4"))


@pytest.mark.parametrize("name", ROUTER_SEES_THE_EXPERTS_INPUT)
def test_a_layers_choose_is_its_routers_choice(name):
    """What the store asks of a layer one layer early is what its router then picks."""
    model = load(golden(name), 0.5)
    store = store_of(model)
    assert all(layer.choose is not None for layer in store.layers)
    seen = []
    for layer in store.layers:
        layer.run = _recording(layer, seen)
    run_greedy(model, n=2)
    assert len(seen) >= len(store.layers)
    for layer, x, indices in seen:
        np.testing.assert_array_equal(np.sort(np.array(layer.choose(x)), -1), np.sort(np.array(indices), -1))
    store.close()


def _recording(layer, seen):
    run = layer.run

    def recorded(x, indices):
        seen.append((layer, x, indices))
        return run(x, indices)

    return recorded


def test_the_next_layers_router_guesses_a_step_early(monkeypatch):
    """With guesses by frequency switched off, a decode step still finds misses read ahead:
    the next layer's router was asked about this layer's input. A router whose guesses
    are not right often enough is still asked (and scored) but its guesses are not read."""
    monkeypatch.setattr(expert_store, "GUESS_MIN_RATE", 2.0)  # a rate no expert reaches
    for min_right, reads in ((0.5, True), (2.0, False)):
        monkeypatch.setattr(expert_store, "GUESS_MIN_RIGHT", min_right)
        model = load(golden("gpt_oss"), 0.25)
        store = store_of(model)
        run_greedy(model, n=12)
        stats = store.stats
        assert 0 < stats.router_right <= stats.router_guesses
        assert (stats.read_ahead > 0) is reads, f"needing {min_right} right"
        store.close()


def _second_layer_likes_one_expert_outside_its_slab():
    """gpt-oss streamed at a quarter: (store, first layer, second layer, the expert outside
    the second layer's slab that it routed in every pass lately)."""
    store = store_of(load(golden("gpt_oss"), 0.25))
    first, second = store.layers[0], store.layers[1]
    outside = next(e for e in range(second.num_experts) if second.slot_of[e] < 0)
    second.frequency[:] = 0
    second.frequency[outside] = 5.0
    return store, first, second, outside


def test_frequency_guesses_that_were_wrong_lately_are_scored_but_not_read():
    store, first, second, outside = _second_layer_likes_one_expert_outside_its_slab()
    second.by_frequency.right = 0.2  # but guessed wrong lately
    store.routed(first, np.array([[0]]))
    assert second.index not in store._pending or outside not in store._pending[second.index]
    assert outside in second.by_frequency.pending  # still scored: it can earn its reads back
    store.routed(second, np.array([[outside]]))
    assert second.by_frequency.right == pytest.approx(0.2 * FREQUENCY_DECAY + (1 - FREQUENCY_DECAY))
    assert store.stats.frequency_right == store.stats.frequency_guesses == 1
    store.close()


def test_a_guess_the_pass_does_not_route_counts_as_wasted_bytes():
    store, first, second, outside = _second_layer_likes_one_expert_outside_its_slab()
    store.routed(first, np.array([[0]]))
    guess = store._pending[second.index][outside]
    guess.result(timeout=30)  # read ahead
    store.forget_guesses(second)  # the pass routed elsewhere
    assert store.stats.wasted_bytes == sum(a.nbytes for a in guess.result().values()) > 0
    store.close()


@pytest.mark.parametrize("name", CONVERTED)
def test_mlx_layout_streams_like_resident(name, tmp_path):
    """mlx-lm's layout (stacked, quantized) of the families whose goldens are transformers'."""
    from engine.cli.convert import convert

    folder = tmp_path / name
    convert(str(golden(name)), str(folder), quantize_bits=4, group_size=32)
    want_ids, want_lp = run_greedy(load(folder))
    for fraction in (0.5, 0.01):
        model = load(folder, fraction)
        ids, lp = run_greedy(model)
        assert ids == want_ids
        np.testing.assert_allclose(lp, want_lp, atol=1e-5, rtol=0)
        store_of(model).close()


def test_a_load_cancelled_while_filling_the_slabs_leaves_no_reader():
    import threading

    from engine.runtime.loading import load_model

    class Stop(Exception):
        pass

    def progress(done: int, total: int) -> None:
        if total == 1 and done == 1:  # the slabs' stage: qwen3_moe's one MoE layer
            raise Stop

    with pytest.raises(Stop):
        load_model(golden("qwen3_moe"), resident_experts=0.5, progress=progress)
    assert not [t for t in threading.enumerate() if t.name.startswith("expert-reader")]


def test_a_prefill_reads_each_missing_expert_once():
    """A 40-token pass over a one-slot slab needs every expert of the layer, many tokens
    each: each is looked up once and read at most once, not once per token."""
    import mlx.core as mx

    from engine.models.kv_cache import make_prompt_cache

    model = load(golden("qwen3_moe"), 0.01)
    store = store_of(model)
    (layer,) = store.layers
    expert_bytes = sum(s.nbytes for s in layer.sources.values())
    before = (store.stats.lookups, store.stats.read_bytes)
    prompt = mx.array([[(7 * i + 3) % 200 + 3 for i in range(40)]])
    mx.eval(model(prompt, cache=make_prompt_cache(model)))
    lookups, read = store.stats.lookups - before[0], store.stats.read_bytes - before[1]
    assert lookups == layer.num_experts  # 40 tokens x 2 experts, grouped by expert
    # Each read at most once (the one the slot already held not at all).
    assert (layer.num_experts - 1) * expert_bytes <= read <= layer.num_experts * expert_bytes
    store.close()
