"""Paged KV (engine/models/paged_kv.py): the same greedy tokens as the unpaged cache for
every golden model that pages (the others refused in one line), blocks shared between sessions with a common prefix, copy on write for
a regenerate, eviction of idle blocks under the pool's budget.

The referee is the unpaged cache (itself checked against transformers by the family
goldens): each paged reply is compared token for token and log-prob for log-prob with a
fresh unpaged session's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import pytest

from engine.api import GenerationParams
from engine.errors import EngineError
from engine.models import get_family
from engine.models.kv_cache import make_prompt_cache
from engine.models.paged_kv import PagedKVCache, pool_for, sequence_of
from engine.models.quantized_kv_cache import KVQuantization, uniform
from engine.runtime.session import ChatSession

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "models"
PARAMS = GenerationParams(max_tokens=8, ignore_eos=True, logprobs=True)


class Ids:
    """A tokenizer over raw ids (prompts are given as ids): enough for ``stream_ids``."""

    def decode(self, ids, **_):
        return "".join(chr(65 + i % 26) for i in ids)

    def detokenizer(self):
        decode = self.decode

        class Pieces:
            def add(self, i: int) -> str:
                return decode([i])

            def finalize(self) -> str:
                return ""

        return Pieces()


def build(name: str):
    config = json.loads((GOLDEN / name / "config.json").read_text())
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(GOLDEN / name / "model.safetensors")).items()}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    return model


def reply(chat: ChatSession, ids: list[int]):
    result = None
    for item in chat.stream_ids(ids, PARAMS):
        result = item
    return result


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + 3 + salt) % 90 + 4 for i in range(n)]


NOTHING_TO_PAGE = "no full-attention KV cache to page"
LENGTH_DEPENDENT_ROPE = "rotates each position by the length of the pass"
# The golden models that cannot page, and why: latent attention (MLA) keeps its own cache,
# these Mistral, Ministral and Phi-3 checkpoints have a sliding window on every layer, and
# dynamic NTK scaling rotates keys by the length of the pass that computed them.
REFUSED = {
    **dict.fromkeys(
        ["deepseek_v3", "kimi_k2", "moonlight", "glm4_moe_lite", "glm4_moe_lite_published"], NOTHING_TO_PAGE
    ),
    **dict.fromkeys(["glm_moe_dsa", "glm_moe_dsa_every_layer", "glm_moe_dsa_published"], NOTHING_TO_PAGE),
    **dict.fromkeys(["mistral", "ministral3", "mistral3_ministral", "phi3"], NOTHING_TO_PAGE),
    "llama_dynamic": LENGTH_DEPENDENT_ROPE,
}
GOLDEN_MODELS = sorted(p.name for p in GOLDEN.iterdir() if (p / "config.json").is_file())


# Every golden model (each family and its variants): full-attention stacks page and share
# whole prefixes; sliding (gemma2, gemma3), recurrent (qwen3_5, lfm2) and MoE layers keep
# their own caches beside the paged ones; the rest are refused in one line.
@pytest.mark.parametrize("name", GOLDEN_MODELS)
def test_greedy_replies_match_the_unpaged_cache(name):
    model = build(name)
    if name in REFUSED:
        with pytest.raises(EngineError, match=REFUSED[name]):
            pool_for(model, block_size=16)
        return
    plain = ChatSession(model, Ids())
    expected = [reply(plain, prompt(40)), reply(ChatSession(model, Ids()), prompt(40) + [9, 9, 9])]
    pool_for(model, block_size=16)
    try:
        paged = ChatSession(model, Ids())
        first = reply(paged, prompt(40))
        assert any(isinstance(c, PagedKVCache) for c in paged.cache)
        # A second chat branching from the first: its prefix comes from the pool when every
        # layer pages, from its own prefill otherwise; the reply is the same either way.
        second = reply(ChatSession(model, Ids()), prompt(40) + [9, 9, 9])
        follow = reply(paged, prompt(40) + first.token_ids + [5])  # the first chat's next turn
        unpaged_follow = reply(plain, prompt(40) + expected[0].token_ids + [5])
    finally:
        del model.kv_pool
    for got, want in ((first, expected[0]), (second, expected[1]), (follow, unpaged_follow)):
        assert got.token_ids == want.token_ids
        assert got.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-4)


@pytest.mark.long
def test_sessions_sharing_a_prefix_hold_it_once():
    """Eight chats with the same 4k-token system prompt: the paged pool holds it once,
    unpaged chats eight times (MLX's active memory)."""
    model = build("llama")
    system = prompt(4096)
    params = GenerationParams(max_tokens=2, ignore_eos=True)

    def held_by_eight():
        mx.clear_cache()
        before = mx.get_active_memory()
        chats = [ChatSession(model, Ids()) for _ in range(8)]
        for i, chat in enumerate(chats):
            for _ in chat.stream_ids(system + [i + 4] * 3, params):
                pass
        mx.eval([c.state for chat in chats for c in chat.cache])
        mx.clear_cache()
        held = mx.get_active_memory() - before
        stats = getattr(model, "kv_pool", None) and model.kv_pool.stats()
        del chats
        return held, stats

    unpaged, _ = held_by_eight()
    pool = pool_for(model, block_size=64)
    try:
        paged, stats = held_by_eight()
        after = pool.stats()
    finally:
        del model.kv_pool
    one_prefix = 2 * 2 * 4096 * 2 * 16 * 4  # K and V, 2 layers, 4k tokens, 2 heads of 16, float32
    assert unpaged > 7 * one_prefix
    # The prefix once, and each chat's own last block (its 3 tokens and the reply's).
    assert paged < 1.25 * one_prefix, (paged, one_prefix, unpaged, stats)
    assert stats.shared == 4096 // 64 and stats.used == 4096 // 64 + 8
    # The chats are gone: the prefix's published blocks stay cached for the next chat.
    assert after.used == 0 and after.cached == 4096 // 64


def test_a_regenerate_allocates_only_new_blocks():
    model = build("llama")
    pool = pool_for(model, block_size=16)
    try:
        chat = ChatSession(model, Ids())
        ids = prompt(90)
        first = reply(chat, ids)  # 97 tokens held: blocks 0-5 full and published
        before = list(sequence_of(chat.cache).table)
        made = pool._next
        again = reply(chat, ids)  # regenerate: back to 89 tokens, inside block 5
        table = sequence_of(chat.cache).table
        # Blocks 0-4 kept by reference; block 5 copied on write (published, it cannot
        # change), block 6 new: two allocations. The greedy reply is the same, so the
        # copy of block 5 equals the published one and is folded back into it.
        assert pool._next - made == 2
        assert table[:6] == before[:6] and table[5].refs == 1
        assert again.token_ids == first.token_ids
        # The same prompt in another chat (the server's, say) takes blocks 0-4 by
        # reference (89 tokens to keep: 5 whole blocks) and allocates two.
        made = pool._next
        other = ChatSession(model, Ids())
        assert reply(other, ids).token_ids == first.token_ids
        assert pool._next - made == 2
        assert sequence_of(other.cache).table[:6] == table[:6]
        assert pool.stats().shared == 6
    finally:
        del model.kv_pool


def test_idle_blocks_are_evicted_least_recently_used_first():
    model = build("llama")
    pool = pool_for(model, block_size=16)
    try:
        for salt in (1, 2):
            reply(ChatSession(model, Ids()), prompt(64, salt))  # dropped at once: blocks idle
        cached = pool.stats().cached
        assert cached >= 8
        per_block = pool.nbytes // cached
        pool.evict(budget=pool.nbytes - per_block * 4)
        assert pool.stats().cached == cached - 4
        chat = ChatSession(model, Ids())
        reply(chat, prompt(64, 2))  # the later chat's blocks survived
        assert sequence_of(chat.cache).table[0].refs == 1 and pool._next > 0
    finally:
        del model.kv_pool


def test_paged_kv_refuses_what_it_cannot_hold():
    model = build("llama")
    with pytest.raises(EngineError, match="block size"):
        pool_for(model, block_size=48)
    pool_for(model)
    try:
        cache = make_prompt_cache(model)
        with pytest.raises(EngineError, match="one sequence"):
            cache[0].update_and_fetch(mx.zeros((2, 2, 1, 8)), mx.zeros((2, 2, 1, 8)))
    finally:
        del model.kv_pool


def test_embedding_and_diffusion_models_load_unpaged_saying_why_or_are_refused_in_one_line_when_asked():
    from engine.models.paged_kv import CannotPage
    from engine.runtime.host import ModelHost

    host = ModelHost()
    for folder, why in (
        (GOLDEN.parent / "embeddings" / "qwen3_embedding", "embeds text"),
        (GOLDEN.parent / "diffusion_gemma" / "diffusion_gemma_image", "denoising reads"),
    ):
        info = host.load(str(folder), paged_kv_block_size=64, paged_kv_where_possible=True)
        assert why in info.paged_kv_declined
        with pytest.raises(CannotPage, match=why) as refused:
            host.load(str(folder), paged_kv_block_size=64)
        assert "\n" not in str(refused.value)


def test_speculative_decoding_over_paged_caches_matches_plain_decoding():
    """A draft model (another family's tiny model, so many drafts are rejected) over a
    paged target: verify passes write several tokens, rejected ones are trimmed away
    every step, and the reply is the plain one."""
    model, draft = build("qwen3"), build("llama")
    ids = prompt(50)
    want = reply(ChatSession(model, Ids()), ids)
    pool_for(model, block_size=16)
    try:
        chat = ChatSession(model, Ids())
        chat.draft_model = draft
        result = None
        for item in chat.stream_ids(ids, replace(PARAMS, speculative="draft", num_draft_tokens=3)):
            result = item
        assert any(isinstance(c, PagedKVCache) for c in chat.cache)
    finally:
        del model.kv_pool
    assert result.token_ids == want.token_ids
    assert result.stats.draft_tokens > 0


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])  # the compiled step; the hybrid one
def test_the_compiled_decode_step_takes_paged_caches(name):
    """The compiled steps (the GPU's default) decode over paged layers, with the plain
    unpaged pass's tokens and log-probs, across several blocks and view growths."""
    from engine.decode.compiled_hybrid import compiled_decoder  # either step, as decoding picks
    from engine.decode.loop import generate_step

    def decode(cache, compiled: bool):
        steps = generate_step(
            mx.array(prompt(40), dtype=mx.uint32), model, cache, max_tokens=40, logprobs=True, compiled=compiled
        )
        pairs = list(steps)
        return [t for t, _ in pairs], [lp for _, lp in pairs]

    model = build(name)
    want = decode(make_prompt_cache(model), compiled=False)
    pool_for(model, block_size=16)
    try:
        cache = make_prompt_cache(model)
        got = decode(cache, compiled=True)
        assert any(isinstance(c, PagedKVCache) for c in cache)
        decoder = compiled_decoder(model)
        assert decoder is not None and decoder.prepare()
        assert decoder(mx.array([5], dtype=mx.uint32), cache) is not None  # taken, not declined
    finally:
        del model.kv_pool
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1])) <= 1e-5


