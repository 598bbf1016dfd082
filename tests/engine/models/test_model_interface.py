"""Config spellings, family lookup, multimodal weight names, quantized experts, memory figures."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from model_goldens import GOLDEN, load_golden

from engine.errors import UnsupportedModelError
from engine.models import SUPPORTED, get_family
from engine.models.base import rope_settings
from engine.models.cache_sizes import kv_bytes_per_token, kv_window_bytes
from engine.models.switch import QuantizedSwitchLinear, SwitchGLU, SwitchLinear

PROMPT = [(5 * i + 11) % 120 + 3 for i in range(40)]


def test_unknown_architecture_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError) as err:
        get_family("xyz")
    assert str(err.value) == ("Unsupported architecture 'xyz'. MLX Desk runs: " + ", ".join(sorted(SUPPORTED)) + ".")
    for model_type in SUPPORTED:
        family = get_family(model_type)
        assert hasattr(family, "Model") and hasattr(family.ModelArgs, "from_dict")


def test_both_rope_spellings_read_the_same():
    old = {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    new = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}}
    assert rope_settings(old) == rope_settings(new) == (500000.0, {"factor": 2.0, "rope_type": "linear"})
    assert rope_settings({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}) == (7.0, None)
    assert rope_settings({}) == (10000.0, None)
    nested = {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    }
    assert rope_settings(nested, "sliding_attention") == (1e4, None)
    assert rope_settings(nested) == (1e6, None)


def test_legacy_spelling_of_a_golden_config_gives_the_same_model():
    config = json.loads((GOLDEN / "llama3_rope" / "config.json").read_text())
    legacy = dict(config)
    params = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = params.pop("rope_theta")
    legacy["rope_scaling"] = params
    family = get_family("llama")
    assert family.ModelArgs.from_dict(config) == family.ModelArgs.from_dict(legacy)


def test_unknown_config_keys_are_ignored():
    family = get_family("qwen3")
    args = family.ModelArgs.from_dict(
        {
            "model_type": "qwen3",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_hidden_layers": 1,
            "intermediate_size": 8,
            "no_such_key": 1,
        }
    )
    assert args.hidden_size == 64 and args.head_dim == 128


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_gemma3_multimodal_checkpoint_loads_its_language_model(prefix):
    reference, _ = load_golden("gemma3_text")
    text = json.loads((GOLDEN / "gemma3_text" / "config.json").read_text())
    wrapper = {"model_type": "gemma3", "text_config": text, "vision_config": {"hidden_size": 8}, "image_token_index": 5}
    family = get_family("gemma3")
    model = family.Model(family.ModelArgs.from_dict(wrapper))
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(GOLDEN / "gemma3_text" / "model.safetensors")).items()}
    renamed = {prefix + k[len("model.") :]: v for k, v in weights.items()}
    renamed["vision_tower.vision_model.post_layernorm.weight"] = mx.zeros((8,))
    renamed["multi_modal_projector.mm_input_projection_weight"] = mx.zeros((8, 64))
    model.load_weights(list(model.sanitize(renamed).items()))  # strict: every name must fit
    ids = mx.array([PROMPT[:12]])
    assert mx.allclose(model(ids), reference(ids), atol=1e-5).item()


def test_input_embeddings_replace_token_lookup():
    for name in ("gemma2", "qwen3"):
        model, _ = load_golden(name)
        ids = mx.array([PROMPT[:9]])
        assert mx.allclose(model(ids, input_embeddings=model.embed(ids)), model(ids), atol=1e-6).item()
        assert model.embed_tokens is model.model.embed_tokens and len(model.layers) == model.args.num_hidden_layers


def test_sorted_and_unsorted_expert_paths_agree():
    model, _ = load_golden("qwen3_moe")
    ids = mx.array([PROMPT])  # 40 tokens x 2 experts: enough to sort tokens by expert
    long = model(ids)
    short = model(ids[:, :5])  # 10 routings: the unsorted path
    assert mx.allclose(long[:, :5], short, atol=1e-4).item()


@pytest.mark.parametrize("n_tokens", [3, 50])
def test_quantized_switch_linear_equals_its_dequantized_weights(n_tokens):
    mx.random.seed(0)
    layer = SwitchLinear(64, 32, num_experts=4)
    q = layer.to_quantized(group_size=32, bits=4)
    assert isinstance(q, QuantizedSwitchLinear) and (q.bits, q.group_size) == (4, 32)
    layer.weight = mx.dequantize(q.weight, q.scales, q.biases, group_size=32, bits=4)
    x = mx.random.normal((n_tokens, 64))
    chosen = mx.random.randint(0, 4, (n_tokens, 2))
    glu_plain, glu_quant = SwitchGLU(64, 32, 4), SwitchGLU(64, 32, 4)
    glu_plain.gate_proj = glu_plain.up_proj = layer
    glu_quant.gate_proj = glu_quant.up_proj = q
    glu_quant.down_proj.weight = glu_plain.down_proj.weight
    assert mx.allclose(glu_plain(x, chosen), glu_quant(x, chosen), atol=1e-4).item()


def test_whole_moe_model_quantizes():
    model, _ = load_golden("qwen3_moe")
    ids = mx.array([PROMPT])
    full = model(ids)
    nn.quantize(model, group_size=32, bits=8)
    assert isinstance(model.layers[0].mlp.switch_mlp.gate_proj, QuantizedSwitchLinear)
    quant = model(ids)
    assert mx.abs(quant - full).mean().item() < 0.05
    assert (mx.argmax(quant, -1) == mx.argmax(full, -1)).mean().item() > 0.9


def test_kv_bytes_count_sliding_layers_by_their_window():
    model, _ = load_golden("gemma3_text")  # 4 layers (sliding, full, sliding, full), 2 kv heads x 16, window 8
    per_layer = 2 * 2 * 16 * 2  # K and V, bf16
    assert kv_bytes_per_token(model.args, 2) == 2 * per_layer
    assert kv_window_bytes(model.args, 2) == 2 * 8 * per_layer
    llama, _ = load_golden("llama")
    assert kv_bytes_per_token(llama.args, 2) == 2 * 2 * 2 * 16 * 2
    assert kv_window_bytes(llama.args, 2) == 0


def test_every_golden_runs_in_its_stored_bfloat16():
    for name in ("qwen3_moe", "gemma2", "phi3"):
        config = json.loads((GOLDEN / name / "config.json").read_text())
        family = get_family(config["model_type"])
        model = family.Model(family.ModelArgs.from_dict(config))
        model.load_weights(list(model.sanitize(mx.load(str(GOLDEN / name / "model.safetensors"))).items()))
        cache = model.make_cache()
        model(mx.array([PROMPT[:20]]), cache=cache)
        logits = model(mx.array([[PROMPT[20]]]), cache=cache)
        assert logits.dtype == mx.bfloat16 and cache[0].keys.dtype == mx.bfloat16
        reference, _ = load_golden(name)
        float_logits = reference(mx.array([PROMPT[:21]]))[:, -1]
        assert mx.abs(logits[:, 0].astype(mx.float32) - float_logits).max().item() < 0.25, name
