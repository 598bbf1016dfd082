"""q/k/v and gate/up stacked into one matmul each give the separate layers' results,
hold no weight twice, and step aside while an adapter acts on one of the layers.

Each check runs one model with stacked projections against a second copy of the same
weights that never had them.
"""

from __future__ import annotations

import gc
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from model_goldens import load_golden

from engine.cli.bench import SHAPES
from engine.decode.loop import generate_step
from engine.models import get_family
from engine.models.base import GATE_UP, QKV
from engine.models.kv_cache import make_prompt_cache
from engine.models.lora import activate, deactivate, mount, unmount
from engine.models.stacked import MAX_STACKED_ROWS, stack_projections, stacked_output

PROMPT = [(5 * i + 11) % 89 + 3 for i in range(11)]


def decode(model, n: int = 16, compiled: bool = False):
    pairs = list(
        generate_step(
            mx.array(PROMPT, dtype=mx.uint32),
            model,
            make_prompt_cache(model),
            max_tokens=n,
            logprobs=True,
            compiled=compiled,
        )
    )
    return [t for t, _ in pairs], [lp for _, lp in pairs]


def quantized_tiny(bits: int = 4, **sizes):
    """The bench's tiny llama shape (with ``sizes`` in place of its own), quantized, kept in
    float32 (scales included)."""
    config = dict(SHAPES["tiny"], **sizes)
    family = get_family(config["model_type"])
    mx.random.seed(5)
    model = family.Model(family.ModelArgs.from_dict(config))
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def twins(name: str):
    if name == "quantized":
        return quantized_tiny(), quantized_tiny()
    return load_golden(name)[0], load_golden(name)[0]


def attn_and_mlp(model):
    layer = model.layers[0]
    return layer.self_attn, layer.mlp


def assert_same(a, b):
    (ids_a, lps_a), (ids_b, lps_b) = a, b
    assert ids_a == ids_b
    assert max(abs(x - y) for x, y in zip(lps_a, lps_b)) <= 1e-5


# Plain, attention biases, per-head norms, Gemma's own attention class, quantized layers.
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "gemma2", "quantized"])
def test_stacked_projections_equal_separate_ones(name):
    stacked, plain = twins(name)
    assert stack_projections(stacked) == 2 * len(stacked.layers)
    attn, mlp = attn_and_mlp(stacked)
    x = mx.random.normal((1, 3, stacked.layers[0].input_layernorm.weight.shape[0]))
    assert stacked_output(attn, QKV, x) is not None and stacked_output(mlp, GATE_UP, x) is not None
    # A long prefill chunk runs the layers one by one.
    long = mx.zeros((1, MAX_STACKED_ROWS + 1, x.shape[-1]))
    assert stacked_output(attn, QKV, long) is None and stacked_output(mlp, GATE_UP, long) is None
    reference = decode(plain)
    assert_same(decode(stacked), reference)
    # The compiled step (CPU build too) takes the stacked matmuls as well.
    assert_same(decode(stacked, compiled=True), reference)


def address(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]


def assert_layers_are_views(model):
    """Every stacked layer's arrays lie inside its stack's buffers, one after another."""
    for layer in model.layers:
        for module, names in ((layer.self_attn, QKV), (layer.mlp, GATE_UP)):
            stack = module._stacks.by_names[names]
            for key, whole in stack.stacked.items():
                at = address(whole)
                for name in names:
                    part = getattr(module, name)[key]
                    assert part is stack.views[names.index(name)][key]
                    assert address(part) == at
                    at += part.nbytes
                assert at == address(whole) + whole.nbytes


def test_layers_hold_views_of_the_stacked_arrays_not_copies():
    model = quantized_tiny()
    stack_projections(model)
    assert_layers_are_views(model)
    # Stacking again finds everything in place and builds nothing.
    assert stack_projections(model) == 0


def test_no_weight_is_held_twice():
    model = quantized_tiny()
    weights = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    gc.collect()
    before = mx.get_active_memory()
    stack_projections(model)
    gc.collect()
    # The old buffers are gone; a copy would add about the stacked share of the model.
    # (Other threads of the test run may allocate a little meanwhile.)
    assert mx.get_active_memory() - before < weights // 4


