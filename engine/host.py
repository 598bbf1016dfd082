"""ModelHost: one loaded model with everything needed to talk to it.

It holds the model, its tokenizer (from the folder's tokenizer files or the GGUF's own
vocabulary), its chat template, the end-of-turn ids (the union of config, generation
config and tokenizer), the generation defaults, the ModelInfo, the chat sessions
(one KV cache each), the LoRA adapters mounted on the model, and an optional draft model
for speculative decoding. Every method runs on the thread that owns MLX.

Adapters stay mounted across generations and go with the model when it is unloaded; so
does the draft model, which was checked against this model's vocabulary.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .api import (
    AdapterInfo,
    Event,
    GenerationParams,
    GenerationResult,
    MediaInput,
    ModelInfo,
    ProgressEvent,
    SamplingParams,
    TokenEvent,
)
from .errors import EngineError, OutOfMemoryBudget
from .generate import Piece
from .kv_eviction import evict_idle_caches, kv_allowance, touch
from .session import ChatSession

LoadProgress = Callable[[float, float, str], None]
EventSink = Callable[[Event], None]


class NoModelLoaded(EngineError):
    """A request that needs a model arrived before any was loaded."""


class LoadCancelled(EngineError):
    """The load was cancelled by the caller."""


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
    raw: Any = None  # the loader's own record (adapters, towers, draft model hang off it)
    towers: Any = None  # MediaTowers: which media the model takes; loads towers on first use
    sessions: dict[str, ChatSession] = field(default_factory=dict)
    draft: _Draft | None = None


def _union(*groups: Sequence[int] | None) -> list[int]:
    out: list[int] = []
    for group in groups:
        for i in group or ():
            if int(i) not in out:
                out.append(int(i))
    return out


def _load_tokenizer(loaded: Any) -> Any:
    from .text.tokenizer import Tokenizer

    if getattr(loaded, "gguf_metadata", None):
        return Tokenizer.from_gguf(loaded.gguf_metadata)
    return Tokenizer.from_dir(getattr(loaded, "tokenizer_path", None) or loaded.path)


def _load_template(tokenizer: Any) -> Any:
    from .text.chat_template import ChatTemplate, PlainTextTemplate

    source = getattr(tokenizer, "chat_template", None)
    if not source and getattr(tokenizer, "mistral_format", None):
        from .text.mistral_format import MistralFormat

        return MistralFormat(tokenizer.mistral_format, tokenizer.bos_token or "<s>", tokenizer.eos_token or "</s>")
    if not source:
        bos = tokenizer.bos_token if getattr(tokenizer, "add_bos_token", False) else None
        return PlainTextTemplate(bos)
    return ChatTemplate(source, special_tokens=getattr(tokenizer, "special_tokens", None))


def _reasoning_factory(template: Any) -> Callable[[str], Any]:
    """A function from the rendered prompt to a splitter of reasoning text (None when the
    template uses no reasoning markers)."""
    from .text.markers import detect_reasoning_markers

    source = getattr(template, "source", None) or ""

    def make(prompt: str) -> Any:
        markers = detect_reasoning_markers(source, prompt)
        return markers.splitter() if markers is not None else None

    return make


def _reasoning_control(template: Any) -> Any:
    """The template's reasoning switch (ModelInfo.reasoning_control), None without one."""
    from .text.chat_template import ChatTemplate
    from .text.reasoning_switch import find_reasoning_control

    return find_reasoning_control(template) if isinstance(template, ChatTemplate) else None


