"""ModelHost: one loaded model and the services each request uses.

Loading is assembly.py's (model, tokenizer, template, end ids, ModelInfo, towers); the
host keeps what it assembled and serves requests with it: the chat sessions (one KV
cache each), generation, the LoRA adapters mounted on the model, an optional draft model
for speculative decoding, and the Whisper model for transcription. Every method runs on
the thread that owns MLX.

Adapters stay mounted across generations and go with the model when it is unloaded; so
does the draft model, which was checked against this model's vocabulary. The services
live in their own modules and the host only hands them its loaded state: adapters
(runtime/adapters.py), sentence embeddings (runtime/embeddings.py), the Whisper model
(runtime/transcription.py), and the built-in MTP layer's read and re-plan
(runtime/mtp_attach.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api import (
    AdapterInfo,
    Complete,
    DraftEvent,
    Embeddings,
    Event,
    Generate,
    GenerationParams,
    GenerationResult,
    MediaInput,
    ModelInfo,
    ProgressEvent,
    PromptScores,
    SamplingParams,
    TokenEvent,
)
from engine.decode.diffusion import Draft
from engine.decode.loop import Piece
from engine.errors import EngineError, WrongModelKind
from engine.runtime import adapters
from engine.runtime.assembly import LoadCancelled, LoadProgress, assemble, assemble_draft, reasoning_factory  # noqa: F401  (LoadCancelled: part of the host's API)
from engine.runtime.embeddings import embed
from engine.runtime.expert_plan import stop_streaming
from engine.runtime.kv_eviction import evict_idle_caches, kv_allowance, touch
from engine.runtime.paged_pool import CannotPage, page_kv, pool_stats
from engine.runtime.request_errors import Cancelled, NoModelLoaded  # noqa: F401  (Cancelled: part of the host's API)
from engine.runtime.session import ChatSession
from engine.runtime.token_ids import check_token_ids, vocab_size
from engine.runtime.transcription import WhisperSlot
from engine.text.tool_calls import FORMATS

EventSink = Callable[[Event], None]


@dataclass
class _Draft:
    model: Any
    tokenizer: Any
    info: ModelInfo


@dataclass
class _Loaded:
    model: Any
    config: Any
    path: str
    tokenizer: Any
    template: Any
    eos_token_ids: list[int]
    info: ModelInfo
    towers: Any = None  # MediaTowers: which media the model takes; loads towers on first use
    sessions: dict[str, ChatSession] = field(default_factory=dict)
    draft: _Draft | None = None
    batch: Any = None  # engine.decode.batch.Batch, made on first use; False where the family cannot batch
    weights_digest: str | None = None  # saved_cache.weights_fingerprint, taken on first use
    mtp_apart: Any = None  # loading.MTPApart: the built-in MTP layer, read on the first MTP request


class ModelHost:
    def __init__(self) -> None:
        self._loaded: _Loaded | None = None
        self._owner: threading.Thread | None = None
        self._whisper = WhisperSlot()  # the last Whisper used, kept for the next request

    # ---- one thread touches MLX ------------------------------------------------

    def _check_thread(self) -> None:
        if __debug__:
            me = threading.current_thread()
            if self._owner is None:
                self._owner = me
            assert self._owner is me, "ModelHost used from two threads: all MLX work belongs to one"

    # ---- loading ------------------------------------------------------------------

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def _need(self) -> _Loaded:
        if self._loaded is None:
            raise NoModelLoaded("No model is loaded: load one first.")
        return self._loaded

    @property
    def info(self) -> ModelInfo:
        """The loaded model's description, with its adapters and draft model as they are now
        (a fresh copy: safe to hand to another thread)."""
        state = self._need()
        return replace(
            state.info,
            adapters=self.adapters(),
            active_adapters=self.active_adapters(),
            draft_model=state.draft.info.path if state.draft is not None else None,
        )

    @property
    def model(self) -> Any:
        return self._need().model

    @property
    def tokenizer(self) -> Any:
        return self._need().tokenizer

    @property
    def template(self) -> Any:
        return self._need().template

    @property
    def eos_token_ids(self) -> list[int]:
        return self._need().eos_token_ids

    def load(
        self,
        path: str,
        budget: int | None = None,
        progress: LoadProgress | None = None,
        cancel: threading.Event | None = None,
        *,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        context_cap: int | None = None,
        resident_experts: float | None = None,
        paged_kv_block_size: int | None = None,
        paged_kv_where_possible: bool = False,
    ) -> ModelInfo:
        """Load a model folder, HF repo id (already cached) or .gguf file, replacing any
        loaded model. Refuses before allocating when it cannot fit ``budget``. ``kv_bits``
        (4 or 8) holds the KV cache quantized; None follows the folder's kv_config.json.
        ``context_cap`` bounds every chat's context; one the budget cannot hold is refused.
        ``paged_kv_block_size`` pages the KV cache in shared blocks (models.paged_kv); a model
        that cannot page is refused, or with ``paged_kv_where_possible`` loads unpaged and
        says why in ``paged_kv_declined``."""
        from engine.runtime.context_planner import advise_context, check_cap, precision_options
        from engine.runtime.memory import kv_settings_for, with_kv_settings

        self._check_thread()
        if kv_bits is not None:
            from engine.models.quantized_kv_cache import check_kv_settings

            check_kv_settings(kv_bits, kv_group_size)  # refused before the old model goes
        if context_cap is not None:  # refused from the files, before the loaded model goes
            from engine.runtime.model_info import inspect_model

            inspect_model(
                path,
                memory_budget=budget,
                kv_bits=kv_bits,
                kv_group_size=kv_group_size,
                context_cap=context_cap,
                refuse_cap=True,
            )
        self.unload()
        parts = assemble(path, budget, progress, cancel, resident_experts=resident_experts, context_cap=context_cap)
        settings = kv_settings_for(parts.model, parts.path, kv_bits, kv_group_size)
        if settings:
            from engine.models.quantized_kv_cache import KVQuantization

            parts.model.kv_quantization = KVQuantization(settings)
        info = with_kv_settings(parts.info, parts.config, settings)
        if paged_kv_block_size is not None:
            weights = info.plan.weights_bytes if info.plan is not None else 0
            try:
                page_kv(parts.model, paged_kv_block_size, kv_allowance(info, weights))
            except CannotPage as exc:
                if not paged_kv_where_possible:
                    raise
                info = replace(info, paged_kv_declined=exc.reason)
        options = precision_options(
            parts.info, parts.config, lambda bits: kv_settings_for(parts.model, parts.path, bits, kv_group_size)
        )
        if info.plan is not None and options:
            check_cap(context_cap, info.plan, options, info.name)
            advice = advise_context(info.plan, options, info.context_length, context_cap)
            info = replace(info, context_advice=advice)
        self._loaded = _Loaded(
            model=parts.model,
            config=parts.config,
            path=parts.path,
            tokenizer=parts.tokenizer,
            template=parts.template,
            eos_token_ids=parts.eos_token_ids,
            info=info,
            towers=parts.towers,
            mtp_apart=parts.mtp_apart,
        )
        return info

    @property
    def towers(self) -> Any:
        """The loaded model's MediaTowers (what media it takes, the encoded-media cache)."""
        return self._need().towers

    @property
    def tower_loaded(self) -> bool:
        """Whether any image/audio tower's weights are in memory (never after text-only chats)."""
        return self._loaded is not None and self._loaded.towers.loaded

    def check_media(self, messages: Sequence[Mapping[str, Any]], media: Sequence[MediaInput] = ()) -> None:
        """MediaError, before anything runs, when the request carries media the model cannot take."""
        from engine.media.parts import media_kinds

        self._need().towers.check(media_kinds(messages, media))

    def unload(self) -> None:
        """Drop the model, with its sessions, adapters and draft model."""
        self._check_thread()
        if self._loaded is None:
            return
        self._loaded.towers.unload()
        stop_streaming(self._loaded.model)  # experts read from disk: their readers and files
        self._loaded = None
        import gc

        import mlx.core as mx

        gc.collect()
        mx.clear_cache()

    # ---- adapters -----------------------------------------------------------------

    def mount_adapter(self, path: str, name: str | None = None) -> AdapterInfo:
        """Mount an mlx-lm or PEFT adapter folder on the loaded model (inactive until
        ``set_active_adapters``); refused with what does not match."""
        self._check_thread()
        state = self._need()
        return adapters.mount(state.model, state.mtp_apart, path, name)

    def set_active_adapters(self, scales: Mapping[str, float]) -> None:
        """Make exactly these mounted adapters active, each with its scale (1.0 = as trained).
        Sessions notice the change through the adapters' signature and do not reuse KV
        computed under the previous set."""
        self._check_thread()
        adapters.activate(self.model, scales)

    def unmount_adapter(self, name: str) -> None:
        self._check_thread()
        adapters.unmount(self.model, name)

    def adapters(self) -> list[AdapterInfo]:
        return adapters.mounted(self.model)

    def active_adapters(self) -> dict[str, float]:
        return adapters.active(self.model)

    # ---- draft model ----------------------------------------------------------------

    @property
    def draft_model(self) -> Any:
        draft = self._need().draft
        return draft.model if draft is not None else None

    def load_draft(
        self,
        path: str | None,
        progress: LoadProgress | None = None,
        cancel: threading.Event | None = None,
    ) -> ModelInfo | None:
        """Load the draft model for speculative decoding (``None`` unloads it). It must number
        tokens as the loaded model does, and fit in the budget beside it. A refused draft
        model leaves the current one in place."""
        self._check_thread()
        from engine.decode.drafters import check_draft_compatible

        state = self._need()
        if path is None:
            self._set_draft(state, None)
            return None
        plan = state.info.plan
        budget = max(1, plan.budget_bytes - plan.weights_bytes) if plan is not None else None

        from engine.runtime.dflash_loading import is_dflash_drafter, load_dflash_drafter

        if is_dflash_drafter(path):  # a block drafter reading this model's layers, in its vocabulary
            model, info = load_dflash_drafter(path, state.model, budget, progress, cancel)
            self._set_draft(state, _Draft(model, state.tokenizer, info))
            return info
        model, tokenizer, info = assemble_draft(path, budget, progress, cancel)
        check_draft_compatible(state.tokenizer, tokenizer)
        self._set_draft(state, _Draft(model, tokenizer, info))
        return info

    @staticmethod
    def _set_draft(state: _Loaded, draft: _Draft | None) -> None:
        state.draft = draft
        for chat in state.sessions.values():
            chat.draft_model = draft.model if draft is not None else None
        if draft is None:
            import mlx.core as mx

            mx.clear_cache()

    # ---- transcription --------------------------------------------------------------

    def transcriber(self, path: str, progress: LoadProgress | None = None) -> Any:
        """The Whisper Transcriber for ``path``, loaded once and kept (one at a time)."""
        self._check_thread()
        return self._whisper.get(path, progress)

    # ---- sessions -----------------------------------------------------------------

    def session(self, session_id: str) -> ChatSession:
        state = self._need()
        if state.info.embedding_dimensions is not None:
            raise WrongModelKind(
                f"{state.info.name} is a sentence embedding model: it turns text into vectors "
                "(the server's /v1/embeddings) and cannot chat or complete text. Load a chat model for that."
            )
        chat = state.sessions.get(session_id)
        if chat is None:
            chat = ChatSession(
                state.model,
                state.tokenizer,
                state.template,
                eos_token_ids=state.eos_token_ids,
                reasoning_factory=reasoning_factory(state.template),
                reasoning_control=state.info.reasoning_control,
                towers=state.towers if state.towers.kinds else None,
                tool_format=FORMATS.get(state.info.tool_format or ""),
            )
            chat.draft_model = state.draft.model if state.draft is not None else None
            advice = state.info.context_advice  # the model's context, the user's cap, the budget
            chat.context_length = advice.limit if advice is not None else int(state.info.context_length or 0)
            state.sessions[session_id] = chat
        touch(state.sessions, session_id)  # most recently used; others may give back their caches
        evict_idle_caches(state.sessions, session_id, kv_allowance(state.info, self.weights_bytes()))
        return chat

    def drop_session(self, session_id: str) -> None:
        if self._loaded is not None:
            self._loaded.sessions.pop(session_id, None)

    # ---- saved caches -----------------------------------------------------------------

    def session_identity(self) -> dict[str, str]:
        """What a saved cache of the loaded model is valid for (saved_cache.session_identity)."""
        from engine.runtime.saved_cache import session_identity, weights_fingerprint

        state = self._need()
        if state.weights_digest is None:
            state.weights_digest = weights_fingerprint(state.path)
        return session_identity(state.path, state.weights_digest, state.model, state.template, state.info.kv_cache)

    def restore_session(self, session_id: str, path: str) -> tuple[int, str]:
        """Use the cache saved in ``path`` for ``session_id`` when it fits the loaded model,
        adapters and template: (tokens restored, why not when 0)."""
        from engine.runtime.saved_cache import restore_session

        self._check_thread()
        chat = self.session(session_id)
        if chat.ids:  # the live cache is at least as far along as any saved one
            return 0, "the session already holds a cache"
        return restore_session(path, chat, self.session_identity())

    def save_session(self, session_id: str, path: str) -> int:
        """Save ``session_id``'s cache to ``path`` (atomically); returns the bytes written."""
        from engine.runtime.saved_cache import save_session

        self._check_thread()
        return save_session(path, self.session(session_id), self.session_identity())

    def kv_bytes(self) -> int:
        if self._loaded is None:
            return 0
        total = self._loaded.batch.nbytes if self._loaded.batch else 0
        for chat in self._loaded.sessions.values():
            for c in [*(chat.cache or ()), *(chat.draft_cache or ())]:
                total += int(getattr(c, "nbytes", 0) or 0)
        pool = getattr(self._loaded.model, "kv_pool", None)  # paged: the blocks chats share
        return total + (pool.common_bytes if pool is not None else 0)

    def weights_bytes(self) -> int:
        """Weights in memory: the model's and the draft model's."""
        if self._loaded is None:
            return 0
        infos = [self._loaded.info] + ([self._loaded.draft.info] if self._loaded.draft else [])
        return sum(i.plan.weights_bytes for i in infos if i.plan is not None)

    def default_params(self) -> GenerationParams:
        """Generation settings from the model's generation_config.json, where it has them
        (the server's defaults for what a request leaves out)."""
        defaults = self._need().info.generation_defaults or {}
        sp = SamplingParams()
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if defaults.get(key) is not None:
                setattr(sp, key, type(getattr(sp, key))(defaults[key]))
        if defaults.get("do_sample") is False:
            sp.temperature = 0.0
        return GenerationParams(sampling=sp)

    # ---- generation ---------------------------------------------------------------

    def open_request(
        self,
        command: Generate | Complete,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        *,
        request_id: int = 0,
        session_id: str | None = None,
        batch: Any = None,
        **template_kwargs: Any,
    ) -> Iterator[Piece | GenerationResult | object]:
        """The one generate entry: a conversation (``Generate``) or plain text or ids
        (``Complete``), as a stream not yet run, in the session the command names (or
        ``session_id``). With ``batch`` it decodes in the batch and yields WAITING
        (engine.decode.loop) while it waits for a step. Progress goes to ``on_event``; a
        request drafting with the built-in MTP layer reads it first (runtime/mtp_attach.py)."""
        self._check_thread()
        sid = command.session_id if session_id is None else session_id
        progress = _progress_sink(on_event, request_id)
        if isinstance(command, Complete):
            chat = self.session(sid)  # an embedding model is refused here, first
            prompt = command.prompt
            ids = self.encode_prompt(prompt) if isinstance(prompt, str) else self.check_token_ids(prompt)
            params = self._mtp_for(command.params, on_event, request_id, cancel)
            return chat.stream_ids(ids, params, cancel=cancel, on_progress=progress, batch=batch)
        self.check_media(command.messages, command.media)
        params = self._mtp_for(command.params, on_event, request_id, cancel)
        return self.session(sid).stream(
            command.messages,
            params,
            tools=command.tools,
            add_generation_prompt=command.add_generation_prompt,
            cancel=cancel,
            on_progress=progress,
            media=command.media,
            batch=batch,
            **template_kwargs,
        )

    def run_request(
        self,
        command: Generate | Complete,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        *,
        request_id: int = 0,
        **template_kwargs: Any,
    ) -> GenerationResult:
        """``open_request`` run to its end: TokenEvent and ProgressEvent go to ``on_event``."""
        stream = self.open_request(command, on_event, cancel, request_id=request_id, **template_kwargs)
        return _drain(stream, on_event, request_id)

    def generate(
        self,
        session_id: str,
        messages: list[Mapping[str, Any]],
        params: GenerationParams,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        *,
        request_id: int = 0,
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        media: Sequence[MediaInput] = (),
        **template_kwargs: Any,
    ) -> GenerationResult:
        """Continue the conversation kept under ``session_id``; TokenEvent and
        ProgressEvent go to ``on_event``; returns the result. Messages may hold image and
        audio parts (see ``engine.api.Generate``); ``media`` fills parts without a source."""
        stream = self.open_generate(
            session_id,
            messages,
            params,
            on_event,
            cancel,
            request_id=request_id,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            media=media,
            **template_kwargs,
        )
        return _drain(stream, on_event, request_id)

    def open_generate(
        self,
        session_id: str,
        messages: list[Mapping[str, Any]],
        params: GenerationParams,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        *,
        request_id: int = 0,
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        media: Sequence[MediaInput] = (),
        batch: Any = None,
        **template_kwargs: Any,
    ) -> Iterator[Piece | GenerationResult | object]:
        """``generate``'s stream, not yet run (``open_request`` with a ``Generate``)."""
        command = Generate(
            session_id,
            list(messages),
            params,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            media=list(media),
        )
        return self.open_request(command, on_event, cancel, request_id=request_id, batch=batch, **template_kwargs)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        *,
        request_id: int = 0,
        session_id: str = "",
    ) -> GenerationResult:
        """Generate from token ids as they are (no template, nothing added)."""
        stream = self.open_generate_ids(
            prompt_ids, params, on_event, cancel, request_id=request_id, session_id=session_id
        )
        return _drain(stream, on_event, request_id)

    def open_generate_ids(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        *,
        request_id: int = 0,
        session_id: str = "",
        batch: Any = None,
    ) -> Iterator[Piece | GenerationResult | object]:
        """``generate_ids``'s stream, not yet run (``open_request`` with a ``Complete``)."""
        command = Complete(session_id, list(prompt_ids), params)
        return self.open_request(command, on_event, cancel, request_id=request_id, batch=batch)

    def _mtp_for(
        self,
        params: GenerationParams,
        on_event: EventSink | None = None,
        request_id: int = 0,
        cancel: threading.Event | None = None,
    ) -> GenerationParams:
        """Read the built-in MTP layer, set apart at load, when a request first drafts with
        it (it then stays, counted in the weights, and chats may grow only as far as the KV
        cache still fits; the media features cache shrinks to the room left); refused when
        the budget cannot hold it. The read is the request's "load" progress, and adapters
        mounted before it take their targets inside it. Returns the params the request runs
        with: a request stopped during the read (``cancel``, checked between chunks) leaves
        the layer apart and unread and goes on without drafting, to end as any request
        stopped before its prefill does ("cancelled", nothing generated)."""
        from engine.runtime.mtp_attach import attach_mtp

        return attach_mtp(
            self._need(),
            params,
            self.weights_bytes,
            lambda message: _progress_sink(on_event, request_id, "load", message),
            cancel,
        )

    @property
    def batch(self) -> Any:
        """The loaded model's Batch for decoding requests together; None where its family's
        caches cannot be batched (those requests run one at a time)."""
        state = self._need()
        if state.info.embedding_dimensions is not None:
            return None  # an embedding model has no decoder to batch (and cannot generate)
        if state.batch is None:
            from engine.decode.batch import Batch, batchable

            plan = state.info.plan
            per_token = plan.kv_bytes_per_token if plan is not None else 0
            batchable_model = batchable(state.model)
            state.batch = (
                Batch(state.model, kv_room=self._batch_kv_room, kv_bytes_per_token=per_token)
                if batchable_model
                else False
            )
        return state.batch or None

    def kv_pool_stats(self) -> dict[str, int] | None:
        """The loaded model's KV block pool (blocks used, shared, cached); None unpaged."""
        return pool_stats(self._loaded.model) if self._loaded is not None else None

    def _batch_kv_room(self, need: int) -> int:
        """Bytes the memory budget leaves for the batch's KV caches beside the weights and
        the caches chats keep (a chat in the batch lends its cache to it); when that is
        short of ``need``, the least recently used chats give theirs back first."""
        from engine.runtime.kv_eviction import session_kv_bytes

        state = self._need()
        allowance = kv_allowance(state.info, self.weights_bytes())
        if allowance is None:
            return 1 << 62
        kept = sum(session_kv_bytes(chat) for chat in state.sessions.values())
        if allowance - kept < need:
            evict_idle_caches(state.sessions, "", max(0, allowance - need))
            kept = sum(session_kv_bytes(chat) for chat in state.sessions.values())
        return allowance - kept

    # ---- embeddings -----------------------------------------------------------------

    def embed(self, inputs: Sequence[str | Sequence[int]], cancel: threading.Event | None = None) -> Embeddings:
        """Embed each text (tokenized and truncated as sentence-transformers does) or list of
        token ids (truncated alike) with the loaded sentence embedding model."""
        self._check_thread()
        state = self._need()
        return embed(state.model, state.tokenizer, state.info, inputs, cancel, self.check_token_ids)

    def check_token_ids(self, ids: Sequence[Any]) -> list[int]:
        """Ids given as they are, each refused unless it names a row of the embedding."""
        return check_token_ids(ids, vocab_size(self._need().model))

    def score_prompt(
        self, ids: Sequence[int], top_logprobs: int = 0, cancel: threading.Event | None = None
    ) -> PromptScores:
        """Each token's log-probability given those before it, on a fresh cache (no session's)."""
        from engine.decode.scoring import score_tokens

        self._check_thread()
        self.session("")  # an embedding model is refused here, as for generation
        ids = self.check_token_ids(ids)
        logprobs, top = score_tokens(self.model, ids, top_logprobs=top_logprobs, cancel=cancel)
        return PromptScores(ids, logprobs, top)

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt tokenized as the tokenizer's own settings say (BOS when it adds one)."""
        return list(self._need().tokenizer.encode(text))

    def chat_prompt_ids(self, messages: list[Mapping[str, Any]], **kw: Any) -> list[int]:
        chat = self.session("")
        return chat.encode_rendered(chat.render(messages, **kw))


def _progress_sink(
    on_event: EventSink | None, request_id: int, stage: str = "prefill", message: str = ""
) -> Callable[[int, int], None] | None:
    if on_event is None:
        return None
    return lambda done, total: on_event(ProgressEvent(request_id, stage, float(done), float(total), message))


def token_event(piece: Piece | Draft, request_id: int) -> TokenEvent | DraftEvent:
    if isinstance(piece, Draft):  # a diffusion block still refining
        return DraftEvent(request_id, piece.text, piece.step, piece.steps, piece.reasoning)
    return TokenEvent(
        request_id,
        piece.text,
        piece.channel,
        piece.token_ids,
        piece.stats,
        piece.logprobs,
        piece.top_logprobs,
        piece.tool_call,
    )


def _drain(stream: Iterator[Any], on_event: EventSink | None, request_id: int) -> GenerationResult:
    result: GenerationResult | None = None
    for item in stream:
        if isinstance(item, GenerationResult):
            result = item
        elif on_event is not None:
            on_event(token_event(item, request_id))
    if result is None:
        raise EngineError("generation ended without a result")
    return result
