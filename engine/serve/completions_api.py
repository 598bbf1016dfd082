"""OpenAI's legacy POST /v1/completions: plain-text continuation, streamed or not.

Beyond one prompt and one reply, as lm-eval's ``local-completions`` and other clients use it:

- ``prompt`` is a string, a list of token ids, or a batch of either (up to MAX_PROMPTS);
  choices come prompt by prompt, ``n`` each (choice ``index`` = prompt * n + j).
- ``echo`` puts the prompt before the reply; with ``logprobs`` it also gives the prompt's
  own tokens their log-probabilities (the first token's null: nothing predicts it).
- ``max_tokens: 0`` writes nothing (with ``echo`` and ``logprobs``: the prompt's scores,
  which is lm-eval's loglikelihood).
- Literal special tokens are left out of the text unless ``skip_special_tokens`` is false.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.api import Complete, GenerationParams, GenerationResult, PromptScores, ScorePrompt
from engine.serve.common import (
    check_body,
    check_model,
    check_text_size,
    choice_count,
    choice_params,
    field,
    generation_params,
    hidden_specials,
    new_id,
    now,
    run,
    session_key,
    without_specials,
)
from engine.serve.http import ApiError, Handler

MAX_PROMPTS = 256  # prompts in one request (lm-eval sends its batch as one)
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 16  # the completions API's own default


def prompts(body: Mapping[str, Any]) -> list[str | list[int]]:
    """The request's prompts: a string, token ids, or a list of either."""
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    if len(batch) > MAX_PROMPTS:
        raise ApiError(400, f"'prompt' holds {len(batch)} prompts; at most {MAX_PROMPTS} per request.", param="prompt")
    for item in batch:
        text_ok = isinstance(item, str) and item
        ids_ok = isinstance(item, list) and item and all(isinstance(i, int) and not isinstance(i, bool) for i in item)
        if not (text_ok or ids_ok):
            raise ApiError(
                400,
                "'prompt' must be a non-empty string, a list of token ids, or a list of those.",
                param="prompt",
            )
    return batch


def _settings(body: Mapping[str, Any], backend: Any) -> tuple[GenerationParams, int | None]:
    """(the generation settings, the number of top log-probs asked for, None for none)."""
    params = generation_params(body, backend, max_tokens_keys=(), stop_key="stop")
    params.max_tokens = field(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    if params.max_tokens < 0:
        raise ApiError(400, "'max_tokens' must be 0 or more.", param="max_tokens")
    top = field(body, "logprobs", int)
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}.", param="logprobs")
    params.logprobs, params.top_logprobs = top is not None, top or 0
    return params, top


class _Choice:
    """One choice's text and log-probabilities as they build up (echoed prompt, then reply)."""

    def __init__(self, backend: Any, top: int | None, hidden: frozenset[str]):
        self.backend, self.top, self.hidden = backend, top, hidden
        self.text = ""
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []

    def add(self, ids: list[int], logprobs: list[float | None] | None, tops: Any) -> None:
        for i, token_id in enumerate(ids):
            self.tokens.append(self.backend.token_text(token_id))
            self.token_logprobs.append(logprobs[i] if logprobs is not None else None)
            row = tops[i] if tops is not None and i < len(tops) else None
            self.top_logprobs.append(
                {self.backend.token_text(t): v for t, v in sorted(row, key=lambda p: -p[1])} if row else None
            )

    def logprobs(self) -> dict[str, Any] | None:
        if self.top is None:
            return None
        offsets, at = [], 0
        for token in self.tokens:
            offsets.append(at)
            at += len(token)
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "text_offset": offsets,
            "top_logprobs": self.top_logprobs if self.top else None,
        }