def test_a_chunked_prefill_never_gathers_the_blocks(monkeypatch):
    """Each chunk evaluates the view and blocks it wrote, not ``state`` (a gathered copy of
    the whole cache per chunk: quadratic in the prompt, 8x slower at 32k on the H200)."""
    from engine.decode.prefill import prefill

    model = build("llama")
    pool_for(model, block_size=16)
    gathered = []
    real = PagedKVCache.held
    monkeypatch.setattr(PagedKVCache, "held", lambda self: gathered.append(self.layer) or real(self))
    try:
        cache = make_prompt_cache(model)
        prefill(model, mx.array(prompt(200), dtype=mx.uint32), cache, chunk=32)
        assert gathered == [] and cache[0].offset == 200
    finally:
        del model.kv_pool
    unpaged = make_prompt_cache(model)
    prefill(model, mx.array(prompt(200), dtype=mx.uint32), unpaged, chunk=32)
    for paged_layer, plain_layer in zip(cache, unpaged, strict=True):
        for got, want in zip(paged_layer.held(), plain_layer.state, strict=True):
            assert mx.allclose(got, want, atol=1e-5).item()


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_request_holds_its_keys_and_values_once(kv_bits):
    """During a request the view alone holds the new tokens (blocks are written when it ends),
    so a long prompt holds as much as the unpaged cache, not a view and blocks; after the
    request the blocks alone hold it (the views and a quantized layer's view cache freed)."""
    from engine.decode.prefill import prefill

    model = build("llama")
    if kv_bits:
        model.kv_quantization = KVQuantization(uniform(kv_bits, 32, len(make_prompt_cache(model))))
    ids = mx.array(prompt(4096), dtype=mx.uint32)

    def held(cache) -> int:
        mx.clear_cache()
        return mx.get_active_memory() - before

    mx.clear_cache()
    before = mx.get_active_memory()
    unpaged = make_prompt_cache(model)
    prefill(model, ids, unpaged, chunk=512)
    mx.eval([c.state for c in unpaged])
    want = held(unpaged)
    del unpaged
    pool_for(model, block_size=64)
    try:
        mx.clear_cache()
        before = mx.get_active_memory()
        cache = make_prompt_cache(model)
        prefill(model, ids, cache, chunk=512)
        during = held(cache)
        sequence = sequence_of(cache)
        sequence.drop_views()
        after = held(cache)
    finally:
        del model.kv_pool
    assert want > 0
    assert during < 1.15 * want, (during, want)
    assert after < 1.15 * want, (after, want)
    assert sequence.view_caches == [None] * len(sequence.view_caches)


