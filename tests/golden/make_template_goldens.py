"""Render every chat template in ../shared/data/chat_templates with transformers.

The outputs (or the error transformers raises) become tests/golden/templates/*.json,
one file per template folder, keyed by the template's path relative to
chat_templates/. The conversations, the pinned clock and the special tokens are
written to tests/golden/templates/cases.json so the test renders the same inputs.

Run from the repository root with an environment that has transformers and jinja2:

    python tests/golden/make_template_goldens.py [--data ../shared/data]

Needs no network; the tests that read the output do not need transformers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
from pathlib import Path

import transformers
import transformers.utils.chat_template_utils as ctu

OUT = Path(__file__).resolve().parent / "templates"
FIXED_NOW = _dt.datetime(2025, 3, 14, 9, 26, 53)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city, in °C or °F.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}

SYSTEM = {"role": "system", "content": "You are a concise assistant."}
TURNS = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]

# name -> (messages, tools, add_generation_prompt, extra template variables)
CASES: dict[str, dict] = {
    "chat": {"messages": [SYSTEM, *TURNS], "add_generation_prompt": False},
    "chat_gen": {"messages": [SYSTEM, *TURNS], "add_generation_prompt": True},
    "no_system_gen": {"messages": TURNS, "add_generation_prompt": True},
    "single_user_unicode": {
        "messages": [{"role": "user", "content": "Grüße aus Zürich 👋 — 你好，世界! <b>&'\"</b>"}],
        "add_generation_prompt": True,
    },
    "tools": {
        "messages": [SYSTEM, {"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    "tool_call_round": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call00001",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": '{"temp_c": 18}'},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    "reasoning_no_thinking": {
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
            {"role": "user", "content": "3+3?"},
        ],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False},
    },
    "content_parts": {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this."}]},
        ],
        "add_generation_prompt": True,
    },
}

# Special tokens for bare .jinja files (tokenizer_config.json files bring their own).
DEFAULT_SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


class _FixedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ARG003 - signature of datetime.now
        return FIXED_NOW


def special_tokens_of(config: dict) -> dict[str, str]:
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def template_of(config: dict) -> str:
    ct = config["chat_template"]
    if isinstance(ct, list):
        return next(e["template"] for e in ct if e.get("name") == "default")
    return ct


def collect(root: Path) -> dict[str, tuple[str, dict]]:
    found = {}
    for path in sorted(root.rglob("*.jinja")):
        found[path.relative_to(root).as_posix()] = (path.read_text(encoding="utf-8"), DEFAULT_SPECIAL)
    for path in sorted(root.glob("tokenizer_configs/*/tokenizer_config.json")):
        config = json.loads(path.read_text(encoding="utf-8"))
        found[path.relative_to(root).as_posix()] = (template_of(config), special_tokens_of(config))
    return found


def render(source: str, special: dict, case: dict) -> dict:
    # The same preparation apply_chat_template does before rendering.
    conversation = ctu._normalize_chat_messages(case["messages"])
    try:
        rendered, _ = ctu.render_jinja_template(
            conversations=[conversation],
            tools=case.get("tools"),
            chat_template=source,
            add_generation_prompt=case["add_generation_prompt"],
            **{**special, **case.get("kwargs", {})},
        )
        return {"output": rendered[0]}
    except Exception as exc:  # noqa: BLE001 - the failure itself is the golden value
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[2].parent / "shared" / "data")
    args = parser.parse_args()
    root = args.data / "chat_templates"
    ctu.datetime = _FixedDatetime  # pin strftime_now

    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "cases.json").write_text(
        json.dumps(
            {
                "made_by": f"transformers {transformers.__version__}",
                "now": FIXED_NOW.isoformat(),
                "default_special_tokens": DEFAULT_SPECIAL,
                "cases": CASES,
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n",
        encoding="utf-8",
    )
    by_folder: dict[str, dict] = {}
    for rel, (source, special) in collect(root).items():
        folder = rel.split("/", 1)[0]
        results = {name: render(source, special, case) for name, case in CASES.items()}
        by_folder.setdefault(folder, {})[rel] = {"special_tokens": special, "results": results}
    for folder, entries in by_folder.items():
        (OUT / f"{folder}.json").write_text(
            json.dumps(entries, indent=1, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8"
        )
        errors = sum("error" in r for e in entries.values() for r in e["results"].values())
        print(f"{folder}: {len(entries)} templates, {errors} refusals")


if __name__ == "__main__":
    main()
