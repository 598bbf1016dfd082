"""The memory plan counts a checkpoint's appended MTP layers only as far as they load.

DeepSeek V3 / GLM-5 load their first MTP layer only when MTP drafting asks for it (the first
--mtp request), never its copies of the embedding and head nor further MTP layers; GLM-4.5
(glm4_moe) loads none. The plan's weights must equal what the loaded model holds, byte for
byte, before and after the MTP layer loads, and inspect gives both figures and what is
stored but not loaded.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.api import GenerationParams, SamplingParams
from engine.errors import OutOfMemoryBudget
from engine.runtime.host import ModelHost
from engine.runtime.loading import load_model
from engine.runtime.model_info import format_inspect, inspect_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "speculative"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_goldens import GOLDEN  # noqa: E402
from test_mtp_deepseek import mtp_weights  # noqa: E402


def held_bytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def folder_with_mtp(tmp_path: Path, name: str, layers: int, dtype=mx.bfloat16) -> Path:
    """The golden folder with ``layers`` complete MTP layers appended, bf16 on disk (or ``dtype``)."""
    src = GOLDEN / name
    dst = tmp_path / name
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(src / "model.safetensors")).items()}
    for i in range(layers):
        extra = mtp_weights(weights, n, config["vocab_size"], config["hidden_size"], seed=i)
        weights.update({k.replace(f"model.layers.{n}.", f"model.layers.{n + i}."): v for k, v in extra.items()})
    config["num_nextn_predict_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dst / "model.safetensors"), {k: v.astype(dtype) for k, v in weights.items()})
    return dst


def with_tokenizer(folder: Path, tokenizer_folder: Path) -> Path:
    """``folder`` with a tokenizer beside the weights, for the host (ids are given as ids)."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / f, folder / f)
    return folder


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_the_plan_counts_the_mtp_layer_only_once_it_loads(tmp_path, name):
    folder = folder_with_mtp(tmp_path, name, layers=2)
    info = inspect_model(folder, memory_budget=1 << 34)
    assert info.plan.mtp_bytes > 0 and not info.plan.mtp_loaded
    loaded = load_model(folder, memory_budget=1 << 34, mtp=True)
    model = loaded.model
    assert "mtp" in model and loaded.plan.mtp_loaded
    assert loaded.plan.weights_bytes == held_bytes(model) == info.plan.weights_bytes + info.plan.mtp_bytes
    assert info.plan.mtp_bytes == held_bytes(model.mtp)
    config = json.loads((folder / "config.json").read_text())
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    # Left out: the second MTP layer whole, and the first's embedding and head copies.
    stored = sum(v.nbytes for v in mx.load(str(folder / "model.safetensors")).values())
    assert info.plan.left_out_bytes == stored - loaded.plan.weights_bytes
    assert info.plan.left_out_bytes > 2 * vocab * hidden * 2
    text = format_inspect(info)
    assert "MTP layer" in text and "loaded only for built-in drafting" in text and "not loaded" in text
    assert "(16.00 bits per weight)" in text  # bf16 on disk: every stored tensor counted alike


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_without_mtp_the_layer_is_not_resident_until_a_request_drafts_with_it(tmp_path, tiny_model_dir, name):
    folder = with_tokenizer(folder_with_mtp(tmp_path, name, layers=1), tiny_model_dir)
    host = ModelHost()
    info = host.load(str(folder), budget=1 << 34)
    plan = info.plan
    assert "mtp" not in host.model and info.mtp  # offered, not loaded
    assert not plan.mtp_loaded and plan.weights_bytes == held_bytes(host.model) and plan.mtp_bytes > 0

    prompt = json.loads((GOLDEN / name / "expected.json").read_text())["prompt_ids"][:20]
    greedy = GenerationParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    plain = host.generate_ids(prompt, greedy)
    assert "mtp" not in host.model  # plain decoding never reads it

    gc.collect()  # earlier tests' garbage must not be freed inside the measurement
    gc.disable()
    try:
        before = mx.get_active_memory()
        drafted = host.generate_ids(prompt, replace(greedy, speculative="mtp", num_draft_tokens=2))
        grown = mx.get_active_memory() - before
    finally:
        gc.enable()
    assert "mtp" in host.model and held_bytes(host.model.mtp) == plan.mtp_bytes
    # Its arrays were read now, not at load: the memory they hold was allocated by this request
    # (less a few hundred bytes the request frees; read at load, it grew by under 1 KB).
    assert grown > 0.9 * plan.mtp_bytes
    assert drafted.token_ids == plain.token_ids and drafted.stats.draft_tokens > 0
    after = host.info.plan
    assert after.mtp_loaded and after.weights_bytes == plan.weights_bytes + plan.mtp_bytes == held_bytes(host.model)


