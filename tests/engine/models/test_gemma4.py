"""Gemma 4 beyond the shared golden checks (test_families.py compares every golden
folder, these included, with transformers): KV-shared layers and their caches, the
memory plan, multimodal checkpoints, both config spellings, and mlx-lm's layout."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from model_goldens import GOLDEN, load_golden
from test_families import greedy

from engine.artifacts.config import read_config
from engine.errors import UnsupportedModelError
from engine.models import gemma4
from engine.models.kv_cache import KVCache, RotatingKVCache
from engine.runtime.loading import load_model
from engine.runtime.memory import plan_memory

MLX_GOLDEN = GOLDEN.parent / "gemma4_mlx" / "gemma4_moe_mlx_q4"  # and its siblings


def config_of(name: str) -> dict:
    return json.loads((GOLDEN / name / "config.json").read_text())


def test_the_goldens_cover_both_spellings_and_every_switch():
    text = config_of("gemma4_text_ple")
    assert text["model_type"] == "gemma4_text" and "per_layer_config" in text  # transformers 5's spelling
    published = config_of("gemma4_moe")
    inner = published["text_config"]
    assert published["model_type"] == "gemma4" and "per_layer_config" not in inner
    assert inner["global_head_dim"] == 32 and inner["num_global_key_value_heads"] == 1
    # Each switch off its default somewhere (defaults: transformers' Gemma4TextConfig).
    dense = text
    assert dense["num_kv_shared_layers"] and dense["hidden_size_per_layer_input"] and dense["use_double_wide_mlp"]
    assert dense["attention_bias"] and not dense["tie_word_embeddings"] and dense["hidden_activation"] == "silu"
    assert dense["rope_parameters"]["full_attention"]["factor"] == 2.0
    assert inner["enable_moe_block"] and inner["attention_k_eq_v"] and inner["final_logit_softcapping"] == 30.0
    for cfg in (dense, inner):
        assert cfg["sliding_window"] < 20 and cfg["rms_norm_eps"] != 1e-6 and cfg["vocab_size_per_layer_input"] == 256


@pytest.mark.parametrize("name", ["gemma4_text_ple", "gemma4_ple_published"])
def test_shared_layers_own_no_cache_and_reuse_their_sources(name):
    model, _ = load_golden(name)
    args = model.args
    assert args.first_shared == 3
    assert [args.kv_source(i) for i in range(5)] == [0, 1, 2, 2, 1]  # last earlier layer of the same type
    cache = model.make_cache()
    assert [type(c) for c in cache] == [RotatingKVCache, KVCache, RotatingKVCache]
    for layer in model.layers[3:]:
        assert "k_proj" not in layer.self_attn and "v_proj" not in layer.self_attn
    assert model.layers[3].mlp.gate_proj.weight.shape[0] == 2 * args.intermediate_size  # double-wide
    model(mx.array([list(range(3, 23))]), cache=cache)
    # Global layers keep their own head size (32, against 16 on sliding layers).
    assert cache[1].keys.shape[-1] == 32 and cache[0].keys.shape[-1] == 16
    assert all(c.offset == 20 for c in cache)


def test_global_layers_take_keys_as_values_with_fewer_heads():
    model, _ = load_golden("gemma4_moe")
    full = model.layers[1].self_attn
    assert full.k_is_v and "v_proj" not in full and (full.n_kv_heads, full.head_dim) == (1, 32)
    sliding = model.layers[0].self_attn
    assert not sliding.k_is_v and (sliding.n_kv_heads, sliding.head_dim) == (2, 16)


def test_multimodal_checkpoint_skips_the_towers():
    names = mx.load(str(GOLDEN / "gemma4_moe" / "model.safetensors")).keys()
    assert any(n.startswith("model.vision_tower.") for n in names)
    assert any(n.startswith("model.embed_vision.") for n in names)
    model, _ = load_golden("gemma4_moe")  # strict load: nothing left over, nothing missing
    assert model.model.embed_tokens.weight.shape == (256, 64)


@pytest.mark.parametrize("name", ["gemma4_text_ple", "gemma4_moe"])
def test_input_embeddings_path_matches_ids(name):
    """The vision path hands in embeddings (with the ids, for the per-layer inputs)."""
    model, expected = load_golden(name)
    ids = mx.array([expected["prompt_ids"]])
    plain = model(ids)
    spliced = model(ids, input_embeddings=model.embed(ids))
    assert mx.allclose(plain, spliced, atol=1e-5).item()


def test_media_placeholders_read_the_pad_tokens_per_layer_embedding():
    model, _ = load_golden("gemma4_ple_published")
    stack = model.model
    assert stack.args.media_token_ids  # image/video/audio ids from the wrapper
    stack.args.media_token_ids = [7]
    got = stack.token_per_layer_inputs(mx.array([[7, 9]]))
    want = stack.token_per_layer_inputs(mx.array([[stack.args.pad_token_id, 9]]))
    assert mx.array_equal(got, want).item()


def test_memory_plan_counts_only_layers_that_hold_a_cache():
    # Dense: owners are layers 0 (sliding), 1 (global, head 32) and 2 (sliding); 3 and 4 share.
    plan = plan_memory(read_config(GOLDEN / "gemma4_text_ple"), weights_bytes=1, dtype_bytes=2, budget=10**9)
    assert plan.kv_bytes_per_token == 2 * 2 * 32 * 2  # one global layer: K and V, 2 heads x 32
    [window] = plan.kv_windows
    assert (window.tokens, window.layers, window.bytes_per_token) == (8, 2, 2 * (2 * 2 * 16 * 2))
    # MoE: two global layers with one KV head of 32, one sliding layer with two of 16.
    plan = plan_memory(read_config(GOLDEN / "gemma4_moe"), weights_bytes=1, dtype_bytes=2, budget=10**9)
    assert plan.kv_bytes_per_token == 2 * (2 * 1 * 32 * 2)
    [window] = plan.kv_windows
    assert (window.layers, window.bytes_per_token) == (1, 2 * 2 * 16 * 2)


def test_published_26b_a4b_config_plans_its_real_cache():
    """google/gemma-4-26B-A4B's text settings (from its config.json)."""
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 2816,
        "num_hidden_layers": 30,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_global_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "attention_k_eq_v": True,
        "sliding_window": 1024,
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": True,
        "num_experts": 128,
        "top_k_experts": 8,
        "moe_intermediate_size": 704,
    }
    args = gemma4.ModelArgs.from_dict({"model_type": "gemma4", "text_config": text})
    layers = args.kv_cache_layers()
    assert len(layers) == 30
    assert layers.count((None, 2, 512)) == 5 and layers.count((1024, 8, 256)) == 25


