"""Compare hears only its own runs: another generation decoding beside a column (in the
batch, its tokens on the bridge's global signal too) neither reaches the column nor takes
the column's tokens away. Real worker, tiny llama and a tiny adapter."""

from __future__ import annotations

import asyncio

import pytest

from engine import api
from tests.app.test_app_adapters import GREEDY, PROMPT
from tests.tiny_models import make_tiny_adapter

pytestmark = pytest.mark.qt_log_ignore("propagateSizeHints")  # offscreen plugin noise


def test_a_generation_beside_a_column_does_not_cross_into_it(qtbot, make_window, run_async, tiny_model, tmp_path):
    adapter = make_tiny_adapter(tmp_path / "alpha", seed=3)
    window = make_window()
    assert run_async(window.load_model(str(tiny_model)))
    window.store.update_conversation(window.chat.conversation_id, settings=GREEDY)
    assert run_async(window.mount_adapter(str(adapter)))
    streamed: dict[int, str] = {0: "", 1: ""}
    beside: list[asyncio.Future[api.GenerationResult]] = []
    on_signal: set[int] = set()
    window.bridge.token.connect(lambda rid, _text, _channel: on_signal.add(rid))

    def heard(column: int, text: str) -> None:
        streamed[column] += text
        if column == 1 and not beside:  # the plain column has begun: another request joins it
            params = api.GenerationParams(max_tokens=48, ignore_eos=True)
            ask = [{"role": "user", "content": "something else entirely"}]
            beside.append(asyncio.ensure_future(window.bridge.generate("beside", ask, params)))

    window.compare.token.connect(heard)
    assert run_async(window.compare.run(PROMPT, variants=[{"alpha": 1.0}, {}]), timeout=120_000)
    other = run_async(beside[0])
    assert other.stats.generated_tokens == 48 and other.text
    assert len(on_signal) >= 3  # two columns and the request beside them, all on the global signal
    assert streamed == {0: window.compare.results[0][0], 1: window.compare.results[1][0]}
    assert all(r[1]["generated_tokens"] == GREEDY["max_tokens"] for r in window.compare.results)
