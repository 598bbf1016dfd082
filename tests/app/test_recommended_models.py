"""The first-launch list: picks per memory size, the default chosen for the machine."""

from __future__ import annotations

import json

import pytest

from app.recommended import GB, recommended_models
from app.resources import resource_path


def test_the_shipped_list_is_complete():
    data = json.loads(resource_path("recommended_models.json").read_text(encoding="utf-8"))
    ids = [m["repo_id"] for m in data["models"]]
    assert len(ids) == len(set(ids)) and data["default"] in ids
    assert set(data["default_by_memory"].values()) <= set(ids)
    for m in data["models"]:
        assert m["repo_id"].startswith("mlx-community/") and m["approx_size_bytes"] > 0
        assert m["min_memory_gb"] in (8, 16, 24, 32, 48, 64) and m["why"] and m["family"]
        # comfortable: the download is at most about half the machine's memory
        assert m["approx_size_bytes"] <= m["min_memory_gb"] * GB * 0.55, m["repo_id"]


@pytest.mark.parametrize(
    ("memory_gb", "default"),
    [
        (8, "mlx-community/Qwen3.5-2B-MLX-4bit"),
        (16, "mlx-community/Qwen3.5-4B-MLX-4bit"),
        (24, "mlx-community/gpt-oss-20b-MXFP4-Q8"),
        (36, "mlx-community/gemma-4-26b-a4b-it-4bit"),
        (128, "mlx-community/gemma-4-26b-a4b-it-4bit"),
    ],
)
def test_the_default_and_the_picks_follow_the_machines_memory(memory_gb, default):
    reported = int(memory_gb * GB * 0.98)  # the OS keeps a little for itself
    picks = recommended_models(reported)
    assert picks[0].repo_id == default
    assert all(p.min_memory_bytes <= memory_gb * GB for p in picks)
    assert len(picks) == len({p.repo_id for p in recommended_models()} & {p.repo_id for p in picks})


def test_a_machine_smaller_than_every_pick_still_gets_the_list(tmp_path, monkeypatch):
    import app.recommended

    (tmp_path / "recommended_models.json").write_text(
        json.dumps(
            {
                "default": "org/a",
                "default_by_memory": {"16": "org/b"},
                "models": [
                    {"repo_id": "org/a", "approx_size_bytes": 1, "min_memory_gb": 16},
                    {"repo_id": "org/b", "approx_size_bytes": 2, "min_memory_gb": 16},
                ],
            }
        )
    )
    monkeypatch.setattr(app.recommended, "resource_path", lambda name: tmp_path / name)
    assert [p.repo_id for p in recommended_models(4 * GB)] == ["org/a", "org/b"]
    assert [p.repo_id for p in recommended_models(16 * GB)] == ["org/b", "org/a"]
    assert [p.repo_id for p in recommended_models()] == ["org/a", "org/b"]
