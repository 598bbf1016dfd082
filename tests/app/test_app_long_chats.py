"""Long chats in the window (real worker, tiny llama): each conversation's KV cache is saved
in the data folder when a reply ends or the app quits and offered back after a restart;
the disk budget; the KV precision choice; the context overflow policies."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from app.controllers.saved_caches import DEFAULT_BUDGET
from app.qt import Qt
from engine import api

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _load(window, run_async, path) -> None:
    assert run_async(window.load_model(str(path)))


def _send_and_save(qtbot, window, text: str):
    """Type and send; return the reply's result once its cache is saved too."""
    window.composer.edit.setFocus()
    qtbot.keyClicks(window.composer.edit, text)
    with qtbot.wait_signal(window.caches.saved, timeout=60_000) as saved:
        with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as done:
            qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert saved.args[0] == window.chat.conversation_id
    return done.args[1], saved.args[1]


def _uncached(window, run_async, conversation_id: int) -> api.GenerationResult:
    """The last reply again, on a session of its own with nothing cached."""
    thread = window.store.thread(conversation_id)
    messages = [{"role": m.role, "content": m.content} for m in thread[:-1]]
    params = api.GenerationParams(max_tokens=8, ignore_eos=True)
    return run_async(window.bridge.generate("uncached", messages, params))


def test_three_turns_across_a_restart_prefill_only_the_new_tokens(qtbot, make_window, run_async, tiny_model, tmp_path):
    data = tmp_path / "data"
    window = make_window(data)
    _load(window, run_async, tiny_model)
    window.store.update_conversation(window.chat.conversation_id, settings=GREEDY)
    _send_and_save(qtbot, window, "hello there")
    second, written = _send_and_save(qtbot, window, "how are you")
    conv = window.chat.conversation_id
    path = window.caches.path_for(conv)
    assert written > 0 and path.stat().st_size == written
    assert path.parent == data / "kv-cache"
    window.close()
    window.store.close()

    again = make_window(data)  # as after quitting the app
    assert again.chat.conversation_id == conv
    qtbot.waitUntil(lambda: "Saved cache:" in again.sidebar.list.currentItem().toolTip())  # scanned off the GUI thread
    _load(again, run_async, tiny_model)
    third, _ = _send_and_save(qtbot, again, "tell me a story")
    restored = again.caches.last_restore[conv]
    assert restored.tokens > second.stats.prompt_tokens and restored.reason == ""
    # Everything up to the second reply came from the file; only the rest was prefilled.
    assert third.stats.cached_tokens >= second.stats.prompt_tokens
    new_tokens = third.stats.prompt_tokens - second.stats.prompt_tokens
    assert 0 < third.stats.prompt_tokens - third.stats.cached_tokens <= new_tokens
    plain = _uncached(again, run_async, conv)
    assert plain.stats.cached_tokens == 0
    assert plain.token_ids == third.token_ids and plain.text == third.text


def test_a_damaged_file_is_skipped_reprefilled_and_replaced(qtbot, make_window, run_async, tiny_model, tmp_path):
    data = tmp_path / "data"
    window = make_window(data)
    _load(window, run_async, tiny_model)
    window.store.update_conversation(window.chat.conversation_id, settings=GREEDY)
    _send_and_save(qtbot, window, "hello there")
    conv = window.chat.conversation_id
    path = window.caches.path_for(conv)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short, as by a crash
    window.close()
    window.store.close()

    again = make_window(data)
    _load(again, run_async, tiny_model)
    result, written = _send_and_save(qtbot, again, "and then")
    restored = again.caches.last_restore[conv]
    assert restored.tokens == 0 and "unreadable" in restored.reason
    assert result.stats.cached_tokens == 0
    assert result.token_ids == _uncached(again, run_async, conv).token_ids
    assert written > 0 and path.stat().st_size == written  # replaced by a good one
    again.close()
    again.store.close()

    third = make_window(data)
    _load(third, run_async, tiny_model)
    _send_and_save(qtbot, third, "one more")
    assert third.caches.last_restore[conv].tokens > 0


