"""The engine's public vocabulary: request parameters, streamed events, results.

These plain dataclasses cross the thread wall between the EngineWorker and its
callers (the CLI, the app's bridge). They hold no MLX arrays, so the app can
import this module without importing mlx.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


def new_call_id() -> str:
    """Nine letters and digits: the one id shape every template accepts (Mistral's insist)."""
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote in its own markers (engine.text.tool_calls parses them), for a
    request that offered tools."""

    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=new_call_id)


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context: int = 64
    seed: int | None = None


@dataclass
class GenerationParams:
    max_tokens: int = 512
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    prefill_chunk: int = 512
    # Speculative decoding: "draft" (needs a loaded draft model), "ngram" (prompt lookup) or
    # "mtp" (the checkpoint's own multi-token-prediction layer: Qwen3.5, Qwen3-Next, DeepSeek V3, GLM-5).
    speculative: Literal["draft", "ngram", "mtp"] | None = None
    ngram_size: int = 3  # ids matched by n-gram lookup
    # Drafts verified per forward pass; None ("auto"): chosen each round from this reply's
    # measured acceptance and pass costs, plain steps when drafting does not pay
    # (engine.decode.draft_depth).
    num_draft_tokens: int | None = None
    # Gemma 3 vision: also show wide or tall images as square crops ("pan and scan").
    # None follows the model's processor config; attachments may say otherwise one by one.
    pan_and_scan: bool | None = None
    # The chat template's reasoning switch (ModelInfo.reasoning_control): True/False for an
    # on/off switch, "low"/"medium"/"high" for an effort. None leaves the variable undefined,
    # so the template's own default applies; a model whose template has no switch ignores it.
    reasoning: bool | str | None = None
    # With logprobs: also the log-probabilities of this many most likely tokens per step.
    top_logprobs: int = 0
    # Grammar-constrained decoding (engine.decode.constrained): {"type": "json_object"},
    # {"type": "json_schema", "schema": {...}} (with "prefix"/"suffix": literal text around
    # the JSON), {"type": "regex", "pattern": "..."} or {"type": "lark", "grammar": "..."};
    # the output always matches it.
    constraint: dict[str, Any] | None = None
    # When a chat outgrows the model's context (engine.runtime.context_policy): "stop" caps
    # the reply at the limit, "truncate_middle" keeps the system prompt and first exchange
    # and drops the oldest turns after it, "rolling" drops the oldest turns. None: neither
    # (the engine's own limits apply).
    context_policy: Literal["stop", "truncate_middle", "rolling"] | None = None
    # With tools offered: "required" makes the reply one call to one of them, in the model's
    # own markers (a grammar constraint); formats without a plain-JSON call, like "auto",
    # leave the model to choose.
    tool_choice: Literal["auto", "required"] = "auto"


@dataclass(frozen=True)
class GenerationStats:
    """A reply's figures at one moment. Frozen: every event carries its own snapshot, so the
    GUI thread never reads numbers the worker is still writing."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the KV cache
    generated_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    time_to_first_token: float = 0.0  # seconds
    peak_memory_bytes: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0


@dataclass
class GenerationResult:
    text: str
    reasoning: str
    token_ids: list[int]
    token_logprobs: list[float] | None
    finish_reason: FinishReason
    stats: GenerationStats
    error: str | None = None
    adapters: dict[str, float] = field(default_factory=dict)  # active adapters -> scale
    # With GenerationParams.top_logprobs: per generated token, the most likely (id, logprob).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With GenerationParams.context_policy: earlier messages left out to fit the context, and
    # whether the reply ended because the context was full.
    dropped_messages: int = 0
    context_full: bool = False
    # When messages were dropped: the indices (into the request's messages) of those the
    # prompt held, so a transcript can mark where the model's memory begins.
    kept_messages: list[int] | None = None
    # Block diffusion (DiffusionGemma): the denoising steps the reply took, over all blocks,
    # and block by block (an early stop shows as a block that took fewer).
    denoising_steps: int | None = None
    denoising_steps_per_block: list[int] | None = None
    # One line each about how the prompt's media was taken (a long video sampled to the
    # model's frame limit, audio cut to what the model hears).
    notes: list[str] = field(default_factory=list)
    # With tools offered: the calls the reply made, in order; ``text`` is then the answer
    # without their markers.
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class TranscriptSegment:
    """A stretch of a transcription, times in seconds from the start of the audio.

    Decoded with timestamps (audio over 30 s, or when asked), a segment is what Whisper
    put between two timestamp tokens, and ``token_ids`` include those timestamp tokens;
    otherwise the one segment spans the whole clip."""

    start_s: float
    end_s: float
    text: str
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Transcript:
    """What a Whisper model heard in an audio file; ``language`` is a code like "en"."""

    text: str
    language: str | None
    duration_s: float
    segments: list[TranscriptSegment] = field(default_factory=list)
    finish_reason: Literal["stop", "cancelled"] = "stop"
    model: str = ""  # the Whisper model's name


# ---- events streamed out of the worker -------------------------------------


@dataclass
class TokenEvent:
    """New text. ``channel`` is "answer" or "reasoning" (thinking blocks), or "tool": with
    tools offered, a call the model wrote (``tool_call``; ``text`` empty, its markers never
    reach the answer)."""

    request_id: int
    text: str
    channel: Literal["answer", "reasoning", "tool"]
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[float] | None = None  # of token_ids, with GenerationParams.logprobs
    top_logprobs: list[list[tuple[int, float]]] | None = None  # with GenerationParams.top_logprobs
    tool_call: ToolCall | None = None


@dataclass
class DraftEvent:
    """Block diffusion (DiffusionGemma): the block being denoised, as its text stands after
    ``step`` of at most ``steps`` denoising steps. Not settled: each DraftEvent replaces the
    one before, and the block's TokenEvent (its settled text) ends it. Split as settled text
    is: ``text`` the answer part, ``reasoning`` the thinking part, markers left out."""

    request_id: int
    text: str
    step: int
    steps: int
    reasoning: str = ""


@dataclass
class ProgressEvent:
    """Long work under way: loading weights, prefill, downloads."""

    request_id: int
    stage: str  # "load", "prefill", "download", "encode", "transcribe"
    done: float
    total: float
    message: str = ""


@dataclass
class DoneEvent:
    request_id: int
    result: Any  # GenerationResult for generation, ModelInfo for loads, etc.


@dataclass
class ErrorEvent:
    request_id: int
    message: str  # one readable line
    kind: str = "EngineError"


@dataclass
class MemoryEvent:
    """Live memory figures, sent while generating and after loads."""

    active_bytes: int
    cache_bytes: int
    peak_bytes: int
    weights_bytes: int
    kv_bytes: int
    budget_bytes: int
    total_bytes: int
    # What the budget leaves beside the weights for KV caches: past it, the caches of the
    # least recently used other chats are dropped (engine.runtime.kv_eviction). 0: no budget.
    kv_allowance_bytes: int = 0
    # An MoE model whose experts are partly read from disk: the slab of experts it holds
    # (part of weights_bytes) and the share of routed experts found there (0 slab: none).
    expert_slab_bytes: int = 0
    expert_hit_rate: float = 1.0


@dataclass(frozen=True)
class EngineStatus:
    """What the engine holds, published by the worker after each command it finishes."""

    model_loaded: bool = False
    tower_loaded: bool = False  # an image or audio tower's weights are in memory
    decoding: int = 0  # generations decoding together in the batch now
    budget_bytes: int = 0  # the memory budget the loaded model runs under (0: none)
    kv_allowance_bytes: int = 0  # of it, what KV caches may hold (MemoryEvent.kv_allowance_bytes)


Event = TokenEvent | DraftEvent | ProgressEvent | DoneEvent | ErrorEvent | MemoryEvent  # and TrainProgress (below)


# ---- model descriptions -----------------------------------------------------


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
    # The context the chat can reach in the budget, and the recommended context and KV bits.
    context_advice: ContextAdvice | None = None


# ---- commands into the worker -------------------------------------------------


@dataclass
class LoadModel:
    path: str
    memory_budget: int | None = None
    # Quantized KV cache: 4 or 8 bits in groups of kv_group_size (32/64/128); None: the
    # model folder's kv_config.json when it ships one, else full precision.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # The longest context a chat may reach (tokens); None: as long as the model and the
    # budget allow. A cap the budget cannot hold is refused at load, with what would fit.
    context_cap: int | None = None
    # An MoE model's share of experts kept in memory (the rest read from disk when routed);
    # None: what the memory plan gives (all of them when the model fits).
    resident_experts: float | None = None
    # Paged KV (--paged-kv): full-attention keys and values in shared blocks of this many
    # tokens, so chats and requests with a common prefix hold it once; None: unpaged.
    paged_kv_block_size: int | None = None


@dataclass
class UnloadModel:
    pass


@dataclass
class InspectModel:
    path: str


@dataclass(frozen=True)
class MediaInput:
    """One attached image, audio clip or video: a file path or the file's encoded bytes.

    Messages place media with content parts (``{"type": "image"}``); a part without
    its own source takes the next attached input of its kind, in order.
    """

    kind: Literal["image", "audio", "video"]
    source: str | bytes
    # Images, Gemma 3: crop a wide or tall image into extra squares; None: the request's
    # GenerationParams.pan_and_scan, else the model's processor config. Others ignore it.
    pan_and_scan: bool | None = None


@dataclass
class Generate:
    """Continue a conversation. ``session_id`` names the KV cache to reuse.

    A message's ``content`` is a string, or a list of parts as in transformers'
    multimodal chat templates: ``{"type": "text", "text": ...}``,
    ``{"type": "image", "image": PATH}`` (or bytes), ``{"type": "audio", "audio": PATH}``;
    a media part without a source takes the next item of ``media`` of its kind.
    """

    session_id: str
    messages: list[dict[str, Any]]
    params: GenerationParams = field(default_factory=GenerationParams)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    media: list[MediaInput] = field(default_factory=list)


@dataclass
class Complete:
    """Continue plain text (no chat template): ``prompt`` is text, tokenized as the
    tokenizer's own settings say, or token ids fed as they are."""

    session_id: str
    prompt: str | list[int]
    params: GenerationParams = field(default_factory=GenerationParams)


@dataclass
class Transcribe:
    """Transcribe an audio file with a Whisper model folder (or cached repo id).

    ``model_path`` None means the worker's default (its ``whisper_path``, else the
    MLX_DESK_WHISPER environment variable). ``language`` is a code like "en"; None
    detects it. Ends with DoneEvent(result=Transcript); ProgressEvent(stage="transcribe")
    after each 30 s window (audio over 30 s comes in timed segments); cancellable (the transcript so far, finish_reason "cancelled").
    """

    path: str
    model_path: str | None = None
    language: str | None = None


@dataclass
class Embed:
    """Embed each input (a text, tokenized as the model's tokenizer says, or token ids) with
    the loaded sentence embedding model (``beside``: the one loaded by LoadEmbedder next to
    the chat model). Done with Embeddings."""

    inputs: list[str | list[int]]
    beside: bool = False


@dataclass
class LoadEmbedder:
    """Load a sentence embedding model beside the chat model, within what the chat model's
    budget leaves (None unloads it), for documents. Done with its ModelInfo, or None."""

    path: str | None


@dataclass
class Embeddings:
    vectors: list[list[float]]  # one per input, in order
    prompt_tokens: int  # tokens read, over all inputs (after truncation)


@dataclass
class ScorePrompt:
    """The log-probability of each token of ``prompt`` given the tokens before it (text
    tokenized as the tokenizer's own settings say, or ids fed as they are): what a
    completion's ``echo`` with ``logprobs`` reports, and lm-eval's loglikelihood reads.
    With ``top_logprobs``: also that many most likely tokens at each position. Done with
    PromptScores."""

    prompt: str | list[int]
    top_logprobs: int = 0


@dataclass
class PromptScores:
    token_ids: list[int]
    # One per token; the first is None (nothing comes before it to predict it).
    logprobs: list[float | None]
    # With ScorePrompt.top_logprobs: per token, the most likely (id, logprob), best first; the first empty.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class Cancel:
    target: int  # the request id to stop


@dataclass
class DropSession:
    session_id: str


@dataclass
class GetModelInfo:
    """Done with the loaded model's ModelInfo as it is now (adapters, draft), or None."""


@dataclass
class MountAdapter:
    """Mount an adapter folder on the loaded model, inactive. Done with its AdapterInfo."""

    path: str
    name: str | None = None  # default: the folder's name


@dataclass
class SetActiveAdapters:
    """Make exactly these mounted adapters active (name -> scale; {} = none). Done with
    the ModelInfo as it is now."""

    scales: dict[str, float] = field(default_factory=dict)


@dataclass
class UnmountAdapter:
    """Done with the ModelInfo as it is now."""

    name: str


@dataclass
class LoadDraftModel:
    """Load the draft model for speculative decoding (None unloads it). Done with the
    draft's ModelInfo, or None."""

    path: str | None


@dataclass
class SaveSession:
    """Save a session's KV cache, with what it is valid for, to ``path`` (a .safetensors
    file, written atomically). Done with the bytes written (0: nothing worth saving)."""

    session_id: str
    path: str


@dataclass
class RestoreSession:
    """Before a session's first turn: take the cache saved in ``path`` when it was made
    under the loaded model, adapters, template and KV settings. Done with a
    SessionRestore. A session that already holds a cache keeps it."""

    session_id: str
    path: str


@dataclass(frozen=True)
class SessionRestore:
    tokens: int  # tokens now cached (0: nothing was restored)
    reason: str = ""  # why not, when nothing was ("no saved cache", "another adapters", ...)


@dataclass
class Decide:
    """Score candidate answers after one prompt (decision scoring). The prompt is plain
    text (tokenized as the tokenizer's own settings say), token ids fed as they are, or
    ``messages`` rendered with the chat template and its generation prompt (media parts
    as in ``Generate``). A text candidate's tokens are those the prompt + candidate
    tokenize to beyond the prompt's own; id candidates are fed as they are. Done with
    Decision."""

    candidates: list[str] | list[list[int]]
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    media: list[MediaInput] = field(default_factory=list)


@dataclass
class Decision:
    candidates: list[str]  # each candidate's text (id candidates: their decoded text)
    candidate_ids: list[list[int]]  # the tokens scored for each
    logprobs: list[float]  # each candidate's log-probability given the prompt (sum over its tokens)
    probabilities: list[float]  # the softmax over the candidates' log-probabilities
    prompt_tokens: int = 0
    seconds: float = 0.0


@dataclass
class Train:
    """Train a LoRA (or DoRA) adapter on the loaded model (engine.training). ``data`` is a
    .jsonl file or a folder with train.jsonl / valid.jsonl in mlx-lm's row shapes. Reports
    TrainProgress events as it goes; a Cancel stops it between iterations with the adapter
    trained so far saved. Done with TrainResult. Other requests wait until it ends."""

    data: str
    adapter_out: str
    adapter_init: str | None = None  # continue from this adapter (mlx-lm or PEFT folder)
    iters: int = 100
    batch_size: int = 4
    lr: float = 1e-4
    optimizer: str = "adam"
    rank: int = 8
    scale: float = 20.0
    layers: int = 16
    keys: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    mask_prompt: bool = False
    grad_checkpoint: bool = False
    steps_per_eval: int = 0
    save_every: int = 10
    seed: int = 0


@dataclass
class TrainProgress:
    """One training iteration done (``loss`` set) or a validation pass (``val_loss`` set)."""

    request_id: int
    iteration: int
    iters: int
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_second: float = 0.0
    seconds: float = 0.0
    peak_memory_bytes: int = 0
    skipped_rows: list[str] = field(default_factory=list)  # bad data rows, with their line numbers (first event)


@dataclass
class TrainResult:
    adapter: str
    train_losses: list[float]
    val_loss: float | None
    trained_tokens: int
    seconds: float
    stopped: bool  # cancelled: the adapter holds what was trained so far
    skipped_rows: list[str] = field(default_factory=list)


Command = (
    LoadModel
    | UnloadModel
    | InspectModel
    | Generate
    | Complete
    | Transcribe
    | Embed
    | ScorePrompt
    | Decide
    | Train
    | LoadEmbedder
    | Cancel
    | DropSession
    | GetModelInfo
    | MountAdapter
    | SetActiveAdapters
    | UnmountAdapter
    | LoadDraftModel
    | SaveSession
    | RestoreSession
)
