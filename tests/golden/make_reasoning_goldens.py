"""Render the reasoning-switch templates with transformers, switch unset and at each choice.

For each template of TEMPLATES (paths under ../shared/data/chat_templates) and each
conversation of CONVERSATIONS, the output with the variable left undefined and with
every choice becomes tests/golden/reasoning/switch_renders.json, next to the variable
transformers was given. The clock is pinned as in make_template_goldens.py.

Run from the repository root with an environment that has transformers and jinja2:

    python tests/golden/make_reasoning_goldens.py [--data ../shared/data]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import transformers
import transformers.utils.chat_template_utils as ctu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_template_goldens import DEFAULT_SPECIAL, FIXED_NOW, _FixedDatetime  # noqa: E402

OUT = Path(__file__).resolve().parent / "reasoning" / "switch_renders.json"

# template -> (variable, choices); the engine must find the same switch by itself.
TEMPLATES = {
    "llama.cpp/Qwen-Qwen3-0.6B.jinja": ("enable_thinking", [False, True]),
    "llama.cpp-2026/Qwen3.5-4B.jinja": ("enable_thinking", [False, True]),
    "llama.cpp/deepseek-ai-DeepSeek-V3.1.jinja": ("thinking", [False, True]),
    "llama.cpp-2026/deepseek-ai-DeepSeek-V3.2.jinja": ("thinking", [False, True]),
    "llama.cpp-2026/HuggingFaceTB-SmolLM3-3B.jinja": ("enable_thinking", [False, True]),
    "llama.cpp-2026/GLM-4.6.jinja": ("enable_thinking", [False, True]),
    "mistral.rs/smollm3.jinja": ("enable_thinking", [False, True]),
    "llama.cpp/openai-gpt-oss-120b.jinja": ("reasoning_effort", ["low", "medium", "high"]),
}

CONVERSATIONS = {
    "one_question": [{"role": "user", "content": "Is 91 a prime number?"}],
    "system_and_turns": [
        {"role": "system", "content": "You are a careful tutor."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And 3+3?"},
    ],
    "system_no_think_flag": [
        {"role": "system", "content": "Answer briefly. /no_think"},
        {"role": "user", "content": "Name a colour."},
    ],
}


def render(source: str, messages: list, variables: dict) -> dict:
    # transformers 5.23 renamed its message normaliser.
    normalise = getattr(ctu, "_normalize_chat_messages", None) or ctu._alias_reasoning_fields
    conversation = normalise(messages)
    try:
        rendered, _ = ctu.render_jinja_template(
            conversations=[conversation],
            chat_template=source,
            add_generation_prompt=True,
            **{**DEFAULT_SPECIAL, **variables},
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
    entries = {}
    for rel, (variable, choices) in TEMPLATES.items():
        source = (root / rel).read_text(encoding="utf-8")
        renders = []
        for name, messages in CONVERSATIONS.items():
            for choice in [None, *choices]:
                variables = {} if choice is None else {variable: choice}
                renders.append({"conversation": name, "choice": choice, **render(source, messages, variables)})
        entries[rel] = {"variable": variable, "choices": choices, "renders": renders}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "made_by": f"transformers {transformers.__version__}",
                "now": FIXED_NOW.isoformat(),
                "special_tokens": DEFAULT_SPECIAL,
                "conversations": CONVERSATIONS,
                "templates": entries,
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n",
        encoding="utf-8",
    )
    for rel, entry in entries.items():
        outs = {r["output"] for r in entry["renders"] if "output" in r}
        errors = sum("error" in r for r in entry["renders"])
        print(f"{rel}: {len(entry['renders'])} renders, {len(outs)} distinct, {errors} refusals")


if __name__ == "__main__":
    main()
