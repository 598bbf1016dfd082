"""DFlash block drafters: the published layout loads and drafts exactly as the reference
(tests/golden/make_dflash_goldens.py, written from z-lab's model code, run under torch), the
verified output is the target's (greedy token for token; sampled: its distribution, by
chi-square as test_speculative_sampling.py), and bad drafters are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from dflash_models import drafter_config, make_drafter, write_drafter
from spec_models import make_llama, plain_greedy
from test_speculative_sampling import VOCAB, check, exact_pairs, sample_pairs, target_dist

from engine.api import SamplingParams
from engine.decode.dflash_drafter import DFlashDrafter
from engine.decode.drafters import decoder_for
from engine.decode.sampling import filter_logits
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.errors import EngineError, ModelLoadError
from engine.models.dflash import is_dflash_dir, load_dflash
from engine.models.kv_cache import make_prompt_cache
from engine.runtime.loading import load_model

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "dflash"


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_block_logits_equal_the_reference(name):
    """The target's layers seen through the tap during its prefill, the drafter's context
    rows and one block pass give z-lab's block logits."""
    expected = json.loads((GOLDEN / name / "expected.json").read_text())
    target = load_model(GOLDEN / name / "target").model
    assert is_dflash_dir(GOLDEN / name / "drafter") and not is_dflash_dir(GOLDEN / name / "target")
    draft = load_dflash(GOLDEN / name / "drafter", target)
    drafter = DFlashDrafter(target, draft)
    seen = []

    def pick(logits, recent):
        seen.append(logits)
        return mx.argmax(logits, keepdims=True).astype(mx.uint32), None

    try:
        prompt = expected["prompt"]
        logits = target(mx.array([prompt]), cache=make_prompt_cache(target))[0, -1]
        assert int(mx.argmax(logits).item()) == expected["first"]
        drafts, _ = drafter.propose(prompt + [expected["first"]], drafter.max_draft, pick)
    finally:
        drafter.close()
    assert target.model.layer_tap is None
    want = np.array(expected["block_logits"])
    got = np.array(mx.stack(seen))
    assert got.shape == want.shape == (draft.block_size - 1, target.args.vocab_size)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert np.array(drafts).tolist() == want.argmax(-1).tolist()


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
@pytest.mark.parametrize("k", [1, 3, None])
def test_speculative_greedy_equals_plain_greedy(model_type, k):
    target = make_llama(4, vocab=6, hidden=24, layers=3, sharpen=3.0, model_type=model_type)
    draft = make_drafter(target, layer_ids=(0, 2), block=5, seed=6)  # a seed that drafts some right
    prompt = [3, 5, 1, 2, 4, 3, 5, 1, 2]
    want = plain_greedy(target, prompt, 24)
    stats = StatsCounter()
    drafter = DFlashDrafter(target, draft, k)
    try:
        got = list(
            speculative_step(
                prompt, target, target.make_cache(), drafter, max_tokens=24, stats=stats, num_draft_tokens=k
            )
        )
    finally:
        drafter.close()
    assert [t for t, _ in got] == want
    assert stats.draft_tokens > 0 and 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert target.model.layer_tap is None


def test_the_drafters_context_follows_accepted_tokens_only():
    """After a run, the drafter's context rows equal those of a drafter fed the settled
    text in one prefill: rejected drafts left nothing behind."""
    target = make_llama(4, vocab=12, hidden=24, layers=3, sharpen=3.0, model_type="qwen3")
    draft = make_drafter(target, layer_ids=(0, 2), block=5)
    prompt = [3, 7, 1, 9, 4, 3, 7]
    drafter = DFlashDrafter(target, draft, 4)
    try:
        out = [t for t, _ in speculative_step(prompt, target, target.make_cache(), drafter, max_tokens=12)]
        history = prompt + out
        drafter._add_rows(len(history) - 1)
        rows_after_run = [np.array(c.state[0]) for c in drafter.cache]
    finally:
        drafter.close()
    fresh = DFlashDrafter(target, draft, 4)
    try:
        target(mx.array([history[:-1]]), cache=make_prompt_cache(target))
        fresh._add_rows(len(history) - 1)
        rows_fresh = [np.array(c.state[0]) for c in fresh.cache]
    finally:
        fresh.close()
    assert drafter._held() == fresh._held() == len(history) - 1
    for a, b in zip(rows_after_run, rows_fresh):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution():
    target = make_llama(12, vocab=VOCAB, layers=1, sharpen=4.0, model_type="qwen3")
    # One target layer (the last: read after the final norm); a seed whose drafts the target
    # accepts about half the time, so a wrong rejection rule would show.
    draft = make_drafter(target, layers=1, layer_ids=(0,), block=3, seed=4)
    prompt = [1, 5, 2, 7]
    params = SamplingParams(temperature=1.0)
    drafter = DFlashDrafter(target, draft)  # before the prefill: it follows the target from the start
    try:
        counts, stats = sample_pairs(target, drafter, prompt, params, k=1)
        q_logits = drafter.block_logits(prompt[-1])[0]
    finally:
        drafter.close()
    assert 0.15 < stats.acceptance_rate < 0.9  # both acceptance and rejection paths are exercised
    p = target_dist(target, prompt, params)
    q = np.array(mx.softmax(filter_logits(q_logits.astype(mx.float32), params), axis=-1), dtype=np.float64)
    accept = np.minimum(p, q).sum()
    wrong = np.minimum(p, q) + (1 - accept) * p  # "on rejection, sample from p"
    check(counts, exact_pairs(target, prompt, params), wrong)


