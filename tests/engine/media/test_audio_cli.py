"""Audio on the command line: ``transcribe``, and ``generate --audio`` for text-only models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.media.audio_checkpoints import (
    load_arrays,
    load_meta,
    write_qwen2_audio_folder,
    write_whisper_folder,
)

ROOT = Path(__file__).resolve().parents[3]
META = load_meta("whisper_asr")


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "MLX_DESK_WHISPER"}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=ROOT, capture_output=True, text=True, timeout=180, env=environ
    )


def one_line_failure(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert err and "\n" not in err and "Traceback" not in err, proc.stderr
    return err


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory) -> Path:
    return write_whisper_folder(tmp_path_factory.mktemp("cli-w") / "whisper-tiny-random")


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory) -> Path:
    import importlib.util

    spec = importlib.util.spec_from_file_location("audio_cli_tiny", ROOT / "tests/engine/runtime/tiny_folder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_tiny_model_folder(tmp_path_factory.mktemp("cli-llm") / "tiny-llama")


def test_transcribe_json(whisper_dir, shared_data):
    proc = run("transcribe", "--whisper", str(whisper_dir), str(shared_data / "audio" / "jfk.wav"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "language", "duration_s", "segments", "finish_reason", "model"}
    assert out["language"] == META["detected_language"] and out["finish_reason"] == "stop"
    assert out["segments"][0]["token_ids"] == load_arrays("whisper_asr")["detect/ids"].tolist()[4:-1]
    plain = run("transcribe", str(shared_data / "audio" / "jfk.wav"), env={"MLX_DESK_WHISPER": str(whisper_dir)})
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == out["text"]


def test_transcribe_failures_are_one_line(whisper_dir, tmp_path, shared_data):
    assert "--whisper" in one_line_failure(run("transcribe", str(shared_data / "audio" / "jfk.wav")))
    bad = tmp_path / "clip.wav"
    bad.write_bytes(b"RIFF....WAVEfmt ")
    assert "clip.wav" in one_line_failure(run("transcribe", "--whisper", str(whisper_dir), str(bad)))
    assert "language" in one_line_failure(
        run(
            "transcribe", "--whisper", str(whisper_dir), "--language", "klingon", str(shared_data / "audio" / "jfk.wav")
        )
    )


def test_generate_with_audio_on_a_text_model_uses_the_transcript(llm_dir, whisper_dir, shared_data):
    jfk = str(shared_data / "audio" / "jfk.wav")
    err = one_line_failure(run("generate", "--model", str(llm_dir), "--prompt", "hello", "--chat", "--audio", jfk))
    assert "cannot take audio" in err and "--whisper" in err
    transcript = json.loads(run("transcribe", "--whisper", str(whisper_dir), jfk, "--json").stdout)["text"]
    common = ["--max-tokens", "4", "--json", "--chat"]
    with_audio = run(
        "generate", "--model", str(llm_dir), "--prompt", "hello", "--audio", jfk, "--whisper", str(whisper_dir), *common
    )
    assert with_audio.returncode == 0, with_audio.stderr
    as_text = run("generate", "--model", str(llm_dir), "--prompt", f"{transcript}\n\nhello", *common)
    a = json.loads(with_audio.stdout.strip().splitlines()[-1])
    b = json.loads(as_text.stdout.strip().splitlines()[-1])
    assert a["prompt_tokens"] == b["prompt_tokens"] > 20
    assert a["token_ids"] == b["token_ids"]
    assert "--prompt TEXT" in one_line_failure(
        run("generate", "--model", str(llm_dir), "--prompt-ids", "1,2", "--audio", jfk, "--whisper", str(whisper_dir))
    )


def test_generate_on_qwen2_audio_hears_the_clip_without_whisper(tmp_path, shared_data):
    """An audio model takes the clip itself: no Whisper model is asked for or loaded."""
    folder = write_qwen2_audio_folder(tmp_path / "tiny-qwen2-audio")
    jfk = str(shared_data / "audio" / "jfk.wav")
    proc = run(
        "generate",
        "--model",
        str(folder),
        "--prompt",
        "what is said",
        "--chat",
        "--audio",
        jfk,
        "--whisper",
        str(tmp_path / "no-such-whisper"),
        "--max-tokens",
        "3",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["generated_tokens"] == 3 and out["prompt_tokens"] > 275  # 11 s of audio: 275 <|AUDIO|> tokens


def test_transcribe_timestamps_prints_one_timed_line_per_segment(tmp_path, shared_data):
    """``--timestamps`` on the short clip: transformers' segments (return_timestamps=True),
    one ``[mm:ss.ss -> mm:ss.ss] text`` line each."""
    meta = load_meta("whisper_longform")
    gold = load_arrays("whisper_longform")
    folder = write_whisper_folder(tmp_path / "whisper-longform-random", meta)
    proc = run("transcribe", "--whisper", str(folder), "--timestamps", str(shared_data / "audio" / "jfk.wav"))
    assert proc.returncode == 0, proc.stderr
    bounds, tokens = gold["short/bounds"], gold["short/tokens"].tolist()
    expected = []
    for i, (start, end) in enumerate(gold["short/times"].tolist()):
        words = " ".join(f"w{t}" for t in tokens[bounds[i] : bounds[i + 1]] if t < meta["n_ordinary"])
        expected.append(f"[{int(start // 60):02d}:{start % 60:05.2f} -> {int(end // 60):02d}:{end % 60:05.2f}] {words}")
    assert proc.stdout.splitlines() == expected
