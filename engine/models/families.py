"""The family manifest: every model family the engine runs, declared in one place.

One ``Family`` per config.json ``model_type`` says what the engine does with it, and every
registry reads it rather than keeping its own list:

- ``module``: the module of this package with its ``ModelArgs`` and ``Model`` classes
  (``engine.models.get_family``);
- ``towers``: media kind -> the module whose ``make_encoder(source)`` builds that kind's
  tower with its processor ("module:function" names another factory in it), read by
  ``engine.media.towers``;
- ``batches``: every layer keeps a plain ``KVCache`` and rotates with the plain ``RoPE``,
  so its sequences can share one decode step (``engine.decode.batch``; a checkpoint with a
  sliding window or another RoPE variant is still checked layer by layer);
- ``embeds``: the published sentence embedding models built on it (``engine.models.embedder``);
- ``shards``: the splits its models run across several machines ("pipeline": a range of
  layers each; "tensor": every layer split), read by ``engine.models.sharding``; empty: none;
- ``streams_experts``: an MoE family whose routed experts may be read from disk when routed
  rather than all held in memory (``engine.runtime.expert_plan``); its streamed decoding is
  checked token for token against the fully resident model.

Paged KV is not a family's property: a loaded model pages its plain full-attention layers
whatever its family, and ``engine.models.paged_kv.pool_for`` refuses, in one line, a model
with none of them (latent attention, sliding windows everywhere) or with a RoPE that depends
on the pass's length (checked for every golden model in tests/engine/models/test_paged_kv.py).

Pure data (no MLX): the app and the docs may read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Family:
    module: str
    towers: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    batches: bool = False
    embeds: str | None = None
    shards: tuple[str, ...] = ()
    streams_experts: bool = False


def _towers(**kinds: str) -> Mapping[str, str]:
    return MappingProxyType(dict(kinds))


_QWEN3_VL = _towers(image="engine.media.qwen3_vl.encoders", video="engine.media.qwen3_vl.encoders:make_video_encoder")
PIPELINE = ("pipeline",)
BOTH = ("pipeline", "tensor")
_QWEN3_5 = _towers(image="engine.media.qwen3_5.encoders", video="engine.media.qwen3_5.encoders:make_video_encoder")

# model_type -> its family
FAMILIES: Mapping[str, Family] = MappingProxyType(
    {
        "deepseek_v3": Family("deepseek_v3", shards=BOTH, streams_experts=True),
        "diffusion_gemma": Family("diffusion_gemma", _towers(image="engine.media.gemma4.diffusion")),
        "gemma2": Family("gemma2"),
        "gemma3": Family("gemma3", _towers(image="engine.media.gemma3.vision")),
        "gemma3_text": Family("gemma3", embeds="EmbeddingGemma"),
        "gemma4": Family(
            "gemma4",
            _towers(image="engine.media.gemma4.vision", audio="engine.media.gemma4.audio"),
            streams_experts=True,
        ),
        "gemma4_text": Family("gemma4", streams_experts=True),
        "gpt_oss": Family("gpt_oss", shards=PIPELINE, streams_experts=True),
        "glm4_moe": Family("glm4_moe", shards=PIPELINE, streams_experts=True),
        "glm4_moe_lite": Family("glm4_moe_lite", streams_experts=True),
        "glm_moe_dsa": Family("glm_moe_dsa", streams_experts=True),
        "kimi_k2": Family("deepseek_v3", shards=BOTH, streams_experts=True),
        "lfm2": Family("lfm2"),
        "lfm2_moe": Family("lfm2_moe", streams_experts=True),
        "llama": Family("llama", batches=True, shards=BOTH),
        "ministral3": Family("ministral3"),
        "mistral": Family("llama", batches=True, shards=BOTH),
        "mistral3": Family("mistral3", _towers(image="engine.media.pixtral.tower")),
        "phi3": Family("phi3"),
        "qwen2": Family("qwen2", batches=True, shards=BOTH),
        "qwen2_5_vl": Family("qwen2_5_vl", _towers(image="engine.media.qwen2_5_vl.vision")),
        "qwen2_audio": Family("qwen2_audio", _towers(audio="engine.media.qwen2_audio.tower")),
        "qwen3": Family("qwen3", batches=True, embeds="Qwen3-Embedding", shards=BOTH),
        "qwen3_moe": Family("qwen3_moe", batches=True, shards=BOTH, streams_experts=True),
        "smollm3": Family("smollm3"),
        "qwen3_vl": Family("qwen3_vl", _QWEN3_VL),
        "qwen3_vl_moe": Family("qwen3_vl_moe", _QWEN3_VL),
        "qwen3_5": Family("qwen3_5", _QWEN3_5, shards=PIPELINE),
        "qwen3_5_text": Family("qwen3_5", shards=PIPELINE),
        "qwen3_5_moe": Family("qwen3_5_moe", _QWEN3_5, shards=PIPELINE, streams_experts=True),
        "qwen3_5_moe_text": Family("qwen3_5_moe", shards=PIPELINE, streams_experts=True),
        "qwen3_next": Family("qwen3_next", streams_experts=True),
        "voxtral": Family("voxtral", _towers(audio="engine.media.voxtral.tower")),
    }
)