# ---- bad input ---------------------------------------------------------------------------


@pytest.fixture
def qwen():
    return make_llama(4, vocab=12, hidden=24, layers=3, model_type="qwen3")


def _one_line(error: Exception) -> str:
    text = str(error)
    assert "\n" not in text
    return text


def test_a_drafter_for_another_target_is_refused(tmp_path, qwen):
    other = make_llama(4, vocab=12, hidden=24, layers=4, model_type="qwen3")
    folder = write_drafter(tmp_path / "d", drafter_config(other, layer_ids=(1, 3)))
    with pytest.raises(ModelLoadError, match="made for a target with 4 layers.*has 3") as e:
        load_dflash(folder, qwen)
    _one_line(e.value)
    wide = make_llama(4, vocab=12, hidden=32, layers=3, model_type="qwen3")
    folder = write_drafter(tmp_path / "w", drafter_config(wide))
    with pytest.raises(ModelLoadError, match="hidden states of size 32.*are 24"):
        load_dflash(folder, qwen)
    bigger = make_llama(4, vocab=20, hidden=24, layers=3, model_type="qwen3")
    folder = write_drafter(tmp_path / "v", drafter_config(bigger))
    with pytest.raises(ModelLoadError, match="vocabulary of 20"):
        load_dflash(folder, qwen)


def test_a_drafter_without_its_mask_token_is_refused(tmp_path, qwen):
    config = drafter_config(qwen)
    del config["dflash_config"]["mask_token_id"]
    folder = write_drafter(tmp_path / "d", config)
    with pytest.raises(ModelLoadError, match="no mask token") as e:
        load_dflash(folder, qwen)
    _one_line(e.value)


def test_a_truncated_drafter_file_is_refused(tmp_path, qwen):
    folder = write_drafter(tmp_path / "d", drafter_config(qwen))
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="damaged or cut short") as e:
        load_dflash(folder, qwen)
    _one_line(e.value)
    shutil.copy(GOLDEN / "qwen3" / "drafter" / "config.json", folder / "config.json")  # weights for another shape
    write_drafter(tmp_path / "ok", drafter_config(qwen))
    shutil.copy(tmp_path / "ok" / "model.safetensors", weights)
    with pytest.raises(ModelLoadError):
        load_dflash(folder, make_llama(4, vocab=64, hidden=32, layers=4, model_type="qwen3"))


def test_a_target_whose_layers_cannot_be_read_is_refused(qwen):
    class Opaque:
        model_type = "opaque"

    with pytest.raises(EngineError, match="DFlash drafting needs a target"):
        DFlashDrafter(Opaque(), make_drafter(qwen))


