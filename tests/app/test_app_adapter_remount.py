"""Adapters mounted through the menu come back when their model loads again (same window
or after a restart); a folder that vanished or no longer fits is skipped with one notice and
forgotten; another model never gets them. Real worker, tiny llama, tiny mlx-lm adapters."""

from __future__ import annotations

import shutil

import pytest

from app import model_prefs
from app.qt import QApplication, QDialog, Qt
from tests.tiny_models import make_tiny_adapter

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def _mounted(window) -> list[str]:
    return [a.name for a in window.bridge.model_info.adapters]


def _send(qtbot, window, text="hello there"):
    window.composer.edit.setPlainText(text)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    return blocker.args


def test_adapters_come_back_after_reload_and_restart(qtbot, make_window, run_async, tiny_model, tmp_path):
    data = tmp_path / "data"
    alpha = make_tiny_adapter(tmp_path / "adapters" / "alpha", seed=3)
    beta = make_tiny_adapter(tmp_path / "adapters" / "beta", seed=4)
    window = make_window(data)
    assert run_async(window.load_model(str(tiny_model)))
    assert run_async(window.mount_adapter(str(alpha)))
    assert run_async(window.mount_adapter(str(beta)))
    window.adapters_menu.rows["alpha"].check.click()  # this chat uses alpha
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {"alpha": 1.0}, timeout=10_000)
    conv = window.chat.conversation_id

    # The same model again: the engine starts bare; both come back, alpha active for the chat.
    assert run_async(window.load_model(str(tiny_model)))
    assert _mounted(window) == ["alpha", "beta"]
    assert window.bridge.model_info.active_adapters == {"alpha": 1.0}
    assert list(window.adapters_menu.rows) == ["alpha", "beta"]
    assert window.adapters_menu.rows["alpha"].check.isChecked()
    assert not window.error_banner.isVisible()
    window.store.update_conversation(conv, settings=GREEDY)
    reply_id, _ = _send(qtbot, window)
    assert window.store.message(reply_id).adapters == {"alpha": 1.0}

    # Unmounting forgets: the next load does not bring beta back.
    window.adapters_menu.unmount_menu.actions()[1].trigger()
    qtbot.waitUntil(lambda: _mounted(window) == ["alpha"], timeout=10_000)
    assert run_async(window.load_model(str(tiny_model)))
    assert _mounted(window) == ["alpha"]
    assert run_async(window.mount_adapter(str(beta)))

    # A restart over the same data folder: the model reopened gets its adapters back.
    window.close()
    window.store.close()
    again = make_window(data)
    assert again.chat.conversation_id == conv
    assert again.adapters_menu.rows == {}
    assert run_async(again.load_model(str(tiny_model)))
    assert _mounted(again) == ["alpha", "beta"]
    assert again.bridge.model_info.active_adapters == {"alpha": 1.0}
    assert again.adapters_menu.rows["alpha"].check.isChecked()
    assert not again.error_banner.isVisible()


def test_vanished_or_unfitting_adapters_are_skipped_once_and_forgotten(
    qtbot, make_window, run_async, tiny_model, tmp_path
):
    alpha = make_tiny_adapter(tmp_path / "adapters" / "alpha", seed=3)
    beta = make_tiny_adapter(tmp_path / "adapters" / "beta", seed=4)
    gamma = make_tiny_adapter(tmp_path / "adapters" / "gamma", seed=5)
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    for folder in (alpha, beta, gamma):
        assert run_async(window.mount_adapter(str(folder)))
    model_path = window.bridge.model_info.path

    shutil.rmtree(beta)  # gone
    gamma_wide = make_tiny_adapter(gamma, hidden=96, heads=4, kv_heads=2)  # no longer fits
    assert gamma_wide == gamma
    banners: list[str] = []
    window.statusBar().messageChanged.connect(banners.append)

    assert run_async(window.load_model(str(tiny_model)))
    assert _mounted(window) == ["alpha"]
    assert window.error_banner.isVisible()
    notice = window.error_banner.text()
    assert notice.startswith("Skipped 2 adapters mounted on tiny-llama before, and forgot them:")
    assert "beta (its folder" in notice and "is gone" in notice
    assert "gamma (" in notice and "\n" not in notice
    assert sum("Skipped" in m for m in banners) == 1  # one notice, and no dialog at all
    assert not [w for w in QApplication.topLevelWidgets() if isinstance(w, QDialog) and w.isVisible()]
    remembered = model_prefs.remembered_adapters(window.store, model_path)
    assert [e["name"] for e in remembered] == ["alpha"]

    # Forgotten: the next load is quiet.
    assert run_async(window.load_model(str(tiny_model)))
    assert _mounted(window) == ["alpha"]
    assert not window.error_banner.isVisible()


def test_another_model_does_not_get_the_first_ones_adapters(qtbot, make_window, run_async, tiny_model, tmp_path):
    alpha = make_tiny_adapter(tmp_path / "adapters" / "alpha", seed=3)
    other = shutil.copytree(tiny_model, tmp_path / "tiny-llama-other")
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    assert run_async(window.mount_adapter(str(alpha)))
    first = window.bridge.model_info.path
    started: list[str] = []
    window.bridge.started.connect(lambda _rid, kind: started.append(kind))

    assert run_async(window.load_model(str(other)))
    assert window.bridge.model_info.adapters == []
    assert "adapter" not in started  # nothing was even tried on the other model
    assert not window.error_banner.isVisible()
    assert window.adapters_menu.rows == {}
    # The first model keeps its memory of alpha and gets it back when it returns.
    assert [e["name"] for e in model_prefs.remembered_adapters(window.store, first)] == ["alpha"]
    assert run_async(window.load_model(str(tiny_model)))
    assert _mounted(window) == ["alpha"]


def test_a_message_sent_during_the_reload_waits_for_its_adapters(
    qtbot, make_window, run_async, tiny_model, tmp_path, hold_worker
):
    """The re-mount is part of the load: a reply asked for meanwhile runs with the chat's
    adapters, not on the bare model."""
    from app.tasks import spawn

    alpha = make_tiny_adapter(tmp_path / "adapters" / "alpha", seed=3)
    beta = make_tiny_adapter(tmp_path / "adapters" / "beta", seed=4)
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    assert run_async(window.mount_adapter(str(alpha)))
    assert run_async(window.mount_adapter(str(beta)))
    window.adapters_menu.rows["beta"].check.click()  # the second one mounted: the last to return
    qtbot.waitUntil(lambda: window.bridge.model_info.active_adapters == {"beta": 1.0}, timeout=10_000)
    window.store.update_conversation(window.chat.conversation_id, settings=GREEDY)

    release = hold_worker(window)
    loading = spawn(window.load_model(str(tiny_model)))
    qtbot.waitUntil(lambda: window.bridge.loading, timeout=10_000)
    window.composer.edit.setPlainText("with beta please")
    window.composer.send_button.click()
    qtbot.waitUntil(lambda: window.chat.busy, timeout=10_000)
    with qtbot.wait_signal(window.chat.reply_finished, timeout=60_000) as blocker:
        release()
    reply_id, result = blocker.args
    assert loading.done() and loading.result() is True
    assert result.adapters == {"beta": 1.0}
    assert window.store.message(reply_id).adapters == {"beta": 1.0}
    assert _mounted(window) == ["alpha", "beta"]