def test_a_request_stores_its_new_tokens_in_few_arrays_and_the_next_frees_its_partial_block():
    """A fresh request's end adopts each layer's view as its blocks' storage (no copy); a
    continuing request's end writes a layer's new tokens as one array for its whole blocks
    and one for the partial last block (kv_blocks.Segment), not an array per block, and the
    next request rewrites that block, which frees its array. The blocks read back equal the
    unpaged cache's keys and values."""
    import weakref

    from engine.decode.prefill import prefill

    model = build("llama")
    ids = prompt(170)
    unpaged = make_prompt_cache(model)
    prefill(model, mx.array(ids, dtype=mx.uint32), unpaged, chunk=64)
    pool_for(model, block_size=16)

    def segments(layer: int) -> list[int]:
        return [
            len({id(b.keys[layer][0]) for b in sequence.table}),
            len({id(b.values[layer][0]) for b in sequence.table}),
        ]

    try:
        cache = make_prompt_cache(model)
        sequence = sequence_of(cache)
        for lo, hi in ((0, 100), (100, 140)):
            prefill(model, mx.array(ids[lo:hi], dtype=mx.uint32), cache, chunk=64)
            sequence.drop_views()
        layers = range(sequence.pool.layers)
        # The first request's view (100 tokens, 7 blocks), then blocks 6-7 whole and block 8's 12 tokens.
        assert [segments(layer) for layer in layers] == [[3, 3]] * len(layers)
        first, tail = sequence.table[0].keys[0][0], weakref.ref(sequence.table[8].keys[0][0])
        prefill(model, mx.array(ids[140:], dtype=mx.uint32), cache, chunk=64)
        sequence.drop_views()
        assert tail() is None
        assert [b.keys[0][0] is first for b in sequence.table] == [True] * 6 + [False] * 5
        for paged, plain in zip(cache, unpaged):
            for got, want in zip(paged.state, plain.state):
                assert mx.array_equal(got, want[..., : plain.offset, :])
    finally:
        del model.kv_pool


