"""DiffusionGemma (``diffusion_gemma``): Gemma 4's MoE layers run two ways.

transformers 5.23 splits the model into an encoder and a decoder that share every
layer weight (the checkpoint stores them once, under ``model.decoder.``):

* the **encoder** reads the prompt (and, later, each finished block) causally, like a
  Gemma 4 model, and only fills the KV cache;
* the **decoder** reads a canvas of ``canvas_length`` tokens at the positions after the
  cache, attending both ways over the cached keys and values and the canvas itself,
  without writing to the cache. Sliding layers see the last ``sliding_window - 1``
  cached tokens (what transformers' sliding cache keeps) plus the whole canvas.

Besides the shared weights, the decoder has a self-conditioning block (a gated MLP
over the softmax-weighted embedding of the previous step's logits, added to the canvas
embedding and RMS-normalised) and each of the two keeps its own per-layer scale
(``layer_scalar``). The global layers use keys as values. Images go through Gemma 4's
vision tower (engine/media/gemma4/diffusion.py) into the prompt's embeddings; the
encoder lets one image's tokens see each other both ways on every layer (transformers'
"vision" mode here overlays the image runs on the full layers' causal mask and on the
sliding layers' windowed one alike, unlike Gemma 4's, whose full layers stay causal and
whose sliding layers cut an image at the window). The denoising loop itself is
engine/decode/diffusion.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.errors import UnsupportedModelError
from engine.models import gemma4
from engine.models.base import activation, attention_mask, caches_for, sdpa, text_config
from engine.models.gemma3 import media_mask

_SKIPPED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.", "lm_head.")
_ENCODER_SCALAR = "model.encoder.language_model.layers."


@dataclass
class ModelArgs(gemma4.ModelArgs):
    model_type: str = "diffusion_gemma"
    canvas_length: int = 256  # tokens per block (transformers' default)

    @classmethod
    def normalise(cls, config: dict[str, Any]) -> dict[str, Any]:
        canvas = config.get("canvas_length") or cls.canvas_length
        inner = text_config(config)
        if inner.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError(
                "This DiffusionGemma checkpoint encodes its prompt both ways (use_bidirectional_attention "
                "'all'); MLX Desk runs the causal-encoder ones."
            )
        inner.update(
            canvas_length=int(canvas),
            model_type="diffusion_gemma",
            # What DiffusionGemma fixes where Gemma 4 has switches: always the MoE block, the
            # global layers' keys as values (and their own KV heads), no PLE, no KV sharing.
            enable_moe_block=True,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=0,
            num_kv_shared_layers=0,
            use_double_wide_mlp=False,
            final_logit_softcapping=inner.get("final_logit_softcapping", 30.0),
        )
        return super().normalise(inner)


def image_mask(cache: Any, n: int, window: int | None, blocks: list[tuple[int, int]]) -> mx.array:
    """Boolean [n, keys] mask before ``cache`` takes ``n`` new tokens: causal within
    ``window`` (None: no window), OR both tokens in one of ``blocks`` whatever the window."""
    no_blocks = media_mask(cache, n, window, [])  # the cache's key layout, causal and windowed
    offset = int(cache.offset) if cache is not None else 0
    n_keys = no_blocks.shape[-1]
    q = mx.arange(offset, offset + n)[:, None]
    k = (mx.arange(n_keys) + offset + n - n_keys)[None, :]
    allowed = no_blocks
    for start, end in blocks:
        s, e = offset + start, offset + end
        allowed = allowed | ((q >= s) & (q < e) & (k >= s) & (k < e))
    return allowed


@partial(mx.compile, shapeless=True)
def _float_soft_cap(logits: mx.array, cap: float) -> mx.array:
    """``tanh(logits / cap) * cap`` in float32, in one pass over a canvas's [256, vocab] logits
    (each denoising step makes them; four passes uncompiled)."""
    return mx.tanh(logits.astype(mx.float32) / cap) * cap


class SelfConditioning(nn.Module):
    """The previous step's soft prediction, through a gated MLP, added to the canvas embedding."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, inner = args.hidden_size, args.intermediate_size
        self.pre_norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.gate_proj = nn.Linear(h, inner, bias=False)
        self.up_proj = nn.Linear(h, inner, bias=False)
        self.down_proj = nn.Linear(inner, h, bias=False)
        self.act = activation(args.hidden_activation)
        self.eps = args.rms_norm_eps

    def __call__(self, embedded: mx.array, soft: mx.array | None) -> mx.array:
        if soft is not None:  # without a previous step the signal is zero, and so is the MLP's output
            normed = self.pre_norm(soft)
            embedded = embedded + self.down_proj(self.act(self.gate_proj(normed)) * self.up_proj(normed))
        return mx.fast.rms_norm(embedded, None, self.eps)  # post-norm without a scale


