"""``generate --draft-model DIR`` with a DFlash drafter folder (recognised by its config),
run as a subprocess: the output is plain greedy's, drafts are verified, and a drafter made
for another target is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_cli import _one_line_failure, last_json, run
from test_cli_adapters_and_drafting import PROMPT, _tiny_folder

sys.path.insert(0, str(Path(__file__).parent / "speculative"))
from dflash_models import drafter_config, write_drafter  # noqa: E402


def _shape(hidden: int, layers: int, vocab: int) -> SimpleNamespace:
    """What drafter_config reads of a target, without loading one."""
    return SimpleNamespace(args=SimpleNamespace(hidden_size=hidden, vocab_size=vocab), layers=[None] * layers)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    import json

    root = tmp_path_factory.mktemp("cli_dflash")
    model = _tiny_folder().make_tiny_model_folder(root / "model")
    config = json.loads((model / "config.json").read_text())
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    return {
        "model": model,
        "dflash": write_drafter(
            root / "dflash", drafter_config(_shape(hidden, layers, vocab), layer_ids=(0, 1), block=6)
        ),
        "other": write_drafter(root / "other", drafter_config(_shape(hidden, layers + 2, vocab), layer_ids=(0, 3))),
    }


def generate(folders, *extra: str) -> dict:
    proc = run("generate", "--model", str(folders["model"]), *PROMPT, *extra)
    assert proc.returncode == 0, proc.stderr
    return last_json(proc.stdout)


def test_a_dflash_drafter_folder_drafts_and_keeps_plain_greedy(folders):
    plain = generate(folders)["token_ids"]
    drafted = generate(folders, "--draft-model", str(folders["dflash"]), "--num-draft", "5")
    assert drafted["token_ids"] == plain
    assert drafted["draft_tokens"] > 0 and 0 <= drafted["accepted_draft_tokens"] <= drafted["draft_tokens"]


def test_a_dflash_drafter_for_another_target_is_refused_in_one_line(folders):
    err = _one_line_failure(
        run("generate", "--model", str(folders["model"]), *PROMPT, "--draft-model", str(folders["other"]))
    )
    assert "made for a target with 4 layers" in err


def test_prefix_reuse_with_a_dflash_drafter_keeps_plain_greedy(folders):
    """Through the host: a second request sharing the first's prefix reuses the target's
    cache; the drafter starts its context where that request's passes start, and both
    replies are plain greedy's."""
    from engine.api import GenerationParams, SamplingParams
    from engine.runtime.host import ModelHost

    host = ModelHost()
    host.load(str(folders["model"]))
    first = host.encode_prompt("Once upon a time there was a little robot.")
    second = first + host.encode_prompt(" Once upon a time")
    greedy = GenerationParams(max_tokens=10, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    plain = [host.generate_ids(ids, greedy, session_id="plain").token_ids for ids in (first, second)]
    info = host.load_draft(str(folders["dflash"]))
    assert info is not None and info.family == "dflash" and host.info.draft_model == info.path
    drafting = GenerationParams(
        max_tokens=10,
        ignore_eos=True,
        sampling=SamplingParams(temperature=0.0),
        speculative="draft",
        num_draft_tokens=4,
    )
    results = [host.generate_ids(ids, drafting, session_id="drafted") for ids in (first, second)]
    assert [r.token_ids for r in results] == plain
    assert results[1].stats.cached_tokens > 0 and results[1].stats.draft_tokens > 0
