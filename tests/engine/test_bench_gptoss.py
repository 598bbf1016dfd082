"""The gpt-oss-20b bench shape: the published dimensions, MXFP4 experts, and mlx-lm's
gpt_oss running the very same weights (checked on the tiny twin of the shape)."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.cli.bench import SHAPES, _ours, _theirs, build_model, mlx_lm_twin
from engine.models import get_family
from engine.models.switch import QuantizedSwitchLinear


def test_gpt_oss_20b_has_the_published_size():
    """21B parameters (3.6B active), as OpenAI's model card says: counted on the lazily
    built model, whose random weights are never materialised."""
    family = get_family("gpt_oss")
    args = family.ModelArgs.from_dict(dict(SHAPES["gpt-oss-20b"]))
    model = family.Model(args)
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 20.8e9 < total < 21.0e9
    experts = sum(v.size for k, v in tree_flatten(model.parameters()) if ".experts." in k)
    embedding = args.vocab_size * args.hidden_size  # a lookup: the model card leaves it out of "active"
    active = total - experts + experts * args.num_experts_per_tok // args.num_local_experts - embedding
    assert 3.55e9 < active < 3.65e9
    assert args.layer_windows()[:4] == [128, None, 128, None]
    assert args.rope_scaling["rope_type"] == "yarn" and args.rope_scaling["factor"] == 32.0


def test_tiny_gpt_oss_bench_model_has_mxfp4_experts_and_matches_mlx_lm():
    model, config, quantized = build_model("tiny-gpt-oss", 16, 64)
    experts = model.layers[0].mlp.experts
    assert isinstance(experts.gate_proj, QuantizedSwitchLinear) and experts.gate_proj.mode == "mxfp4"
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16  # --bits 16: the rest stays bf16
    assert quantized == {p for p in config["quantization"] if p.startswith("model.")}
    twin = mlx_lm_twin(model, config, quantized)
    assert twin.layers[0].mlp.experts.gate_proj.mode == "mxfp4"
    prompt = mx.random.randint(0, 256, (20,), key=mx.random.key(1)).astype(mx.uint32)
    assert list(_ours(model, prompt, 10)) == list(_theirs(twin, prompt, 10))


def test_tiny_gpt_oss_at_4_bits_keeps_mxfp4_experts():
    model, config, _ = build_model("tiny-gpt-oss", 4, 32)
    assert model.layers[1].mlp.experts.down_proj.mode == "mxfp4"
    attn = model.layers[1].self_attn.o_proj
    assert (attn.mode, attn.bits, attn.group_size) == ("affine", 4, 32)
    assert (config["quantization"]["bits"], config["quantization"]["group_size"]) == (4, 32)
