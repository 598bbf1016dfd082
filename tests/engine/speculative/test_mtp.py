"""Drafting with the checkpoint's own multi-token-prediction (MTP) layer (Qwen3.5 family).

transformers has no MTP forward pass to compare with, so the MTP weights here are random,
stored as the Hub stores them (``mtp.*``, (1 + w) norms as w). What is checked:

* greedy output is plain greedy output, token for token, with 1, 2 and 4 drafts a round;
* the drafter follows the target exactly: after rounds with rejections, its next draft's
  logits equal those of the MTP layer run afresh over the whole history (entry i: the
  target's hidden state h_i and token x_{i+1}), so no entry of a rejected draft survives;
* plain tokens between rounds go through the compiled step while the drafter listens;
* a checkpoint without MTP layers (mlx-lm's conversions drop them) is refused in one line.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from spec_models import check_mtp_drafting, first_draft_logits, mtp_hub_weights

from engine.decode.compiled_hybrid import compiled_decoder
from engine.decode.draft_depth import FixedDepth
from engine.decode.drafters import decoder_for
from engine.decode.mtp_drafter import MTPDrafter
from engine.errors import EngineError
from engine.models.kv_cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_hybrid_families import GOLDEN, build  # noqa: E402

N = 20


def with_mtp(name: str):
    """The golden model, loaded again with random MTP weights in the Hub's layout."""
    import json

    from engine.models import get_family

    model, expected = build(name)
    mtp = mtp_hub_weights(model)
    config = json.loads((GOLDEN / name / "config.json").read_text())
    family = get_family(config["model_type"])
    target = family.Model(family.ModelArgs.from_dict(config))
    weights = {k: v.astype(mx.float32) for k, v in mx.load(str(GOLDEN / name / "model.safetensors")).items()}
    weights.update(mtp)
    target.load_weights(list(target.sanitize(weights).items()), strict=True)
    mx.eval(target.parameters())
    return target, expected


@pytest.fixture(scope="module")
def qwen():
    return with_mtp("qwen3_5")


def test_sanitize_builds_the_mtp_layer_only_when_the_checkpoint_has_one(qwen):
    target, _ = qwen
    assert "mtp" in target and len(target.mtp.layers) == 1
    plain, _ = build("qwen3_5")
    assert "mtp" not in plain


@pytest.mark.parametrize("k", [1, 2, 4])
def test_mtp_greedy_equals_plain(qwen, k):
    target, expected = qwen
    check_mtp_drafting(target, expected["prompt_ids"][:30], N, k, num_draft_tokens=k)


def test_the_drafter_follows_the_target_exactly(qwen):
    target, expected = qwen
    drafted, full = first_draft_logits(target, expected["prompt_ids"][:30])
    # Afresh: the target's hidden states over the whole history, the MTP layer over all of it.
    hidden = target.model(mx.array([full[:-1]]))
    mtp_cache = [KVCache() for _ in target.mtp.layers]
    out_h = target.mtp(hidden, target.embed(mx.array([full[1:]])), mtp_cache)
    reference = target.logits(out_h)[0, -1]
    assert mx.allclose(drafted, reference, atol=1e-4).item()


def test_a_checkpoint_without_mtp_layers_is_refused():
    plain, _ = build("qwen3_5")
    with pytest.raises(EngineError, match="no built-in multi-token-prediction"):
        MTPDrafter(plain)


class PlainThenDrafts(FixedDepth):
    """``plain`` plain tokens, then a round of ``k`` drafts, in turn: the adaptive depth's
    pattern when drafting does not pay (plain stretches between probes)."""

    def __init__(self, k: int, plain: int):
        super().__init__(k)
        self.script = itertools.cycle([0] * plain + [k])

    def next(self, room: int) -> int:
        return min(next(self.script), max(room, 0))


def test_plain_stretches_run_compiled_while_the_drafter_follows(qwen):
    """An MTP drafter listening must not send plain tokens to the slower uncompiled pass: the
    compiled hybrid step shows it the hidden states as the model's own pass does. Output is
    plain greedy's, the compiled step ran one-token steps and verify passes, and the drafts
    after the plain stretches come from entries made over every position."""
    target, expected = qwen
    decoder = compiled_decoder(target)
    assert decoder is not None and decoder.prepare()

    def listener_keeps_the_compiled_step() -> None:
        assert decoder_for(target, True) is decoder

    check_mtp_drafting(
        target,
        expected["prompt_ids"][:30],
        N,
        2,
        during=listener_keeps_the_compiled_step,
        depth=PlainThenDrafts(2, 3),
        compiled=True,
    )
    assert {1, 3} <= set(decoder._fns)  # one-token steps and verify passes of 1 + 2 drafts
