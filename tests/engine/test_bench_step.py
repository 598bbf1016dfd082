"""``python -m engine bench --step`` on the tiny MLA shape, run as a subprocess."""

from __future__ import annotations

import pytest
from test_cli import last_json, run


def test_one_step_taken_apart_next_to_mlx_lm():
    pytest.importorskip("mlx_lm")
    args = ["bench", "--shape", "tiny-mla", "--bits", "4", "--group-size", "32", "-p", "24", "-g", "6"]
    proc = run(*args, "--vs", "mlx-lm", "--step", "--json")
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    steps = out["steps"]
    assert set(steps) == {"engine compiled", "engine plain", "mlx-lm"}
    for s in steps.values():
        assert s["ms"] > 0 and s["median_ms"] >= s["ms"]
        assert 0 < s["build_ms"] and 0 < s["launch_ms"]
        assert s["ops"] == sum(s["op_kinds"].values()) > 0
        assert s["nodes"] > s["ops"]  # the views are counted among the nodes
        assert not {"Reshape", "Transpose", "Slice"} & set(s["op_kinds"])  # views are not work
    # Compiling fuses elementwise ops: fewer primitives than the plain pass, same tokens.
    assert steps["engine compiled"]["ops"] < steps["engine plain"]["ops"]
    assert out["compiled_matches_plain"] is True
    assert isinstance(out["same_tokens_as_mlx_lm"], bool)
    assert out["compiled_split_ms"]["traced"] > 0 and out["compiled_split_ms"]["outside"] > 0
    parts = out["parts_ms"]
    assert {"attention", "router", "routed experts", "shared experts", "moe block", "dense mlp"} <= set(parts)
    assert parts["attention"]["layers"] == 2 and parts["router"]["layers"] == 1  # first layer dense
    for form in ("fused", "composed"):  # latent attention alone, both ways, ours only
        assert parts[f"latent attention {form}"]["engine"] > 0 and "mlx-lm" not in parts[f"latent attention {form}"]
    both = [name for name in parts if name != "final norm + head" and not name.startswith("latent attention")]
    assert all(parts[name]["engine"] > 0 and parts[name]["mlx-lm"] > 0 for name in both)
    assert "ms/step" in proc.stdout and "routed experts x1" in proc.stdout
    assert "engine compiled: " in proc.stdout and "graph nodes with views; most ops: " in proc.stdout


def test_step_needs_a_text_shape_and_two_steps():
    proc = run("bench", "--shape", "tiny-mla", "--bits", "16", "-p", "4", "-g", "1", "--step")
    assert proc.returncode != 0 and "-g must be a whole number from 2" in proc.stderr and proc.stderr.count("\n") == 1


def test_mla_attention_form_is_chosen_from_the_command_line():
    pytest.importorskip("mlx_lm")
    args = ["bench", "--shape", "tiny-mla", "--bits", "4", "--group-size", "32", "-p", "12", "-g", "4", "--json"]
    for form in ("fused", "composed"):
        proc = run(*args, "--vs", "mlx-lm", "--mla-attention", form)
        assert proc.returncode == 0, proc.stderr
        assert last_json(proc.stdout)["ratio"]["generation"] > 0
    proc = run(*args, "--mla-attention", "other")
    assert proc.returncode != 0 and "--mla-attention" in proc.stderr


def test_a_batch_step_taken_apart_next_to_mlx_lms():
    """``--rows 3``: three streams after the same prompt, the compiled batch step (one graph
    each step, every row the same tokens as the plain batch pass) next to mlx-lm's model over
    its own batch caches, and each part fed three rows."""
    pytest.importorskip("mlx_lm")
    args = ["bench", "--shape", "tiny", "--bits", "4", "--group-size", "32", "-p", "16", "-g", "5"]
    proc = run(*args, "--vs", "mlx-lm", "--step", "--rows", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    out = last_json(proc.stdout)
    assert out["rows"] == 3 and "one batch step of 3 rows" in proc.stdout
    steps = out["steps"]
    assert set(steps) == {"engine compiled", "engine plain", "mlx-lm"}
    # The batch caches were evaluated before the graphs were counted: one step's ops only,
    # the same number of products in every loop that stacks its projections.
    assert (
        steps["engine compiled"]["op_kinds"]["QuantizedMatmul"] == steps["engine plain"]["op_kinds"]["QuantizedMatmul"]
    )
    assert steps["engine compiled"]["ops"] < steps["engine plain"]["ops"]
    assert out["compiled_matches_plain"] is True
    assert out["compiled_split_ms"]["traced"] > 0 and out["compiled_split_ms"]["outside"] > 0
    assert {"attention", "dense mlp", "final norm + head"} <= set(out["parts_ms"])


def test_a_batch_step_needs_a_shape_whose_streams_batch():
    proc = run("bench", "--shape", "tiny-mla", "--bits", "16", "-p", "4", "-g", "2", "--step", "--rows", "2")
    assert proc.returncode != 0 and "decode one at a time" in proc.stderr and proc.stderr.count("\n") == 1
