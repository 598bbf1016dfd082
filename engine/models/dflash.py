"""DFlash block drafters (z-lab, arXiv 2602.06036): a few decoder layers that fill a whole
block of masked positions in one pass, conditioned on hidden states of some target layers.

Published layout (a folder with ``config.json`` and ``*.safetensors``):

* ``config.json``: a Qwen3-style decoder config for the drafter's own layers
  (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
  ``head_dim``, ``intermediate_size``, ``rms_norm_eps``, ``rope_theta`` or
  ``rope_parameters.rope_theta``, ``attention_bias``), plus ``num_target_layers``,
  ``vocab_size``, ``block_size`` and ``dflash_config`` = {``target_layer_ids``,
  ``mask_token_id``, optionally ``block_size``}; ``architectures`` names
  ``DFlashDraftModel``. Optional: ``is_causal``, ``layer_types`` with ``sliding_window``,
  ``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale`` (in
  ``dflash_config`` or at the top level), ``quantization`` (MLX-quantized drafters).
* weights: ``layers.i.self_attn.{q,k,v,o}_proj``, ``layers.i.self_attn.{q,k}_norm``,
  ``layers.i.mlp.{gate,up,down}_proj``, ``layers.i.{input,post_attention}_layernorm``,
  ``fc`` (len(target_layer_ids) * hidden -> hidden), ``hidden_norm``, ``norm``. No embedding
  and no output head: the drafter reads the target's.

One pass: the target's hidden states of the named layers for the newly settled positions
(``context`` [1, c, n_ids * H], concatenated in ``target_layer_ids`` order; each is the
output of that decoder layer) are projected (``fc``, ``hidden_norm``) to context rows. The
block is the target's raw embeddings of [last settled token, mask, mask, ...]. In every layer
the block's queries attend to the keys/values of all context rows seen so far (the cache)
plus the block itself, without a causal mask (unless ``is_causal``); context rows take the
positions they had in the text, the block the positions after them. Logits are the target's
output head over the drafter's normed output, times ``output_multiplier``, soft-capped when
the config says so.

``load_dflash`` reads such a folder for a given target and refuses, in one line each, a
drafter made for another target (target layer count, hidden size, vocabulary), one without
its mask token, and a damaged or truncated weights file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import ModelLoadError
from engine.models.base import GatedMLP, activation, make_rope, sdpa
from engine.models.checkpoint import fill_weights, one_line, quantize_like_checkpoint
from engine.models.kv_cache import KVCache

ARCHITECTURES = ("DFlashDraftModel",)


def is_dflash_config(config: dict[str, Any]) -> bool:
    """Does this config.json describe a DFlash drafter?"""
    return any(a in ARCHITECTURES for a in config.get("architectures") or ()) or (
        isinstance(config.get("dflash_config"), dict) and "num_target_layers" in config
    )


def is_dflash_dir(path: str | Path) -> bool:
    """Is ``path`` a folder holding a DFlash drafter's config.json?"""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return is_dflash_config(json.loads(config.read_text()))
    except (OSError, ValueError):
        return False


def _setting(config: dict[str, Any], name: str, default: Any = None) -> Any:
    """A DFlash setting: from ``dflash_config`` first, else the top level, as z-lab reads them."""
    inner = config.get("dflash_config") or {}
    return inner.get(name, config.get(name, default))


