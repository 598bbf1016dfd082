"""Decision scoring against transformers (tests/golden/make_decide_goldens.py): each
candidate's log-probability after a prompt on tiny dense, sliding-window, MoE and
vision checkpoints, batched and one by one; the prompt fed once; bad input refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from engine.api import Decide, MediaInput
from engine.decode.batch import batchable
from engine.decode.decision import check_candidates, score_candidates, softmax
from engine.errors import EngineError
from engine.runtime.decide import decide
from engine.runtime.host import ModelHost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from model_goldens import load_golden  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[2] / "golden"
EXPECTED = json.loads((GOLDEN / "decide" / "expected.json").read_text())
TOLERANCE = 1e-3


class CountingModel:
    """The model, counting the tokens fed to it."""

    def __init__(self, model):
        self.model, self.fed = model, 0

    def __call__(self, inputs, cache=None, **kwargs):
        self.fed += int(inputs.size)
        return self.model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "qwen3_moe"])
def test_logprobs_match_transformers(name):
    model, _ = load_golden(name)
    expected = EXPECTED[name]
    prompt, candidates = expected["prompt_ids"], expected["candidates"]
    counting = CountingModel(model)
    one_by_one = score_candidates(counting, prompt, candidates, batched=False)
    assert one_by_one == pytest.approx(expected["logprobs"], abs=TOLERANCE)
    # The prompt is fed once; each candidate feeds only its own tokens but the last.
    assert counting.fed == len(prompt) + sum(len(c) - 1 for c in candidates)
    together = score_candidates(model, prompt, candidates, batched=True)
    assert together == pytest.approx(expected["logprobs"], abs=TOLERANCE)


def test_dense_and_moe_families_batch_and_sliding_windows_do_not():
    assert batchable(load_golden("llama")[0]) and batchable(load_golden("qwen3_moe")[0])
    assert not batchable(load_golden("mistral")[0])


def test_a_vision_prompt_with_an_image(shared_data):
    expected = EXPECTED["qwen2_5_vl"]
    host = ModelHost()
    host.load(str(GOLDEN / "vision" / "qwen2_5_vl"))
    photo = MediaInput("image", str(shared_data / "images" / expected["image"]))
    result = decide(host, Decide(candidates=expected["candidates"], messages=expected["messages"], media=[photo]))
    assert result.logprobs == pytest.approx(expected["logprobs"], abs=TOLERANCE)
    assert sum(result.probabilities) == pytest.approx(1.0)
    assert result.probabilities == pytest.approx(softmax(expected["logprobs"]), abs=1e-4)


def test_softmax_is_over_the_candidates():
    assert softmax([0.0, 0.0]) == [0.5, 0.5]
    assert softmax([-1000.0, -1001.0])[0] == pytest.approx(1 / (1 + 2.718281828**-1))


@pytest.mark.parametrize(
    ("prompt", "candidates", "words"),
    [
        ([1, 2], [], "No candidates"),
        ([1, 2], [[3], []], "Candidate 2 is empty"),
        ([1, 2], [[3, 300]], "id 300, outside the model's vocabulary of 256"),
        ([1, 999], [[3]], "The prompt has token id 999"),
        (
            [1] * 10,
            [[3] * 7],
            "Candidate 1 (7 tokens) after the prompt (10 tokens) is longer than the model's context of 16",
        ),
        ([], [[3]], "The prompt is empty"),
    ],
)
def test_bad_input_is_one_line(prompt, candidates, words):
    with pytest.raises(EngineError) as e:
        check_candidates(prompt, candidates, 256, 16)
    message = str(e.value)
    assert words in message and "\n" not in message
