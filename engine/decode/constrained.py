"""Grammar-constrained decoding: a logits processor that lets through only the tokens
that keep the output inside a grammar (a JSON schema, any JSON object, a regex, Lark).

The grammar engine is llguidance: a small Rust wheel with no other dependencies (no
torch, unlike xgrammar's Python package), wheels for macOS arm64 and Linux, JSON schema,
regex and Lark grammars, and it reads the same ``tokenizer.json`` the engine does. Its
mask is computed on the CPU per step (tens of microseconds for JSON); applying it is one
``where`` on the logits.

The processor follows ``engine.decode.sampling``'s contract, ``(tokens, logits) -> logits``
with ``tokens`` ending in the token sampled last, so the matcher advances by that token
before computing the next mask. The first call of a request consumes nothing: its
``tokens`` are the prompt. End-of-turn ids are allowed exactly when the grammar accepts.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from engine.errors import EngineError

_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

# Compact JSON: a random or weak model must not be able to stall in endless whitespace.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(EngineError):
    """A response format or grammar that cannot be compiled."""


def _ll_tokenizer(tokenizer: Any, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of the engine's tokenizer (built once per tokenizer: ~1 s for a
    150k vocabulary)."""
    import llguidance

    key = (tuple(eos_ids),)
    cached = _TOKENIZERS.get(tokenizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise ConstraintError("Structured output needs a model with a tokenizer.json tokenizer.")
    eos = list(eos_ids) or sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
    ll = llguidance.LLTokenizer(backend.to_str(), eos_token=eos or None)
    _TOKENIZERS[tokenizer] = (key, ll)
    return ll


def grammar_for(constraint: Mapping[str, Any]) -> str:
    """The llguidance grammar for a constraint (see ``GenerationParams.constraint``)."""
    from llguidance import LLMatcher

    kind = constraint.get("type")
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
    if kind == "json_schema":
        schema = constraint.get("schema")
        if not isinstance(schema, Mapping):
            raise ConstraintError("A json_schema response format needs a 'schema' object.")
        prefix, suffix = str(constraint.get("prefix") or ""), str(constraint.get("suffix") or "")
        if prefix or suffix:  # literal text around the JSON (a tool call's markers)
            schema = {**schema, "x-guidance": _JSON_OPTIONS}
            parts = [json.dumps(prefix)] * bool(prefix) + ["value"] + [json.dumps(suffix)] * bool(suffix)
            return LLMatcher.grammar_from_lark(f"start: {' '.join(parts)}\nvalue: %json {json.dumps(schema)}")
        try:
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise ConstraintError(f"The JSON schema cannot be used: {' '.join(str(exc).split())}") from None
    if kind == "regex":
        pattern = constraint.get("pattern")
        if not isinstance(pattern, str):
            raise ConstraintError("A regex response format needs a 'pattern' string.")
        return LLMatcher.grammar_from_regex(pattern)
    if kind == "lark":
        grammar = constraint.get("grammar")
        if not isinstance(grammar, str):
            raise ConstraintError("A lark response format needs a 'grammar' string.")
        return LLMatcher.grammar_from_lark(grammar)
    raise ConstraintError(f"Unknown constraint type {kind!r}; use json_object, json_schema, regex or lark.")


def make_matcher(constraint: Mapping[str, Any], tokenizer: Any, eos_ids: Sequence[int] = ()) -> Any:
    """A fresh llguidance matcher at the start of the output; ConstraintError when the
    grammar does not compile."""
    from llguidance import LLMatcher

    ll = _ll_tokenizer(tokenizer, eos_ids)
    grammar = grammar_for(constraint)
    error = LLMatcher.validate_grammar(grammar, ll)
    if error:
        raise ConstraintError(f"The response format cannot be used: {' '.join(error.split())[:300]}")
    matcher = LLMatcher(ll, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"The response format cannot be used: {matcher.get_error()[:300]}")
    return matcher


def make_constraint_processor(constraint: Mapping[str, Any], tokenizer: Any, eos_ids: Sequence[int] = ()) -> Any:
    """A logits processor that masks every token the grammar does not allow next."""
    matcher = make_matcher(constraint, tokenizer, eos_ids)
    started = [False]

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        # Waits for the token just sampled: the next mask depends on it.
        if started[0] and not matcher.consume_token(int(tokens[-1].item())):
            raise EngineError(f"constrained decoding lost track of the grammar: {matcher.get_error()}")
        started[0] = True
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
        vocab = logits.shape[-1]
        if allowed.size < vocab:  # the model's padded vocabulary rows are never allowed
            allowed = np.concatenate([allowed, np.zeros(vocab - allowed.size, bool)])
        return mx.where(mx.array(allowed[:vocab]), logits, mx.array(float("-inf"), logits.dtype))

    return process
