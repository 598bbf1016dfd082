"""What a model is and what it needs: ``ModelInfo`` and the ``MemoryPlan`` it carries.

Built once per load (or inspection) from what the load read, before any weight loads where a
plan is concerned. No MLX arrays here: the app imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

UNLIMITED_CONTEXT = 2**63 - 1  # MemoryPlan.max_context when the KV cache stops growing in time


@dataclass
class KVWindow:
    """Sliding-window layers that share one window: their KV cache stops growing at ``tokens``."""

    tokens: int  # the window
    layers: int  # how many layers use it
    bytes_per_token: int  # all those layers together, until the window is full

    @property
    def max_bytes(self) -> int:
        return self.tokens * self.bytes_per_token


@dataclass
class ExpertResidency:
    """How much of an MoE model's routed experts stays in memory: each MoE layer holds
    ``slots`` of its ``experts`` in a slab; the rest are read from the files when routed."""

    total_bytes: int  # every routed expert, as held in memory
    slab_bytes: int  # what the slabs hold (all layers)
    layers: int  # MoE layers
    experts: int  # routed experts per layer
    slots: int  # slab slots per layer
    top_k: int  # experts a token is routed to
    # Expected share of fully resident decode speed (engine.runtime.expert_plan.speed_share).
    speed_share: float = 1.0

    @property
    def streamed(self) -> bool:
        return self.slots < self.experts

    @property
    def streamed_bytes(self) -> int:
        return self.total_bytes - self.slab_bytes


@dataclass
class MemoryPlan:
    """What a model needs, computed from file headers before any weight loads.

    KV cache: every full-attention layer costs ``kv_bytes_per_token`` for every token of
    the context; a sliding-window layer costs the same per token until its window is
    full and then no more (``kv_windows``, at most ``kv_window_bytes`` together).
    """

    weights_bytes: int
    kv_bytes_per_token: int  # the full-attention layers (sliding-window ones: kv_windows)
    budget_bytes: int
    total_bytes: int  # the machine's memory
    kv_windows: list[KVWindow] = field(default_factory=list)
    # Recurrent layers (Qwen3.5's DeltaNet, LFM2's convolutions): a fixed state from the
    # first token on, whatever the context length, with the snapshots kept for prefix reuse.
    state_bytes: int = 0
    # A built-in multi-token-prediction layer: loaded only when MTP drafting asks for it,
    # and part of weights_bytes only then (``mtp_loaded``).
    mtp_bytes: int = 0
    mtp_loaded: bool = False
    # Stored in the files but never loaded, so not in weights_bytes (further MTP layers,
    # the MTP layer's copies of the embedding and output head).
    left_out_bytes: int = 0
    # An MoE model's routed experts: how many are held (weights_bytes counts the slabs, not
    # every expert, when some are read from disk); None for a dense model.
    experts: ExpertResidency | None = None

    @property
    def kv_window_bytes(self) -> int:
        """What the sliding-window layers hold at most, reached once the context passes the window."""
        return sum(w.max_bytes for w in self.kv_windows)

    def kv_bytes(self, tokens: int) -> int:
        """The KV cache of a ``tokens``-long context, all layers."""
        tokens = max(0, tokens)
        return (
            self.kv_bytes_per_token * tokens
            + sum(w.bytes_per_token * min(tokens, w.tokens) for w in self.kv_windows)
            + (self.state_bytes if tokens else 0)
        )

    @property
    def max_context(self) -> int:
        """The longest context whose KV cache fits beside the weights in the budget;
        ``UNLIMITED_CONTEXT`` when the cache stops growing (all layers windowed) and fits."""
        spare = self.budget_bytes - self.weights_bytes - self.state_bytes
        if spare < 0:
            return 0
        # kv_bytes grows piecewise linearly and more slowly as each window fills.
        tokens, used = 0, 0
        slope = self.kv_bytes_per_token + sum(w.bytes_per_token for w in self.kv_windows)
        for window in sorted(self.kv_windows, key=lambda w: w.tokens):
            if window.tokens > tokens and slope:
                if used + slope * (window.tokens - tokens) > spare:
                    return tokens + (spare - used) // slope
                used += slope * (window.tokens - tokens)
                tokens = window.tokens
            slope -= window.bytes_per_token
        return tokens + (spare - used) // slope if slope else UNLIMITED_CONTEXT

    @property
    def kv_limits_context(self) -> bool:
        """Whether the budget, rather than nothing at all, bounds the context."""
        return self.max_context != UNLIMITED_CONTEXT

    @property
    def fits(self) -> bool:
        return self.weights_bytes < self.budget_bytes


@dataclass
class AdapterInfo:
    """A LoRA/DoRA adapter mounted on the loaded model."""

    name: str
    path: str
    format: str  # "mlx-lm" or "peft"
    kind: str  # "lora" or "dora"
    rank: int
    targets: int  # how many layers it changes
    base_model: str | None = None  # the model it says it was trained on, if it says


@dataclass(frozen=True)
class ReasoningControl:
    """A variable the chat template reads to turn reasoning on or off or to set its effort.

    ``choices`` are the values it takes: ``(False, True)`` for a switch
    (``enable_thinking``, ``thinking``), ``("low", "medium", "high")`` for
    ``reasoning_effort``. ``default`` is the choice the template renders exactly like when
    the variable is left undefined; None when no choice does (or the probe failed).
    """

    variable: str
    choices: tuple[bool | str, ...]
    default: bool | str | None = None

    @property
    def is_switch(self) -> bool:
        return self.choices == (False, True)


@dataclass(frozen=True)
class ContextAdvice:
    """How long a chat can grow on the loaded model within the memory budget, and what
    the planner recommends (engine.runtime.context_planner).

    ``limit`` is enforced: the model's context, the user's cap, and what the KV cache can
    hold at the loaded precision, whichever is least (0: no limit known). The recommendation
    is the highest KV precision that holds the model's context (or the user's cap) within
    the budget, else the precision that holds the most.
    """

    limit: int
    recommended_tokens: int
    recommended_kv_bits: int | None  # None: full precision
    cap: int | None = None  # the user's context cap, never raised or lowered by the planner
    note: str = ""  # one line for people: the recommendation and why


@dataclass(frozen=True)
class VideoLimits:
    """How the loaded model's video processor samples a clip: ``fps`` frames a second, at
    most ``max_frames`` (a longer clip is spread over that many)."""

    fps: float
    max_frames: int


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded (or inspected) model is and what the engine can feed it. Built once per
    load from what the load read; frozen: a change (adapters, the MTP layer read) is a new
    one (``dataclasses.replace``)."""

    path: str  # folder or .gguf file
    name: str
    family: str  # config's model_type
    parameters: int
    quantization: str  # "bf16", "4-bit g64", "Q8_0", ...
    size_on_disk: int
    context_length: int
    plan: MemoryPlan | None = None
    vision: bool = False
    audio: bool = False
    video: bool = False  # takes video parts (Qwen3-VL)
    video_limits: VideoLimits | None = None  # its video processor's sampling; None without video
    chat_template: bool = True  # False: a base model, prompted as plain running text
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    adapters: list[AdapterInfo] = field(default_factory=list)  # mounted, in mount order
    active_adapters: dict[str, float] = field(default_factory=dict)  # name -> scale
    draft_model: str | None = None  # path of the draft model for speculative decoding
    # Built-in multi-token-prediction layers (GenerationParams.speculative "mtp"); when absent,
    # ``mtp_note`` says why, for a model whose family has them.
    mtp: bool = False
    mtp_note: str = ""
    # Whether images are pan-and-scanned by default (GenerationParams.pan_and_scan);
    # None when the model cannot do it.
    pan_and_scan: bool | None = None
    # The chat template's reasoning switch (GenerationParams.reasoning); None: it has none.
    reasoning_control: ReasoningControl | None = None
    # A sentence embedding model (it embeds, it does not chat): its vectors' length; None for chat models.
    embedding_dimensions: int | None = None
    # How the chat template's model writes tool calls (a key of engine.text.tool_calls.FORMATS); None: unknown.
    tool_format: str | None = None
    # Its template writes a call's arguments as text (DeepSeek) rather than as a JSON object.
    tool_arguments_as_text: bool = False
    # How the KV cache is held: "" full precision, "8-bit g64", "per layer ..." (kv_config.json).
    kv_cache: str = ""
    # Paged KV was asked for where possible and this model cannot page: why (CannotPage.reason).
    paged_kv_declined: str = ""
    # The context the chat can reach in the budget, and the recommended context and KV bits.
    context_advice: ContextAdvice | None = None
