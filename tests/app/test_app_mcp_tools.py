"""MCP tools in the chat, through the real window and engine: a tiny stdio MCP server
written here, a tiny random model whose first answer is forced into a tool call.

What drives the model: the conversation's ``tool_choice: "required"`` setting makes the
chat constrain the first answer with the engine's grammar (engine.text.tool_calls'
``forced_call``) to one call in the template's Hermes markers; the window then parses it
with the real parser, asks, runs it on the real MCP server, and hands the result back
for a second, unconstrained answer from the same random model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.controllers.tools import load_servers
from app.qt import QPushButton
from app.ui.tools_dialog import ToolsDialog
from tests.tiny_models import make_tiny_llama

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

SERVER = '''
import os, signal, subprocess, sys, time
from typing import Literal
from mcp.server.mcpserver import MCPServer

mode, log = sys.argv[1], sys.argv[2]
app = MCPServer("places")

@app.tool()
def lookup(city: Literal["paris", "rome"]) -> str:
    """The weather in a city."""
    with open(log, "a") as f:
        f.write(city + "\\n")
    if mode == "crash":
        os._exit(3)
    if mode == "family":  # a helper process, then a hang that shrugs off SIGTERM
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {helper.pid}\\n")
        time.sleep(3600)
    if mode == "hang":
        time.sleep(3600)  # the app ends it on the timeout: a test that fails here leaves it behind
    return f"weather in {city}: sunny"

if mode == "family":  # shrugs off SIGTERM (set here: tools may run off the main thread)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

if mode.startswith("http:"):  # Streamable HTTP on that port
    app.run("streamable-http", host="127.0.0.1", port=int(mode[5:]))
else:
    app.run("stdio")
'''

# Qwen/Hermes-style: tools described in a system turn, calls in <tool_call> tags, results
# as <tool_response> turns.
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    folder = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-tools")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture
def places(tmp_path):
    """(the command line of the MCP server in ``mode``, the file it logs each call to)."""
    script = tmp_path / "places_server.py"
    script.write_text(SERVER)
    log = tmp_path / "calls.log"
    return lambda mode: (f"{sys.executable} {script} {mode} {log}", log)


def _window(make_window, run_async, tool_model, command):
    window = make_window()
    assert run_async(window.load_model(str(tool_model)))
    assert window.bridge.model_info.tool_format == "hermes"
    window.tools.add_server("places", command)
    window.store.update_conversation(
        window.chat.conversation_id,
        settings={"max_tokens": 120, "seed": 3, "temperature": 0.8, "tool_choice": "required"},
    )
    return window


def _spy(window, offered: list | None = None):
    """Every message list the window sends the engine (the real bridge still answers), and
    into ``offered`` the tools sent with each."""
    sent: list[list[dict]] = []
    original = window.bridge.generate

    async def generate(conv, messages, params=None, tools=None, **passed):
        sent.append([dict(m) for m in messages])
        if offered is not None:
            offered.append(tools)
        return await original(conv, messages, params, tools=tools, **passed)

    window.bridge.generate = generate
    return sent


def _send(qtbot, window, text, decide=None, asked=None):
    """Send ``text``; when ``decide`` names a button, wait for the approval bar and click it
    (calling ``asked()`` first, while the call waits)."""
    window.composer.edit.setPlainText(text)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=90_000) as blocker:
        window.composer.send_button.click()
        if decide is not None:
            qtbot.waitUntil(window.tool_approval.isVisible, timeout=60_000)
            assert "lookup" in window.tool_approval.label.text()
            assert "places" in window.tool_approval.label.text()
            if asked is not None:
                asked()
            getattr(window.tool_approval, decide).click()
    return blocker.args


def test_approved_call_runs_and_its_result_goes_back(qtbot, make_window, run_async, tool_model, places):
    command, log = places("ok")
    window = _window(make_window, run_async, tool_model, command)
    sent = _spy(window)
    message_id, result = _send(qtbot, window, "weather?", decide="allow_button")

    city = log.read_text().split()
    assert len(city) == 1 and city[0] in ("paris", "rome")  # the server ran the call, once
    assert result.finish_reason in ("stop", "length")
    # The engine saw the tools, then the call and its result as a tool message.
    assert len(sent) == 2
    call_turn, tool_turn = sent[1][-2], sent[1][-1]
    assert call_turn["role"] == "assistant" and call_turn["tool_calls"][0]["function"]["name"] == "lookup"
    assert tool_turn == {
        "role": "tool",
        "tool_call_id": call_turn["tool_calls"][0]["id"],
        "name": "lookup",
        "content": f"weather in {city[0]}: sunny",
    }
    # The transcript shows the call and its result, and keeps them.
    stored = window.store.thread(window.chat.conversation_id)[-1]
    assert f'🔧 **lookup** `{{"city": "{city[0]}"}}` → weather in {city[0]}: sunny' in stored.content
    assert stored.status == "complete"
    assert "lookup" in window.chat_view.widgets[message_id].content
    assert not window.tool_approval.isVisible()


def test_denied_call_does_not_run_and_the_model_is_told(qtbot, make_window, run_async, tool_model, places):
    command, log = places("ok")
    window = _window(make_window, run_async, tool_model, command)
    sent = _spy(window)
    _, result = _send(qtbot, window, "weather?", decide="deny_button")
    assert not log.exists()
    assert sent[1][-1]["content"] == "The user declined this tool call."
    assert "→ declined" in window.store.thread(window.chat.conversation_id)[-1].content


def test_always_allow_stops_asking_for_that_tool(qtbot, make_window, run_async, tool_model, places, tmp_path):
    command, log = places("ok")
    window = _window(make_window, run_async, tool_model, command)
    _send(qtbot, window, "weather?", decide="always_button")
    saved = json.loads((tmp_path / "data" / "mcp.json").read_text())
    assert saved["mcpServers"]["places"]["alwaysAllow"] == ["lookup"]
    shown: list[bool] = []
    original_ask = window.tools.approve

    async def ask(*args):
        shown.append(True)
        return await original_ask(*args)

    window.tools.approve = ask
    _send(qtbot, window, "and now?")  # no click: it must not ask
    assert not shown
    assert len(log.read_text().split()) == 2


def test_a_server_that_crashes_is_reported_and_the_app_goes_on(qtbot, make_window, run_async, tool_model, places):
    command, log = places("crash")
    window = _window(make_window, run_async, tool_model, command)
    sent = _spy(window)
    pids: list[int] = []
    _, result = _send(qtbot, window, "weather?", decide="allow_button", asked=lambda: pids.append(_server_pid(window)))
    assert _gone_within(pids[0], 5.0) and window.tools._links["places"].process.pid is None
    stored = window.store.thread(window.chat.conversation_id)[-1]
    assert "⚠ The MCP server 'places' stopped" in stored.content and stored.status == "complete"
    assert sent[1][-1]["content"].startswith("Error: The MCP server 'places' stopped")
    # Still usable: without tools the next reply is ordinary text.
    window.tools.remove_server("places")
    _, again = _send(qtbot, window, "hello")
    assert again.finish_reason in ("stop", "length") and again.stats.generated_tokens >= 1


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended: only its reaping is left)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def _server_pid(window, name: str = "places") -> int:
    link = window.tools._links.get(name)
    assert link is not None and link.process.pid is not None
    return link.process.pid


def test_a_server_that_hangs_times_out_and_its_process_is_ended(qtbot, make_window, run_async, tool_model, places):
    command, log = places("hang")
    window = _window(make_window, run_async, tool_model, command)
    window.tools.timeout_s = 2.0
    notes: list[str] = []
    window.chat.status.connect(notes.append)
    pids: list[int] = []  # the server listed its tools and runs, waiting for the call
    _send(qtbot, window, "weather?", decide="allow_button", asked=lambda: pids.append(_server_pid(window)))
    pid = pids[0]
    stored = window.store.thread(window.chat.conversation_id)[-1]
    assert "did not answer the call to lookup within 2 s" in stored.content and stored.status == "complete"
    assert log.read_text().split()[0] in ("paris", "rome")  # it was called, and never answered
    assert any("did not answer the call to lookup" in n for n in notes)  # and the status bar says so
    assert _gone_within(pid, 1.0), "the hung MCP server's process outlived the timeout"
    # Next use starts it afresh.
    run_async(window.tools.offered())
    assert _server_pid(window) != pid and _alive(_server_pid(window))


def test_a_stdio_server_process_ends_when_removed_disabled_or_the_app_quits(make_window, run_async, places):
    command, _ = places("ok")
    window = make_window()
    window.tools.add_server("places", command)
    run_async(window.tools.offered())
    first = _server_pid(window)
    assert _alive(first)
    window.tools.set_servers([replace(s, enabled=False) for s in window.tools.servers])  # disabled
    assert _gone_within(first, 5.0)
    assert run_async(window.tools.offered()) == []  # nothing offered, nothing started
    window.tools.set_servers([replace(s, enabled=True) for s in window.tools.servers])
    run_async(window.tools.offered())
    second = _server_pid(window)
    assert second != first and _alive(second)
    window.tools.remove_server("places")  # removed
    assert _gone_within(second, 5.0)
    window.tools.add_server("places", command)
    run_async(window.tools.offered())
    third = _server_pid(window)
    window.close()  # the app quits
    assert _gone_within(third, 5.0)


def test_settings_tools_lists_adds_and_removes_servers(qtbot, make_window, tmp_path):
    window = make_window()
    window.settings_toggle.setChecked(True)
    window.settings.findChild(QPushButton, "toolsButton").click()
    dialog = window.findChild(ToolsDialog)
    assert dialog is not None and dialog.isVisible() and dialog.list.count() == 0
    qtbot.keyClicks(dialog.name_edit, "files")
    qtbot.keyClicks(dialog.target_edit, "npx -y some-mcp-server ~/Documents")
    dialog.add_button.click()
    qtbot.keyClicks(dialog.name_edit, "web")
    qtbot.keyClicks(dialog.target_edit, "http://127.0.0.1:8000/mcp")
    dialog.add_button.click()
    qtbot.keyClicks(dialog.name_edit, "web")
    qtbot.keyClicks(dialog.target_edit, "other")
    dialog.add_button.click()
    assert "already an MCP server called 'web'" in dialog.error.text()
    assert [dialog.list.item(i).text().split()[0] for i in range(dialog.list.count())] == ["files", "web"]
    saved = json.loads((tmp_path / "data" / "mcp.json").read_text())["mcpServers"]
    assert saved == {
        "files": {"command": "npx", "args": ["-y", "some-mcp-server", "~/Documents"]},
        "web": {"url": "http://127.0.0.1:8000/mcp"},
    }
    dialog.list.setCurrentRow(0)
    dialog.remove_button.click()
    assert [s.name for s in window.tools.servers] == ["web"]
    # Read back as a new window would.
    assert [(s.name, s.url) for s in load_servers(tmp_path / "data")] == [("web", "http://127.0.0.1:8000/mcp")]
    # The chat's "first answer calls a tool" switch is a conversation setting.
    window.settings.tool_required_box.setChecked(True)
    assert window.store.conversation(window.chat.conversation_id).settings.get("tool_choice") == "required"


def test_a_server_over_http(qtbot, make_window, run_async, tool_model, places):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command, log = places(f"http:{port}")
    proc = subprocess.Popen(command.split(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        window = _window(make_window, run_async, tool_model, f"http://127.0.0.1:{port}/mcp")
        assert window.tools.servers[0].url.endswith("/mcp")
        _send(qtbot, window, "weather?", decide="allow_button")
        city = log.read_text().split()[0]
        assert f"→ weather in {city}: sunny" in window.store.thread(window.chat.conversation_id)[-1].content
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_stop_while_a_call_waits_for_approval_ends_the_reply(qtbot, make_window, run_async, tool_model, places):
    command, log = places("ok")
    window = _window(make_window, run_async, tool_model, command)
    sent = _spy(window)
    window.composer.edit.setPlainText("weather?")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=90_000) as blocker:
        window.composer.send_button.click()
        qtbot.waitUntil(window.tool_approval.isVisible, timeout=60_000)
        window.stop()  # Esc
    _, result = blocker.args
    assert result.finish_reason == "cancelled" and len(sent) == 1 and not log.exists()
    stored = window.store.thread(window.chat.conversation_id)[-1]
    assert stored.status == "cancelled" and "→ declined" in stored.content
    assert not window.tool_approval.isVisible()


QWEN_TEMPLATE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "chat_templates"
QWEN_TEMPLATE = QWEN_TEMPLATE / "llama.cpp" / "Qwen-Qwen2.5-7B-Instruct.jinja"


@pytest.fixture(scope="module")
def qwen_tool_model(tmp_path_factory) -> Path:
    """The tiny random model with Qwen2.5's real chat template."""
    if not QWEN_TEMPLATE.is_file():
        pytest.skip(f"{QWEN_TEMPLATE} is not here (../shared/data is absent)")
    folder = make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-qwen-tools")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _qwen_exchange(city: str, text: str, answer: str) -> str:
    """One call and its result as Qwen2.5's template writes them, then the answer."""
    return (
        "<|im_start|>assistant" + (f"\n{text}" if text else "") + "\n<tool_call>\n"
        f'{{"name": "lookup", "arguments": {{"city": "{city}"}}}}\n</tool_call><|im_end|>\n'
        f"<|im_start|>user\n<tool_response>\nweather in {city}: sunny\n</tool_response><|im_end|>\n"
        + (f"<|im_start|>assistant\n{answer}<|im_end|>\n" if answer else "")
    )


