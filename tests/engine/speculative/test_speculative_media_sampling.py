"""Sampled speculative output after an image keeps the target's distribution.

The tiny golden Gemma 3 (window widened so its caches can rewind) drafts for itself from the
placeholder ids, so its draft distribution differs from the target's, which sees
../shared/data/images/chelsea.png. Seeded runs of the first two tokens are compared by
chi-square with the exact joint distribution computed from the target's full forward pass
over the spliced embeddings and the image's bidirectional block; the same samples must be
clearly inconsistent with a plausible wrong rule (after a rejection, sample from p).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from test_speculative_sampling import check

from engine.api import MediaInput, SamplingParams
from engine.decode.drafters import DraftModelDrafter
from engine.decode.prefill import PromptInputs, prefill
from engine.decode.sampling import filter_logits
from engine.decode.speculative import speculative_step
from engine.decode.stats import StatsCounter
from engine.models.kv_cache import make_prompt_cache, trim_prompt_cache
from engine.runtime.host import ModelHost

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
SAMPLES = 1200
PARAMS = SamplingParams(temperature=1.0, top_k=6)


@pytest.mark.slow
@pytest.mark.long
def test_image_prompt_sampling_keeps_target_distribution(tmp_path, shared_data):
    folder = tmp_path / "gemma3"
    shutil.copytree(GOLDEN / "vision" / "gemma3", folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["sliding_window"] = 512
    (folder / "config.json").write_text(json.dumps(config))
    host = ModelHost()
    host.load(str(folder))
    chat = host.session("s")
    template = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    media = chat.media_prompt(chat.render(template), [MediaInput("image", str(shared_data / "images" / "chelsea.png"))])
    inputs = chat._prompt_inputs(media, 0)
    ids, emb, blocks, model = media.ids, inputs.embeddings, inputs.blocks, host.model
    assert blocks  # the image's run attends both ways

    def target(extra: list[int]) -> np.ndarray:
        e = mx.concatenate([emb, model.embed(mx.array([extra], dtype=mx.uint32))[0]]) if extra else emb
        logits = model(mx.array([ids + extra]), input_embeddings=e[None], bidirectional=blocks)[0, -1]
        return np.array(mx.softmax(filter_logits(logits.astype(mx.float32), PARAMS), axis=-1), dtype=np.float64)

    p = target([])
    vocab = p.shape[0]
    joint = np.zeros((vocab, vocab))
    for a in np.nonzero(p)[0]:
        joint[a] = p[a] * target([int(a)])
    blind = model(mx.array([ids]))[0, -1].astype(mx.float32)  # what the draft model sees
    q = np.array(mx.softmax(filter_logits(blind, PARAMS), axis=-1), dtype=np.float64)
    accept = np.minimum(p, q).sum()
    wrong = np.minimum(p, q) + (1 - accept) * p

    cache = make_prompt_cache(model)
    prefill(model, mx.array(ids[:-1]), cache, chunk=64, inputs=PromptInputs(embeddings=emb[:-1], blocks=blocks))
    drafter = DraftModelDrafter(model)
    counts = np.zeros((vocab, vocab))
    stats = StatsCounter()
    for i in range(SAMPLES):
        run = SamplingParams(temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=1000 + i)
        out = [
            t
            for t, _ in speculative_step(
                ids[-1:],
                model,
                cache,
                drafter,
                max_tokens=2,
                sampling=run,
                num_draft_tokens=1,
                stats=stats,
                history=ids,
                inputs=PromptInputs(embeddings=emb[-1:]),
            )
        ]
        counts[out[0], out[1]] += 1
        trim_prompt_cache(cache, cache[0].offset - (len(ids) - 1))
        drafter.rewind(len(ids) - 1)
    assert 0.15 < stats.acceptance_rate < 0.95  # both acceptance and rejection are exercised
    check(counts, joint, wrong)