def test_disk_budget_drops_least_recently_used_and_clear_empties(qtbot, make_window, tmp_path):
    window = make_window(tmp_path / "data")
    caches = window.caches
    assert caches.budget == DEFAULT_BUDGET
    folder = caches.folder
    folder.mkdir(parents=True)
    ids = [window.store.create_conversation() for _ in range(3)]
    for age, cid in enumerate(ids):  # ids[0] is the oldest use
        path = caches.path_for(cid)
        path.write_bytes(b"x" * 1000)
        os.utime(path, (1_000_000 + age, 1_000_000 + age))
    caches.rescan()  # the folder is read off the GUI thread; the window shows what it found
    qtbot.waitUntil(lambda: sorted(caches.known) == sorted(ids))
    window.sidebar.reload()
    tips = [window.sidebar.list.item(i).toolTip() for i in range(window.sidebar.list.count())]
    assert sum("Saved cache:" in t for t in tips) == 3

    window.settings.cache_budget.setValue(3.0)  # as typed in Settings
    assert window.store.preference("kv_cache_budget_bytes") == 3 * 1024**3
    assert sorted(caches.sizes()) == sorted(ids)
    caches.set_budget(2500)
    qtbot.waitUntil(lambda: sorted(caches.known) == sorted(ids[1:]))  # the least recently used went first
    assert sorted(caches.sizes()) == sorted(ids[1:])
    assert caches.enforce_budget(keep=ids[1]) == []

    caches.set_budget(1500)
    qtbot.waitUntil(lambda: sorted(caches.known) == [ids[2]])
    assert sorted(caches.sizes()) == [ids[2]]
    action = next(a for a in window.menuBar().actions()[0].menu().actions() if a.text() == "Clear saved caches")
    action.trigger()
    assert caches.sizes() == {}
    assert "cleared" in window.statusBar().currentMessage()
    assert all("Saved cache" not in window.sidebar.list.item(i).toolTip() for i in range(window.sidebar.list.count()))


def test_chats_starting_alike_share_saved_blocks_counted_once_and_kept_while_one_names_them(
    qtbot, make_window, run_async, tiny_model, tmp_path, monkeypatch
):
    from engine import kv_files
    from engine.runtime import saved_cache

    monkeypatch.setattr(saved_cache, "SAVED_BLOCK_TOKENS", 16)  # the tiny chats span several blocks
    window = make_window(tmp_path / "data")
    _load(window, run_async, tiny_model)
    caches, ids = window.caches, []
    for _ in range(2):
        window.new_chat()
        ids.append(window.chat.conversation_id)
        window.store.update_conversation(ids[-1], settings=GREEDY)
        _send_and_save(qtbot, window, "tell me about the little robot who counts the stars")
    blocks = caches.folder / kv_files.BLOCKS
    shared = {p.name for p in blocks.iterdir()}
    assert len(shared) >= 2  # both chats name the same blocks: written once
    assert all(kv_files.named_blocks(kv_files.header_metadata(caches.path_for(c))) for c in ids)
    qtbot.waitUntil(lambda: sorted(caches.known) == sorted(ids))
    sizes = caches.sizes()
    assert caches.total_bytes() < sum(sizes.values())  # each block once in the budget
    window.sidebar.reload()
    tips = [window.sidebar.list.item(i).toolTip() for i in range(window.sidebar.list.count())]
    assert sum("Saved cache:" in t for t in tips) == 2

    window.sidebar.delete(ids[0], confirm=False)
    qtbot.waitUntil(lambda: not caches.path_for(ids[0]).exists())
    assert {p.name for p in blocks.iterdir()} == shared  # still named by the other chat
    window.sidebar.delete(ids[1], confirm=False)
    qtbot.waitUntil(lambda: not any(blocks.iterdir()))
    assert caches.sizes() == {} and caches.total_bytes() == 0


def test_kv_precision_in_settings_applies_at_load_counts_in_the_gauge_and_keys_the_saved_cache(
    qtbot, make_window, run_async, tiny_model
):
    window = make_window()
    _load(window, run_async, tiny_model)
    full_per_token = window.gauge.kv_per_token
    assert window.bridge.model_info.kv_cache == ""
    window.settings.kv_choice.setCurrentIndex(window.settings.kv_choice.findData(8))
    assert window.store.preference("kv_bits") == 8
    assert "next model load" in window.statusBar().currentMessage()
    _load(window, run_async, tiny_model)
    assert window.bridge.model_info.kv_cache == "8-bit g64"
    assert window.gauge.kv_per_token < 0.6 * full_per_token
    window.store.update_conversation(window.chat.conversation_id, settings=GREEDY)
    result, written = _send_and_save(qtbot, window, "hello there")
    assert result.finish_reason == "length" and written > 0
    assert window.gauge.figures.get("kv_bytes", 0) > 0

    window.settings.kv_choice.setCurrentIndex(0)  # back to full precision (shared): the file no longer fits
    _load(window, run_async, tiny_model)
    conv = window.chat.conversation_id
    window.bridge.drop_session(conv)
    _send_and_save(qtbot, window, "and again")
    assert window.caches.last_restore[conv].reason == "the saved cache was made with another kv"