@pytest.mark.parametrize("name", ["llama_dynamic", "phi3"])
def test_an_edited_chat_on_length_dependent_rope_replies_as_a_fresh_one(name):
    """Not paging, but the reason these models refuse it: past their trained length (16
    tokens here) a key's rotation depends on the pass that computed it. A chat cut back to
    an earlier, shorter prompt (an edited message) must not keep keys from the longer pass;
    it replies exactly as a fresh chat does."""
    model = build(name)
    chat = ChatSession(model, Ids())
    reply(chat, prompt(40))
    edited = reply(chat, prompt(30) + [9])
    fresh = reply(ChatSession(model, Ids()), prompt(30) + [9])
    assert edited.token_ids == fresh.token_ids
    assert edited.token_logprobs == pytest.approx(fresh.token_logprobs, abs=1e-5)


@pytest.mark.parametrize(("name", "bits"), [("llama", 8), ("qwen3", 4), ("gemma3_text", 8)])
def test_quantized_kv_pages_with_the_replies_of_the_unpaged_quantized_cache(name, bits):
    """--kv-bits with --paged-kv: the blocks hold the codes, scales and biases, so paged
    replies equal the unpaged quantized cache's, token for token and log-prob for log-prob,
    through a second chat sharing the prefix, a follow-up turn and a regenerate."""
    from engine.models.paged_kv import PagedQuantizedKVCache

    model = build(name)
    model.kv_quantization = KVQuantization(uniform(bits, 32, len(make_prompt_cache(model))))
    plain = ChatSession(model, Ids())
    want = [reply(plain, prompt(40)), reply(ChatSession(model, Ids()), prompt(40) + [9, 9])]
    want.append(reply(plain, prompt(40) + want[0].token_ids + [5]))
    want.append(reply(plain, prompt(40) + want[0].token_ids + [5]))  # regenerate
    pool = pool_for(model, block_size=16)
    try:
        chat = ChatSession(model, Ids())
        got = [reply(chat, prompt(40))]
        assert any(isinstance(c, PagedQuantizedKVCache) for c in chat.cache)
        got.append(reply(ChatSession(model, Ids()), prompt(40) + [9, 9]))
        got.append(reply(chat, prompt(40) + got[0].token_ids + [5]))
        got.append(reply(chat, prompt(40) + got[0].token_ids + [5]))
        if sequence_of(chat.cache).shareable:  # gemma3's sliding layers keep their own caches
            assert pool.stats().shared or pool.stats().cached  # the prefix's blocks were shared or kept
    finally:
        del model.kv_pool
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.token_logprobs == pytest.approx(w.token_logprobs, abs=1e-4)


