"""Prefix reuse on a real family (llama) with its real KV cache, through ModelHost."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.api import GenerationParams
from engine.runtime.host import ModelHost

PARAMS = GenerationParams(max_tokens=8, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def host(tiny_model_dir) -> ModelHost:
    h = ModelHost()
    h.load(str(tiny_model_dir))
    return h


def _fresh(host: ModelHost, messages) -> object:
    host.drop_session("fresh")
    return host.generate("fresh", messages, PARAMS)


def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_run(host):
    turn1 = [{"role": "user", "content": "Once upon a time"}]
    r1 = host.generate("a", turn1, PARAMS)
    assert r1.stats.cached_tokens == 0
    turn2 = turn1 + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "the quick fox"}]
    r2 = host.generate("a", turn2, PARAMS)
    n2 = len(host.chat_prompt_ids(turn2, add_generation_prompt=True))
    assert r2.stats.prompt_tokens == n2
    assert 0 < r2.stats.cached_tokens < n2
    cache = host.session("a").cache
    assert cache[0].offset == len(host.session("a").ids)
    ref = _fresh(host, turn2)
    assert r2.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(r2.token_logprobs, ref.token_logprobs)) < 1e-4


def test_no_double_bos(host):
    ids = host.chat_prompt_ids([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    bos = host.tokenizer.bos_token_id
    assert ids[0] == bos and ids[1] != bos
    assert host.encode_prompt("hi")[0] == bos  # a plain prompt gets the tokenizer's BOS


def test_eos_union_and_chat_stop(host):
    # generation_config lists </s> and <|im_end|>; both end a turn
    tok = host.tokenizer
    assert {tok.token_to_id("</s>"), tok.token_to_id("<|im_end|>")} <= set(host.eos_token_ids)


def test_edit_trims_and_matches_fresh(host):
    conv = [{"role": "user", "content": "how are you today"}]
    host.generate("b", conv, PARAMS)
    edited = [{"role": "user", "content": "how are you, robot"}]
    r = host.generate("b", edited, PARAMS)
    assert r.stats.cached_tokens > 0
    assert r.token_ids == _fresh(host, edited).token_ids


def test_rotating_cache_past_its_window_is_rebuilt(host):
    from engine.models.kv_cache import RotatingKVCache
    from engine.runtime.session import ChatSession

    model = host.model
    chat = ChatSession(model, host.tokenizer, host.template, eos_token_ids=host.eos_token_ids)
    chat.cache = [RotatingKVCache(max_size=8) for _ in model.layers]
    conv = [{"role": "user", "content": "Once upon a time there was a little robot"}]
    r1 = chat.generate(conv, PARAMS)
    conv2 = [{"role": "user", "content": "Once upon a time there was a cat"}]
    r2 = chat.generate(conv2, GenerationParams(max_tokens=2, ignore_eos=True))
    assert r2.stats.cached_tokens == 0  # rotated past the edit point: rebuilt
    assert len(r1.token_ids) == 8
    mx.eval(chat.cache[0].state)
