"""A load reads its model's files once: the safetensors headers the memory plan is made from
are the ones ModelInfo is described from (LoadedModel.source), and the plan is made once.

The header reader and the planner are wrapped to count their calls; the loaded model must
still be described exactly as a separate inspection describes it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from engine.artifacts import weights
from engine.runtime import memory, model_info
from engine.runtime.host import ModelHost


@pytest.fixture
def reads(monkeypatch):
    """Header reads by file name, and memory plans made."""
    counts: Counter[str] = Counter()
    read_header, plan_memory = weights.read_header, memory.plan_memory

    def counting_read(file, *args, **kwargs):
        counts[Path(file).name] += 1
        return read_header(file, *args, **kwargs)

    def counting_plan(*args, **kwargs):
        counts["plan"] += 1
        return plan_memory(*args, **kwargs)

    monkeypatch.setattr(weights, "read_header", counting_read)
    monkeypatch.setattr(memory, "plan_memory", counting_plan)
    monkeypatch.setattr(model_info, "plan_memory", counting_plan)
    return counts


def test_a_load_reads_each_header_once_and_plans_once(tiny_model_dir, reads):
    host = ModelHost()
    try:
        host.load(str(tiny_model_dir))
        files = sorted(p.name for p in Path(tiny_model_dir).glob("*.safetensors"))
        assert files and {name: reads[name] for name in files} == {name: 1 for name in files}
        assert reads["plan"] == 1
        loaded_info = host.info
    finally:
        host.unload()
    reads.clear()
    inspected = model_info.inspect_model(str(tiny_model_dir), kv_config=False)
    assert all(reads[name] == 1 for name in files)  # an inspection on its own: one read too
    same = ("name", "family", "parameters", "quantization", "size_on_disk", "context_length")
    assert {k: getattr(loaded_info, k) for k in same} == {k: getattr(inspected, k) for k in same}
    assert dataclasses.asdict(loaded_info.plan)["weights_bytes"] == inspected.plan.weights_bytes
