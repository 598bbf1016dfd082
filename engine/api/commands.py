"""What goes into the worker: a request's parameters and the commands it runs.

Each command is a plain dataclass the EngineWorker takes from its queue; ``Command`` is their
union. A command answers with what ``engine.api.results`` names (its result, then a
DoneEvent or an ErrorEvent). No MLX arrays here: the app imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from engine.shard_api import PlanShards


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
    # Split across these machines (rank 0 first; 127.0.0.1 repeated: local processes),
    # "pipeline" or "tensor", over an mx.distributed backend: see engine/shard_api.py.
    hosts: list[str] | None = None
    shard: str = "pipeline"
    backend: str = "any"
    # Paged KV (--paged-kv): full-attention keys and values in shared blocks of this many
    # tokens, so chats and requests with a common prefix hold it once; None: unpaged.
    paged_kv_block_size: int | None = None
    # A model that cannot page (no plain full-attention layer, a length-dependent RoPE) loads
    # unpaged, saying why in ModelInfo.paged_kv_declined, instead of being refused: the app's
    # Settings choice holds for every model, the command line's flag for one.
    paged_kv_where_possible: bool = False


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
class ScorePrompt:
    """The log-probability of each token of ``prompt`` given the tokens before it (text
    tokenized as the tokenizer's own settings say, or ids fed as they are): what a
    completion's ``echo`` with ``logprobs`` reports, and lm-eval's loglikelihood reads.
    With ``top_logprobs``: also that many most likely tokens at each position. Done with
    PromptScores."""

    prompt: str | list[int]
    top_logprobs: int = 0


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
    | PlanShards
)
