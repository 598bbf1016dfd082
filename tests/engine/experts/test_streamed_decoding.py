"""Streamed experts under the engine's other decoding paths: continuous batching, speculative
decoding (a verify pass routes several tokens at once) and LoRA adapters (one on the
router changes which experts are read). Each gives the fully resident model's ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from engine.api import GenerationParams
from engine.decode.batch import Batch
from engine.decode.drafters import DraftModelDrafter, NgramDrafter
from engine.decode.loop import generate, stream_generate
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models import lora
from engine.models.kv_cache import make_prompt_cache
from tests.engine.batch_rounds import drive
from tests.engine.experts.moe_folders import PROMPT, golden, load, run_greedy, store_of

PROMPTS = [PROMPT, [4, 8, 15, 16, 23, 42, 99], [7, 3], [50, 51, 52, 53, 54, 55, 56, 57, 58]]


def params(n: int) -> GenerationParams:
    return GenerationParams(max_tokens=n, ignore_eos=True, logprobs=True)


def batched(model, prompts, lengths, starts):
    """Each prompt's result, the i-th joining the batch at round ``starts[i]``."""
    batch = Batch(model)

    def start(i):
        p = params(lengths[i])
        p.prefill_chunk = 4
        return stream_generate(model, None, prompts[i], make_prompt_cache(model), p, batch=batch)

    results = drive(batch, starts, start, limit=300)
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("fraction", [0.5, 0.01])
def test_batched_rows_equal_resident_alone(fraction):
    resident = load(golden("qwen3_moe"))
    streamed = load(golden("qwen3_moe"), fraction)
    lengths = [8, 5, 9, 6]
    got = batched(streamed, PROMPTS, lengths, starts=[0, 0, 2, 4])
    for prompt, n, result in zip(PROMPTS, lengths, got, strict=True):
        want = generate(resident, None, prompt, make_prompt_cache(resident), params(n))
        assert result.token_ids == want.token_ids
        np.testing.assert_allclose(result.token_logprobs, want.token_logprobs, atol=1e-5, rtol=0)
    assert store_of(streamed).stats.read_bytes > 0
    store_of(streamed).close()


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss_mxfp4", "deepseek_v3"])
def test_speculative_verify_passes_equal_resident_greedy(name):
    resident = load(golden(name))
    want, _ = run_greedy(resident, n=16)
    streamed = load(golden(name), 0.25)
    for drafter in (DraftModelDrafter(resident), NgramDrafter(n=2, max_draft=3)):
        stats = StatsCounter()
        cache = make_prompt_cache(streamed)
        got = [
            t
            for t, _ in speculative_step(
                PROMPT, streamed, cache, drafter, max_tokens=16, stats=stats, num_draft_tokens=3
            )
        ]
        assert got == want
    assert stats is not None
    store_of(streamed).close()


def write_adapter(folder, hidden: int, q_out: int, experts: int, layers: int) -> None:
    """mlx-lm LoRA on each layer's q_proj and on the MoE router (mlp.gate)."""
    folder.mkdir()
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": layers,
                "lora_parameters": {"rank": 4, "scale": 8.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "mlp.gate"]},
            }
        )
    )
    rng = np.random.default_rng(3)
    tensors = {}
    for i in range(layers):
        targets = [("self_attn.q_proj", q_out)] + ([("mlp.gate", experts)] if i == 0 else [])
        for path, out in targets:
            tensors[f"model.layers.{i}.{path}.lora_a"] = (rng.standard_normal((hidden, 4)) * 0.5).astype(np.float32)
            tensors[f"model.layers.{i}.{path}.lora_b"] = (rng.standard_normal((4, out)) * 0.5).astype(np.float32)
    save_file(tensors, str(folder / "adapters.safetensors"))


def test_adapter_on_router_and_attention(tmp_path):
    adapter = tmp_path / "adapter"
    write_adapter(adapter, hidden=64, q_out=64, experts=4, layers=2)  # the golden qwen3_moe's shape
    resident = load(golden("qwen3_moe"))
    plain, _ = run_greedy(resident)
    streamed = load(golden("qwen3_moe"), 0.25)
    for model in (resident, streamed):
        lora.mount(model, adapter, "a")
        lora.activate(model, {"a": 1.0})
    want = run_greedy(resident)
    got = run_greedy(streamed)
    assert want[0] != plain  # the adapter changes the output
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=0)
    store_of(streamed).close()


def write_expert_adapter(folder, experts: int = 4, hidden: int = 64, inner: int = 32) -> dict:
    """mlx-lm LoRA on layer 0's stacked experts (``LoRASwitchLinear``: lora_a [E, r, in],
    lora_b [E, out, r]), on gate_proj and down_proj."""
    folder.mkdir()
    keys = ["mlp.switch_mlp.gate_proj", "mlp.switch_mlp.down_proj"]
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {"fine_tune_type": "lora", "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 8.0, "keys": keys}}
        )
    )
    rng = np.random.default_rng(7)
    shapes = {"gate_proj": (hidden, inner), "down_proj": (inner, hidden)}
    tensors = {}
    for proj, (n_in, n_out) in shapes.items():
        p = f"model.layers.0.mlp.switch_mlp.{proj}."
        tensors[p + "lora_a"] = (rng.standard_normal((experts, 4, n_in)) * 0.3).astype(np.float32)
        tensors[p + "lora_b"] = (rng.standard_normal((experts, n_out, 4)) * 0.3).astype(np.float32)
    save_file(tensors, str(folder / "adapters.safetensors"))
    return tensors


def test_adapter_on_the_experts_matches_mlx_lm_and_streams(tmp_path):
    """An adapter on the routed experts themselves: ours equals mlx-lm's LoRASwitchLinear on
    the same model, and the streamed model with it equals the resident one."""
    import mlx.core as mx

    tuner = pytest.importorskip("mlx_lm.tuner.lora")
    tensors = write_expert_adapter(tmp_path / "adapter")
    referee = load(golden("qwen3_moe"))
    plain, _ = run_greedy(referee)
    glu = referee.model.layers[0].mlp.switch_mlp
    for proj in ("gate_proj", "down_proj"):
        a = mx.array(tensors[f"model.layers.0.mlp.switch_mlp.{proj}.lora_a"])
        b = mx.array(tensors[f"model.layers.0.mlp.switch_mlp.{proj}.lora_b"])
        wrapped = tuner.LoRASwitchLinear(a.shape[2], b.shape[1], a.shape[0], r=4, scale=8.0)
        wrapped.linear, wrapped.lora_a, wrapped.lora_b = glu[proj], a, b
        setattr(glu, proj, wrapped)
    want = run_greedy(referee)
    assert want[0] != plain  # the adapter changes the output
    for fraction in (None, 0.5, 0.01):
        model = load(golden("qwen3_moe"), fraction)
        lora.mount(model, tmp_path / "adapter", "experts")
        lora.activate(model, {"experts": 1.0})
        got = run_greedy(model)
        assert got[0] == want[0], fraction
        np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=0)
        if store_of(model) is not None:
            store_of(model).close()
