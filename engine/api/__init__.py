"""The engine's public vocabulary: request parameters, streamed events, results.

These plain dataclasses cross the thread wall between the EngineWorker and its
callers (the CLI, the app's bridge). They hold no MLX arrays, so the app can
import this module without importing mlx.

Three modules hold them, every name importable from here: ``commands`` (what goes into
the worker, with a request's parameters), ``results`` (the events streamed out and each
command's result) and ``model_info`` (what a model is and what it needs: ModelInfo and
its MemoryPlan).
"""

from __future__ import annotations

from engine.api.commands import (
    Cancel,
    Command,
    Complete,
    Decide,
    DropSession,
    Embed,
    Generate,
    GenerationParams,
    GetModelInfo,
    InspectModel,
    LoadDraftModel,
    LoadEmbedder,
    LoadModel,
    MediaInput,
    MountAdapter,
    RestoreSession,
    SamplingParams,
    SaveSession,
    ScorePrompt,
    SetActiveAdapters,
    Train,
    Transcribe,
    UnloadModel,
    UnmountAdapter,
)
from engine.api.model_info import (
    UNLIMITED_CONTEXT,
    AdapterInfo,
    ContextAdvice,
    ExpertResidency,
    KVWindow,
    MemoryPlan,
    ModelInfo,
    ReasoningControl,
    VideoLimits,
)
from engine.api.results import (
    Decision,
    DoneEvent,
    DraftEvent,
    Embeddings,
    EngineStatus,
    ErrorEvent,
    Event,
    FinishReason,
    GenerationResult,
    GenerationStats,
    MemoryEvent,
    ProgressEvent,
    PromptScores,
    SessionRestore,
    TokenEvent,
    ToolCall,
    TrainProgress,
    TrainResult,
    Transcript,
    TranscriptSegment,
    new_call_id,
)

# The split-model vocabulary lives in its own module, re-exported: engine.api stays the one vocabulary.
from engine.shard_api import PlanShards as PlanShards
from engine.shard_api import RankShare as RankShare
from engine.shard_api import ShardPlan as ShardPlan

__all__ = [
    "AdapterInfo",
    "Cancel",
    "Command",
    "Complete",
    "ContextAdvice",
    "Decide",
    "Decision",
    "DoneEvent",
    "DraftEvent",
    "DropSession",
    "Embed",
    "Embeddings",
    "EngineStatus",
    "ErrorEvent",
    "Event",
    "ExpertResidency",
    "FinishReason",
    "Generate",
    "GenerationParams",
    "GenerationResult",
    "GenerationStats",
    "GetModelInfo",
    "InspectModel",
    "KVWindow",
    "LoadDraftModel",
    "LoadEmbedder",
    "LoadModel",
    "MediaInput",
    "MemoryEvent",
    "MemoryPlan",
    "ModelInfo",
    "MountAdapter",
    "ProgressEvent",
    "PromptScores",
    "ReasoningControl",
    "RestoreSession",
    "SamplingParams",
    "SaveSession",
    "ScorePrompt",
    "SessionRestore",
    "SetActiveAdapters",
    "TokenEvent",
    "ToolCall",
    "Train",
    "TrainProgress",
    "TrainResult",
    "Transcribe",
    "Transcript",
    "TranscriptSegment",
    "UNLIMITED_CONTEXT",
    "UnloadModel",
    "UnmountAdapter",
    "VideoLimits",
    "new_call_id",
]