def test_quitting_mid_reply_saves_the_cache_before_the_engine_stops(
    qtbot, make_window, run_async, tiny_model, tmp_path
):
    data = tmp_path / "data"
    window = make_window(data)
    _load(window, run_async, tiny_model)
    window.store.update_conversation(
        window.chat.conversation_id, settings={"max_tokens": 100_000, "temperature": 0.0, "ignore_eos": True}
    )
    tokens: list[str] = []
    window.bridge.token.connect(lambda rid, text, ch: tokens.append(text))
    window.composer.edit.setFocus()
    qtbot.keyClicks(window.composer.edit, "go on and on")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: len(tokens) >= 5, timeout=60_000)
    conv = window.chat.conversation_id
    path = window.caches.path_for(conv)
    assert not path.exists()
    window.close()  # stops the reply; the worker saves the cache before it shuts down
    qtbot.waitUntil(lambda: not window.chat.busy, timeout=10_000)
    window.store.close()
    assert path.is_file() and path.stat().st_size > 0

    again = make_window(data)
    _load(again, run_async, tiny_model)
    assert run_async(again.caches.restore(conv)) > len(tokens)


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """The tiny llama with a 256-token context."""
    import json

    from tests.tiny_models import make_tiny_llama

    folder = make_tiny_llama(tmp_path_factory.mktemp("short") / "tiny-256")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    return folder


def _long_chat(window, turns: int) -> None:
    conv = window.chat.conversation_id or window.store.create_conversation()
    window.chat.conversation_id = conv
    parent = None
    for i in range(turns):
        parent = window.store.add_message(conv, "user", f"question {i}: the quick brown fox", parent)
        parent = window.store.add_message(
            conv, "assistant", f"answer {i}: hello there how are you", parent, status="complete"
        )
    window.chat.refresh()


@pytest.mark.parametrize("policy", [None, "rolling", "stop"])
def test_overflow_policies_at_the_edge_of_a_256_token_context(qtbot, make_window, run_async, short_model, policy):
    window = make_window()
    _load(window, run_async, short_model)
    assert window.bridge.model_info.context_length == 256
    _long_chat(window, 12 if policy != "stop" else 1)
    settings = {"max_tokens": 400, "temperature": 0.0, "ignore_eos": True}
    if policy:
        settings["context_overflow"] = policy
    window.store.update_conversation(window.chat.conversation_id, settings=settings)
    window.settings.load("", settings)
    assert window.settings.values().get("context_overflow") == policy  # None: the default, truncate the middle
    result, _ = _send_and_save(qtbot, window, "and the last question")
    footer = window.chat_view.widgets[window.store.thread(window.chat.conversation_id)[-1].id].stats_label.text()
    assert result.finish_reason == "length" and result.error is None
    if policy == "rolling":  # the window slides along during the reply
        assert result.stats.generated_tokens == 400 and not result.context_full
        # It slid past every earlier message (its kept 3/4 of the context is all reply by the
        # end): the line says so, just above the reply, and is there again on reopening.
        thread = window.store.thread(window.chat.conversation_id)
        reply = thread[-1]
        assert result.kept_messages == [] and result.dropped_messages == len(thread) - 1
        assert reply.stats["context_start"] == reply.id
        for _ in range(2):
            keys = _entry_keys(window)
            assert keys.count("context_divider") == 1 and keys.index("context_divider") == len(thread) - 1
            assert keys[-1] == reply.id
            window.open_conversation(window.store.create_conversation())
            window.open_conversation(reply.conversation_id)
    else:
        assert result.stats.prompt_tokens + result.stats.generated_tokens <= 256
    if policy == "stop":
        assert result.dropped_messages == 0 and result.context_full
        assert "stopped at the context limit" in footer
    else:
        assert result.dropped_messages > 0
        assert f"{result.dropped_messages} earlier messages outside the model's context" in footer
        stored = window.store.thread(window.chat.conversation_id)[-1].stats
        assert stored["dropped_messages"] == result.dropped_messages