class ModelHost:
    def __init__(self) -> None:
        self._loaded: _Loaded | None = None
        self._owner: threading.Thread | None = None
        self._transcriber: Any = None  # the last Whisper used, kept for the next request

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
    ) -> ModelInfo:
        """Load a model folder, HF repo id (already cached) or .gguf file, replacing any
        loaded model. Refuses before allocating when it cannot fit ``budget``."""
        self._check_thread()
        from .artifacts.loader import load_model

        self.unload()

        def on_progress(done: int, total: int) -> None:
            # The loader lets an exception from here end the load cleanly.
            if cancel is not None and cancel.is_set():
                raise LoadCancelled("Loading was cancelled.")
            if progress is not None:
                progress(done, total, "loading weights")

        loaded = load_model(path, memory_budget=budget, progress=on_progress)
        if cancel is not None and cancel.is_set():
            raise LoadCancelled("Loading was cancelled.")
        tokenizer = _load_tokenizer(loaded)
        config = loaded.config
        eos = _union(
            getattr(config, "eos_token_ids", None), getattr(tokenizer, "eos_token_ids", None)
        )
        info = self._describe(loaded, budget)
        towers = _make_towers(loaded)
        # ModelInfo says what the engine can feed this model, not only what its config names.
        info.vision = "image" in towers.kinds
        info.audio = "audio" in towers.kinds
        info.pan_and_scan = towers.pan_and_scan()
        info.chat_template = bool(getattr(tokenizer, "chat_template", None) or getattr(tokenizer, "mistral_format", None))
        template = _load_template(tokenizer)
        info.reasoning_control = _reasoning_control(template)
        self._loaded = _Loaded(
            model=loaded.model,
            config=config,
            path=str(loaded.path),
            tokenizer=tokenizer,
            template=template,
            eos_token_ids=eos,
            info=info,
            raw=loaded,
            towers=towers,
        )
        return info

    @staticmethod
    def _describe(loaded: Any, budget: int | None) -> ModelInfo:
        from .artifacts.inspect import inspect_model

        info = inspect_model(str(loaded.path), memory_budget=budget)
        info.plan = getattr(loaded, "plan", None) or info.plan
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
        from .media.parts import media_kinds

        self._need().towers.check(media_kinds(messages, media))

    def unload(self) -> None:
        """Drop the model, with its sessions, adapters and draft model."""
        self._check_thread()
        if self._loaded is None:
            return
        self._loaded.towers.unload()
        self._loaded = None
        import gc

        import mlx.core as mx

        gc.collect()
        mx.clear_cache()

    # ---- adapters -----------------------------------------------------------------

    def mount_adapter(self, path: str, name: str | None = None) -> AdapterInfo:
        """Mount an mlx-lm or PEFT adapter folder on the loaded model (inactive until
        ``set_active_adapters``); refused with what does not match."""
        from . import adapters

        self._check_thread()
        return _adapter_info(adapters.mount(self.model, path, name))

    def set_active_adapters(self, scales: Mapping[str, float]) -> None:
        """Make exactly these mounted adapters active, each with its scale (1.0 = as trained).
        Sessions notice the change through the adapters' signature and do not reuse KV
        computed under the previous set."""
        from . import adapters

        self._check_thread()
        adapters.activate(self.model, dict(scales))

    def unmount_adapter(self, name: str) -> None:
        from . import adapters

        self._check_thread()
        adapters.unmount(self.model, name)

    def adapters(self) -> list[AdapterInfo]:
        from . import adapters

        return [_adapter_info(a) for a in adapters.mounted(self.model)]

    def active_adapters(self) -> dict[str, float]:
        from . import adapters

        return adapters.active_adapters(self.model)

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
        from .artifacts.loader import load_model
        from .drafters import check_draft_compatible

        state = self._need()
        if path is None:
            self._set_draft(state, None)
            return None
        plan = state.info.plan
        budget = max(1, plan.budget_bytes - plan.weights_bytes) if plan is not None else None

        def on_progress(done: int, total: int) -> None:
            if cancel is not None and cancel.is_set():
                raise LoadCancelled("Loading the draft model was cancelled.")
            if progress is not None:
                progress(done, total, "loading the draft model")

        try:
            loaded = load_model(path, memory_budget=budget, progress=on_progress)
        except OutOfMemoryBudget as e:
            raise OutOfMemoryBudget(f"The draft model does not fit beside the loaded model: {e}") from None
        tokenizer = _load_tokenizer(loaded)
        check_draft_compatible(state.tokenizer, tokenizer)
        info = self._describe(loaded, budget)
        self._set_draft(state, _Draft(loaded.model, tokenizer, info))
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
        from .artifacts.hub import resolve_model_path
        from .media.transcribe import Transcriber

        folder = str(resolve_model_path(path))
        if self._transcriber is None or self._transcriber.path != folder:
            self._transcriber = None
            if progress is not None:
                progress(0, 1, "loading the Whisper model")
            self._transcriber = Transcriber.load(folder)
            if progress is not None:
                progress(1, 1, "loading the Whisper model")
        return self._transcriber

    def drop_transcriber(self) -> None:
        self._transcriber = None

    # ---- sessions -----------------------------------------------------------------

    def session(self, session_id: str) -> ChatSession:
        state = self._need()
        chat = state.sessions.get(session_id)
        if chat is None:
            chat = ChatSession(
                state.model,
                state.tokenizer,
                state.template,
                eos_token_ids=state.eos_token_ids,
                reasoning_factory=_reasoning_factory(state.template),
                reasoning_control=state.info.reasoning_control,
                towers=state.towers if state.towers.kinds else None,
            )
            chat.draft_model = state.draft.model if state.draft is not None else None
            chat.context_length = state.info.context_length
            state.sessions[session_id] = chat
        touch(state.sessions, session_id)  # most recently used; others may give back their caches
        evict_idle_caches(state.sessions, session_id, kv_allowance(state.info, self.weights_bytes()))
        return chat

    def drop_session(self, session_id: str) -> None:
        if self._loaded is not None:
            self._loaded.sessions.pop(session_id, None)

    def kv_bytes(self) -> int:
        if self._loaded is None:
            return 0
        total = 0
        for chat in self._loaded.sessions.values():
            for c in [*(chat.cache or ()), *(chat.draft_cache or ())]:
                total += int(getattr(c, "nbytes", 0) or 0)
        return total

    def weights_bytes(self) -> int:
        """Weights in memory: the model's and the draft model's."""
        if self._loaded is None:
            return 0
        infos = [self._loaded.info] + ([self._loaded.draft.info] if self._loaded.draft else [])
        return sum(i.plan.weights_bytes for i in infos if i.plan is not None)

    def default_params(self) -> GenerationParams:
        """Generation settings from the model's generation_config.json, where it has them."""
        defaults = self._need().info.generation_defaults or {}
        sp = SamplingParams()
        for key, attr in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                          ("min_p", "min_p"), ("repetition_penalty", "repetition_penalty")):
            if key in defaults and defaults[key] is not None:
                setattr(sp, attr, type(getattr(sp, attr))(defaults[key]))
        if defaults.get("do_sample") is False:
            sp.temperature = 0.0
        return GenerationParams(sampling=sp)

    # ---- generation ---------------------------------------------------------------

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
        self._check_thread()
        self.check_media(messages, media)
        chat = self.session(session_id)
        stream = chat.stream(
            messages,
            params,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            cancel=cancel,
            on_progress=_progress_sink(on_event, request_id),
            media=media,
            **template_kwargs,
        )
        return _drain(stream, on_event, request_id)

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
        self._check_thread()
        chat = self.session(session_id)
        stream = chat.stream_ids(
            prompt_ids, params, cancel=cancel, on_progress=_progress_sink(on_event, request_id)
        )
        return _drain(stream, on_event, request_id)

    def encode_prompt(self, text: str) -> list[int]:
        """A plain prompt tokenized as the tokenizer's own settings say (BOS when it adds one)."""
        return list(self._need().tokenizer.encode(text))

    def chat_prompt_ids(self, messages: list[Mapping[str, Any]], **kw: Any) -> list[int]:
        chat = self.session("")
        return chat.encode_rendered(chat.render(messages, **kw))


