"""The real mlx-lm adapter in ../shared/data/lora (trained on Qwen2.5-0.5B-Instruct).

Its safetensors names say which layers it touches (q_proj and v_proj of layers 20-23). Building
the whole 0.5B model on a CPU is needless here: the test builds a module tree with the real
model's paths and shapes for the attention projections (random weights, Qwen2's q/k/v biases)
and checks that each targeted layer's output changes by exactly scale * (x @ a) @ b.
"""

from __future__ import annotations

import json
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.errors import AdapterError
from engine.models import lora as adapters
from engine.models.lora import LoRAHost

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 896, 14, 2, 64, 24  # Qwen2.5-0.5B


class Attn(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.q_proj = nn.Linear(hidden, HEADS * HEAD_DIM, bias=True)
        self.k_proj = nn.Linear(hidden, KV_HEADS * HEAD_DIM, bias=True)
        self.v_proj = nn.Linear(hidden, KV_HEADS * HEAD_DIM, bias=True)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, hidden, bias=False)


class Layer(nn.Module):
    def __init__(self, hidden: int, with_attention: bool):
        super().__init__()
        if with_attention:
            self.self_attn = Attn(hidden)


class Inner(nn.Module):
    def __init__(self, hidden: int, attention_layers: set[int]):
        super().__init__()
        self.layers = [Layer(hidden, i in attention_layers) for i in range(LAYERS)]


class Skeleton(nn.Module):
    def __init__(self, hidden: int, attention_layers: set[int]):
        super().__init__()
        self.model = Inner(hidden, attention_layers)


@pytest.fixture(scope="module")
def jxbot(shared_data):
    folder = shared_data / "lora" / "qwen2.5-0.5b-instruct_jxbot"
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = dict(mx.load(str(folder / "adapters.safetensors")))
    return folder, config, tensors


def test_real_adapter_changes_each_layer_by_its_low_rank_product(jxbot):
    folder, config, tensors = jxbot
    layers = {int(re.search(r"layers\.(\d+)\.", k)[1]) for k in tensors}
    assert len(layers) == config["num_layers"] == 4
    mx.random.seed(0)
    model = Skeleton(HIDDEN, layers)
    mx.eval(model.parameters())
    base_layers = {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)}

    info = adapters.mount(model, folder, name="jxbot")
    assert info.format == "mlx-lm" and info.kind == "lora" and info.rank == 8
    assert info.base_model == "Qwen2.5-0.5B-Instruct"
    targets = sorted((k.rsplit(".", 1)[0] for k in tensors if k.endswith(".lora_a")), key=lambda p: (len(p), p))
    assert info.targets == targets and len(targets) == 8
    adapters.activate(model, {"jxbot": 1.0})

    scale = config["lora_parameters"]["scale"]
    x = mx.random.normal((2, 3, HIDDEN), key=mx.random.key(1))
    for path in targets:
        host = dict(model.named_modules())[path]
        assert isinstance(host, LoRAHost) and host.base is base_layers[path]
        a, b = tensors[path + ".lora_a"], tensors[path + ".lora_b"]
        change = np.array(host(x) - host.base(x))
        want = np.array(scale * ((x @ a) @ b))
        assert np.abs(want).max() > 1e-3  # a trained adapter: a real change
        np.testing.assert_allclose(change, want, rtol=1e-4, atol=1e-5)
    # Untargeted projections are untouched.
    assert isinstance(model.model.layers[20].self_attn.k_proj, nn.Linear)

    adapters.unmount(model, "jxbot")
    assert all(dict(model.named_modules())[p] is m for p, m in base_layers.items())


def test_real_adapter_refused_on_other_shapes(jxbot):
    folder, _, tensors = jxbot
    model = Skeleton(64, {20, 21, 22, 23})
    with pytest.raises(AdapterError) as err:
        adapters.mount(model, folder)
    text = str(err.value)
    assert "expects q_proj 896->896 but the model has 64->896" in text
    assert "Qwen2.5-0.5B-Instruct?" in text