def test_context_length_in_settings_caps_chats_and_the_planner_says_what_fits(
    qtbot, make_window, run_async, tiny_model
):
    """Settings → Context length: the cap goes with the next load and chats stop there; the
    planner's line for the loaded model is shown under it; a cap the memory budget cannot
    hold is refused at load with what fits, and the model loaded before stays."""
    window = make_window()
    _load(window, run_async, tiny_model)
    advice = window.settings.context_advice
    assert advice.isVisibleTo(window.settings) and "2,048 tokens" in advice.text()
    choice = window.settings.context_choice
    choice.setCurrentIndex(choice.findData(4096))
    assert window.store.preference("context_cap") == 4096
    assert "next model load" in window.statusBar().currentMessage()
    window.store.set_preference("context_cap", 64)  # a length set before (or by hand): kept as it is
    window.load_setup.settings.show_context_cap(window.load_setup.context_cap_for_load())
    assert choice.currentData() == 64 and "64 tokens" in choice.currentText()
    _load(window, run_async, tiny_model)
    assert window.bridge.model_info.context_advice.limit == 64
    assert "your context cap (64 tokens)" in advice.text()
    window.store.update_conversation(
        window.chat.conversation_id, settings={"max_tokens": 1000, "temperature": 0.0, "ignore_eos": True}
    )
    result, _ = _send_and_save(qtbot, window, "hi")
    assert result.finish_reason == "length" and result.stats.prompt_tokens + len(result.token_ids) == 64

    plan = window.bridge.model_info.plan
    window.store.set_preference("memory_budget", plan.weights_bytes + plan.kv_bytes(300))
    window.store.set_preference("context_cap", 1000)
    assert not run_async(window.load_model(str(tiny_model)))
    shown = window.statusBar().currentMessage() + " ".join(
        w.text() for w in window.findChildren(type(advice)) if w.isVisible()
    )
    assert "Lower the context length to" in shown, shown
    assert window.bridge.model_info is not None and window.bridge.model_info.context_advice.limit == 64


def _entry_keys(window) -> list:
    return [e.key for e in window.chat_view.entries]


