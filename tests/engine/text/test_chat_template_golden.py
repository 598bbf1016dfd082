"""Every chat template in ../shared/data/chat_templates renders as transformers renders it.

The expected outputs were made by tests/golden/make_template_goldens.py with
transformers' own renderer; templates that raise there must raise TemplateError here.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from engine.errors import TemplateError
from engine.text import chat_template
from engine.text.chat_template import ChatTemplate, load_template

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "templates"
CASES = json.loads((GOLDEN / "cases.json").read_text(encoding="utf-8"))


def _golden_entries() -> list[tuple[str, dict]]:
    entries = []
    for path in sorted(GOLDEN.glob("*.json")):
        if path.name == "cases.json":
            continue
        entries.extend(json.loads(path.read_text(encoding="utf-8")).items())
    return entries


ENTRIES = _golden_entries()


@pytest.fixture(autouse=True)
def pinned_clock(monkeypatch):
    now = datetime.fromisoformat(CASES["now"])
    monkeypatch.setattr(chat_template, "clock", lambda: now)


def test_goldens_cover_every_template(shared_data):
    root = shared_data / "chat_templates"
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*.jinja")}
    on_disk |= {p.relative_to(root).as_posix() for p in root.glob("tokenizer_configs/*/tokenizer_config.json")}
    assert on_disk == {rel for rel, _ in ENTRIES}


@pytest.mark.parametrize("rel, entry", ENTRIES, ids=[rel for rel, _ in ENTRIES])
def test_template_matches_transformers(shared_data, rel, entry):
    template = ChatTemplate(load_template(shared_data / "chat_templates" / rel), entry["special_tokens"])
    mismatches = []
    for name, expected in entry["results"].items():
        case = CASES["cases"][name]
        try:
            got = template.render(
                case["messages"],
                tools=case.get("tools"),
                add_generation_prompt=case["add_generation_prompt"],
                **case.get("kwargs", {}),
            )
        except TemplateError as exc:
            if "error" not in expected:
                mismatches.append(f"{name}: raised {exc}")
            else:
                # Our message carries transformers' (collapsed to one line).
                reference = " ".join(expected["error"].split(": ", 1)[1].split())
                if reference not in str(exc):
                    mismatches.append(f"{name}: message {exc!s} lacks {reference!r}")
                assert "\n" not in str(exc)
            continue
        if "error" in expected:
            mismatches.append(f"{name}: rendered, but transformers raised {expected['error']}")
        elif got != expected["output"]:
            mismatches.append(f"{name}: output differs\n--- ours\n{got}\n--- transformers\n{expected['output']}")
    assert not mismatches, "\n".join(mismatches)


def test_some_goldens_use_the_pinned_date():
    # Llama 3.1 puts today's date in its system header; the pin must reach it.
    outputs = [r["output"] for _, e in ENTRIES for r in e["results"].values() if "output" in r]
    assert any("14 Mar 2025" in out for out in outputs)
