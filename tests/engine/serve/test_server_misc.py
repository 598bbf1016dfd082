"""The server while its model loads (503), and images for a vision model."""

from __future__ import annotations

import base64
import io
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from engine.serve.backend import Backend
from engine.serve.server import make_server

from .conftest import start_server

VISION = Path(__file__).resolve().parents[2] / "golden" / "vision" / "qwen2_5_vl"


def test_everything_answers_503_until_the_model_is_in():
    backend = Backend()  # never told to load: stays "loading"
    server = make_server(backend, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/health")
        with e.value:
            assert e.value.code == 503 and "loading" in json.loads(e.value.read())["error"]["message"]
        with (
            pytest.raises(openai.InternalServerError) as e,
            openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client,
        ):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503
    finally:
        server.shutdown()
        server.server_close()
        backend.shutdown()


def _png_data_url() -> str:
    from PIL import Image

    image = Image.new("RGB", (40, 28))
    for x in range(40):
        for y in range(28):
            image.putpixel((x, y), (x * 6, y * 9, 128))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_an_image_part_reaches_a_vision_model(tmp_path):
    srv = start_server(VISION, tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120) as client:
            _vision_round(client)
    finally:
        srv.stop()


def _vision_round(client):
    model = client.models.list().data[0].id
    url = _png_data_url()

    def ask(parts):
        return client.chat.completions.create(
            model=model, max_tokens=4, temperature=0, messages=[{"role": "user", "content": parts}]
        )

    with_image = ask([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}])
    text_only = ask([{"type": "text", "text": "What?"}])
    # The image's placeholder tokens and features are in the prompt.
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="data: URL"):
        ask([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])


def _wav_base64(seconds: float = 1.0) -> str:
    import math
    import struct
    import wave

    rate = 16000
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(
            b"".join(
                struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
                for i in range(int(rate * seconds))
            )
        )
    return base64.b64encode(buf.getvalue()).decode()


def test_an_input_audio_part_reaches_an_audio_model(tmp_path):
    srv = start_server(Path(__file__).resolve().parents[2] / "golden" / "voxtral_tiny", tmp_path / "server.log")
    try:
        with openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120) as client:
            model = client.models.list().data[0].id

            def ask(parts):
                return client.chat.completions.create(
                    model=model, max_tokens=3, temperature=0, messages=[{"role": "user", "content": parts}]
                )

            heard = ask(
                [
                    {"type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"}},
                    {"type": "text", "text": "What is said?"},
                ]
            )
            text_only = ask([{"type": "text", "text": "What is said?"}])
        # 1 s of audio is one 30 s chunk: 375 audio tokens in the prompt.
        assert heard.usage.prompt_tokens - text_only.usage.prompt_tokens >= 375
    finally:
        srv.stop()
