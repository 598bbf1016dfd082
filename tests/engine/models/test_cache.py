"""KV cache mechanics on hand-made keys whose value is their position."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.decode.batch_cache import BatchKVCache
from engine.errors import EngineError
from engine.models import cache_buffers
from engine.models.cache_buffers import buffer_tokens
from engine.models.kv_cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache


def tokens(start: int, stop: int) -> mx.array:
    """Keys [1, 1, n, 1] holding their own positions."""
    return mx.arange(start, stop, dtype=mx.float32).reshape(1, 1, -1, 1)


def positions(keys: mx.array) -> list[int]:
    return [int(x) for x in keys.reshape(-1).tolist()]


def brute_force_mask(offset: int, key_positions: list[int], n_queries: int, window: int):
    return [[(k <= q and q - k < window) for k in key_positions] for q in range(offset, offset + n_queries)]


def test_plain_cache_grows_in_steps_and_trims():
    c = KVCache(step=4)
    for i in range(5):
        k, _ = c.update_and_fetch(tokens(i, i + 1), tokens(i, i + 1))
    assert positions(k) == [0, 1, 2, 3, 4]
    # A buffer of whole steps of 4 and the decode kernel's pad, grown again only when full,
    # not one buffer per token.
    length = buffer_tokens(1, step=4)
    if length < 5:
        length = buffer_tokens(5, step=4)
    assert c.keys.shape[2] == length
    assert c.nbytes == 2 * length * 4
    assert c.make_mask(1) is None and c.make_mask(3) == "causal"
    assert c.trim(2) == 2 and c.offset == 3
    k, _ = c.update_and_fetch(tokens(10, 12), tokens(10, 12))
    assert positions(k) == [0, 1, 2, 10, 11]
    assert c.trim(99) == 5 and c.offset == 0


def test_keys_and_values_share_one_buffer_that_a_stack_fills_with_one_write():
    c = KVCache(step=4)
    c.update_and_fetch(tokens(0, 3), -tokens(0, 3))  # a prompt's keys and values, apart
    assert c.buffer is not None and c.buffer.shape[0] == 2  # one buffer: [2, B, heads, tokens, dim]
    for i in range(3, 9):  # decode steps, keys and values stacked as the heads kernel gives them
        k, v = c.update_and_fetch_stacked(mx.stack([tokens(i, i + 1), -tokens(i, i + 1)]))
    assert positions(k) == list(range(9)) and positions(v) == [-p for p in range(9)]
    assert c.trim(2) == 2
    k, v = c.update_and_fetch_stacked(mx.stack([tokens(20, 22), -tokens(20, 22)]))
    assert positions(k) == [*range(7), 20, 21] and positions(v) == [0, -1, -2, -3, -4, -5, -6, -20, -21]
    # A state set from outside stays two arrays, written one at a time, until the next growth.
    loaded = KVCache(step=4)
    loaded.state = c.state
    assert loaded.buffer is None and loaded.offset == 9
    k, v = loaded.update_and_fetch_stacked(mx.stack([tokens(30, 31), -tokens(30, 31)]))
    assert positions(k)[-3:] == [20, 21, 30] and positions(v)[-1] == -30
    assert loaded.buffer is not None  # grown: one buffer again
    # Keys and values of different widths (latent attention's) keep two buffers.
    latent = KVCache(step=4)
    k, v = latent.update_and_fetch(tokens(0, 2), mx.zeros((1, 1, 2, 3)))
    assert latent.buffer is None and positions(k) == [0, 1] and v.shape == (1, 1, 2, 3)


def test_a_write_with_its_own_step_grows_a_short_buffer_at_once_and_then_by_that_step(monkeypatch):
    """``write`` (a compiled step's, attention inside): the whole buffer back, a buffer that
    holds less than one of its steps grown at once, and ``capacity_after`` saying so first."""
    monkeypatch.setattr(cache_buffers, "DECODE_KERNEL_PAD", 0)
    c = KVCache(step=4)
    c.update_and_fetch(tokens(0, 5), -tokens(0, 5))  # a prompt: 8 tokens of room
    assert c.capacity_after(1) == 8 and c.capacity_after(1, step=10) == 10
    buffer = c.write(mx.stack([tokens(5, 6), -tokens(5, 6)]), step=10)
    assert buffer is c.buffer and buffer.shape[3] == 10 and c.offset == 6
    assert positions(buffer[0, :, :, :6]) == list(range(6)) and positions(buffer[1, :, :, :6]) == [-p for p in range(6)]
    for i in range(6, 10):  # fits: the same buffer, written in place
        assert c.capacity_after(1, step=10) == 10
        assert c.write((tokens(i, i + 1), -tokens(i, i + 1)), step=10).shape[3] == 10
    assert c.capacity_after(3, step=10) == 20
    buffer = c.write(mx.stack([tokens(10, 13), -tokens(10, 13)]), step=10)
    assert buffer.shape[3] == 20 and positions(buffer[0, :, :, :13]) == list(range(13))
    assert c.capacity_after(1) == 20  # the cache's own step grows nothing that fits


def test_rotating_cache_keeps_exactly_the_window_when_decoding():
    c = RotatingKVCache(max_size=5)
    for i in range(12):
        assert c.make_mask(1) is None
        k, _ = c.update_and_fetch(tokens(i, i + 1), tokens(i, i + 1))
        assert sorted(positions(k)) == list(range(max(0, i - 4), i + 1))
    assert c.offset == 12 and c.keys.shape[2] == 5


def test_rotating_cache_chunks_see_their_window():
    window = 5
    c = RotatingKVCache(max_size=window)
    c.update_and_fetch(tokens(0, 3), tokens(0, 3))
    mask = c.make_mask(6, window)
    k, _ = c.update_and_fetch(tokens(3, 9), tokens(3, 9))
    assert positions(k) == list(range(0, 9))
    assert mask.tolist() == brute_force_mask(3, positions(k), 6, window)
    # Wrap the ring buffer with single steps, then send a chunk again: time order returns.
    for i in range(9, 12):
        c.update_and_fetch(tokens(i, i + 1), tokens(i, i + 1))
    mask = c.make_mask(3, window)
    k, _ = c.update_and_fetch(tokens(12, 15), tokens(12, 15))
    assert positions(k) == list(range(8, 15))
    assert mask.tolist() == brute_force_mask(12, positions(k), 3, window)
    k, _ = c.update_and_fetch(tokens(15, 16), tokens(15, 16))
    assert sorted(positions(k)) == list(range(11, 16))


def test_rotating_cache_keeps_its_first_tokens():
    c = RotatingKVCache(max_size=6, keep=2)
    for i in range(10):
        k, _ = c.update_and_fetch(tokens(i, i + 1), tokens(i, i + 1))
    assert sorted(positions(k)) == [0, 1, 6, 7, 8, 9]
    assert positions(c.state[0]) == [0, 1, 6, 7, 8, 9]  # saved in time order


def test_rotating_cache_trims_only_before_wrapping():
    c = RotatingKVCache(max_size=8)
    c.update_and_fetch(tokens(0, 5), tokens(0, 5))
    c.update_and_fetch(tokens(5, 6), tokens(5, 6))
    assert c.is_trimmable() and c.trim(2) == 2 and c.offset == 4
    k, _ = c.update_and_fetch(tokens(20, 21), tokens(20, 21))
    assert positions(k) == [0, 1, 2, 3, 20]
    c.update_and_fetch(tokens(0, 10), tokens(0, 10))
    assert not c.is_trimmable() and c.trim(1) == 0


def test_save_load_round_trip_of_both_kinds(tmp_path):
    plain, rotating, empty = KVCache(), RotatingKVCache(max_size=4), KVCache()
    plain.update_and_fetch(tokens(0, 6), tokens(0, 6) * 2)
    for i in range(7):
        rotating.update_and_fetch(tokens(i, i + 1), tokens(i, i + 1))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, [plain, rotating, empty], {"conversation": "42"})
    (p, r, e), meta = load_prompt_cache(path)
    assert meta == {"conversation": "42"}
    assert positions(p.state[0]) == list(range(6)) and positions(p.state[1]) == [0, 2, 4, 6, 8, 10]
    assert isinstance(r, RotatingKVCache) and r.max_size == 4 and r.offset == 7
    assert positions(r.state[0]) == [3, 4, 5, 6]
    assert e.offset == 0 and e.state == ()
    k, _ = r.update_and_fetch(tokens(7, 8), tokens(7, 8))
    assert sorted(positions(k)) == [4, 5, 6, 7]


def test_unreadable_cache_file_is_a_readable_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(EngineError, match="Cannot read the prompt cache"):
        load_prompt_cache(bad)
    other = tmp_path / "other.safetensors"
    mx.save_safetensors(str(other), {"x": mx.zeros((1,))})
    with pytest.raises(EngineError, match="not a prompt cache"):
        load_prompt_cache(other)


def test_short_buffers_hold_the_pad_that_picks_the_decode_kernel(monkeypatch):
    """MLX's CUDA attention picks cuDNN for keys sliced from a buffer of whole 256-token
    steps and its vector kernel otherwise; the vector kernel is the faster while rows x
    tokens stay small, so only such buffers are padded past their whole steps."""
    monkeypatch.setattr(cache_buffers, "DECODE_KERNEL_PAD", 8)
    assert buffer_tokens(1) == 256 + 8
    assert buffer_tokens(700, rows=8) == 768 + 8  # 6,144 tokens over the rows
    assert buffer_tokens(1000, rows=8) == 1024  # beyond: whole steps, cuDNN's
    assert buffer_tokens(6000) == 6144 + 8 and buffer_tokens(6145) == 6400

    one = KVCache()
    eight = BatchKVCache()
    for _ in range(8):
        eight.add(None, None)
    one.update_and_fetch(tokens(0, 300), tokens(0, 300))
    keys, _ = eight.update_and_fetch(mx.zeros((8, 1, 700, 1)), mx.zeros((8, 1, 700, 1)))
    assert one.keys.shape[2] == 520 and eight.keys.shape[2] == 776 and keys.shape[2] == 700
    k, _ = one.update_and_fetch(tokens(300, 301), tokens(300, 301))
    assert positions(k) == list(range(301))  # the pad is room past the tokens, never read

    monkeypatch.setattr(cache_buffers, "DECODE_KERNEL_PAD", 0)  # MLX_DESK_CUDNN_DECODE=1
    assert buffer_tokens(1) == 256 and buffer_tokens(700, rows=8) == 768


def test_a_batch_cache_takes_back_what_its_last_steps_wrote_and_writes_there_again():
    batch = BatchKVCache()
    batch.add(tokens(0, 3), tokens(0, 3))
    batch.add(tokens(10, 15), tokens(10, 15))  # the longer row: the first is padded by 2
    assert batch.offset.tolist() == [3, 5]
    for step in range(4):
        batch.update_and_fetch(mx.full((2, 1, 1, 1), 100.0 + step), mx.zeros((2, 1, 1, 1)))
    buffer = batch.buffer
    assert batch.trim(3) == 3 and batch.offset.tolist() == [4, 6]
    keys, _ = batch.update_and_fetch(mx.full((2, 1, 1, 1), 7.0), mx.zeros((2, 1, 1, 1)))
    assert buffer is not None and batch.buffer is buffer  # written in place, not grown
    assert positions(keys[1]) == [10, 11, 12, 13, 14, 100, 7]
    assert positions(keys[0])[2:] == [0, 1, 2, 100, 7]
    # Never past a row's own tokens: the first row holds 5 columns after its padding.
    assert batch.trim(100) == 5 and batch.offset.tolist() == [0, 2]


def test_a_batch_cache_takes_stacked_keys_and_values_in_one_buffer_across_rows_joining_and_leaving():
    batch = BatchKVCache()
    batch.add(tokens(0, 3), -tokens(0, 3))
    batch.add(tokens(10, 12), -tokens(10, 12))  # the shorter row: padded by 1
    keys, values = batch.update_and_fetch_stacked(mx.stack([mx.full((2, 1, 1, 1), 50.0), mx.full((2, 1, 1, 1), -50.0)]))
    assert batch.buffer is not None  # the joined rows grew into one buffer
    assert positions(keys[0]) == [0, 1, 2, 50] and positions(values[1])[1:] == [-10, -11, -50]
    batch.add(tokens(20, 21), -tokens(20, 21))  # a row joins, one leaves: two arrays until the next growth
    assert positions(batch.remove(0)[0]) == [0, 1, 2, 50]
    keys, values = batch.update_and_fetch_stacked(mx.stack([mx.full((2, 1, 1, 1), 60.0), mx.full((2, 1, 1, 1), -60.0)]))
    assert positions(keys[0]) == [10, 11, 50, 60] and positions(values[1])[-2:] == [-20, -60]
