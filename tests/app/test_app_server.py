"""The Server menu: started from the window, the local server answers the official
OpenAI client with the window's loaded model, on the window's worker; the request log
fills; the address is copied; Stop closes the port; a network bind without a key is
refused with a readable message."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from app.qt import QApplication

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def test_server_menu_serves_the_windows_model(qtbot, make_window, run_async, tiny_model):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    menu = window.server_menu
    menu.port.setValue(18000)  # then 0: the OS picks a free port (the field says 1024+)
    menu.settings()
    menu.controller.port = 0
    with qtbot.wait_signal(menu.controller.changed, timeout=10_000):
        menu.controller.start()
    address = menu.controller.address
    assert address.startswith("http://127.0.0.1:") and menu.toggle_action.text() == "Stop server"
    assert not menu.port.isEnabled()

    with openai.OpenAI(base_url=address, api_key="none", max_retries=0, timeout=60) as client:
        assert client.models.list().data[0].id == "tiny-llama"
        reply = client.chat.completions.create(
            model="tiny-llama", max_tokens=5, temperature=0, messages=[{"role": "user", "content": "hello"}]
        )
    assert reply.choices[0].message.content is not None and reply.usage.completion_tokens > 0
    qtbot.waitUntil(lambda: "POST /v1/chat/completions  200" in menu.log.view.toPlainText(), timeout=10_000)

    menu.copy_address()
    assert QApplication.clipboard().text() == address
    assert window.store.preference("server.port") == 18000

    with qtbot.wait_signal(menu.controller.changed, timeout=10_000):
        menu.toggle()  # Stop
    assert menu.toggle_action.text() == "Start server" and menu.port.isEnabled()
    with pytest.raises(OSError):
        urllib.request.urlopen(address.removesuffix("/v1") + "/health", timeout=5)
    # The window's own chat still works on the same worker.
    info = run_async(window.bridge.refresh_model_info())
    assert info.name == "tiny-llama"


def test_other_devices_need_an_api_key(qtbot, make_window):
    window = make_window()
    menu = window.server_menu
    menu.network_action.setChecked(True)
    menu.key.setText("")
    with qtbot.wait_signal(menu.controller.failed, timeout=5_000) as blocker:
        menu.toggle()
    assert "API key" in blocker.args[0]
    assert not menu.controller.running and menu.toggle_action.text() == "Start server"


def test_requests_before_a_model_is_loaded_get_503(qtbot, make_window):
    window = make_window()
    menu = window.server_menu
    menu.controller.port = 0
    assert menu.controller.start()
    try:
        url = menu.controller.address + "/models"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        with e.value:
            assert e.value.code == 503 and "pick one" in json.loads(e.value.read())["error"]["message"]
    finally:
        menu.controller.stop()


def test_the_windows_chat_decodes_beside_a_server_stream(qtbot, make_window, run_async, tiny_model):
    """Continuous batching: a reply typed in the window finishes while a long API stream
    on the same worker is still decoding; neither waits for the other."""
    import threading

    from app.qt import Qt

    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    menu = window.server_menu
    menu.controller.port = 0
    with qtbot.wait_signal(menu.controller.changed, timeout=10_000):
        menu.controller.start()
    started, done = threading.Event(), threading.Event()

    def stream() -> None:
        with openai.OpenAI(base_url=menu.controller.address, api_key="none", max_retries=0, timeout=120) as c:
            for chunk in c.chat.completions.create(
                model="tiny-llama",
                max_tokens=1500,
                temperature=0,
                stream=True,
                messages=[{"role": "user", "content": "tell me a story"}],
            ):
                if chunk.choices and chunk.choices[0].delta.content:
                    started.set()
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    qtbot.waitUntil(started.is_set, timeout=30_000)
    # A short reply (the default, sampled up to 512 tokens, could outlast the stream).
    window.store.update_conversation(
        window.chat.conversation_id, settings={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    )
    window.composer.edit.setFocus()
    qtbot.keyClicks(window.composer.edit, "hello")
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert not done.is_set(), "the window's reply waited for the server's stream"
    qtbot.waitUntil(done.is_set, timeout=120_000)
    with qtbot.wait_signal(menu.controller.changed, timeout=10_000):
        menu.toggle()
