"""KV caches saved to a file: used again only when they fit, never changing the output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.api import GenerationParams, SamplingParams
from engine.runtime.host import ModelHost
from tests.engine.runtime.tiny_folder import make_tiny_model_folder

ROOT = Path(__file__).resolve().parents[3]
PARAMS = GenerationParams(max_tokens=6, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
FIRST = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
SECOND = FIRST + [40, 41, 42, 43]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_model_folder(tmp_path_factory.mktemp("saved") / "tiny-llama")


def _host(folder: Path) -> ModelHost:
    host = ModelHost()
    host.load(str(folder))
    return host


def test_a_saved_cache_serves_a_new_host_and_the_output_is_unchanged(folder, tmp_path):
    path = tmp_path / "chat.safetensors"
    host = _host(folder)
    first = host.generate_ids(FIRST, PARAMS, session_id="a")
    assert host.save_session("a", str(path)) > 0
    held = FIRST + first.token_ids[:-1]  # the last sampled token was never fed

    fresh = _host(folder)  # as after a restart
    restored, why = fresh.restore_session("a", str(path))
    assert (restored, why) == (len(held), "")
    again = fresh.generate_ids(held + [40, 41], PARAMS, session_id="a")
    assert again.stats.cached_tokens == len(held)
    plain = _host(folder).generate_ids(held + [40, 41], PARAMS, session_id="b")
    assert plain.stats.cached_tokens == 0
    assert again.token_ids == plain.token_ids


def test_a_damaged_or_truncated_file_is_skipped_and_replaced(folder, tmp_path):
    path = tmp_path / "chat.safetensors"
    host = _host(folder)
    host.generate_ids(FIRST, PARAMS, session_id="a")
    host.save_session("a", str(path))
    data = path.read_bytes()
    for damaged in (data[: len(data) // 2], b"\x00" * 64, data[:8] + b"{not json" + data[17:]):
        path.write_bytes(damaged)
        fresh = _host(folder)
        restored, why = fresh.restore_session("a", str(path))
        assert restored == 0 and "unreadable" in why
        result = fresh.generate_ids(SECOND, PARAMS, session_id="a")
        assert result.stats.cached_tokens == 0
        assert fresh.save_session("a", str(path)) > 0  # replaced by a good one
        assert _host(folder).restore_session("a", str(path))[0] > 0


def test_a_cache_from_another_model_or_adapter_set_is_not_used(folder, tmp_path):
    path = tmp_path / "chat.safetensors"
    host = _host(folder)
    host.generate_ids(FIRST, PARAMS, session_id="a")
    host.save_session("a", str(path))
    other = make_tiny_model_folder(tmp_path / "other", seed=7)
    restored, why = _host(other).restore_session("a", str(path))
    assert restored == 0 and "another model" in why
    meta_path = tmp_path / "tampered.safetensors"
    # A template change alone is enough to refuse the file.
    from engine.models.kv_cache import load_prompt_cache, save_prompt_cache

    cache, meta = load_prompt_cache(path)
    save_prompt_cache(meta_path, cache, {**meta, "template": "0" * 64})
    assert _host(folder).restore_session("a", str(meta_path)) == (0, "the saved cache was made with another template")


def _cli(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "generate", *args, "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cli_cache_file_reports_cached_tokens_and_equals_an_uncached_run(folder, tmp_path):
    cache = str(tmp_path / "cli.safetensors")
    ids = ",".join(map(str, FIRST))
    first = _cli("--model", str(folder), "--prompt-ids", ids, "--max-tokens", "5", "--cache-file", cache)
    assert first["cached_tokens"] == 0 and Path(cache).is_file()
    longer = ",".join(map(str, FIRST + first["token_ids"][:-1] + [40, 41, 42]))
    cached = _cli("--model", str(folder), "--prompt-ids", longer, "--max-tokens", "5", "--cache-file", cache)
    plain = _cli("--model", str(folder), "--prompt-ids", longer, "--max-tokens", "5")
    assert cached["cached_tokens"] == len(FIRST) + len(first["token_ids"]) - 1
    assert cached["token_ids"] == plain["token_ids"]
    assert "cached_tokens" not in plain


def test_cli_refuses_a_cache_file_it_cannot_write(folder, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            str(folder),
            "--prompt-ids",
            "1,2",
            "--cache-file",
            str(tmp_path / "x.bin"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and proc.stderr.strip().count("\n") == 0 and ".safetensors" in proc.stderr
