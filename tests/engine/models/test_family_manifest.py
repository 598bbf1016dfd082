"""The family manifest is the one place a family says it shards and streams its experts:
the sharding module and the expert plan read it, and what it claims is what the tests show.

A change to the manifest alone changes what sharding refuses and whether a model's experts
may be read from disk; every family it says streams has a tiny checkpoint among the
expert-streaming tests' folders (each checked token for token against the resident model).
"""

from __future__ import annotations

import dataclasses
import json
from types import MappingProxyType, SimpleNamespace

import pytest

from engine.api import MemoryPlan
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.models import families, sharding
from engine.runtime import expert_plan
from tests.engine.experts.moe_folders import FAMILIES as STREAMED_FOLDERS
from tests.engine.experts.moe_folders import golden

MOE_ARGS = SimpleNamespace(num_experts=8, num_experts_per_tok=2)


def _with(model_type: str, **change) -> MappingProxyType:
    table = dict(families.FAMILIES)
    table[model_type] = dataclasses.replace(table[model_type], **change)
    return MappingProxyType(table)


def test_sharding_reads_the_manifest(monkeypatch):
    sharding.check_family("llama", "tensor")
    with pytest.raises(UnsupportedModelError, match="gemma3 models do not shard"):
        sharding.check_family("gemma3", "pipeline")
    monkeypatch.setattr(sharding, "FAMILIES", _with("gemma3", shards=("pipeline",)))
    sharding.check_family("gemma3", "pipeline")  # declared in the manifest: now it shards
    assert "gemma3" in sharding.sharding_model_types("pipeline")
    assert "gemma3" not in sharding.sharding_model_types("tensor")
    monkeypatch.setattr(sharding, "FAMILIES", _with("llama", shards=()))
    with pytest.raises(UnsupportedModelError, match="llama models do not shard"):
        sharding.check_family("llama", "tensor")


def _plan() -> MemoryPlan:
    return MemoryPlan(weights_bytes=1000, kv_bytes_per_token=1, budget_bytes=10_000, total_bytes=20_000)


def test_the_expert_plan_reads_the_manifest(monkeypatch):
    assert expert_plan.family_streams_experts("qwen3_moe")
    assert not expert_plan.family_streams_experts("qwen3_vl_moe")  # not yet shown to stream
    assert not expert_plan.family_streams_experts("no_such_family")
    streamed = expert_plan.plan_residency(_plan(), 800, 2, MOE_ARGS, forced=0.5, streams=True)
    assert streamed.experts is not None and streamed.experts.streamed
    with pytest.raises(ModelLoadError, match="does not read its experts from disk"):
        expert_plan.plan_residency(_plan(), 800, 2, MOE_ARGS, forced=0.5, streams=False)
    held = expert_plan.plan_residency(_plan(), 800, 2, MOE_ARGS, forced=None, streams=False)
    assert held.experts is None and held.weights_bytes == 1000  # every expert resident
    monkeypatch.setattr(families, "FAMILIES", _with("qwen3_moe", streams_experts=False))
    assert not expert_plan.family_streams_experts("qwen3_moe")


def test_every_family_said_to_stream_has_a_streamed_checkpoint_under_test():
    tested = set()
    for name in STREAMED_FOLDERS:
        config = golden(name) / "config.json"
        if not config.is_file():
            pytest.skip(f"the golden folder {name} is not in this checkout")
        tested.add(json.loads(config.read_text())["model_type"])
    claimed = {t for t, family in families.FAMILIES.items() if family.streams_experts}
    # A family's multimodal and text-only configs share one module: either one under test covers both.
    modules = {families.FAMILIES[t].module for t in tested}
    assert {t for t in claimed if families.FAMILIES[t].module not in modules} == set()
