"""The CLI's --adapter, --draft-model, --ngram and --num-draft, run as a subprocess."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_cli import JSON_KEYS, _one_line_failure, last_json, run

SPEC_KEYS = JSON_KEYS | {"draft_tokens", "accepted_draft_tokens", "acceptance_rate"}
PROMPT = [
    "--prompt",
    "Once upon a time there was a little robot. Once upon a time",
    "--max-tokens",
    "12",
    "--ignore-eos",
    "--json",
]


def _tiny_folder():
    spec = importlib.util.spec_from_file_location(
        "cli_tiny_folder_5", Path(__file__).parent / "runtime" / "tiny_folder.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tiny = _tiny_folder()
    root = tmp_path_factory.mktemp("cli5")
    return {
        "model": tiny.make_tiny_model_folder(root / "model"),
        "draft": tiny.make_tiny_model_folder(root / "draft", seed=1),
        "other_vocab": tiny.make_tiny_model_folder(root / "other", corpus=["zebra quartz jukebox vexing"] * 4),
        "alpha": tiny.make_tiny_adapter(root / "alpha" / "adapters", seed=11),
        "beta": tiny.make_tiny_adapter(root / "beta" / "adapters", seed=12),  # same folder name as alpha's
    }


def generate(folders, *extra: str) -> dict:
    proc = run("generate", "--model", str(folders["model"]), *PROMPT, *extra)
    assert proc.returncode == 0, proc.stderr
    return last_json(proc.stdout)


def in_process(folders, scales: dict[str, float]) -> list[int]:
    """The same request through ModelHost in this process: the reference for the CLI."""
    from engine.api import GenerationParams
    from engine.runtime.host import ModelHost

    host = ModelHost()
    host.load(str(folders["model"]))
    for name in scales:
        host.mount_adapter(str(folders[name]), name)
    host.set_active_adapters(scales)
    ids = host.encode_prompt(PROMPT[1])
    return host.generate_ids(ids, GenerationParams(max_tokens=12, ignore_eos=True)).token_ids


def test_adapters_with_scales(folders):
    plain = generate(folders)
    assert set(plain) == JSON_KEYS  # no speculative keys without speculative decoding
    one = generate(folders, "--adapter", str(folders["alpha"]))
    assert one["token_ids"] != plain["token_ids"]
    assert one["token_ids"] == in_process(folders, {"alpha": 1.0})
    two = generate(folders, "--adapter", f"{folders['alpha']}:0.5", "--adapter", f"{folders['beta']}:1.5")
    assert two["token_ids"] == in_process(folders, {"alpha": 0.5, "beta": 1.5})
    assert generate(folders, "--adapter", f"{folders['alpha']}:0")["token_ids"] == plain["token_ids"]


def test_ngram_and_draft_model_equal_plain_greedy(folders):
    plain = generate(folders)["token_ids"]
    ngram = generate(folders, "--ngram", "2", "--num-draft", "3")
    assert set(ngram) == SPEC_KEYS
    assert ngram["token_ids"] == plain
    assert ngram["draft_tokens"] > 0 and 0 <= ngram["accepted_draft_tokens"] <= ngram["draft_tokens"]
    # A fixed depth: a draft model as large as the target would not pay, by the adaptive depth's
    # reckoning, for its prefill of the prompt within 12 tokens.
    draft = generate(folders, "--draft-model", str(folders["draft"]), "--num-draft", "3")
    assert draft["token_ids"] == plain and draft["draft_tokens"] > 0
    assert draft["acceptance_rate"] == draft["accepted_draft_tokens"] / draft["draft_tokens"]
    itself = generate(folders, "--draft-model", str(folders["model"]), "--num-draft", "5", "--logprobs")
    assert itself["token_ids"] == plain and itself["acceptance_rate"] == 1.0
    assert len(itself["token_logprobs"]) == 12
    adapted = generate(folders, "--adapter", str(folders["alpha"]), "--draft-model", str(folders["draft"]))
    assert adapted["token_ids"] == in_process(folders, {"alpha": 1.0})


def test_refusals_are_one_line(folders, tmp_path):
    model = ["generate", "--model", str(folders["model"]), *PROMPT]
    err = _one_line_failure(run(*model, "--draft-model", str(folders["other_vocab"])))
    assert "the draft model's vocabulary does not match the target's" in err
    proc = run(*model, "--ngram", "2", "--draft-model", str(folders["draft"]))
    assert proc.returncode != 0 and "not allowed with" in proc.stderr
    not_adapter = tmp_path / "empty"
    not_adapter.mkdir()
    assert "no adapter_config.json" in _one_line_failure(run(*model, "--adapter", str(not_adapter)))


def test_real_adapter_onto_the_wrong_model_is_refused_with_the_shapes(shared_data, tmp_path):
    """The real mlx-lm adapter (../shared/data/lora, trained on Qwen2.5-0.5B-Instruct) targets
    layers 20-23; a 24-layer model of hidden size 32 has them, in the wrong shape."""
    wrong = _tiny_folder().make_tiny_model_folder(tmp_path / "wrong", layers=24)
    adapter = shared_data / "lora" / "qwen2.5-0.5b-instruct_jxbot"
    err = _one_line_failure(run("generate", "--model", str(wrong), "--prompt", "hi", "--adapter", str(adapter)))
    assert "expects q_proj 896->896 but the model has 32->32 at model.layers.20.self_attn.q_proj" in err
    assert "trained for a different base model (Qwen2.5-0.5B-Instruct?)" in err
