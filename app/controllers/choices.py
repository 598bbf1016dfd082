"""What a reply is asked with: a chat's settings over the model's generation defaults.

``build_params`` merges the conversation's choices (sampling, stops, speculative decoding,
context overflow, the reasoning switch) over the model's generation_config and the engine's
defaults into the engine's GenerationParams; a choice the loaded model cannot take (a
reasoning level its template has no switch for) is left out rather than refused.
"""

from __future__ import annotations

from typing import Any, Literal

from engine import api

# A chat's "context_overflow" setting as the engine's GenerationParams.context_policy.
CONTEXT_POLICIES: dict[str, Literal["stop", "truncate_middle", "rolling"]] = {
    "stop": "stop",
    "truncate_middle": "truncate_middle",
    "rolling": "rolling",
}

DEFAULT_OVERFLOW = "truncate_middle"  # a chat's context overflow policy unless it sets one

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")


def build_params(
    settings: dict[str, Any], defaults: dict[str, Any], reasoning_control: Any = None
) -> api.GenerationParams:
    """Conversation settings over the model's generation_config over engine defaults.
    The chat's reasoning choice goes only to a model whose template switch takes it (a
    chat may have been set up under another model)."""
    merged = {**defaults, **{k: v for k, v in settings.items() if v is not None}}
    sampling = api.SamplingParams(
        **{k: merged[k] for k in SAMPLING_KEYS if k in merged and merged[k] not in ("", None)}
    )
    params = api.GenerationParams(sampling=sampling)
    if merged.get("max_tokens"):
        params.max_tokens = int(merged["max_tokens"])
    if merged.get("stop_strings"):
        params.stop_strings = [s for s in merged["stop_strings"] if s]
    if merged.get("ignore_eos"):
        params.ignore_eos = True
    if merged.get("speculative") in ("ngram", "draft", "mtp"):
        params.speculative = merged["speculative"]
    if isinstance(merged.get("pan_and_scan"), bool):  # unset: the model's own setting
        params.pan_and_scan = merged["pan_and_scan"]
    policy = merged.get("context_overflow") or DEFAULT_OVERFLOW
    if policy in CONTEXT_POLICIES:
        params.context_policy = CONTEXT_POLICIES[policy]
    if accepts_reasoning(reasoning_control, settings.get("reasoning")):
        params.reasoning = settings["reasoning"]
    return params


def accepts_reasoning(control: Any, choice: Any) -> bool:
    """Whether the template switch ``control`` (ModelInfo.reasoning_control) takes ``choice``."""
    if control is None or choice is None:
        return False
    return any(choice == c and type(choice) is type(c) for c in control.choices)