def test_config_edge_cases():
    base = {"model_type": "gemma4_text", "hidden_size": 64, "num_hidden_layers": 7, "num_attention_heads": 4}
    args = gemma4.ModelArgs.from_dict({**base, "hidden_size_per_layer_input": None})
    assert args.hidden_size_per_layer_input == 0
    kinds = args.layer_types  # 5 sliding : 1 global, and the last layer is always global
    assert kinds[5] == kinds[6] == "full_attention" and kinds[:5] == ["sliding_attention"] * 5
    with pytest.raises(UnsupportedModelError, match="embedding model"):
        gemma4.ModelArgs.from_dict({**base, "use_bidirectional_attention": "all"})
    with pytest.raises(UnsupportedModelError, match="share keys and values"):
        gemma4.ModelArgs.from_dict({**base, "num_kv_shared_layers": 7})
    with pytest.raises(UnsupportedModelError, match="one block per layer type"):
        gemma4.ModelArgs.from_dict({**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0}})


def test_proportional_rope_rotates_the_leading_pairs_of_each_half():
    args = gemma4.ModelArgs.from_dict(
        {
            "model_type": "gemma4_text",
            "num_hidden_layers": 1,
            "head_dim": 8,
            "global_head_dim": 8,
            "rope_parameters": {
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0}
            },
        }
    )
    rope = args.rope_for("full_attention", 8)
    x = mx.random.normal((1, 1, 3, 8))
    y = rope(x, offset=5)
    # Pairs (i, i + 4): 0 and 1 rotate, 2 and 3 (features 2, 3, 6, 7) stay.
    assert mx.array_equal(y[..., [2, 3, 6, 7]], x[..., [2, 3, 6, 7]]).item()
    assert not mx.allclose(y[..., [0, 1, 4, 5]], x[..., [0, 1, 4, 5]]).item()


