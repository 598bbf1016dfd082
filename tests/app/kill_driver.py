"""Run the real window over the real engine and stream an endless reply until killed.

Used by test_app_store.py: ``python kill_driver.py DATA_DIR MODEL_DIR LOG``. Each streamed
piece appends ``<time.monotonic()> <characters streamed so far>`` to LOG, so the test can
tell how much of what was streamed before the kill never reached the history.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import qasync

    from app.bridge import EngineBridge
    from app.qt import QApplication
    from app.store import HistoryStore
    from app.ui.main_window import MainWindow

    data_dir, model, log_path = sys.argv[1], sys.argv[2], sys.argv[3]
    app = QApplication([])
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    store = HistoryStore(data_dir)
    window = MainWindow(store, EngineBridge())
    window.show()
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - open until the process is killed
    streamed = [0]

    def note(_rid, text, channel) -> None:
        if channel == "answer":
            streamed[0] += len(text)
            log.write(f"{time.monotonic():.4f} {streamed[0]}\n")

    window.bridge.token.connect(note)

    async def chat() -> None:
        assert await window.load_model(model)
        window.store.update_conversation(
            window.chat.conversation_id,
            settings={"max_tokens": 1_000_000, "ignore_eos": True, "seed": 3},
        )
        print("sending", flush=True)
        await window.chat.send("tell me a very long story")

    with loop:
        loop.run_until_complete(chat())


if __name__ == "__main__":
    main()
