"""Built-in MTP drafting for DeepSeek V3 and GLM-5 (``glm_moe_dsa``).

transformers has no forward pass for these checkpoints' MTP module, so its weights here are
random, stored as the published checkpoints store them: layer ``num_hidden_layers`` with
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, a full decoder layer (latent attention,
routed experts, GLM-5's indexer) and the copies of the embedding and head that are left out.
What is checked (as for Qwen3.5's MTP layer in test_mtp.py):

* the layer loads into ``model.mtp`` (strict: nothing left over, nothing missing), and a
  layer stored only in part is left out;
* greedy output is plain greedy output, token for token, with 1, 2 and 4 drafts a round and
  with the adaptive depth, drafts verified and counted;
* the drafter follows the target exactly: its next draft's logits equal those of the MTP
  module run afresh over the whole history (the module's definition, written out here).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from spec_models import check_mtp_drafting, first_draft_logits, plain_greedy

from engine.decode.draft_depth import DraftDepth
from engine.decode.mtp_drafter import MTPDrafter
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models import get_family

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_goldens import GOLDEN  # noqa: E402

N = 16
NAMES = ["deepseek_v3", "glm_moe_dsa"]


def mtp_weights(weights: dict, n: int, vocab: int, hidden: int, seed: int) -> dict:
    """A random MTP layer as checkpoints store it: the last decoder layer's tensors (HF
    layout) with noise, under ``model.layers.{n}``, plus the module's own tensors."""
    rng = np.random.default_rng(seed)
    src = f"model.layers.{n - 1}."
    out = {}
    for key, value in weights.items():
        if key.startswith(src):
            noise = 0.1 * rng.standard_normal(value.shape).astype(np.float32)
            out[f"model.layers.{n}." + key[len(src) :]] = value + mx.array(noise)
    for name, shape, scale in (
        ("enorm.weight", (hidden,), None),
        ("hnorm.weight", (hidden,), None),
        ("shared_head.norm.weight", (hidden,), None),
        ("eh_proj.weight", (hidden, 2 * hidden), 0.15),
        ("embed_tokens.weight", (vocab, hidden), 0.02),  # copies the loader leaves out
        ("shared_head.head.weight", (vocab, hidden), 0.02),
    ):
        arr = 1 + 0.1 * rng.standard_normal(shape) if scale is None else scale * rng.standard_normal(shape)
        out[f"model.layers.{n}.{name}"] = mx.array(arr.astype(np.float32))
    return out


def load(name: str, with_mtp: bool = True, drop: str | None = None):
    config = json.loads((GOLDEN / name / "config.json").read_text())
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(GOLDEN / name / "model.safetensors")).items()}
    n = config["num_hidden_layers"]
    if with_mtp:
        weights.update(mtp_weights(weights, n, config["vocab_size"], config["hidden_size"], seed=3))
    if drop is not None:
        weights = {k: v for k, v in weights.items() if drop not in k}
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    expected = json.loads((GOLDEN / name / "expected.json").read_text())
    return model, expected


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    return load(request.param)


def test_the_mtp_layer_loads_and_its_copies_do_not(loaded):
    model, _ = loaded
    assert "mtp" in model and len(model.mtp.layers) == 1
    names = {k for k, _ in __import__("mlx.utils", fromlist=["tree_flatten"]).tree_flatten(model.mtp.parameters())}
    assert "eh_proj.weight" in names and not any("embed_tokens" in k or "head.weight" in k for k in names)


@pytest.mark.parametrize("name", NAMES)
def test_a_layer_stored_in_part_is_left_out(name):
    model, _ = load(name, drop=".eh_proj.")
    assert "mtp" not in model
    plain, _ = load(name, with_mtp=False)
    assert "mtp" not in plain


@pytest.mark.parametrize("k", [1, 2, 4, "auto"])
def test_mtp_greedy_equals_plain(loaded, k):
    target, expected = loaded
    auto = k == "auto"
    check_mtp_drafting(
        target,
        expected["prompt_ids"][:20],
        N,
        4 if auto else k,
        num_draft_tokens=None if auto else k,
        depth=DraftDepth(4) if auto else None,
    )


def test_the_drafter_follows_the_target_exactly(loaded):
    target, expected = loaded
    drafted, full = first_draft_logits(target, expected["prompt_ids"][:20])
    # Afresh, the module as DeepSeek-V3 defines it: for every position i, the target's final
    # hidden state h_i and the embedding of x_{i+1}, each normalised, projected, through the
    # MTP decoder layer (causal over all positions), then shared_head.norm and the head.
    hidden = target.model(mx.array([full[:-1]]))
    mtp = target.mtp
    x = mtp.eh_proj(mx.concatenate([mtp.enorm(target.embed(mx.array([full[1:]]))), mtp.hnorm(hidden)], axis=-1))
    cache = mtp.make_cache()
    out = mtp.layers[0](x, "causal", cache[0])
    out = out[0] if isinstance(out, tuple) else out
    reference = target.lm_head(mtp.shared_head.norm(out))[0, -1]
    assert mx.allclose(drafted, reference, atol=1e-4).item()


def test_greedy_is_plain_while_the_depth_changes_every_round(loaded):
    """Plain tokens between rounds (the MTP layer makes their entries later, in one pass)
    and rounds of every depth: the output is still plain greedy output."""
    from test_draft_depth import Scripted

    target, expected = loaded
    prompt = expected["prompt_ids"][:20]
    want = plain_greedy(target, prompt, 24)
    depth = Scripted([2, 0, 0, 4, 1, 0, 3])
    drafter = MTPDrafter(target, 4)
    stats = StatsCounter()
    try:
        got = [
            t
            for t, _ in speculative_step(
                prompt, target, target.make_cache(), drafter, max_tokens=24, stats=stats, depth=depth
            )
        ]
    finally:
        drafter.close()
    assert got == want
    assert {0, 1, 2, 3, 4} <= set(depth.asked) and stats.draft_tokens > 0


@pytest.mark.parametrize("name", NAMES)
def test_the_choice_is_greyed_out_with_the_reason(name):
    from types import SimpleNamespace

    from engine.runtime.assembly import _mtp_support

    plain, _ = load(name, with_mtp=False)
    plain.args.num_nextn_predict_layers = 1  # the config says it has one; the files lack it
    available, note = _mtp_support(SimpleNamespace(model=plain))
    assert not available and "mlx-lm's conversions drop them" in note
    plain.args.num_nextn_predict_layers = 0  # a checkpoint made without any (Moonlight)
    available, note = _mtp_support(SimpleNamespace(model=plain))
    assert not available and note == "This model has no built-in multi-token-prediction layers."
    model, _ = load(name)
    assert _mtp_support(SimpleNamespace(model=model)) == (True, "")
