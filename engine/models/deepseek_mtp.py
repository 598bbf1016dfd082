"""DeepSeek V3's (and GLM-5's) multi-token-prediction (MTP) module, used as a drafter.

The checkpoints append it after the decoder as layer ``num_hidden_layers``
(``num_nextn_predict_layers`` of them; both families publish one). For position i it takes
the target's final hidden state h_i (after the final norm) and the embedding of the next
token x_{i+1}, normalises each (``hnorm`` / ``enorm``), projects their concatenation
[embedding, hidden] back to the hidden size (``eh_proj``), runs one full decoder layer of the
family (latent attention with its own cache, routed experts) and predicts x_{i+2} through
``shared_head`` (its norm, then the output head). Chained on its own output (the layer's
output before ``shared_head.norm``, as vLLM's DeepSeek MTP chains it) it drafts several tokens.

As the DeepSeek-V3 report describes the module, its embedding and output head are the main
model's; the checkpoints store copies (``embed_tokens``, ``shared_head.head``, each a
vocabulary-sized matrix), which are left out: the model's own are used. transformers has no
forward pass for this module and mlx-lm drops it when converting.
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.models.base import attention_mask
from engine.models.switch import MissingExperts

# Stored in the MTP layer, not loaded: copies of the main model's embedding and output head.
SHARED_COPIES = ("embed_tokens.", "shared_head.head.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def nextn_part(name: str, n_layers: int) -> tuple[int, str] | None:
    """(which MTP layer, the rest of the name) for a weight of an appended MTP layer, else None."""
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) < n_layers:
        return None
    return int(m.group(1)) - n_layers, m.group(2)


def mtp_name(rest: str) -> str:
    """Where a name inside the first stored MTP layer (``model.layers.N.<rest>``) lives on the
    model: the module's own parts under ``mtp.``, its decoder layer under ``mtp.layers.0.``."""
    own = rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head")
    return ("mtp." if own else "mtp.layers.0.") + rest


def mtp_module_path(path: str, n_layers: int) -> str | None:
    """The path on the model (``mtp.*``) of a module that an adapter names as the checkpoints
    store the first MTP layer (``model.layers.N.self_attn.q_a_proj``, N = ``n_layers``), else
    None (not that layer; or one of its copies of the embedding and head, never loaded)."""
    part = nextn_part(path, n_layers)
    if part is None or part[0] > 0 or (part[1] + ".").startswith(SHARED_COPIES):
        return None
    return mtp_name(part[1])


def left_out(name: str, n_layers: int) -> bool:
    """Stored but never loaded: MTP layers after the first (the drafter chains the first on
    itself), and the first one's copies of the embedding and head."""
    part = nextn_part(name, n_layers)
    return part is not None and (part[0] > 0 or part[1].startswith(SHARED_COPIES))


class SharedHead(nn.Module):
    def __init__(self, args: Any):
        super().__init__()
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class NextNHead(nn.Module):
    """The MTP module: ``__call__(hidden, embeddings, cache)`` -> its layer's output, and
    ``logits(output)`` through ``shared_head.norm`` and the model's head."""

    def __init__(self, args: Any, layer: nn.Module, model_logits):
        super().__init__()
        h = args.hidden_size
        self.enorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = [layer]
        self.shared_head = SharedHead(args)
        self._model_logits = model_logits  # a bound method: not a parameter

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache: list) -> mx.array:
        x = self.eh_proj(mx.concatenate([self.enorm(embeddings), self.hnorm(hidden)], axis=-1))
        mask = attention_mask(x.shape[1], cache[0])
        out = self.layers[0](x, mask, cache[0])
        return out[0] if isinstance(out, tuple) else out  # GLM-5's layers also hand on a selection

    def logits(self, output: mx.array) -> mx.array:
        return self._model_logits(self.shared_head.norm(output))

    def make_cache(self) -> list:
        from engine.models.mla import latent_caches

        return latent_caches(1)


def mtp_args(args: Any, weights: dict[str, mx.array]) -> Any:
    """The family's args with one more layer, configured as the stored MTP layer is (routed
    experts or a dense MLP; a DSA indexer or none)."""
    n = args.num_hidden_layers
    prefix = f"model.layers.{n}."
    sparse = any(k.startswith(prefix + "mlp.gate.") or k.startswith(prefix + "mlp.experts.") for k in weights)
    extra: dict[str, Any] = {"num_hidden_layers": n + 1}
    extra["mlp_layer_types"] = [("sparse" if args.is_sparse(i) else "dense") for i in range(n)] + [
        "sparse" if sparse else "dense"
    ]
    if getattr(args, "indexer_types", None) is not None:
        indexer = any(k.startswith(prefix + "self_attn.indexer.") for k in weights)
        extra["indexer_types"] = [*args.indexer_types, "full" if indexer else "shared"]
    return type(args)(**{**args.__dict__, **extra})


def attach_mtp(model: Any, weights: dict[str, mx.array], prepare_layer) -> dict[str, mx.array]:
    """Build ``model.mtp`` when ``weights`` hold a complete first MTP layer, moving its weights
    to ``mtp.*`` (``prepare_layer(weights, prefix)`` stacks experts and splits ``kv_b`` as
    for the decoder's layers); leave out everything else appended. An incomplete layer (only
    some of its tensors) is left out whole: there is nothing to draft with."""
    args = model.args
    n = args.num_hidden_layers
    first: dict[str, mx.array] = {}
    for key in list(weights):
        part = nextn_part(key, n)
        if part is None:
            continue
        value = weights.pop(key)
        if part[0] == 0 and not part[1].startswith(SHARED_COPIES):
            first[part[1]] = value
    if "eh_proj.weight" not in first or "mtp" in model:
        return weights
    full = mtp_args(args, {f"model.layers.{n}.{k}": v for k, v in first.items()})
    head = NextNHead(args, model.model.layer_class(full, n), model.logits)
    moved = {mtp_name(k): v for k, v in first.items()}
    try:
        prepare_layer(moved, "mtp.layers.0")
    except (MissingExperts, KeyError):
        return weights
    wanted = {"mtp." + k for k, _ in tree_flatten(head.parameters())}
    if not wanted <= moved.keys():
        return weights
    model.mtp = head
    weights.update(moved)
    return weights
