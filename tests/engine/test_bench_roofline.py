"""``bench --roofline``: the bytes a decoded token reads, counted from the model's own arrays."""

from __future__ import annotations

import json

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.cli import roofline
from engine.cli.bench import build_model
from engine.cli.main import main


def _bytes(model, keep=lambda path: True) -> int:
    return sum(a.nbytes for p, a in tree_flatten(model.parameters()) if keep(p))


def test_an_untied_model_reads_every_weight_but_one_embedding_row():
    model, config, _ = build_model("tiny", 4, 64)
    assert not config["tie_word_embeddings"]
    table = dict(tree_flatten(model.parameters()))
    embedding = [a for p, a in table.items() if p.startswith("model.embed_tokens.")]
    one_row = sum(a.nbytes // a.shape[0] for a in embedding)
    expected = _bytes(model, lambda p: not p.startswith("model.embed_tokens.")) + one_row
    assert roofline.weight_bytes_per_token(model, config) == expected


def test_a_tied_embedding_is_read_whole_once_as_the_head():
    model, config, _ = build_model("tiny", 4, 64)
    del model["lm_head"]  # what a tied checkpoint looks like: no head of its own
    assert roofline.weight_bytes_per_token(model, config) == _bytes(model)


def test_a_token_reads_top_k_of_the_stacked_experts_and_never_the_mtp_layer():
    model, config, _ = build_model("tiny-mla", 4, 64)
    experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    params = dict(tree_flatten(model.parameters()))
    stacked = sum(a.nbytes for p, a in params.items() if ".switch_mlp." in p)
    assert stacked > 0
    full = roofline.weight_bytes_per_token(model, {**config, "n_routed_experts": 0})
    assert roofline.weight_bytes_per_token(model, config) == full - stacked + stacked * top_k // experts


def test_bench_prints_the_roofline_beside_the_rates(capsys):
    assert main(["bench", "--shape", "tiny", "-p", "16", "-g", "4", "--roofline", "--json"]) == 0
    out = capsys.readouterr().out
    assert "roofline" in out.splitlines()[-2]
    line = json.loads(out.splitlines()[-1])["roofline"]
    assert line["bytes_per_token"] == line["weight_bytes_per_token"] + line["kv_bytes_per_token"]
    assert line["kv_bytes_per_token"] > 0 and line["bandwidth_bytes_per_s"] > 0
    assert (
        abs(line["ceiling_tps"] * line["bytes_per_token"] - line["bandwidth_bytes_per_s"])
        < 1e-3 * line["bandwidth_bytes_per_s"]
    )
    assert 0 < line["share"] == line["share"]


def test_the_kv_read_grows_with_the_prompt():
    model, config, _ = build_model("tiny", 4, 64)
    short = roofline.kv_bytes_after(model, mx.arange(8, dtype=mx.uint32))
    long = roofline.kv_bytes_after(model, mx.arange(40, dtype=mx.uint32))
    assert long > short > 0
