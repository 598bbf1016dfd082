"""The local model list: an HF cache laid out as huggingface_hub lays it out, folders, GGUFs."""

from __future__ import annotations

import hashlib
import os
import shutil

import mlx.core as mx
import pytest
from tiny_checkpoints import PROMPT, TINY_LLAMA, write_checkpoint

from engine.artifacts.hub import delete_local_model, resolve_model_path, scan_local_models
from engine.errors import ModelLoadError
from engine.runtime.loading import load_model

COMMIT_OLD = "a" * 40
COMMIT_NEW = "b" * 40


def add_to_cache(cache, repo_id, folder, commit, ref="main"):
    """Put a folder's files into ``cache`` as blobs + snapshot symlinks + refs/<ref>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


def test_cache_scan_counts_shared_blobs_once(tmp_path, cache):
    ckpt = write_checkpoint(tmp_path / "src", bits=4, group_size=32, shards=2, generation_config={"eos_token_id": 2})
    add_to_cache(cache, "mlx-community/Tiny-4bit", ckpt.path, COMMIT_OLD)
    # A second revision that changes only config.json: the weight blobs are shared.
    config = (ckpt.path / "config.json").read_text()
    (ckpt.path / "config.json").write_text(
        config.replace('"max_position_embeddings": 512', '"max_position_embeddings": 1024')
    )
    snap = add_to_cache(cache, "mlx-community/Tiny-4bit", ckpt.path, COMMIT_NEW)
    (cache / "models--broken--Model" / "snapshots" / COMMIT_OLD).mkdir(parents=True)
    (cache / "models--broken--Model" / "snapshots" / COMMIT_OLD / "config.json").write_text("{")

    found = {m.name: m for m in scan_local_models()}
    assert set(found) == {"mlx-community/Tiny-4bit", "broken/Model"}
    tiny = found["mlx-community/Tiny-4bit"]
    assert tiny.path == snap and tiny.repo_id == "mlx-community/Tiny-4bit" and tiny.source == "hf-cache"
    assert tiny.family == "llama" and tiny.quantization == "4-bit g32" and tiny.error is None
    assert tiny.context_length == 1024  # refs/main points at the newer snapshot
    blobs = list((cache / "models--mlx-community--Tiny-4bit" / "blobs").iterdir())
    assert tiny.size_on_disk == sum(b.stat().st_size for b in blobs)
    unique_files = sum(f.stat().st_size for f in ckpt.path.iterdir())
    assert tiny.size_on_disk == unique_files + len(config)  # two configs, one copy of the weights
    h, i, v = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"], TINY_LLAMA["vocab_size"]
    assert tiny.parameters == 2 * v * h + h + 2 * (2 * h * h + 2 * h * 32 + 3 * h * i + 2 * h)
    assert "not valid JSON" in found["broken/Model"].error


def test_folders_and_gguf_files_the_user_added(tmp_path, cache, shared_data):
    write_checkpoint(tmp_path / "mine" / "model-a")
    (tmp_path / "mine" / "notes").mkdir()
    gguf = tmp_path / "mine" / "stories.gguf"
    shutil.copy(shared_data / "tiny_llm" / "stories260K.gguf", gguf)
    single = write_checkpoint(tmp_path / "single", dtype=mx.float32)
    found = {m.name: m for m in scan_local_models([tmp_path / "mine", single.path])}
    assert set(found) == {"model-a", "stories", "single"}
    assert found["stories"].source == "gguf" and found["stories"].quantization == "F32"
    assert found["stories"].parameters == 292_800 and found["stories"].context_length == 2048
    assert found["stories"].size_on_disk == gguf.stat().st_size
    assert found["single"].quantization == "fp32" and found["model-a"].quantization == "bf16"


def test_repo_id_resolves_and_loads_from_the_cache(tmp_path, cache):
    ckpt = write_checkpoint(tmp_path / "src")
    snap = add_to_cache(cache, "someone/tiny-llama", ckpt.path, COMMIT_OLD)
    assert resolve_model_path("someone/tiny-llama") == snap
    loaded = load_model("someone/tiny-llama")
    assert loaded.name == "tiny-llama" and loaded.tokenizer_path == snap
    assert mx.array_equal(loaded.model(PROMPT), ckpt.logits()).item()


def test_repo_not_in_cache_says_how_to_download(cache):
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache.*hf download someone/missing"):
        resolve_model_path("someone/missing")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path("./no/such/folder/at/all")


def test_delete_local_model(tmp_path, cache):
    ckpt = write_checkpoint(tmp_path / "src")
    add_to_cache(cache, "someone/tiny", ckpt.path, COMMIT_OLD)
    (cache / ".locks" / "models--someone--tiny").mkdir(parents=True)
    freed = delete_local_model("someone/tiny")
    assert freed == sum(f.stat().st_size for f in ckpt.path.iterdir())
    assert not (cache / "models--someone--tiny").exists() and not (cache / ".locks" / "models--someone--tiny").exists()
    assert scan_local_models() == []
    with pytest.raises(ModelLoadError, match="nothing to delete"):
        delete_local_model("someone/tiny")
