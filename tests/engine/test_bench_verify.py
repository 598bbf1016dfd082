"""``python -m engine.cli.bench_verify``: the checks the GPU run relies on to say why a
speculative verify pass in bf16 gives other numbers than single decode steps.

* ``--primitives``: each MLX primitive a step runs, n rows at once against n one-row calls.
  On the CPU build every one computes each row as it would alone (so a difference on the
  CPU is a formulation of ours); a primitive that rounds a multi-row call otherwise (a
  mutant here: latent attention upcast to float32 when it has several queries) is named.
* the layer-by-layer comparison also covers latent attention with routed experts (the
  Moonlight / DeepSeek V3 shapes), not only the hybrid stacks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from engine.cli.bench_shapes import SHAPES
from engine.cli.bench_verify import compare, primitives
from engine.models import mla

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-mla"])
def test_every_primitive_computes_each_row_as_alone_on_the_cpu_build(shape):
    rows = primitives(SHAPES[shape], n=5, context=40)
    names = " | ".join(name for name, _, _ in rows)
    for part in ("matmul bf16", "quantized_matmul 4-bit", "matmul float32 (router)", "rms_norm", "rope"):
        assert part in names
    if "mla" in shape:
        assert "latent attention (composed)" in names and "latent attention (fused)" in names
        assert "experts (bf16)" in names and "experts (4-bit)" in names
    else:
        assert "sdpa head_dim 32" in names and "depthwise conv1d" in names and "gated_delta_update" in names
    assert all(same and rel == 0.0 for _, same, rel in rows), rows


def test_a_primitive_that_rounds_several_rows_otherwise_is_named(monkeypatch):
    original = mla.MLAttention.latent_attention

    def upcast_when_several(self, q_latent, q_pe, latent, k_pe, keep, scaled=False):
        if q_latent.shape[2] > 1:  # a dtype promotion in the verify path only
            out = original(self, q_latent.astype(mx.float32), q_pe, latent.astype(mx.float32), k_pe, keep, scaled)
            return out.astype(q_latent.dtype)
        return original(self, q_latent, q_pe, latent, k_pe, keep, scaled)

    monkeypatch.setattr(mla.MLAttention, "latent_attention", upcast_when_several)
    rows = {name: (same, rel) for name, same, rel in primitives(SHAPES["tiny-mla"], n=5, context=40)}
    differs = [name for name, (same, _) in rows.items() if not same]
    assert differs and all(name.startswith("latent attention") for name in differs)
    assert all(0 < rows[name][1] < 0.1 for name in differs)  # bf16 rounding, not a wrong result


def test_layer_by_layer_covers_latent_attention_and_experts():
    from engine.cli.bench import build_model

    model, _, _ = build_model("tiny-mla", 16, 64)
    ids = mx.random.randint(0, 256, (45,), key=mx.random.key(7)).astype(mx.uint32)
    rows = dict(compare(model, ids[:40], ids[40:]))
    for part in ("latent attention", "router weights", "experts", "output"):
        assert any(part in name for name in rows), rows
    assert max(rows.values()) == 0.0 and "argmax equal 5/5" in rows


def test_the_primitives_command_prints_one_line_per_primitive():
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli.bench_verify", "--shape", "tiny-mla", "--primitives", "-p", "24"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("tiny-mla primitives on Device(cpu") and len(lines) == 10
    assert all(line.split()[-2] == "equal" for line in lines[1:])
