"""Reasoning markers: tell a model's thinking apart from its answer while text streams.

Reasoning models wrap their thinking in tags (``<think>...</think>`` and relatives).
Text arrives in arbitrary pieces, so a tag may be split across pieces; the splitter
holds back only the few characters that could still become a tag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.text.channels import Channel, add_piece


@dataclass(frozen=True)
class ReasoningMarkers:
    open_tag: str
    close_tag: str
    starts_in_reasoning: bool = False
    # Sentinels that carry no text of their own (gpt-oss's channel headers).
    drop: tuple[str, ...] = field(default=())

    def splitter(self) -> ReasoningSplitter:
        if self.open_tag == HARMONY_OPEN:  # channels, not a tag pair: commentary, tool calls...
            from engine.text.harmony import HarmonySplitter

            return HarmonySplitter(self.starts_in_reasoning)  # type: ignore[return-value]
        return ReasoningSplitter(self.open_tag, self.close_tag, self.starts_in_reasoning, drop=self.drop)


HARMONY_OPEN = "<|channel|>analysis<|message|>"

# Known marker styles, most specific first: (signature in the template, open, close,
# sentinels to drop).
_STYLES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    # gpt-oss "harmony": analysis channel = reasoning, final channel = answer.
    ("<|channel|>", HARMONY_OPEN, "<|end|>", ("<|start|>assistant", "<|channel|>final<|message|>")),
    ("<|channel>", "<|channel>thought", "<channel|>", ()),  # Gemma 4
    ("<seed:think>", "<seed:think>", "</seed:think>", ()),  # ByteDance Seed-OSS
    ("[THINK]", "[THINK]", "[/THINK]", ()),  # Ministral 3 Reasoning, Magistral
    ("<think>", "<think>", "</think>", ()),  # Qwen3, QwQ, DeepSeek-R1, SmolLM3, GLM, MiniMax, ...
)


def detect_reasoning_markers(chat_template: str | None, rendered_prompt: str = "") -> ReasoningMarkers | None:
    """The reasoning tags a template uses, and whether ``rendered_prompt`` left a block open.

    Qwen3 and DeepSeek-R1 templates end the generation prompt with ``<think>\\n``, so the
    model's first tokens are already reasoning; Qwen3 with thinking off writes an empty
    ``<think></think>`` pair instead, which leaves the model answering.
    """
    source = chat_template or ""
    for signature, open_tag, close_tag, drop in _STYLES:
        if signature in source or signature in rendered_prompt:
            opened = rendered_prompt.rfind(open_tag)
            closed = rendered_prompt.rfind(close_tag)
            return ReasoningMarkers(open_tag, close_tag, starts_in_reasoning=opened > closed, drop=drop)
    return None


class ReasoningSplitter:
    """Feed streamed text, get ``(channel, text)`` pairs; tags themselves are not emitted.

    Newlines right after a tag are dropped (templates put ``<think>\\n`` and
    ``</think>\\n\\n`` around the thinking); all other text passes through unchanged.
    """

    def __init__(
        self,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
        starts_in_reasoning: bool = False,
        *,
        drop: tuple[str, ...] = (),
    ):
        if not open_tag or not close_tag:
            raise ValueError("reasoning tags must be non-empty")
        self.open_tag, self.close_tag = open_tag, close_tag
        self.drop = tuple(d for d in drop if d)
        self.channel: Channel = "reasoning" if starts_in_reasoning else "answer"
        self._pending = ""
        self._after_tag = starts_in_reasoning  # swallow the newlines that follow a tag

    def _patterns(self) -> tuple[str, ...]:
        tag = self.close_tag if self.channel == "reasoning" else self.open_tag
        return (tag, *self.drop)

    def feed(self, piece: str) -> list[tuple[Channel, str]]:
        self._pending += piece
        out: list[tuple[Channel, str]] = []
        while True:
            patterns = self._patterns()
            hits = [(self._pending.find(p), p) for p in patterns]
            hits = [(i, p) for i, p in hits if i >= 0]
            if not hits:
                break
            index, pattern = min(hits, key=lambda h: (h[0], -len(h[1])))
            self._emit(out, self._pending[:index])
            self._pending = self._pending[index + len(pattern) :]
            if pattern not in self.drop:
                self.channel = "answer" if self.channel == "reasoning" else "reasoning"
            self._after_tag = True
        # Keep back the longest tail that could still grow into a pattern.
        keep = 0
        for pattern in self._patterns():
            for size in range(min(len(pattern) - 1, len(self._pending)), keep, -1):
                if pattern.startswith(self._pending[-size:]):
                    keep = size
                    break
        ready = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(ready) :]
        self._emit(out, ready)
        return out

    def flush(self) -> list[tuple[Channel, str]]:
        """The held-back tail at the end of the stream (an unfinished tag is plain text)."""
        out: list[tuple[Channel, str]] = []
        self._emit(out, self._pending)
        self._pending = ""
        return out

    def _emit(self, out: list[tuple[Channel, str]], text: str) -> None:
        if self._after_tag:
            text = text.lstrip("\n")
            self._after_tag = not text
        add_piece(out, self.channel, text)
