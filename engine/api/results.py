"""What comes out of the worker: streamed events and each command's result.

Events (tokens, drafts, progress, memory, done, error) stream while a command runs; a result
dataclass ends it. No MLX arrays here: the app imports this module.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.shard_api import RankShare

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
    # A model split across machines: each rank's weights, measured there (empty otherwise).
    ranks: list[RankShare] = field(default_factory=list)
    # Paged KV (LoadModel.paged_kv_block_size): the block pool's block_size and blocks
    # used, shared (held by more than one chat or request) and cached (kept for reuse), and
    # its bytes; None when the KV cache is unpaged.
    kv_pool: dict[str, int] | None = None


@dataclass(frozen=True)
class EngineStatus:
    """What the engine holds, published by the worker after each command it finishes."""

    model_loaded: bool = False
    tower_loaded: bool = False  # an image or audio tower's weights are in memory
    decoding: int = 0  # generations decoding together in the batch now
    budget_bytes: int = 0  # the memory budget the loaded model runs under (0: none)
    kv_allowance_bytes: int = 0  # of it, what KV caches may hold (MemoryEvent.kv_allowance_bytes)


Event = TokenEvent | DraftEvent | ProgressEvent | DoneEvent | ErrorEvent | MemoryEvent  # and TrainProgress


@dataclass
class Embeddings:
    vectors: list[list[float]]  # one per input, in order
    prompt_tokens: int  # tokens read, over all inputs (after truncation)


@dataclass
class PromptScores:
    token_ids: list[int]
    # One per token; the first is None (nothing comes before it to predict it).
    logprobs: list[float | None]
    # With ScorePrompt.top_logprobs: per token, the most likely (id, logprob), best first; the first empty.
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True)
class SessionRestore:
    tokens: int  # tokens now cached (0: nothing was restored)
    reason: str = ""  # why not, when nothing was ("no saved cache", "another adapters", ...)


@dataclass
class Decision:
    candidates: list[str]  # each candidate's text (id candidates: their decoded text)
    candidate_ids: list[list[int]]  # the tokens scored for each
    logprobs: list[float]  # each candidate's log-probability given the prompt (sum over its tokens)
    probabilities: list[float]  # the softmax over the candidates' log-probabilities
    prompt_tokens: int = 0
    seconds: float = 0.0


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
