"""``python -m engine decide`` as DESIGN.md's contract states it, run as a subprocess on
a tiny model folder: the JSON keys, text candidates tokenized beyond the prompt, and one
line on stderr for each kind of bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine", "decide", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("decide") / "tiny-llama")


def test_json_holds_each_candidates_logprob_and_the_softmax(model_dir):
    proc = run("--model", str(model_dir), "--prompt", "the capital of france is", "--candidate", " paris",
               "--candidate", " the lazy dog", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["candidates"] == [" paris", " the lazy dog"]
    assert len(out["logprobs"]) == 2 and all(lp < 0 for lp in out["logprobs"])
    total = sum(math.exp(lp) for lp in out["logprobs"])
    assert out["probabilities"] == pytest.approx([math.exp(lp) / total for lp in out["logprobs"]])
    # Text candidates are the ids prompt + candidate tokenizes to beyond the prompt's own:
    # scoring those ids directly gives the same numbers.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = tok.encode("the capital of france is").ids
    cands = [tok.encode("the capital of france is" + c).ids[len(prompt) :] for c in out["candidates"]]
    assert out["candidate_ids"] == cands
    ids = run("--model", str(model_dir), "--prompt-ids", ",".join(map(str, prompt)),
              "--candidate-ids", ";".join(",".join(map(str, c)) for c in cands), "--json")  # fmt: skip
    assert json.loads(ids.stdout.strip().splitlines()[-1])["logprobs"] == pytest.approx(out["logprobs"], abs=1e-5)


def test_chat_prompt_prints_one_line_per_candidate(model_dir):
    proc = run("--model", str(model_dir), "--prompt", "hello", "--chat", "--candidate", "fine", "--candidate", "bad")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith("fine") and lines[1].endswith("bad")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--prompt", "x"], "No candidates"),
        (["--prompt", "x", "--candidate", "a", "--candidate", ""], "Candidate 2 is empty"),
        (["--prompt-ids", "1,2", "--candidate-ids", "4,5;999"], "id 999, outside the model's vocabulary"),
        (["--prompt-ids", "1,2", "--candidate-ids", ",".join(["4"] * 2100)], "longer than the model's context of 2048"),
        (["--prompt", "x", "--candidate", "a", "--image", "photo.png"], "need --chat"),
        (["--prompt-ids", "1,2", "--candidate", "a"], "needs --prompt TEXT"),
    ],
)
def test_bad_input_is_one_line(model_dir, args, words):
    proc = run("--model", str(model_dir), *args)
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert words in err and "\n" not in err and "Traceback" not in err, proc.stderr