@dataclass
class DFlashArgs:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int | None = None
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    hidden_act: str = "silu"
    is_causal: bool | None = None  # None: causal for sliding layers only, as z-lab's code
    windows: tuple[int | None, ...] = ()
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    denoising_steps: int = 1
    quantization: dict[str, Any] | None = None  # MLX's: bits, group_size, mode

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "the DFlash drafter") -> DFlashArgs:
        mask = _setting(config, "mask_token_id")
        if mask is None:
            raise ModelLoadError(
                f"{name} names no mask token (dflash_config.mask_token_id): it cannot fill a block; "
                "download the drafter's config.json again from its published repository"
            )
        ids = _setting(config, "target_layer_ids")
        if not ids:
            raise ModelLoadError(f"{name} names no target layers (dflash_config.target_layer_ids) to read")
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            rope = config.get("rope_parameters") or {}
            theta = config.get("rope_theta", rope.get("rope_theta", 1000000.0))
            scaling = config.get("rope_scaling")
            if scaling is None and rope.get("rope_type", "default") != "default":
                scaling = rope
            layers = int(config["num_hidden_layers"])
            kinds = config.get("layer_types") or ["full_attention"] * layers
            window = config.get("sliding_window")
            causal = config.get("is_causal")
            return cls(
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                target_layer_ids=[int(i) for i in ids],
                mask_token_id=int(mask),
                num_target_layers=config.get("num_target_layers"),
                block_size=int(_setting(config, "block_size", 16)),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=int(config.get("max_position_embeddings", 40960)),
                attention_bias=bool(config.get("attention_bias", False)),
                hidden_act=config.get("hidden_act", "silu"),
                is_causal=bool(causal) if causal is not None else None,
                windows=tuple(window if k == "sliding_attention" else None for k in kinds),
                output_multiplier=float(_setting(config, "output_multiplier", 1.0)),
                final_logit_softcapping=_setting(config, "final_logit_softcapping"),
                input_embedding_scale=float(_setting(config, "input_embedding_scale", 1.0)),
                denoising_steps=max(1, int(_setting(config, "denoising_steps", 1))),
                quantization=config.get("quantization") or None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{name}: config.json is incomplete or malformed ({one_line(e)})") from None


class DFlashAttention(nn.Module):
    """Block queries over [context rows seen so far, new context rows, the block]."""

    def __init__(self, args: DFlashArgs, window: int | None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.scale = self.head_dim**-0.5
        h, d, bias = args.hidden_size, self.head_dim, args.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.rope = make_rope(d, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
        self.window = window
        self.causal = args.is_causal if args.is_causal is not None else window is not None

    def keys_values(self, rows: mx.array, offset: int) -> tuple[mx.array, mx.array]:
        """Rotated keys and values [1, kv heads, T, head_dim] of ``rows`` from position ``offset``."""
        b, n, _ = rows.shape
        k = self.k_norm(self.k_proj(rows).reshape(b, n, self.n_kv_heads, self.head_dim)).transpose(0, 2, 1, 3)
        v = self.v_proj(rows).reshape(b, n, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return self.rope(k, offset), v

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        """The block ``x`` attends to the context rows in ``cache`` and to itself; its own
        keys and values join the cache (the caller trims them)."""
        b, n, _ = x.shape
        offset = cache.offset
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.n_heads, self.head_dim)).transpose(0, 2, 1, 3)
        q = self.rope(q, offset)
        k, v = cache.update_and_fetch(*self.keys_values(x, offset))
        out = sdpa(q, k, v, self.scale, self._mask(n, k.shape[2]))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    def _mask(self, n_queries: int, n_keys: int) -> mx.array | None:
        if not self.causal and self.window is None:
            return None
        query = mx.arange(n_keys - n_queries, n_keys)[:, None]
        key = mx.arange(n_keys)[None, :]
        visible = mx.ones((n_queries, n_keys), dtype=mx.bool_)
        if self.causal:
            visible = visible & (key <= query)
        if self.window is not None:
            visible = visible & (query - key < self.window)
            if not self.causal:
                visible = visible & (key - query < self.window)
        return visible


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs, window: int | None):
        super().__init__()
        self.self_attn = DFlashAttention(args, window)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, False, activation(args.hidden_act))
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """The drafter's layers; see the module docstring for one pass."""

    def __init__(self, args: DFlashArgs):
        super().__init__()
        self.args = args
        windows = args.windows or (None,) * args.num_hidden_layers
        self.layers = [DFlashLayer(args, windows[i]) for i in range(args.num_hidden_layers)]
        self.fc = nn.Linear(len(args.target_layer_ids) * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    @property
    def block_size(self) -> int:
        return self.args.block_size

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def absorb(self, features: mx.array, cache: list[KVCache]) -> None:
        """Add context rows for the target features ``features`` [1, c, n_ids * H] of the
        next c positions. Every layer reads the same projected features, so a row's keys and
        values never change once made."""
        rows = self.hidden_norm(self.fc(features))
        offset = cache[0].offset
        for layer, c in zip(self.layers, cache):
            c.update_and_fetch(*layer.self_attn.keys_values(rows, offset))

    def __call__(self, noise: mx.array, cache: list[KVCache]) -> mx.array:
        """Normed hidden states [1, B, H] of the block whose embeddings are ``noise``
        [1, B, H], placed right after the context rows ``cache`` holds; the block's keys and
        values join the cache (the caller trims them off)."""
        h = noise
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.norm(h)

    def logits(self, target: Any, hidden: mx.array) -> mx.array:
        """Logits over the target's vocabulary from the drafter's normed output."""
        logits = target.logits(hidden)
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        cap = self.args.final_logit_softcapping
        if cap is not None and float(cap) > 0:
            logits = mx.tanh(logits / float(cap)) * float(cap)
        return logits

    def embed(self, target: Any, ids: mx.array) -> mx.array:
        """The block's input: the target's raw token embeddings (scaled where the config says)."""
        x = target.model.embed_tokens(ids)
        scale = self.args.input_embedding_scale
        return x * scale if scale != 1.0 else x


def _target_shape(target: Any) -> tuple[int, int, int]:
    """(decoder layers, hidden size, embedding rows) of a target model."""
    args = target.args
    layers = len(target.layers)
    table = target.model.embed_tokens
    rows = getattr(table, "num_embeddings", None)
    if rows is None:
        rows = table.weight.shape[0]
    return layers, int(args.hidden_size), int(rows)


def check_pairs_with(args: DFlashArgs, target: Any, name: str = "the DFlash drafter") -> None:
    """Refuse, in one line, a drafter made for another target."""
    layers, hidden, rows = _target_shape(target)
    expected = args.num_target_layers
    if (expected is not None and int(expected) != layers) or max(args.target_layer_ids) >= layers:
        raise ModelLoadError(
            f"{name} was made for a target with {expected} layers (it reads layers {args.target_layer_ids}); "
            f"the loaded model has {layers}: pick the DFlash drafter published for this model"
        )
    if args.hidden_size != hidden:
        raise ModelLoadError(
            f"{name} reads hidden states of size {args.hidden_size}; the loaded model's are {hidden}: "
            "pick the DFlash drafter published for this model"
        )
    if args.vocab_size != int(target.args.vocab_size) or args.mask_token_id >= rows:
        raise ModelLoadError(
            f"{name} drafts over a vocabulary of {args.vocab_size} with mask token {args.mask_token_id}; "
            f"the loaded model has {target.args.vocab_size} ids ({rows} embedding rows): "
            "pick the DFlash drafter published for this model"
        )


def load_dflash(path: str | Path, target: Any) -> DFlashDraft:
    """Read a DFlash drafter folder and check it pairs with ``target``."""
    folder = Path(path)
    name = f"the DFlash drafter {folder.name}"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{name}: cannot read config.json ({one_line(e)})") from None
    args = DFlashArgs.from_config(config, name)
    check_pairs_with(args, target, name)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{name} has no .safetensors weights: download the drafter again")
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelLoadError(
                f"{name}: {file.name} is damaged or cut short ({one_line(e)}); download the drafter again"
            ) from None
    weights = {k.removeprefix("model."): v for k, v in weights.items() if "rotary_emb" not in k}
    model = DFlashDraft(args)
    quant = args.quantization
    if quant:
        from engine.artifacts.config import QuantizationSpec

        spec = QuantizationSpec(
            bits=int(quant["bits"]), group_size=int(quant["group_size"]), mode=quant.get("mode", "affine")
        )
        quantize_like_checkpoint(model, weights, spec, name=name)
    fill_weights(model, weights, name=name)
    try:
        mx.eval(model.parameters())
    except (RuntimeError, ValueError) as e:
        raise ModelLoadError(
            f"{name}: its weights cannot be read ({one_line(e)}); download the drafter again"
        ) from None
    return model
