"""A sentence embedding model: a family's decoder stack, then the sentence-transformers steps.

The backbone is the family's own ``DecoderStack`` (no LM head: embedding checkpoints
store the bare ``Qwen3Model``/``Gemma3TextModel``, without the ``model.`` prefix), run
over one text at a time so no padding enters the pooling. Then, as the folder's
``modules.json`` says (engine/artifacts/sentence_transformers.py): pooling over the
tokens, Dense layers, L2 normalisation. Pooling and what follows run in float32.

EmbeddingGemma's backbone attends in both directions (``use_bidirectional_attention``):
full layers see every token, sliding layers every token within half the window, as
transformers' Gemma 3 does (it stores ``sliding_window`` W and uses W // 2 + 1,
exclusive, in each direction).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.artifacts.sentence_transformers import DenseSpec, EmbeddingSpec
from engine.errors import UnsupportedModelError
from engine.models.base import attention_mask
from engine.models.families import FAMILIES

# model_type -> the published models built on it: the families that embed.
EMBEDDING_FAMILIES = {t: f.embeds for t, f in FAMILIES.items() if f.embeds}  # the family manifest's ``embeds``

_ACTIVATIONS = {"identity": lambda x: x, "tanh": mx.tanh, "relu": nn.relu, "gelu": nn.gelu, "sigmoid": mx.sigmoid}


def embedding_families() -> str:
    """The families that embed, for messages: "gemma3_text (EmbeddingGemma), qwen3 (Qwen3-Embedding)"."""
    return ", ".join(f"{k} ({v})" for k, v in sorted(EMBEDDING_FAMILIES.items()))


def check_embedding_family(model_type: str) -> None:
    if model_type not in EMBEDDING_FAMILIES:
        raise UnsupportedModelError(
            f"'{model_type}' sentence embedding models are not supported; the families that embed: "
            f"{embedding_families()}."
        )


def bidirectional_mask(n_queries: int, cache: Any, window: int | None) -> mx.array | None:
    """Every token sees every other (full layers) or those within W // 2 of it (sliding)."""
    if window is None:
        return None
    q = mx.arange(n_queries)
    return mx.abs(q[:, None] - q[None, :]) < window // 2 + 1


def pool(mode: str, h: mx.array) -> mx.array:
    """One sentence-transformers pooling over the [tokens, hidden] states of one text."""
    n = h.shape[0]
    if mode == "cls":
        return h[0]
    if mode == "lasttoken":
        return h[-1]
    if mode == "max":
        return h.max(axis=0)
    if mode == "mean":
        return h.sum(axis=0) / n
    if mode == "mean_sqrt_len_tokens":
        return h.sum(axis=0) / (n**0.5)
    if mode == "weightedmean":  # positions 1..n weigh the tokens
        w = mx.arange(1, n + 1, dtype=h.dtype)
        return (h * w[:, None]).sum(axis=0) / w.sum()
    raise UnsupportedModelError(f"Unsupported pooling {mode!r}.")


class Dense(nn.Module):
    def __init__(self, spec: DenseSpec):
        super().__init__()
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.activation = spec.activation

    def __call__(self, x: mx.array) -> mx.array:
        return _ACTIVATIONS[self.activation](self.linear(x))


class Embedder(nn.Module):
    is_embedder = True

    def __init__(self, family: ModuleType, args: Any, spec: EmbeddingSpec):
        super().__init__()
        check_embedding_family(args.model_type)
        lm = family.Model(args)
        self.args = args
        self.model_type = args.model_type
        self.spec = spec
        self.model = lm.model  # the decoder stack alone: no LM head to load
        self.dense = [Dense(d) for d in spec.dense]
        self._family_sanitize = lm.sanitize
        self._make_mask = bidirectional_mask if getattr(args, "use_bidirectional_attention", False) else attention_mask

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        if not any(k.startswith("model.") for k in weights):  # the bare backbone, as sentence-transformers saves it
            weights = {f"model.{k}": v for k, v in weights.items()}
        weights = self._family_sanitize(weights)
        return {k: v for k, v in weights.items() if not k.startswith("lm_head.")}

    def __call__(self, ids: list[int]) -> mx.array:
        """The embedding of one text's token ids: a float32 vector of ``spec.dimensions``."""
        h = self.model.run(mx.array([ids]), None, None, make_mask=self._make_mask)[0].astype(mx.float32)
        x = mx.concatenate([pool(mode, h) for mode in self.spec.pooling])
        for layer in self.dense:
            x = layer(x).astype(mx.float32)
        if self.spec.normalize:  # torch's F.normalize: divide by max(norm, 1e-12)
            x = x / mx.maximum(mx.linalg.norm(x), 1e-12)
        return x
