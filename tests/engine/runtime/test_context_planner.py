"""The context planner: the chat's hard limit is the least of the model's context, the
user's cap and what the KV cache holds in the budget; it recommends a KV precision and a
context length, and never moves a cap the user set."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.api import GenerationParams, KVWindow, MemoryPlan, SamplingParams
from engine.errors import OutOfMemoryBudget
from engine.runtime.context_planner import USEFUL_TOKENS, advise_context, check_cap, usable_tokens
from engine.runtime.host import ModelHost
from engine.runtime.model_info import format_inspect, inspect_model
from tests.engine.runtime.tiny_folder import make_tiny_model_folder

GB = 10**9
MODEL_CONTEXT = 262_144
KV = 144 * 1024  # bytes per token at full precision (a 4B model's 36 layers x 8 heads x 128 x 2 x bf16 / 2)


def _plan(budget: int, kv_per_token: int = KV, windows: list[KVWindow] | None = None) -> MemoryPlan:
    return MemoryPlan(
        weights_bytes=3 * GB,
        kv_bytes_per_token=kv_per_token,
        budget_bytes=budget,
        total_bytes=64 * GB,
        kv_windows=windows or [],
    )


def _options(budget: int) -> dict:
    # 8-bit g64 keeps ~0.53 of the bytes, 4-bit ~0.28 (engine.models.quantized_kv_cache).
    return {None: _plan(budget), 8: _plan(budget, int(KV * 0.53)), 4: _plan(budget, int(KV * 0.28))}


def test_full_precision_is_recommended_when_it_holds_the_whole_context():
    options = _options(3 * GB + MODEL_CONTEXT * KV + GB)
    advice = advise_context(options[None], options, MODEL_CONTEXT)
    assert (advice.limit, advice.recommended_tokens, advice.recommended_kv_bits) == (MODEL_CONTEXT,) * 2 + (None,)
    assert "Full-precision KV holds the model's whole context (262,144 tokens)" in advice.note


def test_the_highest_precision_that_holds_the_whole_context_is_recommended():
    options = _options(3 * GB + int(MODEL_CONTEXT * KV * 0.6))  # 8-bit fits, full precision does not
    advice = advise_context(options[None], options, MODEL_CONTEXT)
    assert advice.recommended_kv_bits == 8 and advice.recommended_tokens == MODEL_CONTEXT
    # Loaded at full precision, the chat stops where the budget does, not at the model's context.
    assert advice.limit == usable_tokens(options[None]) < MODEL_CONTEXT
    assert advice.limit % 256 == 0 and options[None].kv_bytes(advice.limit) <= options[None].budget_bytes - 3 * GB
    assert "8-bit KV holds the model's whole context" in advice.note
    loaded_at_8 = advise_context(options[8], options, MODEL_CONTEXT)
    assert loaded_at_8.limit == MODEL_CONTEXT and loaded_at_8.note == advice.note


def test_when_nothing_holds_the_whole_context_a_useful_chat_at_the_best_precision_wins():
    # Full precision holds ~20k tokens, 8-bit ~38k (over USEFUL_TOKENS), 4-bit ~72k.
    options = _options(3 * GB + 20_000 * KV)
    advice = advise_context(options[None], options, MODEL_CONTEXT)
    assert advice.recommended_kv_bits == 8
    assert advice.recommended_tokens == usable_tokens(options[8]) >= USEFUL_TOKENS
    assert "Recommended: 8-bit KV" in advice.note and "full precision holds" in advice.note
    # Tighter still: no precision holds a useful chat, so the one that holds the most.
    tight = _options(3 * GB + 5_000 * KV)
    advice = advise_context(tight[None], tight, MODEL_CONTEXT)
    assert advice.recommended_kv_bits == 4 and advice.recommended_tokens == usable_tokens(tight[4])


def test_a_user_cap_is_the_target_and_is_never_moved():
    options = _options(3 * GB + 20_000 * KV)
    advice = advise_context(options[None], options, MODEL_CONTEXT, cap=16_384)
    assert advice.cap == 16_384 and advice.limit == 16_384
    assert advice.recommended_kv_bits is None and advice.recommended_tokens == 16_384
    assert "your context cap" in advice.note
    check_cap(16_384, options[None], options, "m")  # fits: nothing raised
    with pytest.raises(OutOfMemoryBudget, match=r"A 65,536-token context on m needs .*Lower the context length to "):
        check_cap(65_536, options[None], options, "m")
    with pytest.raises(OutOfMemoryBudget, match="hold the KV cache at 4 bits"):
        check_cap(65_536, options[None], options, "m")


def test_a_cache_that_stops_growing_has_no_memory_limit():
    windowed = _plan(4 * GB, kv_per_token=0, windows=[KVWindow(tokens=4096, layers=4, bytes_per_token=KV)])
    advice = advise_context(windowed, {None: windowed}, 0)
    assert advice.limit == 0 and advice.recommended_tokens == 0
    assert "any context length fits" in advice.note


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model_folder(tmp_path_factory.mktemp("plan") / "tiny")


def _budget_for(folder, tokens: int) -> int:
    plan = inspect_model(folder).plan
    return plan.weights_bytes + plan.kv_bytes(tokens)


def test_a_session_stops_where_the_budget_does(folder):
    """With a budget that holds ~300 tokens of KV, a chat stops there (finish reason
    "length"), a longer prompt is refused with both numbers, and inspect says the same."""
    budget = _budget_for(folder, 300)
    host = ModelHost()
    info = host.load(str(folder), budget=budget)
    limit = info.context_advice.limit
    assert 256 <= limit <= 300 < info.context_length
    params = GenerationParams(max_tokens=10_000, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    result = host.generate_ids([1] * 40, params)
    assert result.finish_reason == "length" and 40 + len(result.token_ids) == limit
    with pytest.raises(Exception, match=f"{limit:,}"):
        host.generate_ids([1] * (limit + 10), params)
    report = format_inspect(inspect_model(folder, memory_budget=budget))
    assert f"max context   {limit:,} tokens" in report and "recommended   " in report


def test_a_cap_the_budget_cannot_hold_is_refused_before_the_loaded_model_goes(folder):
    host = ModelHost()
    host.load(str(folder))
    with pytest.raises(OutOfMemoryBudget, match="Lower the context length to"):
        host.load(str(folder), budget=_budget_for(folder, 300), context_cap=1000)
    assert host.info is not None  # still loaded
    info = host.load(str(folder), context_cap=200)
    assert info.context_advice.limit == 200 and info.context_advice.cap == 200


def test_cli_context_length(folder, tmp_path):
    run = [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--prompt-ids", "1,2,3"]
    ok = subprocess.run(
        [*run, "--max-tokens", "500", "--ignore-eos", "--context-length", "64", "--json"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "length" and result["generated_tokens"] == 64 - 3
    budget = str(_budget_for(folder, 300))
    bad = subprocess.run([*run, "--context-length", "1000", "--memory-budget", budget], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("error: A 1,000-token context") and "Lower the context length" in bad.stderr