@pytest.mark.parametrize("policy", ["truncate_middle", "rolling"])
def test_the_transcript_marks_where_the_models_memory_begins(qtbot, make_window, run_async, short_model, policy):
    """With turns left out, a line "N earlier messages are outside the model's context" sits
    just above the first message the model still read after them (the N left-out messages
    above it, after the kept first exchange for truncate-the-middle), moves with each reply,
    and is there again when the chat is reopened."""
    window = make_window()
    _load(window, run_async, short_model)
    _long_chat(window, 12)
    conv = window.chat.conversation_id
    settings = {"max_tokens": 40, "temperature": 0.0, "ignore_eos": True, "context_overflow": policy}
    window.store.update_conversation(conv, settings=settings)
    view = window.chat_view
    head = 2 if policy == "truncate_middle" else 0  # the first exchange stays
    for turn in range(2):
        result, _ = _send_and_save(qtbot, window, f"and the last question {turn}")
        thread = window.store.thread(conv)
        dropped = result.dropped_messages
        assert dropped > 0 and result.kept_messages[head] == head + dropped
        keys = _entry_keys(window)
        first_read = thread[head + dropped].id
        assert keys.count("context_divider") == 1
        assert keys.index("context_divider") == head + dropped and keys[head + dropped + 1] == first_read
        assert keys[: head + dropped] == [m.id for m in thread[: head + dropped]]
        assert thread[-1].stats["context_start"] == first_read
        if turn == 0:
            before = dropped
    assert dropped > before  # the line moved down with the second reply
    view.verticalScrollBar().setValue(0)  # scrolled up to it, the line is a real widget
    view.verticalScrollBar().setValue(view.verticalScrollBar().maximum() // 2)
    qtbot.waitUntil(lambda: view.divider is not None and view.divider.isVisible(), timeout=10_000)
    text = f"{dropped} earlier messages are outside the model's context"
    assert view.divider.text() == text + (" (it still reads the first exchange)" if head else "")

    other = window.store.create_conversation()
    window.open_conversation(other)
    assert "context_divider" not in _entry_keys(window)
    window.open_conversation(conv)  # reopened: the line is where the last reply left it
    keys = _entry_keys(window)
    assert keys.index("context_divider") == head + dropped and keys[head + dropped + 1] == first_read


def test_context_memory_is_shared_by_default_and_the_gauge_shows_shared_blocks(
    qtbot, make_window, run_async, tiny_model
):
    window = make_window()
    assert window.store.preference("kv_bits") is None  # nothing chosen: chats share their context memory
    assert window.settings.kv_choice.currentText() == "Full precision, shared by chats"
    assert window.load_setup.kv_bits_for_load() is None and window.load_setup.paged_block_size_for_load() == 64
    _load(window, run_async, tiny_model)
    start = "Here is a long shared preamble that every chat of this test begins with. " * 12
    params = api.GenerationParams(max_tokens=4, ignore_eos=True)
    replies = [
        run_async(window.bridge.generate(chat, [{"role": "user", "content": start + question}], params))
        for chat, question in (("first", "What comes next?"), ("second", "And then?"))
    ]
    assert [len(r.token_ids) for r in replies] == [4, 4]
    assert (
        replies[0].stats.cached_tokens == 0 and replies[1].stats.cached_tokens >= 64
    )  # the start, from the other chat
    qtbot.waitUntil(lambda: (window.gauge.figures.get("kv_pool") or {}).get("shared", 0) > 0, timeout=10_000)
    pool = window.gauge.figures["kv_pool"]
    assert pool["block_size"] == 64 and pool["used"] > pool["shared"] > 0
    assert window.gauge.figures["kv_bytes"] == pool["bytes"]  # every layer pages: the KV is the pool, once
    assert f"KV blocks {pool['used']} ({pool['shared']} shared)" in window.gauge.label.text()
    assert "held once" in window.gauge.toolTip()

    window.settings.kv_choice.setCurrentIndex(window.settings.kv_choice.findData("unshared"))
    assert window.load_setup.kv_bits_for_load() is None and window.load_setup.paged_block_size_for_load() is None
    _load(window, run_async, tiny_model)
    qtbot.waitUntil(lambda: window.gauge.figures.get("kv_pool") is None, timeout=10_000)
    assert "KV blocks" not in window.gauge.label.text()
    window.close()
    assert make_window().settings.kv_choice.currentData() == "unshared"  # remembered


def test_a_shared_choice_remembered_from_before_stays_shared(make_window):
    """ "paged" was the choice's name when sharing was not the default."""
    window = make_window()
    window.store.set_preference("kv_bits", "paged")
    assert window.load_setup.paged_block_size_for_load() == 64 and window.load_setup.kv_choice() is None


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_context_memory_shared_by_chats_pages_the_quantized_kv(
    qtbot, make_window, run_async, tiny_model, bits
):
    window = make_window()
    choice = f"paged-{bits}"
    window.settings.kv_choice.setCurrentIndex(window.settings.kv_choice.findData(choice))
    assert window.store.preference("kv_bits") == choice
    assert window.load_setup.kv_bits_for_load() == bits and window.load_setup.paged_block_size_for_load() == 64
    _load(window, run_async, tiny_model)
    assert f"{bits}-bit" in window.bridge.model_info.kv_cache
    start = "Here is a long shared preamble that every chat of this test begins with. " * 12
    params = api.GenerationParams(max_tokens=4, ignore_eos=True)
    replies = [
        run_async(window.bridge.generate(chat, [{"role": "user", "content": start + question}], params))
        for chat, question in (("first", "What comes next?"), ("second", "And then?"))
    ]
    assert replies[1].stats.cached_tokens >= 64  # the start, from the other chat's quantized blocks
    qtbot.waitUntil(lambda: (window.gauge.figures.get("kv_pool") or {}).get("shared", 0) > 0, timeout=10_000)
    window.close()
    reopened = make_window()  # the choice is remembered
    assert reopened.settings.kv_choice.currentData() == choice


def test_a_model_that_cannot_share_its_context_memory_loads_unshared_and_says_why(
    qtbot, make_window, run_async, tiny_model, tmp_path
):
    dynamic = tmp_path / "tiny-dynamic"
    shutil.copytree(tiny_model, dynamic)
    config = json.loads((dynamic / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}  # keys depend on the pass's length
    (dynamic / "config.json").write_text(json.dumps(config))
    window = make_window()  # shared by default
    _load(window, run_async, dynamic)
    assert "RoPE scaling" in window.bridge.model_info.paged_kv_declined
    message = window.statusBar().currentMessage()
    assert message.startswith("Loaded tiny-dynamic.") and "not shared between chats" in message
    window.store.update_conversation(window.chat.conversation_id, settings=GREEDY)
    result, _ = _send_and_save(qtbot, window, "hello there")
    assert result.finish_reason == "length"
    assert window.gauge.figures.get("kv_pool") is None