def test_a_quantized_drafter_loads_and_keeps_plain_greedy(tmp_path):
    """An MLX-quantized drafter (config "quantization", scales beside the packed weights)
    loads as stored and drafts for a target; the output stays plain greedy's."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    target = make_llama(4, vocab=64, hidden=64, layers=2, sharpen=3.0, model_type="qwen3")
    config = {**drafter_config(target, layer_ids=(0, 1), block=5), "quantization": {"group_size": 32, "bits": 4}}
    draft = make_drafter(target, layer_ids=(0, 1), block=5)
    nn.quantize(
        draft,
        group_size=32,
        bits=4,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 32 == 0,
    )
    folder = tmp_path / "q4"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(draft.parameters())))
    loaded = load_dflash(folder, target)
    assert loaded.layers[0].self_attn.q_proj.bits == 4
    prompt = [3, 5, 1, 2, 4, 3, 5, 1, 2]
    want = plain_greedy(target, prompt, 12)
    drafter = DFlashDrafter(target, loaded, 4)
    try:
        got = [t for t, _ in speculative_step(prompt, target, target.make_cache(), drafter, max_tokens=12)]
    finally:
        drafter.close()
    assert got == want


def test_a_drafter_with_denoising_steps_runs_them_and_keeps_plain_greedy():
    target = make_llama(4, vocab=6, hidden=24, layers=3, sharpen=3.0, model_type="llama")
    one = make_drafter(target, layer_ids=(0, 2), block=5, seed=6)
    two = make_drafter(target, layer_ids=(0, 2), block=5, seed=6, denoising_steps=2)
    assert two.args.denoising_steps == 2
    prompt = [3, 5, 1, 2, 4, 3, 5, 1, 2]
    blocks = []
    for draft in (one, two):
        drafter = DFlashDrafter(target, draft, 4)
        try:
            target(mx.array([prompt[:-1]]), cache=make_prompt_cache(target))
            drafter._add_rows(len(prompt) - 1)
            blocks.append(np.array(drafter.block_logits(prompt[-1])))
            got = [t for t, _ in speculative_step(prompt, target, target.make_cache(), drafter, max_tokens=16)]
        finally:
            drafter.close()
        assert got == plain_greedy(target, prompt, 16)
    assert not np.allclose(blocks[0], blocks[1])  # the second pass read the first one's guesses


def test_the_compiled_step_shows_the_drafter_the_same_layers():
    """Plain steps and verify passes through the compiled step hand the tap what the plain
    pass would: the run is plain greedy's and the drafter's context rows equal a plain
    prefill's. A tap naming the last layer (read after the final norm) takes the plain pass."""
    target = make_llama(4, vocab=6, hidden=24, layers=3, sharpen=3.0, model_type="qwen3")
    draft = make_drafter(target, layer_ids=(0, 1), block=5, seed=6)
    prompt = [3, 5, 1, 2, 4, 3, 5, 1, 2]
    want = plain_greedy(target, prompt, 16)
    for compiled in (True, False):
        drafter = DFlashDrafter(target, draft, 3)
        stats = StatsCounter()
        try:
            decoder = decoder_for(target, True)
            assert decoder is not None
            traced = decoder.traces
            got = [
                t
                for t, _ in speculative_step(
                    prompt, target, target.make_cache(), drafter, max_tokens=16, stats=stats, compiled=compiled
                )
            ]
            assert (decoder.traces > traced) is compiled  # the steps went through the traces, or not
            history = prompt + got
            drafter._add_rows(len(history) - 1)
            rows = [np.array(c.state[0]) for c in drafter.cache]
        finally:
            drafter.close()
        assert got == want and stats.accepted_draft_tokens > 0
        fresh = DFlashDrafter(target, draft, 3)
        try:
            target(mx.array([history[:-1]]), cache=make_prompt_cache(target))
            fresh._add_rows(len(history) - 1)
            for a, b in zip(rows, [np.array(c.state[0]) for c in fresh.cache]):
                np.testing.assert_allclose(a, b, atol=1e-5)
        finally:
            fresh.close()
    last = DFlashDrafter(target, make_drafter(target, layer_ids=(0, 2), block=5), 3)
    try:
        cache = make_prompt_cache(target)
        target(mx.array([prompt]), cache=cache)
        assert decoder_for(target, True)(mx.array([1], dtype=mx.uint32), cache) is None
    finally:
        last.close()


def test_an_adapted_target_is_drafted_for_from_its_adapted_layers():
    """With an adapter active on the target (the drafter reads whatever the adapted layers
    compute), the output is the adapted target's greedy output, compiled step or not."""
    from test_speculative_adapters import GOLDEN as ADAPTERS
    from test_speculative_adapters import load_base

    from engine.models import lora as adapters

    target = load_base()
    adapters.mount(target, ADAPTERS / "peft_vo_mlp", name="vo")
    adapters.activate(target, {"vo": 1.0})
    draft = make_drafter(target, layer_ids=(0,), block=5)
    prompt = [1, 7, 42, 99, 3, 64]
    want = plain_greedy(target, prompt, 20)
    for compiled in (True, False):
        drafter = DFlashDrafter(target, draft, 4)
        stats = StatsCounter()
        try:
            got = [
                t
                for t, _ in speculative_step(
                    prompt, target, make_prompt_cache(target), drafter, max_tokens=20, stats=stats, compiled=compiled
                )
            ]
        finally:
            drafter.close()
        assert got == want and stats.draft_tokens > 0