def _adapter_info(a: Any) -> AdapterInfo:
    return AdapterInfo(
        name=a.name, path=a.path, format=a.format, kind=a.kind, rank=a.rank,
        targets=len(a.targets), base_model=a.base_model,
    )


def _make_towers(loaded: Any) -> Any:
    from pathlib import Path

    from .media.towers import MediaTowers, TowerSource

    path = Path(loaded.path)
    source = TowerSource(
        name=getattr(loaded, "name", path.name), path=path, config=loaded.config,
        model=loaded.model, dtype=getattr(loaded, "dtype", "float32"),
    )
    return MediaTowers(source)


def _progress_sink(on_event: EventSink | None, request_id: int) -> Callable[[int, int], None] | None:
    if on_event is None:
        return None
    return lambda done, total: on_event(ProgressEvent(request_id, "prefill", float(done), float(total)))


def _drain(stream: Iterator[Piece | GenerationResult], on_event: EventSink | None, request_id: int) -> GenerationResult:
    result: GenerationResult | None = None
    for item in stream:
        if isinstance(item, GenerationResult):
            result = item
        elif on_event is not None:
            on_event(TokenEvent(request_id, item.text, item.channel, item.token_ids, item.stats))
    if result is None:
        raise EngineError("generation ended without a result")
    return result
