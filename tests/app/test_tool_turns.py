"""A reply's tool rounds, read back two ways: the transcript's record and the messages the
model reads next turn (app.controllers.tool_turns)."""

from __future__ import annotations

from app.controllers import tool_turns as tt


def _round() -> dict:
    turn = tt.new_round("Let me look.", [("c1", "lookup", '{"city": "rome"}'), ("c2", "lookup", '{"city": "oslo"}')])
    tt.settle(turn["calls"][0], tt.DONE, "sunny")
    tt.settle(turn["calls"][1], tt.DENIED, tt.DECLINED, "declined")
    return turn


def test_the_record_shows_each_call_in_its_state():
    turn = tt.new_round("", [("c1", "lookup", "{}")])
    assert tt.record([turn]) == "\n\n🔧 **lookup** `{}` — waiting for approval…"
    turn["calls"][0]["state"] = tt.RUNNING
    assert tt.record([turn]).endswith(" — running…")
    tt.settle(turn["calls"][0], tt.FAILED, "Error: it broke", "⚠ it broke")
    assert tt.record([turn]) == "\n\n🔧 **lookup** `{}` → ⚠ it broke\n\n"


def test_the_model_reads_calls_results_and_the_answer_as_messages():
    turn = _round()
    content = tt.record([turn]) + "Rome is sunny."
    assert tt.answer_of(content, [turn]) == "Rome is sunny."
    assert tt.engine_messages(content, [turn], arguments_as_text=False) == [
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": {"city": "rome"}}},
                {"id": "c2", "type": "function", "function": {"name": "lookup", "arguments": {"city": "oslo"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "lookup", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "name": "lookup", "content": tt.DECLINED},
        {"role": "assistant", "content": "Rome is sunny."},
    ]
    as_text = tt.engine_messages(content, [turn], arguments_as_text=True)  # DeepSeek's templates
    assert as_text[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "rome"}'


def test_a_reply_stopped_after_its_calls_or_cut_mid_call_reads_sensibly():
    turn = _round()
    stopped = tt.engine_messages(tt.record([turn]), [turn], arguments_as_text=False)
    assert [m["role"] for m in stopped] == ["assistant", "tool", "tool"]  # no empty answer after them
    cut = tt.new_round("", [("c9", "lookup", "{}")])  # the app closed while it ran
    cut["calls"][0]["state"] = tt.RUNNING
    messages = tt.engine_messages(tt.record([cut]), [cut], arguments_as_text=False)
    assert messages[-1] == {"role": "tool", "tool_call_id": "c9", "name": "lookup", "content": tt.UNFINISHED}


def test_a_reply_without_rounds_is_its_text():
    assert tt.engine_messages("plain", [], arguments_as_text=False) == [{"role": "assistant", "content": "plain"}]
