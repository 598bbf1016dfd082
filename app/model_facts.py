"""Facts about a loaded model that the window shows but the engine's ModelInfo lacks.

Read from the model's files (JSON, or a GGUF header read with struct): nothing here
imports mlx or runs code that ships with a model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def has_chat_template(info: Any) -> bool:
    """Whether the model brings a chat template (a base model continues plain text)."""
    declared = getattr(info, "chat_template", None)
    if declared is not None:  # the engine says so itself
        return bool(declared)
    path = Path(info.path)
    if path.suffix.lower() == ".gguf":
        from engine.artifacts.gguf import read_gguf_header  # struct only, no mlx

        try:
            return bool(read_gguf_header(path).metadata.get("tokenizer.chat_template"))
        except Exception:  # noqa: BLE001 - an unreadable header says nothing either way
            return True
    if (path / "chat_template.jinja").is_file():
        return True
    for name in ("chat_template.json", "tokenizer_config.json"):
        try:
            data = json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("chat_template"):
            return True
    return False
