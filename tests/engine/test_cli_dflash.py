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
