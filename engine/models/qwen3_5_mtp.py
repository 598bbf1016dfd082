"""Qwen3.5's (and Qwen3-Next's) built-in multi-token prediction layer, used as a drafter.

The checkpoint's ``mtp.*`` weights: for position i it takes the target's final hidden
state h_i (after the final norm) and the embedding of the next token x_{i+1}, normalises
each (``pre_fc_norm_hidden`` / ``pre_fc_norm_embedding``, (1 + w) norms), projects their
concatenation [embedding, hidden] back to the hidden size (``fc``), runs one full-attention
decoder layer of the family (its own KV cache, position i) and the final ``norm``; the
shared ``lm_head`` then predicts x_{i+2}. Chained on its own output it drafts several
tokens. transformers ignores these weights and mlx-lm drops them when converting, so a
converted checkpoint has none (``has_mtp`` is then False).
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn

# (1 + w) norms of the MTP layer, besides those its decoder layer shares with the family.
MTP_ONE_CENTRED = ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight")
# The MTP layer's weights as checkpoints name them: top level, or under the language model.
_MTP_NAME = re.compile(r"^(model\.)?(language_model\.)?(model\.)?mtp\.")


def resident_weight(name: str, n_layers: int) -> str:
    """How a stored weight is held once loaded (the memory plan asks): "mtp" for the MTP
    layer's, loaded only when MTP drafting asks for it, "model" for the rest."""
    return "mtp" if _MTP_NAME.match(name) else "model"


class MTPHead(nn.Module):
    def __init__(self, args, layer_class):
        super().__init__()
        h = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        full = type(args)(**{**args.__dict__, "layer_types": ["full_attention"] * args.num_hidden_layers})
        self.layers = [layer_class(full, 0) for _ in range(max(1, int(getattr(args, "mtp_num_hidden_layers", 1))))]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache: list) -> mx.array:
        """Final-normed hidden states [B, T, H] for positions whose target hidden states are
        ``hidden`` and whose next tokens embed as ``embeddings``."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = cache[0].make_mask(x.shape[1])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.norm(x)