def test_a_paged_quantized_cache_decodes_compiled_and_saves_as_the_quantized_cache(tmp_path):
    """The compiled step takes a paged quantized layer (its write and attention run outside
    the traces), and a saved paged quantized cache loads as the plain quantized one."""
    from engine.decode.loop import generate_step
    from engine.models.kv_cache import load_prompt_cache, save_prompt_cache
    from engine.models.quantized_kv_cache import QuantizedKVCache

    model = build("qwen3")
    model.kv_quantization = KVQuantization(uniform(8, 32, len(make_prompt_cache(model))))

    def decode(cache, compiled: bool):
        steps = generate_step(mx.array(prompt(40), dtype=mx.uint32), model, cache, max_tokens=24, compiled=compiled)
        return [t for t, _ in steps]

    want_cache = make_prompt_cache(model)
    want = decode(want_cache, compiled=False)
    pool_for(model, block_size=16)
    try:
        cache = make_prompt_cache(model)
        assert decode(cache, compiled=True) == want
        save_prompt_cache(tmp_path / "chat.safetensors", cache, {})
    finally:
        del model.kv_pool
    loaded, _ = load_prompt_cache(tmp_path / "chat.safetensors")
    assert all(type(c) is QuantizedKVCache for c in loaded)
    for mine, theirs in zip(loaded, want_cache):
        assert mine.offset == theirs.offset
        assert all(mx.array_equal(a, b).item() for a, b in zip(mine.state, theirs.state))