def test_tool_turns_reach_the_next_turn_in_the_templates_own_form_and_survive_a_restart(
    qtbot, make_window, run_async, qwen_tool_model, places, tmp_path
):
    from app.controllers import tool_turns
    from engine.text.chat_template import ChatTemplate

    command, log = places("ok")
    window = _window(make_window, run_async, qwen_tool_model, command)
    conv = window.chat.conversation_id
    window.store.update_conversation(conv, settings={"max_tokens": 120, "seed": 3, "tool_choice": "required"})
    offered: list = []
    sent = _spy(window, offered)
    _send(qtbot, window, "weather?", decide="always_button")
    city = log.read_text().split()[0]
    reply = window.store.thread(conv)[-1]
    [turn] = reply.tool_turns  # kept apart from the text, with its approval state and result
    assert [(c["name"], c["decision"], c["state"], c["result"]) for c in turn["calls"]] == [
        ("lookup", "always", tool_turns.DONE, f"weather in {city}: sunny")
    ]
    answer = tool_turns.answer_of(reply.content, reply.tool_turns)
    assert reply.content == tool_turns.record(reply.tool_turns) + answer  # the transcript's record, then the answer
    assert f'🔧 **lookup** `{{"city": "{city}"}}` → weather in {city}: sunny' in reply.content

    template = ChatTemplate(QWEN_TEMPLATE.read_text())
    exchange = _qwen_exchange(city, turn["text"], answer)
    window.store.update_conversation(conv, settings={"max_tokens": 8, "seed": 3})  # the model answers freely
    _send(qtbot, window, "and tomorrow?")
    second = template.render(sent[2], tools=offered[2], add_generation_prompt=True)
    assert exchange + "<|im_start|>user\nand tomorrow?<|im_end|>\n<|im_start|>assistant\n" in second
    assert "🔧" not in second  # the transcript's record is not what the model reads

    window.close()
    window.store.close()
    again = make_window(tmp_path / "data")
    assert again.store.thread(conv)[1].tool_turns == reply.tool_turns
    run_async(again.load_model(str(qwen_tool_model)))
    again.chat.open(conv)
    again.store.update_conversation(conv, settings={"max_tokens": 8, "seed": 3})
    offered_again: list = []
    sent_again = _spy(again, offered_again)
    _send(qtbot, again, "thanks")
    third = template.render(sent_again[0], tools=offered_again[0], add_generation_prompt=True)
    assert exchange + "<|im_start|>user\nand tomorrow?<|im_end|>\n" in third
    assert third.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")


