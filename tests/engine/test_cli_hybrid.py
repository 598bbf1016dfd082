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
    return last_json(generate_run(folder, *extra).stdout)


def generate_run(folder: Path, *extra: str):
    prompt = json.loads((folder / "expected.json").read_text())["prompt_ids"][:24] * 2
    proc = run(
        "generate",
        "--model",
        str(folder),
        "--prompt-ids",
        ",".join(map(str, prompt)),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
        *extra,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc


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
    proc = run(
        "bench",
        "--shape",
        "tiny-qwen3.5",
        "--bits",
        "4",
        "-p",
        "16",
        "-g",
        "8",
        "--vs",
        "mlx-lm",
        "--json",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = last_json(proc.stdout)
    assert data["engine"]["generated_tokens"] == data["mlx_lm"]["generated_tokens"] == 8
    assert data["ratio"]["generation"] > 0


def test_mtp_through_the_cli(folders, tmp_path):
    """--mtp on a Hub-layout checkpoint carrying MTP layers: the same ids as plain decoding;
    on mlx-lm's conversion (MTP layers dropped): one line saying why not."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from engine.models import get_family

    hub = tmp_path / "qwen3_5-hub"
    hub.mkdir()
    config = json.loads((GOLDEN / "qwen3_5" / "config.published.json").read_text())
    (hub / "config.json").write_text(json.dumps(config))
    weights = mx.load(str(GOLDEN / "qwen3_5" / "model.safetensors"))
    weights = {("model.language_model." + k[6:] if k.startswith("model.") else k): v for k, v in weights.items()}
    family = get_family(config["model_type"])
    model = family.Model(family.ModelArgs.from_dict(config))
    from engine.models.qwen3_5_mtp import MTPHead

    rng = np.random.default_rng(3)
    for key, value in tree_flatten(MTPHead(model.args, model.model.layer_class).parameters()):
        scale = 0.1 if value.ndim == 1 else 0.15
        weights["mtp." + key] = mx.array((scale * rng.standard_normal(value.shape)).astype(np.float32))
    mx.save_safetensors(str(hub / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folders["qwen3_5"] / f, hub / f)
    shutil.copy(folders["qwen3_5"] / "expected.json", hub / "expected.json")
    plain = generate_run(hub)
    drafted = generate_run(hub, "--mtp", "--num-draft", "2")
    mtp = last_json(drafted.stdout)
    assert mtp["token_ids"] == last_json(plain.stdout)["token_ids"] and mtp["draft_tokens"] > 0
    # The layer is read when the request first drafts with it: one line on stderr says so.
    reading = [line for line in drafted.stderr.splitlines() if "built-in MTP layer" in line]
    assert len(reading) == 1 and reading[0].startswith("Reading the built-in MTP layer (") and "KB)" in reading[0]
    assert "MTP layer" not in drafted.stdout and "MTP layer" not in plain.stderr
    # The MTP layer (nested under the published spelling's text_config) loads only with --mtp.
    report = run("inspect", str(hub))
    assert report.returncode == 0 and "loaded only for built-in drafting (--mtp)" in report.stdout, report.stderr

    prompt = ",".join(map(str, json.loads((folders["qwen3_5"] / "expected.json").read_text())["prompt_ids"][:8]))
    proc = run("generate", "--model", str(folders["qwen3_5"]), "--prompt-ids", prompt, "--mtp", timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    err = proc.stderr.strip()
    assert "\n" not in err and "multi-token-prediction" in err


def test_bench_times_mtp_drafting():
    proc = run(
        "bench",
        "--shape",
        "tiny-qwen3.5",
        "-p",
        "16",
        "-g",
        "8",
        "--speculative",
        "mtp",
        "--num-draft",
        "2",
        "--json",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    spec = last_json(proc.stdout)["speculative"]
    assert spec["mode"] == "mtp" and spec["identical_to_plain"] and spec["draft_tokens"] > 0
