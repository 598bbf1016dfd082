"""Latent-attention and sigmoid-routed MoE families (DeepSeek V3 / Kimi K2 / Moonlight,
GLM-4.5 MoE, GLM-4.7 Flash, GLM-5): what the transformers goldens alone do not show.

The greedy ids and log-probs against transformers are checked for every golden folder
by test_families.py; here: the latent cache (what it holds, the absorbed decode against
the expanded prefill, trim, save/load), the DSA indexer really selecting, MTP layers left
out, group-limited routing, memory figures, and loading through the engine's loader.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from model_goldens import FAMILIES, GOLDEN, load_golden

from engine.artifacts.config import config_from_dict
from engine.models import get_family
from engine.models.kv_cache import load_prompt_cache, save_prompt_cache, trim_prompt_cache
from engine.models.mla_cache import MLALatentCache
from engine.models.routed_moe import GroupLimitedRouter
from engine.runtime.memory import kv_bytes_per_token

MLA_GOLDENS = [
    "deepseek_v3",
    "moonlight",
    "kimi_k2",
    "glm4_moe_lite",
    "glm4_moe_lite_published",
    "glm_moe_dsa",
    "glm_moe_dsa_published",
    "glm_moe_dsa_every_layer",
]
ALL_GOLDENS = [*MLA_GOLDENS, "glm4_moe", "glm4_moe_published"]


def last_logits(model, tokens: list[int], cache) -> mx.array:
    return model(mx.array([tokens]), cache=cache)[0, -1]


def test_every_family_has_goldens_in_both_spellings():
    for name in ALL_GOLDENS:
        assert name in FAMILIES, name
    spellings = {json.loads((GOLDEN / n / "expected.json").read_text())["rope_spelling"] for n in ALL_GOLDENS}
    assert spellings == {"rope_parameters", "rope_theta+rope_scaling"}
    assert json.loads((GOLDEN / "kimi_k2" / "config.json").read_text())["model_type"] == "kimi_k2"


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_cache_holds_only_latents_and_rope_keys(name):
    model, expected = load_golden(name)
    args = model.args
    cache = model.make_cache()
    prompt = expected["prompt_ids"]
    last_logits(model, prompt, cache)
    for i, c in enumerate(cache):
        assert isinstance(c, MLALatentCache)
        latent, rope_keys = c.state
        assert latent.shape == (1, 1, len(prompt), args.kv_lora_rank)
        indexer = getattr(args, "has_indexer", lambda _: False)(i)
        width = args.qk_rope_head_dim + (args.index_head_dim if indexer else 0)
        assert rope_keys.shape == (1, 1, len(prompt), width)


@pytest.mark.parametrize("name", MLA_GOLDENS)
def test_absorbed_decode_equals_expanded_prefill(name):
    """Token by token (the latent-space form) gives the logits of one long prefill (the
    expanded form), and a prefill in two chunks the same again."""
    model, expected = load_golden(name)
    prompt = expected["prompt_ids"] + expected["greedy_ids"][:6]
    whole = last_logits(model, prompt, model.make_cache())
    cache = model.make_cache()
    for t in prompt:
        stepwise = last_logits(model, [t], cache)
    cache = model.make_cache()
    last_logits(model, prompt[:12], cache)
    chunked = last_logits(model, prompt[12:], cache)
    assert mx.abs(whole - stepwise).max().item() < 1e-4
    assert mx.abs(whole - chunked).max().item() < 1e-4


@pytest.mark.parametrize("name", ["kimi_k2", "glm_moe_dsa"])
def test_trim_rewinds_and_save_load_round_trips(name, tmp_path):
    model, expected = load_golden(name)
    prompt, more = expected["prompt_ids"], expected["greedy_ids"][:4]
    cache = model.make_cache()
    last_logits(model, prompt, cache)
    first = last_logits(model, more, cache)
    assert trim_prompt_cache(cache, len(more)) == len(more)
    assert cache[0].offset == len(prompt)
    again = last_logits(model, more, cache)
    assert mx.allclose(first, again, atol=1e-5).item()

    trim_prompt_cache(cache, len(more))
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(path, cache)
    loaded, _ = load_prompt_cache(path)
    assert all(isinstance(c, MLALatentCache) for c in loaded)
    assert mx.allclose(first, last_logits(model, more, loaded), atol=1e-5).item()


def test_dsa_indexer_really_selects():
    """The prompt is longer than index_topk: lifting the limit changes the answer."""
    model, expected = load_golden("glm_moe_dsa")
    prompt = expected["prompt_ids"]
    assert len(prompt) > model.args.index_topk
    sparse = last_logits(model, prompt, model.make_cache())
    for layer in model.layers:
        if "indexer" in layer.self_attn:
            layer.self_attn.indexer.topk = 10**6
    dense = last_logits(model, prompt, model.make_cache())
    assert mx.abs(sparse - dense).max().item() > 1e-2


def test_shared_indexer_pattern_from_the_published_spelling():
    config = json.loads((GOLDEN / "glm_moe_dsa_published" / "config.json").read_text())
    assert "indexer_types" not in config
    args = get_family("glm_moe_dsa").ModelArgs.from_dict(config)
    assert args.indexer_types == ["full", "full", "shared", "full"]
    model, _ = load_golden("glm_moe_dsa_published")
    assert ["indexer" in layer.self_attn for layer in model.layers] == [True, True, False, True]


@pytest.mark.parametrize("name", ["moonlight", "kimi_k2", "glm4_moe_published", "glm_moe_dsa_published"])
def test_mtp_layers_are_left_out(name):
    folder = GOLDEN / name
    n_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    stored = mx.load(str(folder / "model.safetensors"))
    assert any(k.startswith(f"model.layers.{n_layers}.") for k in stored)
    model, _ = load_golden(name)  # strict load: nothing left over, nothing missing
    assert len(model.layers) == n_layers
    assert not any(k.startswith(f"model.layers.{n_layers}.") for k in model.sanitize(dict(stored)))


def test_group_limited_routing_keeps_to_the_best_groups():
    class Args:
        n_routed_experts, hidden_size, num_experts_per_tok = 8, 4, 2
        n_group, topk_group, norm_topk_prob, routed_scaling_factor = 4, 1, True, 2.0

    router = GroupLimitedRouter(Args)
    router.weight = mx.zeros((8, 4))
    # Group 2 (experts 4, 5) has the best pair once the correction bias is added, though
    # expert 0 alone scores highest: only group 2's experts may be chosen.
    router.e_score_correction_bias = mx.array([0.9, -0.9, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0])
    chosen, weights = router(mx.ones((1, 4)))
    assert sorted(chosen[0].tolist()) == [4, 5]
    # Weights come from the unbiased sigmoid (0.5 each), renormalised and scaled.
    assert mx.allclose(weights, mx.array([[1.0, 1.0]])).item()


def test_memory_plan_counts_latents_per_token():
    deepseek = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
    }
    assert kv_bytes_per_token(config_from_dict(deepseek), 2) == 61 * (512 + 64) * 2
    glm5 = {
        "model_type": "glm_moe_dsa",
        "num_hidden_layers": 4,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "index_head_dim": 128,
        "indexer_types": ["full", "shared", "shared", "full"],
    }
    assert kv_bytes_per_token(config_from_dict(glm5), 2) == (4 * 576 + 2 * 128) * 2
    glm45 = {
        "model_type": "glm4_moe",
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 4096,
    }
    assert kv_bytes_per_token(config_from_dict(glm45), 2) == 46 * 2 * 8 * 128 * 2


@pytest.mark.parametrize("name", ["kimi_k2", "glm4_moe_published"])
def test_loads_through_the_engine_loader(name):
    from engine.runtime.loading import load_model

    loaded = load_model(GOLDEN / name, dtype="float32", memory_budget=10**9)
    expected = json.loads((GOLDEN / name / "expected.json").read_text())
    cache = loaded.model.make_cache()
    logits = last_logits(loaded.model, expected["prompt_ids"], cache)
    assert int(mx.argmax(logits).item()) == expected["greedy_ids"][0]


MLX_LAYOUTS = GOLDEN.parent / "mlx_layouts"


def _mla_layouts() -> list[str]:
    """This family group's folders (its goldens record the family; others share the folder)."""
    names = []
    for p in sorted(MLX_LAYOUTS.iterdir()):
        if (p / "expected.json").is_file() and "family" in json.loads((p / "expected.json").read_text()):
            names.append(p.name)
    return names


