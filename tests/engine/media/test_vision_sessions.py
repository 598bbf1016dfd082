"""Images in chats: lazy towers, the encoded-image cache, prefix reuse that tells photos
apart, refusals, the worker and the CLI. Runs on the tiny golden Gemma 3 folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.api import DoneEvent, ErrorEvent, Generate, GenerationParams, GenerationResult, LoadModel, MediaInput
from engine.errors import MediaError
from engine.runtime.host import ModelHost
from engine.runtime.worker import EngineWorker

ROOT = Path(__file__).resolve().parents[3]
GEMMA = ROOT / "tests" / "golden" / "vision" / "gemma3"
QWEN = ROOT / "tests" / "golden" / "vision" / "qwen2_5_vl"
PARAMS = GenerationParams(max_tokens=4, ignore_eos=True)


def ask(image: str | None, text: str = "What is in this picture?") -> list[dict]:
    parts = ([{"type": "image", "image": image}] if image else []) + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def expected_ids(host: ModelHost, image: str) -> list[int]:
    chat = host.session("ids")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
    return chat.media_prompt(chat.render(parts), [MediaInput("image", image)]).ids


@pytest.fixture()
def qwen() -> ModelHost:
    h = ModelHost()
    h.load(str(QWEN))
    return h


@pytest.fixture()
def host() -> ModelHost:
    h = ModelHost()
    info = h.load(str(GEMMA))
    assert info.vision and not info.audio
    return h


def test_text_only_chats_never_load_the_tower(host):
    host.generate("a", [{"role": "user", "content": "hello there"}], PARAMS)
    host.generate("a", ask(None, "plain text parts"), PARAMS)
    assert not host.tower_loaded and host.towers.encode_calls == 0


def test_images_are_encoded_once_across_regenerate_continue_and_sessions(host, shared_data):
    photo = str(shared_data / "images" / "chelsea.png")
    first = host.generate("a", ask(photo), PARAMS)
    assert host.tower_loaded and host.towers.encode_calls == 1
    # Gemma's 6-token sliding window has rotated past the prompt, so the cache is rebuilt:
    # the features come from the encoded-media cache.
    again = host.generate("a", ask(photo), PARAMS)
    assert again.token_ids == first.token_ids
    follow = ask(photo) + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and?"}]
    host.generate("a", follow, PARAMS)
    fresh = host.generate("b", ask(photo), PARAMS)
    assert fresh.token_ids == first.token_ids
    assert host.towers.encode_calls == 1


def test_an_image_in_the_cached_prefix_is_not_encoded_again(qwen, shared_data):
    photo = str(shared_data / "images" / "chelsea.png")
    first = qwen.generate("a", ask(photo), PARAMS)
    qwen.towers.cache.clear()  # only prefix reuse can spare the encoder now
    follow = ask(photo) + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and?"}]
    result = qwen.generate("a", follow, PARAMS)
    assert result.stats.cached_tokens > len(expected_ids(qwen, photo)) - 5
    assert qwen.towers.encode_calls == 1
    reference = ModelHost()
    reference.load(str(QWEN))
    assert result.token_ids == reference.generate("z", follow, PARAMS).token_ids


def test_two_photos_with_equal_placeholder_ids_do_not_share_a_prefix(qwen, shared_data):
    cat, coffee = (str(shared_data / "images" / n) for n in ("chelsea.png", "coffee.png"))
    cat_ids, coffee_ids = expected_ids(qwen, cat), expected_ids(qwen, coffee)
    first_image_token = cat_ids.index(qwen.towers.encoder("image").token_id)
    assert cat_ids == coffee_ids  # both photos resize to the same grid: identical ids
    qwen.generate("a", ask(cat), PARAMS)
    params = GenerationParams(max_tokens=4, ignore_eos=True, logprobs=True)
    swapped = qwen.generate("a", ask(coffee), params)
    assert swapped.stats.cached_tokens == first_image_token
    reference = ModelHost()
    reference.load(str(QWEN))
    alone = reference.generate("z", ask(coffee), params)
    assert swapped.token_ids == alone.token_ids
    assert swapped.token_logprobs == pytest.approx(alone.token_logprobs, abs=1e-5)


def test_a_text_model_refuses_images_before_anything_runs(tmp_path):
    """The same checkpoint without its vision_config is a text-only Gemma 3."""
    folder = tmp_path / "gemma3-text"
    shutil.copytree(GEMMA, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["vision_config"]
    (folder / "config.json").write_text(json.dumps(config))
    host = ModelHost()
    info = host.load(str(folder))
    assert not info.vision
    with pytest.raises(
        MediaError,
        match=r"This model \(gemma3-text\) cannot read images; pick a vision model "
        r"such as Gemma 3 or Qwen2\.5-VL",
    ):
        host.generate("a", ask("/no/such/file.png"), PARAMS)
    assert host.session("a").cache is None  # nothing was rendered, prefilled or cached


def test_worker_generates_with_image_parts_and_reports_unreadable_images(shared_data, tmp_path):
    events: list = []
    done = threading.Event()

    def on_event(event):
        events.append(event)
        if (
            isinstance(event, DoneEvent | ErrorEvent)
            and len([e for e in events if isinstance(e, DoneEvent | ErrorEvent)]) == 4
        ):
            done.set()

    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    worker = EngineWorker(on_event)
    worker.start()
    try:
        worker.submit(LoadModel(str(GEMMA)))
        ok = worker.submit(Generate("s", ask(None), PARAMS, media=[]))
        with_image = worker.submit(
            Generate(
                "s",
                [
                    {
                        "role": "user",
                        "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}],
                    }
                ],
                PARAMS,
                media=[MediaInput("image", str(shared_data / "images" / "rocket.jpg"))],
            )
        )
        bad = worker.submit(Generate("s", ask(str(broken)), PARAMS))
        assert done.wait(120)
    finally:
        worker.shutdown()
    finals = {e.request_id: e for e in events if isinstance(e, DoneEvent | ErrorEvent)}
    assert isinstance(finals[ok], DoneEvent) and isinstance(finals[with_image].result, GenerationResult)
    assert isinstance(finals[bad], ErrorEvent) and finals[bad].kind == "MediaError"
    assert "broken.png" in finals[bad].message and "\n" not in finals[bad].message


def test_cli_image_with_chat_matches_the_golden(shared_data):
    exp = json.loads((GEMMA / "expected.json").read_text())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine",
            "generate",
            "--model",
            str(GEMMA),
            "--chat",
            "--prompt",
            "What is in this picture?",
            "--image",
            str(shared_data / "images" / exp["image"]),
            "--max-tokens",
            str(len(exp["token_ids"])),
            "--ignore-eos",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == exp["token_ids"] and out["prompt_tokens"] == len(exp["prompt_ids"])