class Model(nn.Module):
    # Paged KV (engine/models/paged_kv.py) declines this family, saying so.
    cannot_page = "DiffusionGemma's denoising reads its cache's buffers directly, so its KV cache cannot page"

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = gemma4.Gemma4Model(args)
        self.self_conditioning = SelfConditioning(args)
        self.encoder_layer_scalars = mx.ones((args.num_hidden_layers,))

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.embed_tokens

    @property
    def canvas_length(self) -> int:
        return self.args.canvas_length

    def make_cache(self) -> list:
        return caches_for(self.args.layer_windows())

    def embed(self, inputs: mx.array) -> mx.array:
        return self.model.embed(inputs)

    def logits(self, h: mx.array) -> mx.array:
        return _float_soft_cap(self.model.embed_tokens.as_linear(h), self.args.final_logit_softcapping)

    @property
    def bidirectional_media(self) -> bool:
        """Whether the prompt builder should pass each image's token run to ``encode``."""
        return self.args.use_bidirectional_attention == "vision"

    # -- encoder: fill the cache ------------------------------------------------------

    def encode(
        self,
        inputs: mx.array,
        cache: list,
        input_embeddings: mx.array | None = None,
        bidirectional: list[tuple[int, int]] | None = None,
    ) -> None:
        """Run ``inputs`` [B, L] causally through every layer, appending to ``cache``.
        ``input_embeddings`` [B, L, hidden] replace the ids' (images spliced in), and the
        ``bidirectional`` [start, end) runs (one image each) attend both ways. Only the
        keys and values are kept: the last layer's feed-forward is skipped."""
        h = self.model.embed(inputs) if input_embeddings is None else input_embeddings
        offset, n = cache[0].offset, inputs.shape[1]
        masks: dict[int | None, Any] = {}
        last = len(self.layers) - 1
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            if layer.window not in masks:
                if bidirectional:
                    masks[layer.window] = image_mask(c, n, layer.window, bidirectional)
                else:
                    masks[layer.window] = attention_mask(n, c, layer.window)
            attn, _ = layer.self_attn(layer.input_layernorm(h), masks[layer.window], c, offset, None)
            if i < last:
                h = layer.unscaled_after_attention(h, attn, None) * self.encoder_layer_scalars[i]
        mx.eval([c.keys for c in cache])

    # -- decoder: denoise a canvas ----------------------------------------------------

    def soft_embedding(self, logits: mx.array) -> mx.array:
        """The embedding under the softmax of ``logits`` (scaled like token embeddings)."""
        embed = self.model.embed_tokens
        if isinstance(embed, nn.QuantizedEmbedding):  # a quantized checkpoint: its table is packed
            dtype = embed.scales.dtype
            probs = mx.softmax(logits.astype(mx.float32), axis=-1).astype(dtype)
            mixed = mx.quantized_matmul(
                probs,
                embed.weight,
                embed.scales,
                embed.biases,
                transpose=False,
                group_size=embed.group_size,
                bits=embed.bits,
                mode=getattr(embed, "mode", "affine"),
            )
        else:
            dtype = embed.weight.dtype
            probs = mx.softmax(logits.astype(mx.float32), axis=-1).astype(dtype)
            mixed = probs @ embed.weight
        return mixed * mx.array(self.args.hidden_size**0.5, dtype=dtype)

    def denoise(self, canvas: mx.array, cache: list, previous_logits: mx.array | None = None) -> mx.array:
        """Float32 logits [B, canvas, vocab] for ``canvas`` [B, canvas] after what ``cache``
        holds, self-conditioned on ``previous_logits`` (None at a block's first step)."""
        h = self.canvas_input(canvas, previous_logits)
        offset = cache[0].offset
        for layer, c in zip(self.layers, cache):
            h = layer.after_attention(h, self.canvas_attention(layer, c, h, offset), None)
        return self.logits(self.model.norm(h))

    # The step's parts, apart so that ``bench --profile`` can time each.

    def canvas_input(self, canvas: mx.array, previous_logits: mx.array | None) -> mx.array:
        """The canvas's embeddings, self-conditioned on the previous step's logits."""
        soft = self.soft_embedding(previous_logits) if previous_logits is not None else None
        return self.self_conditioning(self.model.embed(canvas), soft)

    def canvas_attention(self, layer: nn.Module, c: Any, h: mx.array, offset: int) -> mx.array:
        """One layer's attention output for the canvas ``h``: both ways over the canvas and
        over what ``c`` holds (its window's last ``window - 1`` tokens for a sliding layer)."""
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(h), offset)
        if c.offset:
            old_k, old_v = c.held()
            if layer.window is not None:  # transformers' sliding cache keeps window - 1 tokens
                old_k, old_v = old_k[..., -(layer.window - 1) :, :], old_v[..., -(layer.window - 1) :, :]
            k, v = mx.concatenate([old_k, k], axis=2), mx.concatenate([old_v, v], axis=2)
        return attn.out(sdpa(q, k, v, 1.0, None))

    # -- loading ----------------------------------------------------------------------

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        scalars: dict[int, mx.array] = {}
        for key, value in weights.items():
            if key.startswith(_SKIPPED) or "rotary_emb" in key:
                continue
            if key.startswith(_ENCODER_SCALAR) and key.endswith(".layer_scalar"):
                scalars[int(key[len(_ENCODER_SCALAR) :].split(".")[0])] = value.reshape(())
                continue
            if key.startswith("model.encoder."):
                continue  # tied to the decoder's copy (transformers stores it once)
            if key.startswith("model.decoder.self_conditioning."):
                key = key.removeprefix("model.decoder.")
            elif key.startswith("model.decoder."):
                key = "model." + key.removeprefix("model.decoder.")
            out[key] = value
        if scalars:
            out["encoder_layer_scalars"] = mx.stack([scalars[i] for i in sorted(scalars)])
        return gemma4.unpack_experts(out)
