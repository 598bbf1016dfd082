"""check_draft_compatible on real tokenizers from ../shared/data/tokenizers."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from engine.decode.drafters import check_draft_compatible
from engine.errors import EngineError


def load(shared_data, name: str) -> Tokenizer:
    return Tokenizer.from_file(str(shared_data / "tokenizers" / name / "tokenizer.json"))


def test_same_tokenizer_is_accepted(shared_data):
    check_draft_compatible(load(shared_data, "llama2"), load(shared_data, "llama2"))


@pytest.mark.parametrize("other", ["gpt2", "falcon"])
def test_other_family_is_refused_with_one_line(shared_data, other):
    with pytest.raises(EngineError) as err:
        check_draft_compatible(load(shared_data, "llama2"), load(shared_data, other))
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("the draft model's vocabulary does not match the target's (id ")
    assert "pick a draft model from the same family" in text