def test_decoding_with_stacks_copies_no_weight():
    # Wide enough that the weights (1.6 MB) dwarf the step's activations, whose peak moves
    # by tens of KB with evaluation order: at the tiny shape's 81 KB the two were close.
    stacked, plain = (quantized_tiny(hidden_size=256, intermediate_size=1024) for _ in range(2))
    stack_projections(stacked)
    weights = sum(a.nbytes for _, a in tree_flatten(plain.parameters()))
    peaks = []
    for model in (plain, stacked):  # warm-up: tracing the compiled step is not decoding
        list(
            generate_step(
                mx.array(PROMPT, dtype=mx.uint32),
                model,
                make_prompt_cache(model),
                max_tokens=2,
                compiled=model is stacked,
            )
        )
    for model in (plain, stacked):
        gc.collect()
        mx.clear_cache()
        start = mx.get_active_memory()
        mx.reset_peak_memory()
        list(
            generate_step(
                mx.array(PROMPT, dtype=mx.uint32),
                model,
                make_prompt_cache(model),
                max_tokens=24,
                compiled=model is stacked,
            )
        )
        peaks.append(mx.get_peak_memory() - start)
    assert_layers_are_views(stacked)
    # Evaluation order moves the peak by a few activations; a second copy of the
    # stacked weights would add most of the model.
    assert peaks[1] - peaks[0] < weights // 2


def write_adapter(folder, model, targets, seed=7):
    weights, key = {}, mx.random.key(seed)
    for i, layer in enumerate(model.layers):
        for path in targets:
            parent, name = path.split(".")
            out_dim = getattr(getattr(layer, parent), name).weight.shape[0]
            in_dim = layer.input_layernorm.weight.shape[0]  # both targets read the hidden state
            key, ka, kb = mx.random.split(key, 3)
            weights[f"model.layers.{i}.{path}.lora_a"] = 0.3 * mx.random.normal((in_dim, 4), key=ka)
            weights[f"model.layers.{i}.{path}.lora_b"] = 0.3 * mx.random.normal((4, out_dim), key=kb)
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": {"rank": 4, "scale": 2.0}}
        )
    )
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)


@pytest.mark.parametrize("name", ["llama", "quantized"])
def test_an_active_adapter_sets_the_stack_aside(tmp_path, name):
    stacked, plain = twins(name)
    stack_projections(stacked)
    write_adapter(tmp_path / "a", stacked, ["self_attn.v_proj", "mlp.up_proj"])
    base = decode(plain)
    for model in (stacked, plain):
        mount(model, tmp_path / "a", name="a")
    attn, mlp = attn_and_mlp(stacked)
    # Mounted but inactive: the layers compute what they did, so the stack still serves.
    assert_same(decode(stacked), base)
    assert stack_projections(stacked) == 0
    for model in (stacked, plain):
        activate(model, {"a": 1.0})
    adapted = decode(plain)
    assert adapted[0] != base[0]
    assert_same(decode(stacked), adapted)
    assert_same(decode(stacked, compiled=True), adapted)
    hidden = stacked.layers[0].input_layernorm.weight.shape[0]
    x = mx.ones((1, 1, hidden))
    assert stacked_output(attn, QKV, x) is None and stacked_output(mlp, GATE_UP, x) is None
    deactivate(stacked)
    assert stacked_output(attn, QKV, x) is not None
    assert_same(decode(stacked, compiled=True), base)
    unmount(stacked, "a")
    assert stacked_output(mlp, GATE_UP, x) is not None
    assert_same(decode(stacked), base)


def test_replaced_weights_unstack_until_restacked():
    stacked, plain = twins("llama")
    stack_projections(stacked)
    attn = stacked.layers[0].self_attn
    hidden = attn.q_proj.weight.shape[1]
    x = mx.ones((1, 1, hidden))
    for model in (stacked, plain):
        model.layers[0].self_attn.k_proj.weight = mx.flip(model.layers[0].self_attn.k_proj.weight, axis=0)
    # The stack no longer matches what k_proj holds: the layers run on their own.
    assert stacked_output(attn, QKV, x) is None
    reference = decode(plain)
    assert_same(decode(stacked), reference)
    assert stack_projections(stacked) == 1
    assert stacked_output(attn, QKV, x) is not None
    assert_same(decode(stacked), reference)


# Expert blocks: gate and up experts as one [experts, 2 * inner, hidden] array. Plain
# SiLU, gpt-oss's biases and clamped gate, Gemma 4's GELU block, DeepSeek's and LFM2's
# routers; and the same quantized.
MOE = ["qwen3_moe", "gpt_oss", "gemma4_text_moe", "deepseek_v3", "lfm2_moe"]


def expert_blocks(model):
    from engine.models.switch import SwitchGLU

    return [m for m in model.modules() if isinstance(m, SwitchGLU)]


