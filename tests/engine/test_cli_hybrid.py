"""The CLI on hybrid checkpoints (mlx-lm's 4-bit conversions of the tiny goldens): plain,
n-gram and draft-model greedy decoding give the same ids, and the memory plan shows the
recurrent state."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_cli import _tiny_folder_maker, last_json, run

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "models"


def hybrid_folder(root: Path, name: str, tokenizer_dir: Path) -> Path:
    """The golden's mlx-lm folder with a tokenizer beside it (ids are given as ids)."""
    folder = root / name
    shutil.copytree(GOLDEN / name / "mlx", folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, folder / f)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid_cli")
    tokenizer_dir = _tiny_folder_maker()(root / "tok")
    return {n: hybrid_folder(root, n, tokenizer_dir) for n in ("qwen3_5", "lfm2")}


def generate(folder: Path, *extra: str) -> dict:
    prompt = json.loads((folder / "expected.json").read_text())["prompt_ids"][:24] * 2
    proc = run("generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, prompt)), "--max-tokens", "12",
               "--ignore-eos", "--json", *extra, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return last_json(proc.stdout)


def test_speculative_greedy_equals_plain_through_the_cli(folders):
    target = folders["qwen3_5"]
    plain = generate(target)
    assert plain["generated_tokens"] == 12
    assert generate(target, "--ngram", "2")["token_ids"] == plain["token_ids"]
    assert generate(target, "--draft-model", str(folders["lfm2"]))["token_ids"] == plain["token_ids"]


def test_inspect_counts_the_recurrent_state(folders):
    proc = run("inspect", str(folders["qwen3_5"]))
    assert proc.returncode == 0, proc.stderr
    assert "recurrent state" in proc.stdout


def test_bench_hybrid_shape_runs_against_mlx_lm():
    """The bench shapes qwen3.5-4b / qwen3.5-35b-a3b share this code path; a tiny one runs here."""
    pytest.importorskip("mlx_lm")
    proc = run("bench", "--shape", "tiny-qwen3.5", "--bits", "4", "-p", "16", "-g", "8", "--vs", "mlx-lm", "--json",
               timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    assert data["engine"]["generated_tokens"] == data["mlx_lm"]["generated_tokens"] == 8
    assert data["ratio"]["generation"] > 0
