"""Mounted adapters against PEFT's own logits (tests/golden/make_adapter_goldens.py made them)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.models import lora as adapters
from engine.models.lora import LoRAHost

# golden case -> {adapter: multiplier}; PEFT order for "dora_kg+qv" put DoRA first (see the script)
CASES = {
    "qv": {"qv": 1.0},
    "vo_mlp": {"vo_mlp": 1.0},
    "dora_kg": {"dora_kg": 1.0},
    "qv+vo_mlp": {"qv": 1.0, "vo_mlp": 1.0},
    "dora_kg+qv": {"dora_kg": 1.0, "qv": 1.0},
    "qv@0.5": {"qv": 0.5},
}


def logits(model, prompt) -> np.ndarray:
    out = model(prompt)
    mx.eval(out)
    return np.array(out[0])


def mount_all_peft(model, golden_dir):
    for name in ("qv", "vo_mlp", "dora_kg"):
        adapters.mount(model, golden_dir / f"peft_{name}", name=name)


def test_base_model_matches_transformers(tiny_llama, prompt, golden_logits):
    np.testing.assert_allclose(logits(tiny_llama, prompt), np.array(golden_logits["none"]), atol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapters_match_peft(tiny_llama, prompt, golden_logits, golden_dir, case):
    mount_all_peft(tiny_llama, golden_dir)
    adapters.activate(tiny_llama, CASES[case])
    got = logits(tiny_llama, prompt)
    want = np.array(golden_logits[case])
    assert np.abs(want - np.array(golden_logits["none"])).max() > 1e-2  # the case is not a no-op
    np.testing.assert_allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("fmt_name, case", [("mlxlm_qv", "qv"), ("mlxlm_dora_kg", "dora_kg")])
def test_mlxlm_format_matches_peft(tiny_llama, prompt, golden_logits, golden_dir, fmt_name, case):
    info = adapters.mount(tiny_llama, golden_dir / fmt_name)
    assert info.format == "mlx-lm" and info.name == fmt_name
    assert info.kind == ("dora" if "dora" in case else "lora")
    adapters.activate(tiny_llama, {fmt_name: 1.0})
    np.testing.assert_allclose(logits(tiny_llama, prompt), np.array(golden_logits[case]), atol=1e-4)


def test_deactivate_and_unmount_return_exactly_to_base(tiny_llama, prompt, golden_dir):
    base = logits(tiny_llama, prompt)
    originals = {p: m for p, m in tiny_llama.named_modules() if isinstance(m, nn.Linear)}
    mount_all_peft(tiny_llama, golden_dir)
    # Mounted but inactive: exactly the base computation.
    np.testing.assert_array_equal(logits(tiny_llama, prompt), base)
    adapters.activate(tiny_llama, {"qv": 1.0, "dora_kg": 0.7, "vo_mlp": 2.0})
    assert not np.array_equal(logits(tiny_llama, prompt), base)
    adapters.deactivate(tiny_llama)
    np.testing.assert_array_equal(logits(tiny_llama, prompt), base)
    adapters.activate(tiny_llama, {"qv": 1.0, "vo_mlp": 1.0})
    adapters.deactivate(tiny_llama, ["qv"])
    assert adapters.active_adapters(tiny_llama) == {"vo_mlp": 1.0}
    for name in ("qv", "vo_mlp", "dora_kg"):
        adapters.unmount(tiny_llama, name)
    assert not [m for _, m in tiny_llama.named_modules() if isinstance(m, LoRAHost)]
    after = {p: m for p, m in tiny_llama.named_modules() if isinstance(m, nn.Linear)}
    assert after.keys() == originals.keys()
    assert all(after[p] is originals[p] for p in originals)  # the very same layer objects
    np.testing.assert_array_equal(logits(tiny_llama, prompt), base)


def test_unmount_one_keeps_the_others(tiny_llama, prompt, golden_logits, golden_dir):
    mount_all_peft(tiny_llama, golden_dir)
    adapters.activate(tiny_llama, {"qv": 1.0, "vo_mlp": 1.0})
    adapters.unmount(tiny_llama, "vo_mlp")
    assert adapters.active_adapters(tiny_llama) == {"qv": 1.0}
    np.testing.assert_allclose(logits(tiny_llama, prompt), np.array(golden_logits["qv"]), atol=1e-4)
    # k_proj only had dora_kg; v_proj still hosts qv and dora_kg.
    attn = tiny_llama.model.layers[0].self_attn
    assert isinstance(attn.v_proj, LoRAHost) and sorted(attn.v_proj.adapter_names) == ["dora_kg", "qv"]
    assert isinstance(tiny_llama.model.layers[0].mlp.up_proj, nn.Linear)


def test_signature_tracks_active_set(tiny_llama, golden_dir, tmp_path):
    assert adapters.active_signature(tiny_llama) == ""
    mount_all_peft(tiny_llama, golden_dir)
    assert adapters.active_signature(tiny_llama) == ""
    adapters.activate(tiny_llama, {"qv": 1.0, "vo_mlp": 1.0})
    both = adapters.active_signature(tiny_llama)
    adapters.activate(tiny_llama, {"vo_mlp": 1.0, "qv": 1.0})
    assert adapters.active_signature(tiny_llama) == both  # order of the request does not matter
    adapters.activate(tiny_llama, {"qv": 1.0, "vo_mlp": 0.5})
    assert adapters.active_signature(tiny_llama) not in ("", both)
    adapters.activate(tiny_llama, {"qv": 1.0, "vo_mlp": 0.0})  # zero changes nothing
    adapters.activate(tiny_llama, {"qv": 1.0})
    only_qv = adapters.active_signature(tiny_llama)
    adapters.activate(tiny_llama, {"qv": 1.0, "vo_mlp": 0.0})
    assert adapters.active_signature(tiny_llama) == only_qv
    # Different weights under the same name give a different signature.
    adapters.unmount(tiny_llama, "qv")
    adapters.mount(tiny_llama, golden_dir / "mlxlm_dora_kg", name="qv")
    adapters.activate(tiny_llama, {"qv": 1.0})
    assert adapters.active_signature(tiny_llama) != only_qv


def test_quantized_base_stays_quantized(tiny_llama, golden_dir):
    nn.quantize(tiny_llama, group_size=32, bits=8)
    q_before = tiny_llama.model.layers[1].self_attn.q_proj
    assert isinstance(q_before, nn.QuantizedLinear)
    adapters.mount(tiny_llama, golden_dir / "mlxlm_qv", name="qv")
    adapters.mount(tiny_llama, golden_dir / "mlxlm_dora_kg", name="dora")
    host = tiny_llama.model.layers[1].self_attn.q_proj
    assert isinstance(host, LoRAHost) and host.base is q_before
    x = mx.random.normal((1, 5, 64), key=mx.random.key(3))
    lora = dict(mx.load(str(golden_dir / "mlxlm_qv" / "adapters.safetensors")))
    a = lora["model.layers.1.self_attn.q_proj.lora_a"]
    b = lora["model.layers.1.self_attn.q_proj.lora_b"]
    adapters.activate(tiny_llama, {"qv": 1.0})
    want = q_before(x) + 4.0 * ((x @ a) @ b)
    np.testing.assert_allclose(np.array(host(x)), np.array(want), rtol=1e-5, atol=1e-5)

    # DoRA over a quantized layer normalises against the dequantized weight.
    k_host = tiny_llama.model.layers[1].self_attn.k_proj
    dora = dict(mx.load(str(golden_dir / "mlxlm_dora_kg" / "adapters.safetensors")))
    pre = "model.layers.1.self_attn.k_proj"
    qk = k_host.base
    w = mx.dequantize(qk.weight, qk.scales, qk.biases, group_size=32, bits=8)
    adapted = w + (dora[pre + ".lora_b"].T @ dora[pre + ".lora_a"].T)
    want = (dora[pre + ".m"] / mx.linalg.norm(adapted, axis=1)) * (x @ adapted.T)
    adapters.activate(tiny_llama, {"dora": 1.0})
    np.testing.assert_allclose(np.array(k_host(x)), np.array(want), rtol=1e-4, atol=1e-5)
    adapters.unmount(tiny_llama, "qv")
    adapters.unmount(tiny_llama, "dora")
    assert tiny_llama.model.layers[1].self_attn.q_proj is q_before


def test_half_precision_model_keeps_its_dtype(tiny_llama, prompt, golden_logits, golden_dir):
    from mlx.utils import tree_map

    tiny_llama.update(tree_map(lambda a: a.astype(mx.bfloat16), tiny_llama.parameters()))
    adapters.mount(tiny_llama, golden_dir / "mlxlm_dora_kg", name="dora")
    adapters.mount(tiny_llama, golden_dir / "peft_qv", name="qv")
    adapters.activate(tiny_llama, {"dora": 1.0, "qv": 1.0})
    out = tiny_llama(prompt)
    assert out.dtype == mx.bfloat16
    got = np.array(out[0].astype(mx.float32))
    want = np.array(golden_logits["dora_kg+qv"])
    shift = np.abs(want - np.array(golden_logits["none"])).max()
    assert np.abs(got - want).max() < 0.1 * shift  # bfloat16 rounding, far below the adapters' effect