def _echo(handler: Handler, prompt: str | list[int], choice: _Choice) -> int:
    """Put the prompt (and, with logprobs, its scores) first in ``choice``; its token count."""
    backend = handler.server.backend
    if choice.top is None:  # the text alone: no forward pass
        count = _count(backend, prompt)  # (ids checked before the tokenizer reads them)
        choice.text = prompt if isinstance(prompt, str) else backend.host.tokenizer.decode(prompt)
        return count
    scores: PromptScores = run(handler, ScorePrompt(prompt, choice.top or 0), lambda e: None)
    choice.text = prompt if isinstance(prompt, str) else backend.host.tokenizer.decode(scores.token_ids)
    choice.add(scores.token_ids, scores.logprobs, scores.top_logprobs)
    return len(scores.token_ids)


def _count(backend: Any, prompt: str | list[int]) -> int:
    """The prompt's tokens, without running the model (ids are checked against the vocabulary)."""
    if isinstance(prompt, str):
        return len(backend.host.tokenizer.encode(prompt))
    return len(backend.host.check_token_ids(prompt))


def _streamer(chunk: Any, index: int, hidden: frozenset[str]) -> Any:
    def on_token(event: Any) -> None:
        text = without_specials(event.text, hidden)
        if text:
            chunk(index, text)

    return on_token


def _finish(result: GenerationResult | None) -> str:
    return "stop" if result is not None and result.finish_reason != "length" else "length"


def completions(handler: Handler, body: Any) -> None:
    backend = handler.server.backend
    body = check_body(body)
    model = check_model(body, backend)
    n = choice_count(body)
    if field(body, "best_of", int, n) != n:
        raise ApiError(400, "'best_of' must equal 'n' (every reply written is returned).", param="best_of")
    if field(body, "suffix", str):
        raise ApiError(400, "'suffix' is not supported.", param="suffix")
    echo = field(body, "echo", bool, False)
    params, top = _settings(body, backend)
    batch = prompts(body)
    for prompt in batch:  # each prompt is its own context
        check_text_size(backend, [prompt] if isinstance(prompt, str) else [])
    hidden = hidden_specials(body, backend)
    stream = field(body, "stream", bool, False)
    include_usage = bool((field(body, "stream_options", dict) or {}).get("include_usage"))
    cid, created = new_id("cmpl-"), now()
    usage = {"prompt_tokens": 0, "completion_tokens": 0, "cached": 0}

    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> None:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        handler.send_event(
            {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
        )

    choices = []
    for p, prompt in enumerate(batch):
        for j in range(n):
            index = p * n + j
            choice = _Choice(backend, top, hidden)
            prompt_tokens = _echo(handler, prompt, choice) if echo else 0
            if stream and choice.text:
                chunk(index, choice.text)
            result = None
            if params.max_tokens > 0:
                command = Complete(backend.session(session_key(prompt)), prompt, choice_params(params, j))
                result = run(handler, command, _streamer(chunk, index, hidden) if stream else lambda e: None)
                choice.text += without_specials(result.text, hidden)
                choice.add(result.token_ids, result.token_logprobs, result.top_logprobs)
                prompt_tokens = result.stats.prompt_tokens
                usage["completion_tokens"] += result.stats.generated_tokens
                usage["cached"] += result.stats.cached_tokens
            if (
                result is None and not echo
            ):  # nothing written, nothing echoed: the prompt is still counted (and checked)
                prompt_tokens = _count(backend, prompt)
            if j == 0:
                usage["prompt_tokens"] += prompt_tokens
            if stream:
                chunk(index, "", _finish(result), choice.logprobs())
            else:
                choices.append(
                    {
                        "index": index,
                        "text": choice.text,
                        "logprobs": choice.logprobs(),
                        "finish_reason": _finish(result),
                    }
                )
    totals = {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": usage["cached"]},
    }
    if not stream:
        handler.send_json(
            200,
            {
                "id": cid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": totals,
            },
        )
        return
    if not handler.streaming:  # nothing streamed yet (no prompt at all cannot happen; kept safe)
        handler.start_stream()
    if include_usage:
        handler.send_event(
            {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": [], "usage": totals}
        )
    handler.send_event("[DONE]")
