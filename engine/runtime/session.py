"""ChatSession: a conversation's KV cache and the token ids it holds.

Each request renders the whole conversation, tokenizes it, and compares the ids with
those already in the cache. The longest common prefix is kept: the cache is trimmed
back to it and only the rest is prefilled. A follow-up turn therefore costs only its
new tokens, and editing an earlier message costs what follows the edit. A cache that
cannot be trimmed far enough (a sliding window that has already rotated past the
point) is rebuilt from scratch.

Recurrent layers (Qwen3.5's DeltaNet, LFM2's convolutions) cannot be trimmed at all: they
go back only to snapshots of their state taken at turn boundaries (the end of each reply
and of the latest prompt; engine/models/recurrent_cache.py bounds them), so the kept
prefix is the longest one that ends at such a snapshot (``rewind_point``).

The cache also remembers which adapters were active when it was filled
(``adapters.active_signature``): keys and values computed under one adapter set are
never reused under another, so a change of adapters starts the cache afresh.

With a draft model for speculative decoding, the session keeps the draft's cache too and
reuses its prefix the same way (the draft model has no adapters, so only ids matter; it
reads media placeholders as ids and never the media, so two photos share its prefix).

Messages may carry images and audio (content parts). Their placeholder tokens are
compared by per-token keys that name the media content, so two different photos never
share a cached prefix although their ids agree; media already in the cached prefix is
not encoded again, and new media is encoded (or found in the towers' cache) and spliced
into the prompt's embeddings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from engine.api import GenerationParams, GenerationResult, MediaInput, ReasoningControl
from engine.decode.diffusion import is_diffusion_model, stream_diffusion
from engine.decode.draft_depth import AUTO_MAX_DRAFT
from engine.decode.drafters import drafter_for
from engine.decode.guards import check_fits, fit_context
from engine.decode.loop import Piece, stream_generate
from engine.decode.media_inputs import prompt_inputs
from engine.decode.prefill import ProgressCallback, PromptInputs
from engine.decode.rolling import SINK_TOKENS, RollingWindow, can_slide
from engine.decode.sampling import validate_sampling
from engine.decode.tool_channel import tool_channel
from engine.errors import EngineError, MediaError
from engine.models.lora import active_adapters, active_signature
from engine.runtime.prefix_cache import PrefixCache, common_prefix_length
from engine.text.reasoning_switch import reasoning_variables


def _forced_call(params: GenerationParams, fmt: Any, tools: Sequence[Mapping[str, Any]]) -> GenerationParams:
    """``params`` whose reply is one call to one of ``tools``, in the model's markers (a
    grammar constraint); unchanged for a format that has no plain-JSON call to force."""
    from engine.text.tool_calls import forced_call

    forced = forced_call(fmt, [dict(t) for t in tools])
    if forced is None:
        return params
    if params.constraint is not None:
        raise EngineError("A structured response format and a required tool call cannot be combined.")
    return replace(params, constraint=forced)


class ChatSession:
    """Renders messages, reuses the cached prefix, generates, and remembers what the
    cache now holds so the next turn can reuse it."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        template: Any = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        reasoning_factory: Callable[[str], Any] | None = None,
        reasoning_control: ReasoningControl | None = None,
        towers: Any = None,
        tool_format: Any = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.template = template  # a ChatTemplate (render(messages, tools=, add_generation_prompt=))
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else None
        self.reasoning_factory = reasoning_factory  # prompt text -> splitter or None
        # The template's reasoning switch: GenerationParams.reasoning sets it per request.
        # The prompt is rendered afresh every request and the cache is keyed on ids, so a
        # switch changes the rendered ids and the cache keeps only what still agrees.
        self.reasoning_control = reasoning_control
        self.towers = towers  # MediaTowers, or None for a text-only model
        # How the model writes tool calls (an engine.text.tool_calls.ToolCallFormat the load
        # found in the template), or None: a request with tools gets its calls apart from
        # the answer (engine.decode.tool_channel).
        self.tool_format = tool_format
        self.context_length = 0  # the model's context, a hard limit (0: unknown, none)
        self.prefix = PrefixCache(model)  # the model's cache and the ids (and keys) it holds
        self.draft_model: Any = None  # set by the host when a draft model is loaded
        self._draft: PrefixCache | None = None  # the draft model's, once a request drafts with it
        self.context_length = 0  # the model's context (0: unknown), for GenerationParams.context_policy
        self.window: RollingWindow | None = None  # the last reply's rolling window (rolling policy)
        self.reopen_choice: Any = None  # how a saved cache was last reopened (runtime/reopen_choice.py)

    # ---- prompt -----------------------------------------------------------------

    def render(
        self,
        messages: list[Mapping[str, Any]],
        *,
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        if self.template is None:
            raise EngineError(
                "This model has no chat template; send a plain prompt instead of messages, "
                "or add a chat_template to its tokenizer_config.json."
            )
        return self.template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )

    def encode_rendered(self, text: str) -> list[int]:
        # The template writes every special token itself (BOS included), as transformers'
        # apply_chat_template assumes: adding them again would double the BOS.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- cache ------------------------------------------------------------------

    # The target's prefix cache, as the host and saved caches read and set it.
    @property
    def cache(self) -> list[Any] | None:
        return self.prefix.cache

    @cache.setter
    def cache(self, value: list[Any] | None) -> None:
        self.prefix.cache = value

    @property
    def ids(self) -> list[int]:
        """Exactly the tokens held by ``cache``."""
        return self.prefix.ids

    @ids.setter
    def ids(self, value: list[int]) -> None:
        self.prefix.ids = value

    @property
    def token_keys(self) -> list[Hashable]:
        """One per cached token: its id, or for a media token the media's content key."""
        return self.prefix.keys

    @token_keys.setter
    def token_keys(self, value: list[Hashable]) -> None:
        self.prefix.keys = value

    @property
    def signature(self) -> str:
        """The active adapters ``cache`` was filled under."""
        return self.prefix.signature

    @signature.setter
    def signature(self, value: str) -> None:
        self.prefix.signature = value

    @property
    def draft_cache(self) -> list[Any] | None:
        return self._draft.cache if self._draft is not None else None

    @property
    def _draft_ids(self) -> list[int]:
        return self._draft.ids if self._draft is not None else []

    def reset(self) -> None:
        self.prefix.reset()
        self._draft = None

    def _reuse(self, prompt_ids: Sequence[int], keys: Sequence[Hashable], spans: Sequence[Any] = ()) -> int:
        """The target's cache brought to the prefix it shares with ``keys`` (PrefixCache.reuse),
        under the adapters active now; its length."""
        return self.prefix.reuse(prompt_ids, keys, spans, active_signature(self.model))

    def _drafter(self, params: GenerationParams, prompt_ids: Sequence[int]) -> Any:
        """The request's drafter; for a draft model, its cache trimmed to the prefix it
        shares with ``prompt_ids`` (the drafter feeds the rest itself)."""
        if params.speculative == "mtp":
            from engine.decode.mtp_drafter import MTPDrafter

            return MTPDrafter(self.model, params.num_draft_tokens or AUTO_MAX_DRAFT)
        if params.speculative != "draft" or self.draft_model is None:
            return drafter_for(params)
        if getattr(self.draft_model, "mask_token_id", None) is not None:  # a DFlash block drafter
            from engine.decode.dflash_drafter import DFlashDrafter

            return DFlashDrafter(self.model, self.draft_model, params.num_draft_tokens)
        if self._draft is None or self._draft.model is not self.draft_model:
            self._draft = PrefixCache(self.draft_model)
        self._draft.reuse(prompt_ids)
        return drafter_for(params, draft_model=self.draft_model, draft_cache=self._draft.cache)

    def _record(self, known: list[int], known_keys: list[Hashable]) -> None:
        """After a request: note which of ``known`` (prompt + generated) the caches hold."""
        if not self.prefix.record(known, known_keys):
            self.reset()  # cannot tell which tokens went in: start afresh next time
        elif self._draft is not None and not self._draft.record(known, list(known)):
            self.reset()

    # ---- media --------------------------------------------------------------------

    def media_prompt(self, text: str, items: Sequence[MediaInput]) -> Any:
        """The rendered text with each media placeholder expanded, tokenized and located."""
        from engine.media.prompt import expand_placeholders, locate_media

        if self.towers is None:
            raise MediaError("This model cannot take images or audio; pick a multimodal model.")
        prepared = self.towers.prepare(items)
        expanded = expand_placeholders(text, prepared, self.towers.placeholders())
        return locate_media(self.encode_rendered(expanded), prepared, self.towers.token_ids())

    def _prompt_inputs(self, media: Any, keep: int) -> PromptInputs:
        """Embeddings (media features spliced in), positions and bidirectional blocks for
        the ids from ``keep`` on (engine.decode.media_inputs)."""
        return prompt_inputs(self.model, self.towers, media, keep)

    # ---- generation -------------------------------------------------------------

    def stream_ids(
        self,
        prompt_ids: Sequence[int],
        params: GenerationParams,
        *,
        cancel: threading.Event | None = None,
        on_progress: ProgressCallback | None = None,
        reasoning: Any = None,
        media: Any = None,
        batch: Any = None,
        sink: int = SINK_TOKENS,
    ) -> Iterator[Piece | GenerationResult]:
        """Generate from a full prompt (all its ids, cached or not); ``media`` is the
        MediaPrompt when the prompt holds images or audio. With ``batch`` (an
        engine.decode.batch.Batch) it decodes among other sessions' sequences and also
        yields ``WAITING`` (engine.decode.loop) while it waits for the batch's next step.
        Under the rolling-window policy a reply that fills the context slides the window
        along, keeping the first ``sink`` ids (the system prompt) (engine.decode.rolling)."""
        validate_sampling(params.sampling)  # before the cache is touched
        self.window = None
        prompt_ids = list(media.ids if media is not None else prompt_ids)
        if not prompt_ids:
            raise EngineError("The prompt is empty: give at least one token.")
        if is_diffusion_model(self.model):  # the family picks the loop: whole blocks by denoising
            yield from self._diffuse(prompt_ids, params, cancel, reasoning, media)
            return
        context_full = False
        limit = self.context_length
        if params.context_policy is not None and limit and len(prompt_ids) < limit:
            context_full = params.max_tokens > limit - len(prompt_ids)  # the reply stops where the context does
        whole_reply = params.max_tokens
        params = fit_context(params, len(prompt_ids), self.context_length)
        drafter = self._drafter(params, prompt_ids)  # refuses before the cache is touched
        keys: list[Hashable] = list(media.keys) if media is not None else list(prompt_ids)
        keep = self._reuse(prompt_ids, keys, media.spans if media is not None else ())
        rolling = None
        if (
            context_full
            and params.context_policy == "rolling"
            and media is None
            and batch is None
            and drafter is None
            and can_slide(self.cache)
        ):
            # The window slides along during the reply instead of stopping at the context.
            rolling = self.window = RollingWindow(limit, min(sink, len(prompt_ids) - 1))
            params, context_full = replace(params, max_tokens=whole_reply), False
        generated: list[int] = []
        # Stopped already: nothing will be prefilled (the prefill checks before its first
        # chunk, and a cancel stays set), so the towers need not encode (seconds for a clip).
        stopped = cancel is not None and cancel.is_set()
        try:
            inputs = self._prompt_inputs(media, keep) if media is not None and media.spans and not stopped else None
        except Exception:
            self.reset()  # the cache was trimmed for a prompt that will not run
            getattr(drafter, "close", lambda: None)()
            raise
        try:
            for item in stream_generate(
                self.model,
                self.tokenizer,
                prompt_ids[keep:],
                self.cache,
                params,
                cancel=cancel,
                on_progress=on_progress,
                eos_token_ids=self.eos_token_ids,
                reasoning=reasoning,
                cached_tokens=keep,
                context_ids=prompt_ids,
                drafter=drafter,
                inputs=inputs,
                batch=batch,
                rolling=rolling,
            ):
                if isinstance(item, GenerationResult):
                    generated = item.token_ids
                    item.adapters = active_adapters(self.model)
                    item.context_full = context_full and item.finish_reason == "length"
                yield item
        except Exception:
            self.reset()  # a failed step may leave layers at different lengths
            raise
        finally:
            # Whatever happened (done, cancelled, closed early), record what the caches
            # hold; after an error they were dropped above.
            if rolling is not None and rolling.held is not None:  # the window slid: it holds these
                held = rolling.cache_ids(prompt_ids, generated)
                self._record(held, list(held))
            else:
                self._record(prompt_ids + generated, keys + list(generated))
            getattr(drafter, "close", lambda: None)()  # an MTP drafter stops following the model

    def _diffuse(self, prompt_ids: list[int], params: GenerationParams, cancel, reasoning, media):
        """Block diffusion, reusing the cached prefix as the token loop does. Sound because
        the prompt encoder is causal (the checkpoints that encode both ways are refused at
        load), so a prefix's keys and values do not depend on what follows, and the
        decoder only reads the cache. The cache ends one block short of the reply
        (transformers never encodes the last block): ``_record`` keeps only what it holds."""
        keys: list[Hashable] = list(media.keys) if media is not None else list(prompt_ids)
        keep = self._reuse(prompt_ids, keys, media.spans if media is not None else ())
        generated: list[int] = []
        try:
            inputs = self._prompt_inputs(media, keep) if media is not None and media.spans else None
            for item in stream_diffusion(
                self.model,
                self.tokenizer,
                prompt_ids[keep:],
                self.cache,
                params,
                cancel=cancel,
                eos_token_ids=self.eos_token_ids,
                reasoning=reasoning,
                cached_tokens=keep,
                inputs=inputs,
            ):
                if isinstance(item, GenerationResult):
                    generated = item.token_ids
                    item.adapters = active_adapters(self.model)
                yield item
        except Exception:
            self.reset()  # a failed step may leave layers at different lengths
            raise
        finally:
            self._record(prompt_ids + generated, keys + list(generated))

    def stream(
        self,
        messages: list[Mapping[str, Any]],
        params: GenerationParams,
        *,
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        cancel: threading.Event | None = None,
        on_progress: ProgressCallback | None = None,
        media: Sequence[MediaInput] = (),
        batch: Any = None,
        **template_kwargs: Any,
    ) -> Iterator[Piece | GenerationResult]:
        from engine.media.parts import split_media

        dropped, kept, asked = 0, None, len(messages)
        if params.context_policy in ("truncate_middle", "rolling") and self.context_length:
            fitted, dropped = self._fit(messages, params, tools, add_generation_prompt, template_kwargs)
            if dropped:
                held = {id(m) for m in fitted}
                kept = [i for i, m in enumerate(messages) if id(m) in held]
            messages = fitted
        messages, items = split_media(messages, media)
        if params.pan_and_scan is not None:
            items = [m if m.pan_and_scan is not None else replace(m, pan_and_scan=params.pan_and_scan) for m in items]
        if items and self.towers is not None:
            self.towers.check(m.kind for m in items)  # refuse before rendering or touching the cache
        template_kwargs = {**reasoning_variables(self.reasoning_control, params.reasoning), **template_kwargs}
        calls_format = self.tool_format if tools else None
        if calls_format is not None and params.tool_choice == "required":
            params = _forced_call(params, calls_format, tools)
        text = self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
        reasoning = self.reasoning_factory(text) if self.reasoning_factory else None
        prompt = self.media_prompt(text, items) if items else None
        ids = prompt.ids if prompt is not None else self.encode_rendered(text)
        check_fits(len(ids), self.context_length, "chat")
        sink = SINK_TOKENS
        if params.context_policy == "rolling" and messages and messages[0].get("role") in ("system", "developer"):
            # The system prompt stays at the start of a sliding window.
            try:
                head = self.render(messages[:1], tools=tools, add_generation_prompt=False, **template_kwargs)
                sink = max(sink, common_prefix_length(self.encode_rendered(head), ids))
            except EngineError:  # a template that wants a user turn: the sink tokens only
                pass
        stream = self.stream_ids(
            ids,
            params,
            cancel=cancel,
            on_progress=on_progress,
            reasoning=reasoning,
            media=prompt,
            batch=batch,
            sink=sink,
        )
        for item in tool_channel(stream, calls_format) if calls_format is not None else stream:
            if isinstance(item, GenerationResult):
                read = self.window.still_read(len(ids)) if self.window is not None else None
                if read is not None:  # the window slid mid-reply: the model reads fewer messages now
                    index = kept if kept is not None else list(range(len(messages)))
                    kept = [index[j] for j in self._messages_read(messages, ids, read, tools, template_kwargs)]
                    dropped = asked - len(kept)
                item.dropped_messages = dropped
                item.notes = list(prompt.notes) if prompt is not None else []
                item.kept_messages = kept
            yield item

    def _messages_read(
        self,
        messages: list[Mapping[str, Any]],
        ids: Sequence[int],
        read: tuple[int, int],
        tools: Any,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        """Which of the prompt's ``messages`` (rendered as ``ids``) the model still reads once
        the rolling window slid (``read``: the sink's length, where the kept latest ids
        begin): those within the sink (a system prompt) and those ending after the kept
        ids begin. A message ends where the ids of the messages up to it stop agreeing
        with the prompt's; a template that cannot render a prefix keeps the message."""
        sink, start = read

        def end(j: int) -> int:
            if j == len(messages) - 1:
                return len(ids)
            try:
                text = self.render(messages[: j + 1], tools=tools, add_generation_prompt=False, **template_kwargs)
            except EngineError:
                return len(ids)
            return common_prefix_length(self.encode_rendered(text), ids)

        first = len(messages)  # the first message the kept latest ids reach into
        while first > 0 and end(first - 1) > start:
            first -= 1
        head = 0  # messages wholly within the sink
        while head < first and end(head) <= sink:
            head += 1
        return list(range(head)) + list(range(first, len(messages)))

    def _fit(
        self,
        messages: list[Mapping[str, Any]],
        params: GenerationParams,
        tools: Any,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any],
    ) -> tuple[list[Mapping[str, Any]], int]:
        """The messages that fit the context under ``params.context_policy`` (text counted;
        media placeholders count as their text before expansion)."""
        from engine.runtime.context_policy import fit_messages, reply_room

        variables = {**reasoning_variables(self.reasoning_control, params.reasoning), **template_kwargs}

        def count(candidate: list[Mapping[str, Any]]) -> int:
            text = self.render(candidate, tools=tools, add_generation_prompt=add_generation_prompt, **variables)
            return len(self.encode_rendered(text))

        limit = self.context_length
        return fit_messages(messages, count, limit, reply_room(limit, params.max_tokens), params.context_policy)

    def generate(self, messages: list[Mapping[str, Any]], params: GenerationParams, **kw: Any) -> GenerationResult:
        result = None
        for item in self.stream(messages, params, **kw):
            if isinstance(item, GenerationResult):
                result = item
        assert result is not None
        return result
