"""Settings that cannot mean anything are refused when a model folder is read.

``sanity.py`` checks the sizes that shape arrays. This module checks the other numbers a
config carries into the arithmetic: normalisation epsilons, the RoPE base and scaling
block, the context length, token ids, and generation_config.json's sampling defaults.
Left alone, a negative epsilon or a RoPE base of 0 ends deep inside MLX as an internal
error or as NaN blamed on the weights, a context of 0 makes every prompt too long, and a
NaN temperature is handed to every request. Each refusal is one line naming the file, the
key, the value and what it must be.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from engine.errors import ModelLoadError

_EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")
_ROPE_BASES = ("rope_theta", "rope_local_base_freq")
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "n_ctx")
_TOKEN_IDS = ("eos_token_id", "bos_token_id")
# RoPE scaling types whose formula needs the pretraining length (transformers requires it too).
_NEEDS_ORIGINAL_LENGTH = ("llama3", "yarn")
_MAX_POSITIONS = 2**31 - 1


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _is_whole(value: Any) -> bool:
    """An integer (a GGUF header's numpy integers too), or a float with nothing after the point."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())


def _refuse(where: str, key: str, value: Any, rule: str) -> ModelLoadError:
    return ModelLoadError(f"{where} says {key} is {value!r}; it must be {rule}: the file is damaged or mistyped")


def check_model_settings(cfg: Mapping[str, Any], where: str) -> None:
    """Epsilons, RoPE, context length, tie_word_embeddings and token ids of one config dict
    (a plain config, or a multimodal wrapper's text_config)."""
    for key in _EPSILONS:
        value = cfg.get(key)
        if value is not None and not (_is_number(value) and 0 < value < 1):
            raise _refuse(where, key, value, "a small positive number such as 1e-6")
    for key in _ROPE_BASES:
        value = cfg.get(key)
        if value is not None and not (_is_number(value) and value > 0):
            raise _refuse(where, key, value, "a positive number such as 10000")
    for key in _CONTEXT_KEYS:
        value = cfg.get(key)
        if value is not None and not (_is_whole(value) and 1 <= value <= _MAX_POSITIONS):
            raise _refuse(where, key, value, f"a whole number of tokens from 1 to {_MAX_POSITIONS:,}")
    tie = cfg.get("tie_word_embeddings")
    if tie is not None and not isinstance(tie, bool):
        raise _refuse(where, "tie_word_embeddings", tie, "true or false")
    for key in _TOKEN_IDS:
        value = cfg.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(v is None or _is_whole(v) for v in ids):
            raise _refuse(where, key, value, "a token id (a whole number) or a list of them")
    check_rope_scaling(cfg.get("rope_scaling"), where, outer_length=cfg.get("original_max_position_embeddings"))


def check_rope_scaling(block: Any, where: str, *, outer_length: Any = None) -> None:
    """``rope_scaling``: null, or an object whose numbers are positive and finite, with the
    pretraining length its type's formula needs (in the block, or beside it in the config:
    ``outer_length``, Phi-3's spelling, which config_spellings.rope_settings also reads)."""
    if block is None:
        return
    if not isinstance(block, Mapping):
        raise _refuse(where, "rope_scaling", block, 'null or an object like {"rope_type": "linear", "factor": 2.0}')
    kind = block.get("rope_type", block.get("type"))
    if kind is not None and not isinstance(kind, str):
        raise _refuse(where, "rope_scaling.rope_type", kind, "a name such as linear, dynamic, llama3 or yarn")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast", "beta_slow"):
        value = block.get(key)
        if value is not None and not (_is_number(value) and value > 0):
            raise _refuse(where, f"rope_scaling.{key}", value, "a positive number")
    original = block.get("original_max_position_embeddings")
    if original is not None and not (_is_whole(original) and 1 <= original <= _MAX_POSITIONS):
        raise _refuse(where, "rope_scaling.original_max_position_embeddings", original, "a whole number of tokens")
    if kind in _NEEDS_ORIGINAL_LENGTH and original is None and outer_length is None:
        raise ModelLoadError(
            f"{where} asks for {kind} RoPE scaling without rope_scaling.original_max_position_embeddings "
            "(the pretraining context it scales from): the file is damaged or incomplete"
        )
    for key in ("short_factor", "long_factor", "mrope_section"):
        value = block.get(key)
        if value is not None and not (isinstance(value, list) and all(_is_number(v) and v >= 0 for v in value)):
            raise _refuse(where, f"rope_scaling.{key}", value, "a list of non-negative numbers")


# generation_config.json: key -> (test, what it must be). Ranges as the sampler takes them.
_GENERATION_RULES = {
    "temperature": (lambda v: _is_number(v) and 0 <= v <= 100, "a number from 0 (greedy) to 100"),
    "top_p": (lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "top_k": (lambda v: _is_whole(v) and 0 <= v <= 2**31 - 1, "a whole number, 0 for off"),
    "repetition_penalty": (lambda v: _is_number(v) and 0 < v <= 100, "a number above 0, 1.0 for off"),
    "max_new_tokens": (lambda v: _is_whole(v) and v >= 1, "a whole number of at least 1"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
}


def check_generation_settings(generation: Any, where: str) -> None:
    """generation_config.json: an object whose sampling defaults the sampler can take."""
    if not isinstance(generation, Mapping):
        raise ModelLoadError(
            f"{where} must hold a JSON object, not {type(generation).__name__}: fix or delete the file"
        )
    for key, (test, rule) in _GENERATION_RULES.items():
        value = generation.get(key)
        if value is not None and not test(value):
            raise _refuse(where, key, value, rule)
    for key in _TOKEN_IDS:
        value = generation.get(key)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(v is None or _is_whole(v) for v in ids):
            raise _refuse(where, key, value, "a token id (a whole number) or a list of them")


# preprocessor_config.json / processor_config.json: sizes and rates a processor divides or
# resizes by. A zero or negative one ends as a division by zero or an empty image far away.
# Each may be a number, or per side ({"height": 8, "width": 8}, Pixtral's patch_size) or a list.
_PROCESSOR_POSITIVE = (
    "patch_size", "merge_size", "spatial_merge_size", "temporal_patch_size", "min_pixels", "max_pixels",
    "pooling_kernel_size", "max_soft_tokens", "image_seq_length", "sampling_rate", "n_fft", "hop_length",
    "feature_size", "chunk_length", "num_mel_bins", "fps", "min_frames", "max_frames", "num_frames",
    "rescale_factor", "size", "crop_size", "pad_size",
)  # fmt: skip


def _parts(key: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, Mapping):
        return [(f"{key}.{part}", v) for part, v in value.items()]
    if isinstance(value, list):
        return [(f"{key}.{i}", v) for i, v in enumerate(value)]
    return [(key, value)]


def check_processor_settings(settings: Mapping[str, Any], where: str) -> None:
    """A media processor's settings: positive sizes and rates, finite means, non-zero spreads."""
    for key in _PROCESSOR_POSITIVE:
        for name, value in _parts(key, settings.get(key)):
            if value is not None and not (_is_number(value) and value > 0):
                raise _refuse(where, name, value, "a positive number")
    for key, low in (("image_mean", None), ("image_std", 0)):
        value = settings.get(key)
        values = value if isinstance(value, list) else [value]
        if value is not None and not all(_is_number(v) and (low is None or v > low) for v in values):
            rule = "a list of numbers" if low is None else "a list of positive numbers"
            raise _refuse(where, key, value, rule)