@pytest.mark.parametrize("name", ["gemma4_moe_mlx_q4", "gemma4_e2b_published_mlx_q4"])
def test_mlx_lm_layout_matches_mlx_lm(name):
    """mlx-lm's own 4-bit convert (router kept at 8 bits by its predicate), loaded by the
    engine's loader, gives mlx-lm's own greedy ids and log-probs (both in float32)."""
    folder = MLX_GOLDEN.parent / name
    expected = json.loads((folder / "expected.json").read_text())
    model = load_model(folder, dtype="float32").model
    first = model.layers[0]
    assert first.self_attn.q_proj.bits == 4 and first.mlp.gate_proj.bits == 4
    if first.moe:
        assert first.router.proj.bits == 8 and first.experts.switch_glu.up_proj.bits == 4
    else:
        assert len(model.make_cache()) == 3 and first.per_layer_input_gate.bits == 4
    ids, logprobs = greedy(model, expected["prompt_ids"], len(expected["greedy_ids"]))
    assert ids == expected["greedy_ids"]
    assert max(abs(a - b) for a, b in zip(logprobs, expected["logprobs"])) < 2e-3


def test_compiled_decode_only_for_self_contained_layers():
    """Per-layer inputs and shared keys need the plain pass; the 26B layout takes the
    compiled step, and gives the plain pass's tokens and log-probs."""
    from engine.decode.compiled_step import CompiledDecoder
    from engine.decode.loop import generate_step

    for name in ("gemma4_text_ple", "gemma4_ple_published"):
        assert not CompiledDecoder(load_golden(name)[0]).supported
    model, expected = load_golden("gemma4_moe")
    assert CompiledDecoder(model).supported
    prompt = mx.array(expected["prompt_ids"], dtype=mx.uint32)
    runs = {}
    for compiled in (False, True):
        cache = model.make_cache()
        runs[compiled] = list(generate_step(prompt, model, cache, max_tokens=16, logprobs=True, compiled=compiled))
    assert [t for t, _ in runs[True]] == [t for t, _ in runs[False]]
    assert max(abs(a[1] - b[1]) for a, b in zip(runs[True], runs[False])) <= 1e-5
    assert [t for t, _ in runs[True]][:12] == expected["greedy_ids"]
    # The compiled step itself runs (rather than falling back) and equals the forward pass.
    from engine.decode.compiled_step import compiled_decoder

    a, b = model.make_cache(), model.make_cache()
    model(prompt[None], cache=a)
    model(prompt[None], cache=b)
    decoder = compiled_decoder(model)
    assert decoder is not None and decoder.prepare()
    for token in (5, 9, 11):
        fast = decoder(mx.array([token], dtype=mx.uint32), a)
        assert fast is not None
        assert mx.allclose(fast, model(mx.array([[token]]), cache=b)[:, -1, :], atol=1e-5, rtol=0).item()


def test_registered_model_types():
    from engine.models import get_family

    assert get_family("gemma4") is gemma4 and get_family("gemma4_text") is gemma4
    assert Path(gemma4.__file__).name == "gemma4.py"


