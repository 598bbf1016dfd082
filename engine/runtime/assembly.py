"""Loading a model and everything needed to talk to it, before the host takes it over.

``assemble`` turns a folder, cached repo id or .gguf into its parts: the model (through
``loading.load_model``, which checks the memory plan first), the tokenizer (from the
folder's files or the GGUF's own vocabulary), the chat template (Jinja, Mistral's
instruct format, or plain text for base models), the end-of-turn ids (the union of
config, generation config and tokenizer), the ModelInfo and the media towers. The host
(host.py) keeps them and serves requests with them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.api import ModelInfo
from engine.errors import EngineError, OutOfMemoryBudget

LoadProgress = Callable[[float, float, str], None]


class LoadCancelled(EngineError):
    """The load was cancelled by the caller."""


@dataclass
class ModelParts:
    model: Any
    config: Any
    path: str
    tokenizer: Any
    template: Any
    eos_token_ids: list[int]
    info: ModelInfo
    towers: Any  # MediaTowers: which media the model takes; loads towers on first use
    mtp_apart: Any = None  # loading.MTPApart: the built-in MTP layer, read when MTP drafting first asks


def _checked_progress(progress: LoadProgress | None, cancel: threading.Event | None, what: str, message: str):
    def on_progress(done: int, total: int) -> None:
        # The loader lets an exception from here end the load cleanly.
        if cancel is not None and cancel.is_set():
            raise LoadCancelled(f"{what} was cancelled.")
        if progress is not None:
            progress(done, total, message)

    return on_progress


def assemble(
    path: str,
    budget: int | None,
    progress: LoadProgress | None = None,
    cancel: threading.Event | None = None,
    *,
    resident_experts: float | None = None,
    context_cap: int | None = None,
) -> ModelParts:
    """Load ``path`` with its tokenizer, template, end ids, description and towers;
    ``resident_experts``: an MoE model's share of experts held (engine.runtime.expert_plan),
    ``context_cap``: the context its slab leaves room for."""
    from engine.runtime.loading import load_model

    loaded = load_model(
        path,
        memory_budget=budget,
        progress=_checked_progress(progress, cancel, "Loading", "loading weights"),
        resident_experts=resident_experts,
        context_cap=context_cap,
    )
    if cancel is not None and cancel.is_set():
        raise LoadCancelled("Loading was cancelled.")
    tokenizer = load_tokenizer(loaded)
    config = loaded.config
    eos = _union(getattr(config, "eos_token_ids", None), getattr(tokenizer, "eos_token_ids", None))
    towers = _make_towers(loaded)
    template = load_template(tokenizer)
    mtp, mtp_note = _mtp_support(loaded)
    tool_format, arguments_as_text = _tool_format(template)
    embedding = getattr(loaded, "embedding", None)
    # Built once, from the files the load read and what was assembled: ModelInfo says what
    # the engine can feed this model, not only what its config names.
    info = replace(
        _describe(loaded, budget),
        vision="image" in towers.kinds,
        audio="audio" in towers.kinds,
        video="video" in towers.kinds,
        video_limits=towers.video_limits(),
        pan_and_scan=towers.pan_and_scan(),
        chat_template=bool(getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "mistral_format", None)),
        reasoning_control=_reasoning_control(template),
        mtp=mtp,
        mtp_note=mtp_note,
        tool_format=tool_format,
        tool_arguments_as_text=arguments_as_text,
        embedding_dimensions=embedding.dimensions if embedding is not None else None,
    )
    return ModelParts(loaded.model, config, str(loaded.path), tokenizer, template, eos, info, towers, loaded.mtp_apart)


def assemble_draft(
    path: str, budget: int | None, progress: LoadProgress | None = None, cancel: threading.Event | None = None
) -> tuple[Any, Any, ModelInfo]:
    """A draft model for speculative decoding, within what the budget leaves: (model, tokenizer, info)."""
    from engine.runtime.loading import load_model

    on_progress = _checked_progress(progress, cancel, "Loading the draft model", "loading the draft model")
    try:
        loaded = load_model(path, memory_budget=budget, progress=on_progress)
    except OutOfMemoryBudget as e:
        raise OutOfMemoryBudget(f"The draft model does not fit beside the loaded model: {e}") from None
    return loaded.model, load_tokenizer(loaded), _describe(loaded, budget)


def _describe(loaded: Any, budget: int | None) -> ModelInfo:
    from engine.runtime.model_info import inspect_model

    # The load planned from these files already, and read them once: its plan and what it
    # read stand.
    return inspect_model(
        str(loaded.path),
        memory_budget=budget,
        kv_config=False,
        plan=getattr(loaded, "plan", None),
        source=getattr(loaded, "source", None),
    )


def _union(*groups: Sequence[int] | None) -> list[int]:
    out: list[int] = []
    for group in groups:
        for i in group or ():
            if int(i) not in out:
                out.append(int(i))
    return out


def load_tokenizer(loaded: Any) -> Any:
    from engine.text.tokenizer import Tokenizer

    if getattr(loaded, "gguf_metadata", None):
        return Tokenizer.from_gguf(loaded.gguf_metadata)
    return Tokenizer.from_dir(getattr(loaded, "tokenizer_path", None) or loaded.path)


def load_template(tokenizer: Any) -> Any:
    from engine.text.chat_template import ChatTemplate, PlainTextTemplate

    source = getattr(tokenizer, "chat_template", None)
    if not source and getattr(tokenizer, "mistral_format", None):
        from engine.text.mistral_format import MistralFormat

        return MistralFormat(tokenizer.mistral_format, tokenizer.bos_token or "<s>", tokenizer.eos_token or "</s>")
    if not source:
        bos = tokenizer.bos_token if getattr(tokenizer, "add_bos_token", False) else None
        return PlainTextTemplate(bos)
    return ChatTemplate(source, special_tokens=getattr(tokenizer, "special_tokens", None))


def reasoning_factory(template: Any) -> Callable[[str], Any]:
    """A function from the rendered prompt to a splitter of reasoning text (None when the
    template uses no reasoning markers)."""
    from engine.text.markers import detect_reasoning_markers

    source = getattr(template, "source", None) or ""

    def make(prompt: str) -> Any:
        markers = detect_reasoning_markers(source, prompt)
        return markers.splitter() if markers is not None else None

    return make


def _mtp_support(loaded: Any) -> tuple[bool, str]:
    """Whether the model carries its multi-token-prediction layers (loaded, or set apart until
    MTP drafting asks for them), and if not, why (for a family that has them: Qwen3.5,
    Qwen3-Next, DeepSeek V3, GLM-5)."""
    model = loaded.model
    if getattr(model, "mtp", None) is not None or getattr(loaded, "mtp_apart", None) is not None:
        return True, ""
    if not hasattr(model, "hidden_listener") or getattr(model.args, "num_nextn_predict_layers", None) == 0:
        return False, "This model has no built-in multi-token-prediction layers."
    return False, (
        "This copy has no multi-token-prediction layers: mlx-lm's conversions drop them. "
        "The original Hugging Face checkpoint has them."
    )


def _reasoning_control(template: Any) -> Any:
    """The template's reasoning switch (ModelInfo.reasoning_control), None without one."""
    from engine.text.chat_template import ChatTemplate
    from engine.text.reasoning_switch import find_reasoning_control

    return find_reasoning_control(template) if isinstance(template, ChatTemplate) else None


def _tool_format(template: Any) -> tuple[str | None, bool]:
    """How the template's model writes tool calls, found once per load: (the format's name,
    a key of engine.text.tool_calls.FORMATS, or None; whether its arguments are text)."""
    from engine.text.tool_calls import detect_tool_format

    fmt = detect_tool_format(getattr(template, "source", None))
    return (fmt.name, fmt.arguments_as_text) if fmt is not None else (None, False)


def _make_towers(loaded: Any) -> Any:
    from pathlib import Path

    from engine.media.towers import MediaTowers, TowerSource

    path = Path(loaded.path)
    source = TowerSource(
        name=getattr(loaded, "name", path.name),
        path=path,
        config=loaded.config,
        model=loaded.model,
        dtype=getattr(loaded, "dtype", "float32"),
    )
    return MediaTowers(source, plan=getattr(loaded, "plan", None))
