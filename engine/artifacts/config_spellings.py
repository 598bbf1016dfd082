"""Config spellings, settled here once.

Checkpoints spell the same facts several ways: transformers 5 writes ``rope_parameters``
(flat, or one block per layer type) where published repos carry ``rope_theta`` +
``rope_scaling`` (``type`` or ``rope_type``); a multimodal wrapper nests the language
model's settings in ``text_config``; mRoPE's ``mrope_section`` sits in either RoPE block.
``ModelConfig`` (config.py) and every family's ``ModelArgs`` read them through these
functions and nowhere else.
"""

from __future__ import annotations

from typing import Any


def text_config_or_none(config: dict[str, Any]) -> dict[str, Any] | None:
    """A multimodal wrapper's nested ``text_config`` dict, or None for a plain config."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's settings, flattening a multimodal wrapper's ``text_config``.

    Keys of ``text_config`` win over the wrapper's own; the wrapper's ``model_type`` is
    kept as ``wrapper_model_type``.
    """
    inner = config.get("text_config")
    if not isinstance(inner, dict):
        return dict(config)
    merged = {k: v for k, v in config.items() if k != "text_config"}
    merged["wrapper_model_type"] = config.get("model_type")
    merged.update(inner)
    return merged


def rope_settings(
    config: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0
) -> tuple[float, dict[str, Any] | None]:
    """(base frequency, scaling dict or None) from either config spelling.

    Older configs: ``rope_theta`` plus ``rope_scaling`` ({"type"|"rope_type": ...}).
    Newer ones: ``rope_parameters`` = {"rope_type", "rope_theta", ...}, or one such dict
    per layer type ({"full_attention": {...}, "sliding_attention": {...}}), chosen by
    ``layer_type``. The scaling dict always carries "rope_type"; None means plain RoPE.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))
    if not isinstance(params, dict) or not params:
        params = dict(config.get("rope_scaling") or {})
    else:
        params = dict(params)
    theta = params.pop("rope_theta", None) or config.get("rope_theta") or default_theta
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default" or (rope_type == "linear" and float(params.get("factor", 1.0)) == 1.0):
        return float(theta), None
    params["rope_type"] = rope_type
    # Phi-3 keeps the pretraining length outside the RoPE dict; transformers prefers it.
    if "original_max_position_embeddings" in config and rope_type in ("llama3", "yarn", "longrope"):
        params.setdefault("original_max_position_embeddings", config["original_max_position_embeddings"])
    return float(theta), params


def partial_rotary_factor(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(config.get("partial_rotary_factor") or 1.0)


def mrope_section(config: dict[str, Any]) -> list[int] | None:
    """Multimodal RoPE's split of the rotary dims (time, height, width), from either block."""
    section = None
    for block in (config.get("rope_parameters"), config.get("rope_scaling")):
        if isinstance(block, dict) and block.get("mrope_section"):
            section = [int(s) for s in block["mrope_section"]]
    return section


def rope_theta_in_parameters(config: dict[str, Any]) -> float | None:
    """The base frequency a transformers-5 ``rope_parameters`` block carries, if any."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return None


def normalise_rope(cfg: dict[str, Any]) -> None:
    """Rewrite ``rope_parameters`` (transformers >= 5) into ``rope_theta`` + ``rope_scaling``.

    A flat block ``{"rope_type", "rope_theta", ...}`` applies to every layer. A block keyed
    by layer type (Gemma 3: ``full_attention`` / ``sliding_attention``) gives the global
    layers' values as usual and the sliding layers' base as ``rope_local_base_freq``, the
    older spelling of that model's config.
    """
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict):
        return
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        sliding = params.get("sliding_attention") or {}
        _apply_rope_block(cfg, full)
        if "rope_theta" in sliding:
            cfg["rope_local_base_freq"] = sliding["rope_theta"]
    else:
        _apply_rope_block(cfg, params)
    # rope_parameters stays: a family that reads the new spelling per layer type sees it whole.


def _apply_rope_block(cfg: dict[str, Any], block: dict[str, Any]) -> None:
    block = dict(block)
    if "rope_theta" in block:
        cfg["rope_theta"] = block.pop("rope_theta")
    if "partial_rotary_factor" in block:
        cfg.setdefault("partial_rotary_factor", block.pop("partial_rotary_factor"))
    rope_type = block.get("rope_type", block.get("type", "default"))
    if rope_type == "default" and len(set(block) - {"rope_type", "type"}) == 0:
        cfg.setdefault("rope_scaling", None)
        return
    block.setdefault("rope_type", rope_type)
    block.setdefault("type", rope_type)  # some readers still look for the old key
    cfg["rope_scaling"] = block
