"""Compare on the real worker: the tiny llama with and without a tiny LoRA adapter, both
columns streamed, each equal to the engine CLI's greedy answer under the same adapters,
and the kept column becoming the chat's reply."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app.test_app_adapters import GREEDY, PROMPT, _engine_cli
from tests.tiny_models import make_tiny_adapter, make_tiny_llama

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

DATA = Path(__file__).resolve().parents[1] / "documents" / "data"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    return make_tiny_adapter(tmp_path_factory.mktemp("adapters") / "alpha", seed=3)


def test_with_and_without_an_adapter_side_by_side_and_one_kept(qtbot, make_window, run_async, tiny_model, adapter):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    cid = window.chat.conversation_id
    window.store.update_conversation(cid, settings=GREEDY)
    assert not run_async(window.compare_prompt())  # nothing typed: refused in one line
    assert window.error_banner.text() == "Type the message to compare in the box first."
    window.composer.edit.setPlainText(PROMPT)
    assert not run_async(window.compare_prompt())  # no adapter mounted: nothing to compare
    assert "Mount an adapter first" in window.error_banner.text()

    assert run_async(window.mount_adapter(str(adapter)))
    streamed: dict[int, str] = {0: "", 1: ""}
    window.compare.token.connect(lambda col, text: streamed.__setitem__(col, streamed[col] + text))
    headers: list[tuple[int, str]] = []
    window.compare.header.connect(lambda col, line: headers.append((col, line)))
    assert run_async(window.compare_prompt(), timeout=120_000)

    view = window.compare_view
    with_adapter, without = (view.texts[i].toPlainText() for i in range(2))
    assert with_adapter == _engine_cli(tiny_model, "--adapter", f"{adapter}:1.0")
    assert without == _engine_cli(tiny_model)
    assert with_adapter != without
    assert streamed == {0: with_adapter, 1: without}  # each column streamed, nothing crossed
    assert (1, "no adapter (waits, then runs after the first)") in headers
    assert [h.text() for h in view.headers] == ["alpha ×1", "no adapter"]
    assert all("tokens" in s.text() for s in view.stats)
    assert window.bridge.model_info.active_adapters == {}  # the chat's own choice is back
    assert window.store.thread(cid) == []  # nothing is in the chat until a column is kept

    view.keep_buttons[0].click()
    thread = window.store.thread(cid)
    assert [(m.role, m.content) for m in thread] == [("user", PROMPT), ("assistant", with_adapter)]
    assert thread[1].adapters == {"alpha": 1.0} and thread[1].stats["generated_tokens"] == GREEDY["max_tokens"]
    assert window.chat_view.widgets[thread[1].id].content == with_adapter
    assert window.composer.edit.toPlainText() == "" and not view.isVisible()


def test_against_another_model_the_second_runs_after_the_first_and_the_chats_model_comes_back(
    qtbot, make_window, run_async, tiny_model, tmp_path_factory
):
    other = make_tiny_llama(tmp_path_factory.mktemp("other") / "tiny-other", seed=7)
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    cid = window.chat.conversation_id
    window.store.update_conversation(cid, settings=GREEDY)
    window.composer.edit.setPlainText(PROMPT)
    headers: list[tuple[int, str]] = []
    window.compare.header.connect(lambda col, line: headers.append((col, line)))
    assert run_async(window.compare_prompt(str(other)), timeout=120_000)

    view = window.compare_view
    assert view.texts[0].toPlainText() == _engine_cli(tiny_model)
    assert view.texts[1].toPlainText() == _engine_cli(other)
    assert (1, "tiny-other (waits, then runs after the first)") in headers
    assert [h.text() for h in view.headers] == ["tiny-llama", "tiny-other"]
    assert window.bridge.model_info.path == str(tiny_model)  # the chat's model is loaded again

    view.keep_buttons[1].click()
    reply = window.store.thread(cid)[-1]
    assert (reply.content, reply.model) == (view.texts[1].toPlainText(), "tiny-other")


def test_both_columns_show_the_chats_documents_sources(qtbot, make_window, run_async, tiny_model, adapter):
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    assert run_async(window.mount_adapter(str(adapter)))
    cid = window.chat.conversation_id
    window.store.update_conversation(cid, settings=GREEDY)
    run_async(window.add_documents([str(DATA / "libtasn1.pdf")]))
    window.composer.edit.setPlainText("Which asn1Decoding options give strict DER decoding?")
    assert run_async(window.compare_prompt(), timeout=120_000)
    view = window.compare_view
    for col in range(2):
        assert view.cards[col].cards[0].text().startswith("libtasn1.pdf · page 10")
    view.keep_buttons[1].click()
    reply = window.store.thread(cid)[-1]
    assert reply.stats["sources"][0]["page"] == 10 and reply.adapters == {}
    assert window.chat_view.widgets[reply.id].source_cards.cards[0].text().startswith("libtasn1.pdf · page 10")
