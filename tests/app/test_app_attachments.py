"""Attachments without a window: content-hashed copies, the engine's content parts,
refusals, and the store's attachment rows, preferences and exports."""

from __future__ import annotations

import hashlib

from app.attachments import (
    NO_MODEL_FOR_IMAGES,
    NO_MODEL_FOR_VIDEO,
    NO_VIDEO,
    NO_VISION,
    keep_bytes,
    keep_file,
    media_kind,
    message_content,
    refusal,
)
from app.store import HistoryStore


def test_keep_file_copies_once_by_content(tmp_path):
    data = tmp_path / "data"
    a = tmp_path / "A.PNG"
    a.write_bytes(b"\x89PNG same bytes")
    b = tmp_path / "other" / "b.png"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    kept = keep_file(data, a)
    assert kept.name == hashlib.sha256(a.read_bytes()).hexdigest() + ".png"
    assert kept.is_absolute() and kept.parent == (data / "attachments").resolve()
    assert keep_file(data, b) == kept
    assert keep_file(data, kept) == kept  # already kept: left as it is
    assert keep_bytes(data, a.read_bytes(), "png") == kept
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]  # no .part left


def test_engine_content_parts():
    atts = [("image", "/d/a.png"), ("audio", "/d/b.wav"), ("image", "/d/c.jpg")]
    assert message_content("hi", [], {"image"}) == "hi"
    assert message_content("hi", atts, {"image"}) == [
        {"type": "image", "image": "/d/a.png"},
        {"type": "image", "image": "/d/c.jpg"},
        {"type": "text", "text": "hi"},
    ]
    assert message_content("hi", atts, {"image", "audio"})[1] == {"type": "audio", "audio": "/d/b.wav"}
    assert message_content("hi", atts, set()) == "hi"  # a text model gets the words


def test_refusals_name_what_to_do():
    assert media_kind("x.JPEG") == "image" and media_kind("x.m4a") == "audio"
    assert media_kind("x.txt") is None
    assert refusal("x.png", True) is None
    assert refusal("x.png", False) == NO_VISION
    assert refusal("x.png", None) == NO_MODEL_FOR_IMAGES
    assert refusal("x.wav", False) is None  # audio goes to transcription instead
    assert "not an image, audio or video file" in refusal("x.pdf", True)
    assert media_kind("clip.MOV") == "video" and media_kind("x.webm") == "video"
    assert refusal("clip.mp4", True, True) is None
    assert refusal("clip.mp4", True, False) == NO_VIDEO and "qwen3_vl" in NO_VIDEO
    assert refusal("clip.mp4", None) == NO_MODEL_FOR_VIDEO
    assert refusal("IMG_0001.HEIC", True) is None  # HEIC is read by pillow-heif, a dependency
    assert refusal("IMG_0001.HEIC", False) == NO_VISION


def test_store_rows_preferences_and_exports(tmp_path):
    store = HistoryStore(tmp_path)
    conv = store.create_conversation()
    photo = keep_bytes(tmp_path, b"jpeg bytes", ".jpg")
    uid = store.add_message(conv, "user", "look", None, attachments=[("image", str(photo))])
    store.add_message(conv, "assistant", "a cat", uid)
    thread = store.thread(conv)
    assert thread[0].attachments == [("image", str(photo))] and thread[1].attachments == []
    exported = store.export_json(conv)["messages"][0]
    assert exported["attachments"] == [{"kind": "image", "path": str(photo)}]
    assert f"]({photo.as_uri()})" in store.export_markdown(conv)

    assert store.preference("whisper_model") is None
    store.set_preference("whisper_model", "/models/whisper-small")
    store.close()
    again = HistoryStore(tmp_path)
    assert again.preference("whisper_model") == "/models/whisper-small"
    again.set_preference("whisper_model", None)
    assert again.preference("whisper_model", "none") == "none"
    again.delete_conversation(conv)  # attachment rows go with their messages
    assert again._db.execute("SELECT COUNT(*) FROM attachments").fetchone()[0] == 0
    again.close()
