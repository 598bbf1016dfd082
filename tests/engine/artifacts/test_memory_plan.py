"""Memory plans from headers, budget checks and live figures."""

from __future__ import annotations

import os

import pytest
from tiny_checkpoints import WIDE_LLAMA

from engine.api import MemoryPlan
from engine.artifacts.config import read_config
from engine.artifacts.weights import find_weights, read_headers
from engine.errors import OutOfMemoryBudget
from engine.runtime.memory import check_fits, default_budget, live_memory, parse_budget, plan_memory, total_memory


def test_default_budget_is_three_quarters_of_ram_on_this_machine():
    budget, reason = default_budget()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert total_memory() == ram
    assert budget == int(ram * 0.75) and reason.startswith("75% of ") and reason.endswith(" RAM")


def test_plan_counts_packed_weights_and_kv_per_token(checkpoint):
    ckpt = checkpoint(config=WIDE_LLAMA, bits=4, group_size=64)
    headers = read_headers(find_weights(ckpt.path))
    plan = plan_memory(read_config(ckpt.path), headers, budget=10**9)
    files = find_weights(ckpt.path)
    # The files' sizes minus their 8-byte length fields and JSON headers.
    data = sum(os.path.getsize(f) - 8 - int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    assert plan.weights_bytes == data
    # 2 layers x (K + V) x 2 kv heads x 32 dims x 2 bytes
    assert plan.kv_bytes_per_token == 2 * 2 * 2 * 32 * 2
    assert plan.max_context == (10**9 - plan.weights_bytes) // plan.kv_bytes_per_token
    fp32 = plan_memory(read_config(ckpt.path), headers, budget=10**9, dtype_bytes=4)
    assert fp32.kv_bytes_per_token == 2 * plan.kv_bytes_per_token


def test_check_fits_messages():
    plan = MemoryPlan(
        weights_bytes=16_400_000_000, kv_bytes_per_token=131072, budget_bytes=12 * 10**9, total_bytes=16 * 10**9
    )
    with pytest.raises(OutOfMemoryBudget) as err:
        check_fits(plan, name="Qwen3-8B", budget_reason="75% of 16 GB RAM")
    assert str(err.value) == (
        "Qwen3-8B needs 16.4 GB for its weights; the memory budget is 12.0 GB (75% of 16 GB RAM). "
        "Pick a smaller or more quantized model, or raise --memory-budget."
    )
    small = MemoryPlan(
        weights_bytes=4 * 10**9, kv_bytes_per_token=131072, budget_bytes=12 * 10**9, total_bytes=16 * 10**9
    )
    check_fits(small, context_tokens=32768)
    with pytest.raises(OutOfMemoryBudget, match="for a 100,000-token context.*at most 61,035 tokens"):
        check_fits(small, context_tokens=100_000)


def test_parse_budget():
    assert parse_budget("12GB") == 12 * 10**9
    assert parse_budget("800 MB") == 800 * 10**6
    assert parse_budget("1.5g") == 1_500_000_000
    assert parse_budget("4096") == 4096
    with pytest.raises(OutOfMemoryBudget, match="write it like 12GB"):
        parse_budget("lots")


def test_live_memory_reports_mlx_figures():
    figures = live_memory()
    assert set(figures) == {"active", "cache", "peak"}
    assert all(isinstance(v, int) and v >= 0 for v in figures.values())
