"""A reply's tool exchanges as the history keeps them, and the two ways they are read back.

A reply that called tools is stored as one assistant message whose ``tool_turns`` list
holds each round: the text the model wrote before its calls, and each call with its
approval state and result. From that list come

- the transcript's record (``record``): each call shown with its state, then the
  answer; this is what the message's ``content`` starts with, as before tool turns
  were kept apart, so the view, search and export read it unchanged;
- the conversation as the model reads it next turn (``engine_messages``): an
  assistant message with ``tool_calls``, then one ``tool`` message per call, then the
  answer, so the chat template writes them in its own tool-call and tool-result form.

A message written before tool turns were kept (an empty list) is read as its text.
"""

from __future__ import annotations

import json
from typing import Any

DECLINED = "The user declined this tool call."  # what the model is told of a denied call
UNFINISHED = "This tool call did not finish."  # of one the app was closed during

# A call's state: waiting for approval, running, or its outcome.
WAITING, RUNNING, DONE, DENIED, FAILED = "waiting", "running", "done", "declined", "failed"


def new_round(text: str, calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    """A round of calls the model wrote: (id, name, arguments as JSON text) each. A call's
    ``decision`` is the user's ("once", "always", "deny"; "" until asked)."""
    return {
        "text": text,
        "calls": [
            {"id": i, "name": name, "arguments": arguments, "state": WAITING, "decision": "", "result": "", "shown": ""}
            for i, name, arguments in calls
        ],
    }


def settle(call: dict[str, Any], state: str, result: str = "", shown: str = "") -> None:
    """Record a call's outcome: ``result`` goes to the model, ``shown`` to the transcript."""
    call.update(state=state, result=result, shown=shown or result)


def record(rounds: list[dict[str, Any]]) -> str:
    """The transcript's account of the calls, up to where they stand now."""
    out = ""
    for r in rounds:
        out += r.get("text", "")
        for c in r.get("calls", []):
            out += f"\n\n🔧 **{c['name']}** `{c['arguments']}`"
            state = c.get("state")
            if state == WAITING:
                out += " — waiting for approval…"
            elif state == RUNNING:
                out += " — running…"
            else:
                out += f" → {c.get('shown', '')}\n\n"
    return out


def answer_of(content: str, rounds: list[dict[str, Any]]) -> str:
    """The model's answer after its calls: the stored content past the record."""
    prefix = record(rounds)
    return content[len(prefix) :] if content.startswith(prefix) else content


def engine_messages(content: str, rounds: list[dict[str, Any]], arguments_as_text: bool) -> list[dict[str, Any]]:
    """The assistant message ``content`` with tool turns ``rounds``, as the model reads it:
    per round an assistant message with its ``tool_calls`` and a ``tool`` message per call
    (arguments as a JSON object, or as text for templates that join them as text), then
    the answer (left out when there is none, as after a stop)."""
    if not rounds:
        return [{"role": "assistant", "content": content}]
    out: list[dict[str, Any]] = []
    for r in rounds:
        calls = r.get("calls", [])
        out.append(
            {
                "role": "assistant",
                "content": r.get("text", ""),
                "tool_calls": [
                    {
                        "id": c["id"],
                        "type": "function",
                        "function": {"name": c["name"], "arguments": _arguments(c["arguments"], arguments_as_text)},
                    }
                    for c in calls
                ],
            }
        )
        for c in calls:
            result = c.get("result", "") if c.get("state") in (DONE, DENIED, FAILED) else UNFINISHED
            out.append({"role": "tool", "tool_call_id": c["id"], "name": c["name"], "content": result})
    answer = answer_of(content, rounds)
    if answer:
        out.append({"role": "assistant", "content": answer})
    return out


def _arguments(text: str, as_text: bool) -> Any:
    if as_text:
        return text
    try:
        return json.loads(text or "{}")
    except ValueError:  # a call the parser let through with odd arguments: keep its text
        return text