def test_an_mtp_layer_the_budget_cannot_hold_is_refused_in_one_line(tmp_path, tiny_model_dir):
    folder = with_tokenizer(folder_with_mtp(tmp_path, "deepseek_v3", layers=1), tiny_model_dir)
    plan = inspect_model(folder, memory_budget=1 << 34).plan
    host = ModelHost()
    host.load(str(folder), budget=plan.weights_bytes + plan.mtp_bytes // 2)
    params = GenerationParams(max_tokens=2, speculative="mtp", sampling=SamplingParams(temperature=0.0))
    with pytest.raises(OutOfMemoryBudget, match="MTP layer") as refused:
        host.generate_ids([1, 2, 3], params)
    assert "\n" not in str(refused.value) and "mtp" not in host.model
    assert len(host.generate_ids([1, 2, 3], replace(params, speculative=None)).token_ids) == 2


def test_a_family_that_runs_no_mtp_layer_counts_none(tmp_path):
    name = "glm4_moe_published"  # its checkpoint appends part of an MTP layer; glm4_moe leaves it out
    dst = tmp_path / name
    shutil.copytree(GOLDEN / name, dst)
    info = inspect_model(dst, memory_budget=1 << 34)
    model = load_model(dst, memory_budget=1 << 34).model
    assert info.plan.weights_bytes == held_bytes(model)
    assert info.plan.mtp_bytes == 0 and info.plan.left_out_bytes > 0
    assert "MTP layer " not in format_inspect(info)


def test_once_the_mtp_layer_is_read_chats_grow_only_as_far_as_the_kv_cache_still_fits(tmp_path, tiny_model_dir):
    """The budget holds the model's whole 64-token context beside the weights, and 40 tokens
    once the MTP layer is read too: from then on a chat stops at 40. A context cap the
    budget no longer holds with the layer refuses MTP drafting instead (the cap is the user's)."""
    folder = with_tokenizer(folder_with_mtp(tmp_path, "deepseek_v3", layers=1), tiny_model_dir)
    plan = inspect_model(folder, memory_budget=1 << 34).plan
    budget = plan.weights_bytes + plan.mtp_bytes + plan.kv_bytes(40)
    params = GenerationParams(max_tokens=100, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    host = ModelHost()
    assert host.load(str(folder), budget=budget).context_advice.limit == 64
    host.generate_ids([1, 2, 3], params, session_id="before")
    drafted = host.generate_ids([1, 2, 3], replace(params, speculative="mtp", num_draft_tokens=2))
    assert drafted.finish_reason == "length" and 3 + len(drafted.token_ids) == 40
    assert host.info.context_advice.limit == 40 and host.session("before").context_length == 40

    host.load(str(folder), budget=budget, context_cap=60)
    with pytest.raises(OutOfMemoryBudget, match="With its built-in MTP layer .*Lower the context length to 40"):
        host.generate_ids([1, 2, 3], replace(params, speculative="mtp"))
    assert "mtp" not in host.model and host.info.context_advice.limit == 60