def test_thinking_switch_and_markers_of_the_real_template(shared_data):
    from engine.text.chat_template import ChatTemplate
    from engine.text.markers import detect_reasoning_markers
    from engine.text.reasoning_switch import find_reasoning_control

    source = (shared_data / "chat_templates" / "llama.cpp-2026" / "google-gemma-4-31B-it.jinja").read_text()
    template = ChatTemplate(source)
    control = find_reasoning_control(template)
    assert control is not None and (control.variable, control.default) == ("enable_thinking", False)
    hello = [{"role": "user", "content": "Hi"}]
    off = template.render(hello, add_generation_prompt=True)
    on = template.render(hello, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|channel>thought\n<channel|>")  # thinking off: an empty thought block
    assert "<|think|>" in on and on.endswith("<|turn>model\n")
    markers = detect_reasoning_markers(source, on)
    assert markers is not None and not markers.starts_in_reasoning
    splitter = markers.splitter()
    pieces = [
        piece for text in ("<|channel>thou", "ght\nLet me see.<chan", "nel|>Hello!") for piece in splitter.feed(text)
    ] + splitter.flush()
    assert pieces == [("reasoning", "Let me see."), ("answer", "Hello!")]


def test_bench_shape_is_the_published_26b_a4b():
    """Built lazily (nothing is allocated): 25.2B parameters, 3.8B active per token."""
    from mlx.utils import tree_flatten

    from engine.cli.bench import SHAPES

    config = SHAPES["gemma4-26b-a4b"]
    model = gemma4.Model(gemma4.ModelArgs.from_dict(config))
    sizes = dict((k, v.size) for k, v in tree_flatten(model.parameters()))
    total = sum(sizes.values())
    experts = sum(n for k, n in sizes.items() if ".experts." in k)
    active = total - experts + experts * config["top_k_experts"] / config["num_experts"]
    assert round(total / 1e9, 1) == 25.2 and round(active / 1e9, 1) == 3.8


def test_bench_tiny_shape_agrees_with_mlx_lm_on_the_same_weights():
    """The bench's twin is mlx-lm's own gemma4_text holding our weights: same logits."""
    pytest.importorskip("mlx_lm")
    from engine.cli.bench import build_model, mlx_lm_twin

    model, config, quantized = build_model("gemma4-tiny", 16, 64)
    twin = mlx_lm_twin(model, config, quantized)
    model.set_dtype(mx.float32)
    twin.set_dtype(mx.float32)
    prompt = mx.array([[(11 * i + 5) % 500 + 3 for i in range(20)]])  # longer than the window of 8
    ours_cache, their_cache = model.make_cache(), twin.make_cache()
    ours, theirs = model(prompt, cache=ours_cache), twin(prompt, cache=their_cache)
    for token in (7, 99, 300):
        ours = mx.concatenate([ours, model(mx.array([[token]]), cache=ours_cache)], axis=1)
        theirs = mx.concatenate([theirs, twin(mx.array([[token]]), cache=their_cache)], axis=1)
    assert mx.allclose(ours, theirs, atol=1e-4).item()


def test_bench_runs_the_gemma4_shape(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "bench",
            "--shape",
            "gemma4-tiny",
            "--bits",
            "4",
            "-p",
            "16",
            "-g",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["shape"] == "gemma4-tiny" and result["engine"]["generated_tokens"] == 4


def test_inspect_reports_the_towers_the_config_really_has():
    from engine.runtime.model_info import format_inspect, inspect_model

    info = inspect_model(GOLDEN / "gemma4_moe", memory_budget=10**9)
    assert config_of("gemma4_moe")["audio_config"] is None  # written as null: no audio tower
    assert info.family == "gemma4" and info.vision and not info.audio
    report = format_inspect(info)
    assert "KV per token  256 B" in report and "1 layer keeps at most 8 tokens" in report


def test_image_blocks_attend_both_ways_on_sliding_layers_only():
    """transformers' "vision" mode: inside an image's token run the sliding layers look
    both ways; global layers stay causal. (A hook for the vision tower, not yet refereed.)"""
    model, expected = load_golden("gemma4_moe")
    assert not model.bidirectional_media
    model.args.use_bidirectional_attention = "vision"
    assert model.bidirectional_media
    ids = mx.array([expected["prompt_ids"][:12]])
    plain = model(ids)
    blocks = model(ids, bidirectional=[(3, 9)])
    assert mx.allclose(plain[:, :3], blocks[:, :3], atol=1e-6).item()  # before the image: unchanged
    assert not mx.allclose(plain[:, 3:8], blocks[:, 3:8], atol=1e-3).item()  # inside: sees the rest
    # With only global layers there is nothing to change.
    for layer in model.layers:
        layer.window = None
    assert mx.allclose(model(ids), model(ids, bidirectional=[(3, 9)]), atol=1e-6).item()


def test_missing_experts_and_bad_moe_config_are_one_line(tmp_path):
    import shutil

    from engine.errors import ModelLoadError

    folder = tmp_path / "no_experts"
    shutil.copytree(GOLDEN / "gemma4_moe", folder)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(
        str(folder / "model.safetensors"),
        {k: v for k, v in weights.items() if ".experts." not in k},
        metadata={"format": "pt"},
    )
    with pytest.raises(ModelLoadError) as err:
        load_model(folder)
    assert "\n" not in str(err.value) and "experts" in str(err.value)
    config = config_of("gemma4_moe")
    del config["text_config"]["num_experts"]
    with pytest.raises(UnsupportedModelError, match="enable_moe_block needs num_experts"):
        gemma4.ModelArgs.from_dict(config)