def test_a_history_from_before_tool_turns_loads_and_reads_as_text(make_window, run_async, tool_model, tmp_path):
    """A reply stored with its calls inside its text (no tool_turns column): the store adds
    the column, the reply shows as it did, and the model reads it as the text it was."""
    import sqlite3

    from app import store as store_module

    data = tmp_path / "old"
    data.mkdir()
    old_schema = store_module.SCHEMA.replace("    tool_turns TEXT NOT NULL DEFAULT '[]',\n", "")
    assert old_schema != store_module.SCHEMA
    db = sqlite3.connect(data / store_module.DB_NAME)
    db.executescript(old_schema)
    db.execute("INSERT INTO conversations (id, title, created_at, updated_at, leaf_id) VALUES (1, 'old', 1, 1, 2)")
    old = '\n\n🔧 **lookup** `{"city": "rome"}` → weather in rome: sunny\n\nSunny in Rome.'
    db.execute(
        "INSERT INTO messages (id, conversation_id, parent_id, role, content, created_at, updated_at)"
        " VALUES (1, 1, NULL, 'user', 'weather?', 1, 1), (2, 1, 1, 'assistant', ?, 2, 2)",
        (old,),
    )
    db.commit()
    db.close()

    window = make_window(data)
    thread = window.store.thread(1)
    assert [(m.role, m.content, m.tool_turns) for m in thread] == [("user", "weather?", []), ("assistant", old, [])]
    window.chat.open(1)
    assert window.chat_view.widgets[2].content == old
    assert run_async(window.load_model(str(tool_model)))
    messages = window.chat._engine_messages(thread, window.bridge.model_info)
    assert messages == [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": old}]
    window.store.update_message(2, tool_turns=[{"text": "", "calls": []}])  # the new column takes writes
    assert window.store.message(2).tool_turns == [{"text": "", "calls": []}]


def test_a_hung_server_that_ignores_sigterm_is_killed_with_its_helpers(make_window, run_async, places):
    """Terminate, then kill after the grace period, the whole process group: the server
    and the helper it started both end."""
    from app.controllers.tools import ToolCall, ToolError

    command, log = places("family")
    window = make_window()
    window.tools.timeout_s = 2.0
    window.tools.add_server("places", command)
    run_async(window.tools.offered())
    with pytest.raises(ToolError, match="did not answer the call to lookup within 2 s"):
        run_async(window.tools.call(ToolCall("c1", "lookup", '{"city": "rome"}')))
    city, pids = log.read_text().splitlines()
    server, helper = (int(p) for p in pids.split())
    assert city == "rome"
    assert _gone_within(server, 1.0) and _gone_within(helper, 1.0)  # already, after the grace
