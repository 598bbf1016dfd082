"""A media prompt's inputs to the model: its embeddings with the towers' features spliced in
where the placeholders stand, multimodal RoPE's position ids, and the blocks that attend
both ways, for the ids from ``keep`` on (the cached prefix before it is not fed again).

``media`` is the located prompt (``engine.media.prompt.locate_media``: ``ids`` and
``spans``, each with its ``item``); ``towers`` gives each item's features (encoded, or
found in the features cache). Media wholly inside the cached prefix is not encoded.
"""

from __future__ import annotations

from typing import Any

from engine.decode.prefill import PromptInputs


def prompt_inputs(model: Any, towers: Any, media: Any, keep: int) -> PromptInputs:
    """Embeddings (media features spliced in), positions and bidirectional blocks for the
    ids of ``media`` from ``keep`` on."""
    import mlx.core as mx
    import numpy as np

    ids = media.ids
    pending = [s for s in media.spans if s.end > keep]
    embeddings = None
    if pending:
        text = model.embed(mx.array(ids[keep:], dtype=mx.uint32)[None])[0]
        pieces, cursor = [], keep
        for span in pending:
            pieces.append(text[cursor - keep : span.start - keep])
            pieces.append(towers.features(span.item).astype(text.dtype))
            cursor = span.end
        pieces.append(text[cursor - keep :])
        # Qwen3-VL's features carry DeepStack rows beside the embedding: text rows get zeros there.
        width = max(p.shape[-1] for p in pieces)
        pieces = [p if p.shape[-1] == width else mx.pad(p, [(0, 0), (0, width - p.shape[-1])]) for p in pieces]
        embeddings = mx.concatenate(pieces, axis=0)
    positions, delta = None, 0
    rope_index = getattr(model, "rope_index", None)
    if rope_index is not None and media.spans:
        full = np.asarray(rope_index(ids, [(s.start, s.end, s.item.grid) for s in media.spans]))
        delta = int(full.max()) + 1 - len(ids)
        positions = mx.array(full[:, keep:], dtype=mx.int32)
    blocks = []
    if getattr(model, "bidirectional_media", False):
        # Images (and video frames) attend both ways; audio stays causal (Gemma 4).
        blocks = [(s.start - keep, s.end - keep) for s in pending if s.item.kind != "audio"]
    return PromptInputs(embeddings=embeddings, positions=positions, position_delta=delta, blocks=blocks)
