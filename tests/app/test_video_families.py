"""The app's refusal of a video names the families the engine can show video to: the
app cannot import the engine's tower registry (the wall), so this keeps the two in step."""

from __future__ import annotations

from app.attachments import NO_VIDEO, VIDEO_MODELS
from engine.media.towers import families_for


def test_the_video_refusal_names_every_family_whose_tower_watches_video():
    families = families_for("video")
    assert {"qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"} <= set(families)
    missing = [f for f in families if f"{f}," not in f"{VIDEO_MODELS}," and f"{f})" not in VIDEO_MODELS]
    assert not missing, f"app.attachments.VIDEO_MODELS does not name {missing}"
    assert "\n" not in NO_VIDEO
