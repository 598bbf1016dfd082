"""gpt-oss, SmolLM3 and Ministral 3 beyond greedy parity (which test_families.py checks
for every golden): the compiled decode step, config spellings, the memory plan."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from model_goldens import FAMILIES, GOLDEN, load_golden
from test_compiled_decode import (
    test_compiled_decode_equals_plain_decode as compiled_equals_plain,
)

from engine.artifacts.config import read_config
from engine.models import get_family
from engine.runtime.memory import plan_memory
from engine.runtime.model_info import inspect_model

LAYOUTS = GOLDEN.parent / "mlx_layouts"
NEW = ("gpt_oss", "gpt_oss_published", "ministral3", "mistral3_ministral", "smollm3", "smollm3_interval")


def test_every_new_family_has_goldens_in_both_spellings():
    assert set(NEW) <= set(FAMILIES)
    spellings = {json.loads((GOLDEN / n / "expected.json").read_text())["config_spelling"] for n in NEW}
    assert any(s.startswith("published") for s in spellings) and "transformers 5" in spellings


@pytest.mark.parametrize("name", ["gpt_oss", "ministral3", "smollm3"])
def test_compiled_decode_equals_plain_decode(name):
    """Sinks, the position-scaled queries and NoPE layers all take the compiled step."""
    compiled_equals_plain(name)


def _args(name: str, edit=None):
    config = json.loads((GOLDEN / name / "config.json").read_text())
    if edit is not None:
        edit(config)
    return get_family(config["model_type"]).ModelArgs.from_dict(config)


def test_smollm3_nope_layers_from_the_list_or_the_interval():
    listed = _args("smollm3")
    assert listed.no_rope_layers == [1, 0, 0, 1]
    assert listed.layer_windows() == [None, 8, 8, None]  # NoPE layers slide
    interval = _args("smollm3_interval")
    assert interval.no_rope_layers == [1, 1, 0] and interval.layer_windows() == [None, None, 8]
    off = _args("smollm3", lambda c: c.update(use_sliding_window=False))
    assert off.layer_windows() == [None] * 4


def test_ministral3_reads_the_older_rope_spelling_the_same():
    def legacy(config):
        params = config.pop("rope_parameters")
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params

    model, expected = load_golden("ministral3")
    new, old = _args("ministral3"), _args("ministral3", legacy)
    assert (old.llama_4_scaling_beta, old.original_max_position_embeddings) == (0.3, 8)
    assert old == new
    # Without the setting, no position scale (plain Llama attention).
    plain = _args("ministral3", lambda c: c["rope_parameters"].pop("llama_4_scaling_beta"))
    assert plain.llama_4_scaling_beta is None
    logits = model(mx.array([expected["prompt_ids"]]))
    assert logits.shape == (1, len(expected["prompt_ids"]), 256)


def test_mistral3_wrapper_takes_its_own_tie_setting():
    args = _args("mistral3_ministral")
    assert args.model_type == "ministral3" and args.tie_word_embeddings is False
    assert args.llama_4_scaling_beta == 0.5


def test_gpt_oss_layer_kinds_default_and_given():
    assert _args("gpt_oss").layer_windows() == [None, 8, 8]
    assert _args("gpt_oss_published").layer_windows() == [8, None, 8]  # no layer_types: even layers slide


def test_gpt_oss_memory_plan_counts_full_layers_per_token_and_windows_once():
    config = read_config(GOLDEN / "gpt_oss")
    plan = plan_memory(config, budget=10**9, weights_bytes=1, dtype_bytes=2)
    per_layer = 2 * 2 * 16 * 2  # K and V, 2 KV heads, head_dim 16, bf16; sinks cost nothing
    assert plan.kv_bytes_per_token == per_layer  # one full-attention layer of three
    assert [(w.tokens, w.layers, w.bytes_per_token) for w in plan.kv_windows] == [(8, 2, 2 * per_layer)]


def test_gpt_oss_inspect_counts_every_expert():
    """All experts are resident: weights and parameters count each of them, in every layout."""
    names = ("gpt_oss_hf_mxfp4", "gpt_oss_mlx_mxfp4", "gpt_oss_mlx_bf16")
    infos = {n: inspect_model(LAYOUTS / n, memory_budget=10**9) for n in names}
    assert len({i.parameters for i in infos.values()}) == 1
    args = _args("gpt_oss")
    dense_experts = 3 * args.hidden_size * 64 * 4  # gate, up, down of 4 experts (intermediate 64)
    assert infos["gpt_oss_mlx_bf16"].parameters > 2 * dense_experts
    for name, info in infos.items():
        on_disk = sum(f.stat().st_size for f in (LAYOUTS / name).glob("*.safetensors"))
        assert 0.95 * on_disk < info.plan.weights_bytes <= on_disk, name
    # MXFP4 experts take about a quarter of their bf16 bytes.
    assert infos["gpt_oss_hf_mxfp4"].plan.weights_bytes < 0.65 * infos["gpt_oss_mlx_bf16"].plan.weights_bytes


def test_release_config_reads_as_mxfp4():
    config = read_config(LAYOUTS / "gpt_oss_hf_mxfp4")
    assert config.foreign_quantization is None
    assert (config.quantization.mode, config.quantization.bits, config.quantization.group_size) == ("mxfp4", 4, 32)
    assert Path(LAYOUTS / "gpt_oss_hf_mxfp4" / "model.safetensors").is_file()
