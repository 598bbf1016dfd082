"""Decision scoring for a loaded model: a ``Decide`` request in, a ``Decision`` out.

The prompt is taken as generation takes it: plain text tokenized as the tokenizer says
(BOS when it adds one), token ids as they are, or chat messages rendered with the
template's generation prompt (images and audio spliced in as a chat's are). A text
candidate's tokens are those that prompt + candidate tokenizes to beyond the prompt's
own tokens (lm-eval's loglikelihood convention), so the candidate is scored exactly as
the model would meet it after that prompt. Everything is checked before any work is done
(engine.decode.decision.check_candidates), then the prompt is prefilled once and every
candidate scored on its prefix (engine.decode.decision.score_candidates).

Scoring uses caches of its own, never a chat's: a decision between two turns of a chat
leaves that chat's cache as it was, which is what lets the worker run it beside the
generations it is batching.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from engine.api import Decide, Decision
from engine.errors import EngineError

_SESSION = "\x1fdecide"  # the template and media helpers of a chat session; its cache is never used


def _vocab_size(model: Any) -> int:
    return int(getattr(getattr(model, "args", None), "vocab_size", 0) or 0)


def _context_length(host: Any) -> int:
    info = host.info
    advice = info.context_advice
    return int(advice.limit if advice is not None and advice.limit else info.context_length or 0)


def _text_candidates(encode: Callable[[str], list[int]], prompt_ids_len: int, texts: Sequence[str]) -> list[list[int]]:
    return [list(encode(text)[prompt_ids_len:]) if text else [] for text in texts]


def _prompt(host: Any, request: Decide) -> tuple[list[int], Callable[[str], list[int]] | None, Any, Any]:
    """(prompt ids, how prompt + a candidate text tokenizes, the media prompt, its session)."""
    prompt = request.prompt
    if request.messages is not None:
        from engine.media.parts import split_media

        host.check_media(request.messages, request.media)
        chat = host.session(_SESSION)
        messages, items = split_media(request.messages, request.media)
        text = chat.render(messages, add_generation_prompt=True)
        media = chat.media_prompt(text, items) if items else None
        plain = chat.encode_rendered(text)
        ids = media.ids if media is not None else plain
        # The candidate follows the rendered prompt; its tokens are found on the unexpanded
        # text (media placeholders expand inside the prompt, never past its end).
        return ids, lambda cand: [*ids, *chat.encode_rendered(text + cand)[len(plain) :]], media, chat
    if isinstance(prompt, str):
        tokenizer = host.tokenizer
        return list(tokenizer.encode(prompt)), lambda cand: list(tokenizer.encode(prompt + cand)), None, None
    if prompt is None:
        raise EngineError("A decision needs a prompt: text, token ids or chat messages.")
    return list(prompt), None, None, None


def _candidates(request: Decide, prompt_ids: list[int], encode: Callable[[str], list[int]] | None) -> list[list[int]]:
    raw = list(request.candidates)
    if not raw:
        return []
    if all(isinstance(c, str) for c in raw):
        if encode is None:
            raise EngineError("Text candidates need a text prompt; with token-id prompts give candidates as ids.")
        return _text_candidates(encode, len(prompt_ids), [str(c) for c in raw])
    if all(isinstance(c, list | tuple) for c in raw):
        return [list(c) for c in raw]  # type: ignore[arg-type]
    raise EngineError("Candidates must all be texts or all be lists of token ids.")


def decide(host: Any, request: Decide, cancel: threading.Event | None = None) -> Decision:
    """Score ``request``'s candidates on the model loaded in ``host`` (on the MLX thread)."""
    from engine.decode.batch import batchable
    from engine.decode.decision import check_candidates, score_candidates, softmax

    started = time.perf_counter()
    model = host.model
    prompt_ids, encode, media, chat = _prompt(host, request)
    try:
        candidates = _candidates(request, prompt_ids, encode)
        check_candidates(prompt_ids, candidates, _vocab_size(model), _context_length(host))
        inputs = chat._prompt_inputs(media, 0) if media is not None and media.spans else None
        scores = score_candidates(
            model, prompt_ids, candidates, inputs=inputs, batched=inputs is None and batchable(model), cancel=cancel
        )
    finally:
        if chat is not None:
            host.drop_session(_SESSION)
    raw = list(request.candidates)
    texts = [c if isinstance(c, str) else host.tokenizer.decode(list(c)) for c in raw]
    return Decision(
        candidates=texts,
        candidate_ids=candidates,
        logprobs=scores,
        probabilities=softmax(scores),
        prompt_tokens=len(prompt_ids),
        seconds=time.perf_counter() - started,
    )
