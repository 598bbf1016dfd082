"""Streamed experts never land in memory all at once: MLX's own active and peak memory
(not a computed figure) stay within the non-expert weights plus the slab, through the
load and through generation, on a checkpoint whose experts are ~98% of its bytes."""

from __future__ import annotations

import gc
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import save_file

from engine.runtime.loading import load_model
from tests.engine.experts.moe_folders import run_greedy, store_of

EXPERTS, HIDDEN, INNER, LAYERS = 64, 64, 256, 2
# Arrays a model holds that are not parameters (RoPE frequencies and the like).
NOT_PARAMETERS = 16 << 10


@pytest.fixture(scope="module")
def big_experts(tmp_path_factory):
    """A qwen3_moe checkpoint (transformers' per-expert layout, float32): 25 MB of experts
    beside 0.4 MB of everything else."""
    folder = tmp_path_factory.mktemp("moe")
    config = {
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "num_experts": EXPERTS,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": INNER,
        "norm_topk_prob": True,
        "vocab_size": 256,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    t = {"model.embed_tokens.weight": w(256, HIDDEN), "lm_head.weight": w(256, HIDDEN)}
    t["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN, np.float32)
        t[p + "self_attn.q_norm.weight"] = np.ones(16, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(16, np.float32)
        t[p + "self_attn.q_proj.weight"] = w(64, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = w(32, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = w(32, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = w(HIDDEN, 64)
        t[p + "mlp.gate.weight"] = w(EXPERTS, HIDDEN) * 10
        for e in range(EXPERTS):
            q = f"{p}mlp.experts.{e}."
            t[q + "gate_proj.weight"] = w(INNER, HIDDEN)
            t[q + "up_proj.weight"] = w(INNER, HIDDEN)
            t[q + "down_proj.weight"] = w(HIDDEN, INNER)
    save_file(t, str(folder / "model.safetensors"))
    return folder


def test_resident_expert_bytes_never_exceed_the_slab(big_experts):
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    loaded = load_model(big_experts, resident_experts=0.125)
    model, store = loaded.model, store_of(loaded.model)
    slab = store.slab_bytes
    slab_ids = {id(layer._slab(n)) for layer in store.layers for n in layer.sources}
    rest = sum(a.nbytes for _, a in tree_flatten(model.parameters()) if id(a) not in slab_ids)
    experts_total = loaded.plan.experts.total_bytes
    assert slab == experts_total // 8 and experts_total > 50 * rest
    loaded_bytes = mx.get_active_memory() - base
    assert loaded_bytes <= rest + slab + NOT_PARAMETERS  # measured: what the load left in memory
    for n in (1, 4, 12):
        run_greedy(model, n=n)
        gc.collect()
        assert mx.get_active_memory() - base <= rest + slab + NOT_PARAMETERS  # after generating: the same
    assert store.stats.read_bytes > slab  # experts came and went
    # At no moment, load included, were the experts in memory: at most the slab, one pass's
    # reads and the activations of these tiny passes beside the weights.
    assert mx.get_peak_memory() - base < rest + 3 * slab < experts_total / 2
    store.close()