def moe_twins(name: str, quantized: bool):
    models = [load_golden(name)[0] for _ in range(2)]
    if quantized:
        for m in models:
            # Layers whose input is not whole groups (some goldens' 16-wide experts) stay float.
            nn.quantize(
                m,
                group_size=32,
                bits=4,
                class_predicate=lambda _, layer: hasattr(layer, "to_quantized") and layer.weight.shape[-1] % 32 == 0,
            )
            mx.eval(m.parameters())
    return models


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("name", MOE)
def test_expert_gate_and_up_stack_and_equal_separate_ones(name, quantized):
    from engine.models.switch import GATE_UP, QuantizedSwitchLinear

    stacked, plain = moe_twins(name, quantized)
    stack_projections(stacked)
    blocks = expert_blocks(stacked)
    assert blocks
    for block in blocks:
        stack = block._stacks.by_names[GATE_UP]
        assert stack.stacked["weight"].shape[1] == 2 * block.gate_proj.weight.shape[1]
        assert isinstance(block.gate_proj, QuantizedSwitchLinear) == quantized
        for key, whole in stack.stacked.items():  # the layers hold views of it: each expert's gate rows, then up
            assert address(block.gate_proj[key]) == address(whole)
            assert address(block.up_proj[key]) == address(whole) + whole.nbytes // (2 * whole.shape[0])
    reference = decode(plain)
    assert_same(decode(stacked), reference)
    # A prompt long enough for the tokens to be sorted by expert takes the stack too.
    long = mx.array([(7 * i + 5) % 89 + 3 for i in range(40)], dtype=mx.uint32)
    a, b = (model(long[None], cache=make_prompt_cache(model))[0, -8:] for model in (stacked, plain))
    assert mx.allclose(a, b, atol=1e-4)


def test_experts_with_their_own_scales_or_streamed_from_disk_do_not_stack():
    from engine.models.switch import GATE_UP, QuantizedSwitchLinear

    model = load_golden("qwen3_moe")[0]
    block = expert_blocks(model)[0]
    block.gate_proj.global_scale = mx.ones((block.gate_proj.weight.shape[0],))
    stack_projections(model)
    assert GATE_UP not in block._stacks.by_names  # an nvfp4 layer's per-expert scale is its own
    assert all(GATE_UP in b._stacks.by_names for b in expert_blocks(model)[1:])
    other = expert_blocks(load_golden("qwen3_moe")[0])[0]
    other.streamed = object()  # set by the expert store: it fills each projection's slots itself
    assert other.stacked_projections == ()
    assert QuantizedSwitchLinear.stacks_along == 1


def test_an_adapter_on_stacked_experts_adds_its_change_to_the_stack(tmp_path):
    """With an adapter active on the gate experts the stack still computes both bases (alone,
    the layers would run on strided views of it, which CUDA's expert products refuse) and
    the adapter's change is added to the gate part: the same as the unstacked twin."""
    from safetensors.numpy import save_file

    from engine.models.switch import GATE_UP

    stacked, plain = moe_twins("qwen3_moe", quantized=False)
    block = expert_blocks(stacked)[0]
    experts, inner, hidden = block.gate_proj.weight.shape
    folder = tmp_path / "experts"
    folder.mkdir()
    keys = ["mlp.switch_mlp.gate_proj"]
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 8.0, "keys": keys}}
        )
    )
    rng = np.random.default_rng(7)
    save_file(
        {
            "model.layers.0.mlp.switch_mlp.gate_proj.lora_a": (rng.standard_normal((experts, 4, hidden)) * 0.3).astype(
                np.float32
            ),
            "model.layers.0.mlp.switch_mlp.gate_proj.lora_b": (rng.standard_normal((experts, inner, 4)) * 0.3).astype(
                np.float32
            ),
        },
        str(folder / "adapters.safetensors"),
    )
    base = decode(plain)
    stack_projections(stacked)
    for model in (stacked, plain):
        mount(model, folder, name="e")
        activate(model, {"e": 1.0})
    adapted = decode(plain)
    assert adapted[0] != base[0]
    stack = block._stacks.by_names[GATE_UP]
    seen = []
    real_call = type(stack).__call__
    type(stack).__call__ = lambda self, *a: seen.append(self) or real_call(self, *a)
    try:
        assert_same(decode(stacked), adapted)
    finally:
        type(stack).__call__ = real_call
    assert any(s is stack for s in seen)  # the adapted block's stack served
    deactivate(stacked)
    assert_same(decode(stacked), base)