@pytest.mark.parametrize("name", _mla_layouts())
def test_mlx_lm_layout_matches_mlx_lm(name):
    """mlx-lm's 4-bit conversion (split kv_b_proj, stacked experts, quantized layers where
    the file says) loads as it is and decodes as mlx-lm does."""
    from engine.runtime.loading import load_model

    loaded = load_model(MLX_LAYOUTS / name, memory_budget=10**9)
    expected = json.loads((MLX_LAYOUTS / name / "expected.json").read_text())
    model = loaded.model
    cache = model.make_cache()
    logits = last_logits(model, expected["prompt_ids"], cache)
    ids, logprobs = [], []
    for _ in expected["greedy_ids"]:
        lp = logits - mx.logsumexp(logits)
        ids.append(int(mx.argmax(lp).item()))
        logprobs.append(float(lp[ids[-1]].item()))
        logits = last_logits(model, [ids[-1]], cache)
    assert ids == expected["greedy_ids"]
    assert max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"])) < 2e-3


@pytest.mark.parametrize("composed", [False, True])
def test_bench_mla_shape_builds_and_matches_mlx_lm(composed, monkeypatch):
    """The bench's MLA shape (Moonlight's layout at tiny scale) runs, and mlx-lm's
    deepseek_v3 takes its weights as they are and computes the same logits: bit for bit
    through MLX's fused attention call, as mlx-lm makes it; through the composed absorbed
    attention (``mla.composed_latent_attention``), whose bf16 scores are rounded once
    instead of three times, the same tokens from logits a few bf16 steps apart."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

    from engine.cli.bench import SHAPES, build_model, mlx_lm_twin

    monkeypatch.setattr("engine.models.mla.composed_latent_attention", lambda: composed)
    assert SHAPES["moonlight-16b-a3b"]["model_type"] == "deepseek_v3"
    model, config, quantized = build_model("tiny-mla", 4, 32)
    twin = mlx_lm_twin(model, config, quantized)
    ours, theirs = model.make_cache(), mlx_lm_cache(twin)
    # Longer than a verify pass (mla.ABSORB_MAX_QUERIES): a prompt's expanded form, as mlx-lm's.
    prompt = mx.array([[(7 * i + 3) % 250 for i in range(40)]])
    assert mx.array_equal(model(prompt, cache=ours), twin(prompt, cache=theirs)).item()
    for token in (5, 17, 101):
        step = mx.array([[token]])
        mine, peer = model(step, cache=ours), twin(step, cache=theirs)
        if not composed:
            assert mx.array_equal(mine, peer).item()
        else:
            assert mx.argmax(mine).item() == mx.argmax(peer).item()
            assert mx.abs(mine - peer).max().item() < 0.1 and not mx.array_equal(mine, peer).item()


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_compiled_decode_step_equals_the_plain_one(name, monkeypatch):
    """Latent attention, opted in to the compiled decode step (it decodes through the plain
    pass by default), takes it exactly (queries absorbed into the latent space inside the
    traced function); GLM-5's layers, which hand the indexer's choice on, keep the plain pass."""
    from engine.decode.compiled_step import compiled_decoder
    from engine.decode.loop import generate_step
    from engine.models.mla import LatentAttention

    monkeypatch.setattr(LatentAttention, "compiled_decode", True)

    model, expected = load_golden(name)
    assert compiled_decoder(model).prepare()
    prompt = mx.array(expected["prompt_ids"], dtype=mx.uint32)

    def run(compiled):
        pairs = list(generate_step(prompt, model, model.make_cache(), max_tokens=12, logprobs=True, compiled=compiled))
        return [t for t, _ in pairs], [lp for _, lp in pairs]

    plain, fast = run(False), run(True)
    assert plain[0] == fast[0] == expected["greedy_ids"]
    assert max(abs(a - b) for a, b in zip(plain[1], fast[1])) < 1e-5
    dsa, _ = load_golden("glm_moe_dsa")
    assert compiled_decoder(dsa) is None


def test_missing_experts_are_one_clear_error(tmp_path):
    from engine.errors import ModelLoadError
    from engine.runtime.loading import load_model

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text((GOLDEN / "moonlight" / "config.json").read_text())
    weights = mx.load(str(GOLDEN / "moonlight" / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.4.up_proj.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(ModelLoadError, match="lacks 1 of the 6 experts' up_proj.weight in model.layers.2.mlp"):
        load_model(folder, memory_budget=10**9)


def test_other_routing_is_refused_in_one_line():
    from engine.errors import UnsupportedModelError

    config = json.loads((GOLDEN / "moonlight" / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="scoring_func='softmax'"):
        get_family("deepseek_v3").ModelArgs.from_dict({**config, "scoring_func": "softmax"})
