"""Audio parts in chats through the shared media plumbing, on the tiny golden Qwen2-Audio.

The referee is tests/golden/media/qwen2_audio_tiny.*: transformers' Qwen2AudioProcessor
laid out the prompt for the first 4 s of ../shared/data/audio/jfk.wav and its model
produced the greedy ids. Here the clip goes in as an ``{"type": "audio"}`` part and the
host does everything else: expansion of <|AUDIO|>, the lazily loaded tower, splicing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import wave
from pathlib import Path

import numpy as np
import pytest

from engine.api import DoneEvent, ErrorEvent, Generate, GenerationParams, LoadModel, MediaInput
from engine.runtime.host import ModelHost
from engine.runtime.worker import EngineWorker
from tests.engine.media.audio_checkpoints import load_arrays, load_meta, write_qwen2_audio_folder

ROOT = Path(__file__).resolve().parents[3]
META = load_meta("qwen2_audio_tiny")
QUESTION = META["messages"][0]["content"][1]["text"]
PARAMS = GenerationParams(max_tokens=META["steps"], ignore_eos=True, logprobs=True)


def ask(clip: str | bytes | None, text: str = QUESTION) -> list[dict]:
    parts = ([{"type": "audio", "audio": clip}] if clip is not None else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def gold() -> dict:
    return load_arrays("qwen2_audio_tiny")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_qwen2_audio_folder(tmp_path_factory.mktemp("qa-chat") / "tiny-qwen2-audio")


@pytest.fixture(scope="module")
def clip(shared_data, tmp_path_factory) -> Path:
    """The golden's clip: jfk.wav's first 4 s, the PCM frames copied as they are."""
    out = tmp_path_factory.mktemp("qa-clip") / "jfk-4s.wav"
    with wave.open(str(shared_data / "audio" / "jfk.wav"), "rb") as src, wave.open(str(out), "wb") as dst:
        dst.setparams(src.getparams())
        dst.writeframes(src.readframes(int(META["audio_seconds"] * src.getframerate())))
    return out


@pytest.fixture()
def host(folder) -> ModelHost:
    h = ModelHost()
    info = h.load(str(folder))
    assert info.audio and not info.vision
    return h


def test_audio_part_gives_transformers_greedy_ids_and_the_tower_loads_only_then(host, clip, gold):
    host.generate("a", [{"role": "user", "content": "what is said"}], GenerationParams(max_tokens=3))
    host.generate("a", ask(None), GenerationParams(max_tokens=3))
    assert not host.tower_loaded and host.towers.encode_calls == 0

    chat = host.session("ids")
    template_messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    prompt = chat.media_prompt(chat.render(template_messages), [MediaInput("audio", str(clip))])
    assert prompt.ids == gold["prompt/ids"].tolist()
    assert [(s.start, s.end - s.start) for s in prompt.spans] == [
        (prompt.ids.index(META["config"]["audio_token_index"]), META["audio_tokens"])
    ]
    assert not host.tower_loaded  # laying out the prompt needs no weights

    result = host.generate("b", ask(str(clip)), PARAMS)
    assert result.token_ids == gold["greedy/ids"].tolist()
    np.testing.assert_allclose(result.token_logprobs, gold["greedy/logprobs"], atol=2e-3)
    assert result.stats.prompt_tokens == len(gold["prompt/ids"])
    assert host.tower_loaded and host.towers.encode_calls == 1


def test_the_same_clip_is_encoded_once_across_regenerate_sessions_and_bytes(host, clip, gold):
    first = host.generate("a", ask(str(clip)), PARAMS)
    again = host.generate("a", ask(str(clip)), PARAMS)
    other = host.generate("b", ask(clip.read_bytes()), PARAMS)  # keyed by content, not by path
    assert first.token_ids == again.token_ids == other.token_ids == gold["greedy/ids"].tolist()
    assert host.towers.encode_calls == 1


def test_worker_refuses_audio_for_a_model_that_cannot_hear(clip, tmp_path):
    spec = importlib.util.spec_from_file_location("qa_tiny", ROOT / "tests/engine/runtime/tiny_folder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    llm = module.make_tiny_model_folder(tmp_path / "tiny-llama")
    events: list = []
    done = threading.Event()

    def on_event(event):
        events.append(event)
        if len([e for e in events if isinstance(e, DoneEvent | ErrorEvent)]) == 3:
            done.set()

    worker = EngineWorker(on_event)
    worker.start()
    try:
        worker.submit(LoadModel(str(llm)))
        refused = worker.submit(Generate("s", ask(str(clip)), GenerationParams(max_tokens=2)))
        fine = worker.submit(Generate("s", [{"role": "user", "content": "hello"}], GenerationParams(max_tokens=2)))
        assert done.wait(120)
    finally:
        worker.shutdown()
    finals = {e.request_id: e for e in events if isinstance(e, DoneEvent | ErrorEvent)}
    assert isinstance(finals[refused], ErrorEvent) and finals[refused].kind == "MediaError"
    assert finals[refused].message == (
        "This model (tiny-llama) cannot hear audio; transcribe it first or pick an audio model such as Qwen2-Audio."
    )
    assert isinstance(finals[fine], DoneEvent)


def test_cli_chat_audio_feeds_the_clip_natively(folder, clip, gold):
    environ = {k: v for k, v in os.environ.items() if k != "MLX_DESK_WHISPER"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            str(folder),
            "--chat",
            "--prompt",
            QUESTION,
            "--audio",
            str(clip),
            "--max-tokens",
            str(META["steps"]),
            "--ignore-eos",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env=environ,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == gold["greedy/ids"].tolist()
    assert out["prompt_tokens"] == len(gold["prompt/ids"])
