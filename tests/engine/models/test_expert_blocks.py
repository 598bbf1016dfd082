"""A long pass's (token, expert) pairs in blocks of one expert each (models.expert_blocks).

The layout must put every pair in a block of its own expert, each slot holding at most one
pair, within the block count it promises whatever the routing; and a MoE block that takes
it must give what the pair-by-pair product gives (exactly, on the CPU build, where both run
the same kernels). MLX's CUDA backend takes it by default where experts get enough pairs;
elsewhere it is forced here.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from model_goldens import load_golden

from engine.cli import bench_expert_blocks
from engine.models import expert_blocks
from engine.models import quantized_matmul_cuda as qmv
from engine.models.expert_blocks import ExpertBlocks, rows_per_block
from engine.models.kv_cache import make_prompt_cache
from engine.models.switch import SwitchGLU


def test_blocks_are_as_high_as_measured_fastest_and_taken_where_they_pay(monkeypatch):
    assert rows_per_block(256 * 8, 128) == 16  # DiffusionGemma's canvas: 16 pairs an expert
    assert rows_per_block(1024 * 8, 128) == 64  # 64 pairs an expert: the highest tile
    assert rows_per_block(1023 * 8, 128) == 16  # just under 64
    assert rows_per_block(4096 * 8, 256) == 64
    assert rows_per_block(40 * 2, 64) == 16
    monkeypatch.setattr(qmv, "available", lambda: True)
    monkeypatch.delenv(expert_blocks.ENV, raising=False)
    assert expert_blocks.blocks_pay(256 * 8, 128)
    assert not expert_blocks.blocks_pay(64 * 8, 256)  # 2 pairs an expert: mostly padding


def check_layout(ids: mx.array, experts: int, rows: int) -> ExpertBlocks:
    layout = ExpertBlocks.of(ids, experts, rows)
    pairs = ids.size
    assert layout.rows == rows
    assert layout.blocks == -(-pairs // rows) + experts  # the bound, whatever the routing
    block_expert = layout.experts.tolist()
    assert block_expert == sorted(block_expert) and 0 <= block_expert[0] and block_expert[-1] < experts
    slots = layout.pair_slot.tolist()
    assert len(set(slots)) == pairs  # one pair a slot
    flat = ids.flatten().tolist()
    slot_pair = layout.slot_pair.tolist()
    for pair, slot in enumerate(slots):
        assert block_expert[slot // rows] == flat[pair]  # in a block of its own expert
        assert slot_pair[slot] == pair
    return layout


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_every_pair_sits_in_a_block_of_its_own_expert(rows):
    mx.random.seed(3)
    ids = mx.argsort(mx.random.uniform(shape=(37, 12)), axis=-1)[:, :5]  # 37 tokens, 5 of 12 experts
    check_layout(ids, 12, rows)


def test_skewed_routing_fits_the_same_bound():
    check_layout(mx.full((50, 1), 6, dtype=mx.int32), 7, 16)  # every token to the last expert
    check_layout(mx.array([[0, 1]] * 30, dtype=mx.int32), 9, 4)  # two experts, seven idle
    layout = check_layout(mx.array([[2]] * 3, dtype=mx.int32), 4, 16)
    assert layout.experts.tolist() == [2, 3, 3, 3, 3]  # the filled block, then idle ones on the last expert


def test_activations_go_to_their_slots_and_outputs_come_back_in_pair_order():
    ids = mx.array([[3, 0], [0, 2], [3, 3]], dtype=mx.int32)  # 3 tokens x 2 pairs
    layout = ExpertBlocks.of(ids, 4, 2)
    x = mx.arange(3, dtype=mx.float32)[:, None] * mx.ones((1, 5))  # token t's row holds t
    xb = layout.gather(x, 2)
    assert xb.shape == (layout.blocks, 2, 5)
    per_slot = xb[..., 0].flatten().tolist()
    for pair, slot in enumerate(layout.pair_slot.tolist()):
        assert per_slot[slot] == pair // 2
    assert layout.scatter(xb)[:, 0].tolist() == [0, 0, 1, 1, 2, 2]


def test_the_blocked_product_equals_the_pair_by_pair_one():
    mx.random.seed(0)
    block = SwitchGLU(64, 32, 8)
    x = mx.random.normal((40, 64))
    ids = mx.argsort(mx.random.uniform(shape=(40, 8)), axis=-1)[:, :3]
    reference = block.routed(x, ids)  # 40 tokens: sorted, pair by pair
    for rows in (2, 16):
        assert mx.array_equal(block.blocked(x, ids, rows).reshape(reference.shape), reference)
    nn.quantize(block, group_size=32, bits=4)
    xh = x.astype(mx.bfloat16)
    assert mx.array_equal(block.blocked(xh, ids).reshape(40, 3, 64), block.routed(xh, ids))


# Plain SiLU, gpt-oss's biases and clamped gate, Gemma 4's GELU block, DeepSeek's router.
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss", "gemma4_text_moe", "deepseek_v3"])
def test_a_prompt_through_expert_blocks_gives_the_same_logits(monkeypatch, name, quantized):
    model = load_golden(name)[0]
    if quantized:
        nn.quantize(
            model,
            group_size=32,
            bits=4,
            class_predicate=lambda _, layer: hasattr(layer, "to_quantized") and layer.weight.shape[-1] % 32 == 0,
        )
    prompt = mx.array([[(7 * i + 5) % 89 + 3 for i in range(40)]], dtype=mx.uint32)  # long enough to sort

    def logits():
        # On the CPU stream on every machine: there a block's rows sum as a pair's do. On
        # CUDA a float32 block may round otherwise (the bf16 CUDA test below holds there).
        with mx.stream(mx.cpu):
            out = model(prompt, cache=make_prompt_cache(model))
            mx.eval(out)
        return out

    monkeypatch.setattr("engine.models.switch.blocks_pay", lambda *_: False)
    reference = logits()
    taken = []
    monkeypatch.setattr("engine.models.switch.blocks_pay", lambda *_: taken.append(1) or True)
    assert mx.array_equal(logits(), reference)
    assert taken  # the blocks were used


def test_the_environment_turns_the_blocks_off(monkeypatch):
    monkeypatch.setenv(expert_blocks.ENV, "0")
    assert not expert_blocks.blocks_pay(1024, 8)


def test_the_microbench_times_each_layout_and_checks_it_against_pair_by_pair(capsys):
    argv = ["--shape", "tiny-qwen3.5-moe", "--tokens", "8,40", "--repeat", "1", "--copy-mb", "16", "--json"]
    assert bench_expert_blocks.main(argv) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (out["experts"], out["k"]) == (8, 2)
    assert [t["tokens"] for t in out["passes"]] == [8, 40]
    for t in out["passes"]:
        assert set(t["us"]) == {"pair by pair", "blocks of 16", "blocks of 32", "blocks of 64"}
        assert all(d == 0 for d in t["max_difference"].values())
        assert 1 <= t["experts_hit"] <= 8 and t["floor_us"] > 0
    assert bench_expert_blocks.main(["--tokens", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.skipif(not qmv.available(), reason="needs MLX's CUDA backend")
@pytest.mark.parametrize("tokens", [64, 512])
def test_on_cuda_the_blocks_equal_mlxs_pair_by_pair_product(monkeypatch, tokens):
    """Where the blocks are taken, a 4-bit bf16 block's prompt output is MLX's own, bit for bit."""
    mx.random.seed(1)
    block = SwitchGLU(512, 256, 32)
    block.set_dtype(mx.bfloat16)
    nn.quantize(block, group_size=64, bits=4)
    x = mx.random.normal((tokens, 512)).astype(mx.bfloat16)
    ids = mx.argsort(mx.random.uniform(shape=(tokens, 32)), axis=-1)[:, :4]
    monkeypatch.setenv(expert_blocks.ENV, "0")
    reference = block.routed(x, ids)
    monkeypatch.setenv(expert_blocks.ENV, "1")
    assert expert_blocks.blocks_pay(tokens * 4, 32)
    assert mx.array_equal(block.routed(x, ids), reference)
