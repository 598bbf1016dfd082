"""Grammar-constrained decoding: sampled at temperature 1 on a tiny random model (which
left alone writes noise), every completion matches its JSON schema or regex."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.api import GenerationParams, SamplingParams
from engine.decode.constrained import ConstraintError, make_matcher
from engine.errors import EngineError
from engine.runtime.host import ModelHost
from tests.tiny_models import make_tiny_llama

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -50, "maximum": 50},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            },
        },
        "required": ["color", "point"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,5}$"}]},
]


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = ModelHost()
    h.load(str(make_tiny_llama(tmp_path_factory.mktemp("constrained") / "m")))
    return h


def _params(constraint, seed):
    return GenerationParams(max_tokens=120, sampling=SamplingParams(temperature=1.0, seed=seed), constraint=constraint)


@pytest.mark.slow
@pytest.mark.long
def test_200_sampled_completions_all_validate(host):
    prompt = host.encode_prompt("hello there")
    for seed in range(200):
        schema = SCHEMAS[seed % len(SCHEMAS)]
        result = host.generate_ids(prompt, _params({"type": "json_schema", "schema": schema}, seed))
        assert result.finish_reason == "stop", (seed, result.text)
        jsonschema.validate(json.loads(result.text), schema)


def test_regex_and_unconstrained_noise(host):
    prompt = host.encode_prompt("hello there")
    free = host.generate_ids(prompt, GenerationParams(max_tokens=30, sampling=SamplingParams(temperature=1.0, seed=0)))
    with pytest.raises(ValueError):  # the same model, unconstrained, writes no JSON
        json.loads(free.text)
    for seed in range(10):
        result = host.generate_ids(prompt, _params({"type": "regex", "pattern": r"[0-9]{3}-[a-c]+!"}, seed))
        assert re.fullmatch(r"[0-9]{3}-[a-c]+!", result.text), result.text


def test_a_bad_grammar_is_one_clear_error(host):
    with pytest.raises(ConstraintError, match="response format"):
        make_matcher({"type": "regex", "pattern": "(unclosed"}, host.tokenizer)
    with pytest.raises(EngineError, match="Unknown constraint"):
        host.generate_ids(host.encode_prompt("hi"), _params({"type": "xml"}, 0))


def test_with_speculative_decoding_the_output_still_matches(host):
    params = _params({"type": "regex", "pattern": r"[0-9]{3}-[a-c]+!"}, 3)
    params.speculative, params.ngram_size = "ngram", 2
    result = host.generate_ids(host.encode_prompt("123-abc! 123-abc! 123-"), params)
    assert re.fullmatch(r"[0-9]{3}-[a-c]+!", result.text), result.text
