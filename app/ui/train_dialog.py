"""Adapters → Train…: train a LoRA adapter on the loaded model from chats or a data file.

The dialog picks the data (selected conversations, their assistant turns as targets, a
.jsonl file or folder in mlx-lm's shapes, or a folder of .txt/.md files), the settings
(sensible defaults), and an adapter name; Start runs the engine's training on its
worker, and the dialog shows a live loss chart (train and validation), tokens/s, time
left and peak memory. Stop ends it between iterations and keeps the adapter trained so
far, and Start (now Resume) continues from it. When training ends the adapter is mounted and turned on for the chat at once
(``finished_training`` carries its folder and name for the window to do that), and one
click (Compare) answers a prompt without and with it, side by side.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from app.qt import (
    QCheckBox,
    QColor,
    QDialog,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPainter,
    QPen,
    QPlainTextEdit,
    QPointF,
    QPushButton,
    QSpinBox,
    Qt,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)


class LossChart(QWidget):
    """Training loss per iteration (a line) and validation losses (dots)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("lossChart")
        self.setMinimumHeight(140)
        self.train: list[tuple[int, float]] = []
        self.valid: list[tuple[int, float]] = []
        self.iters = 1

    def clear(self, iters: int) -> None:
        self.train, self.valid, self.iters = [], [], max(1, iters)
        self.update()

    def add(self, iteration: int, loss: float | None, val_loss: float | None) -> None:
        if loss is not None:
            self.train.append((iteration, loss))
        if val_loss is not None:
            self.valid.append((iteration, val_loss))
        self.update()

    def paintEvent(self, event) -> None:  # noqa: N802 - Qt override
        points = self.train + self.valid
        if not points:
            return
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        low = min(v for _, v in points)
        high = max(v for _, v in points)
        span = (high - low) or 1.0
        w, h = self.width() - 8, self.height() - 8

        def at(i: int, v: float) -> QPointF:
            return QPointF(4 + w * i / self.iters, 4 + h * (1 - (v - low) / span))

        painter.setPen(QPen(QColor("#3b82f6"), 2))
        for (i0, v0), (i1, v1) in zip(self.train, self.train[1:]):
            painter.drawLine(at(i0, v0), at(i1, v1))
        painter.setPen(QPen(QColor("#f97316"), 2))
        painter.setBrush(QColor("#f97316"))
        for i, v in self.valid:
            painter.drawEllipse(at(i, v), 3, 3)
        painter.setPen(self.palette().color(self.foregroundRole()))
        painter.drawText(6, 14, f"{high:.3f}")
        painter.drawText(6, self.height() - 6, f"{low:.3f}")
        painter.end()


def chat_rows(store: Any, conversation_ids: list[int]) -> list[dict[str, Any]]:
    """One ``{"messages": [...]}`` row per conversation (text turns, system prompt first)."""
    rows = []
    for cid in conversation_ids:
        conv = store.conversation(cid)
        messages = []
        if conv is not None and getattr(conv, "system_prompt", ""):
            messages.append({"role": "system", "content": conv.system_prompt})
        for message in store.thread(cid):
            if message.role in ("user", "assistant") and message.content:
                messages.append({"role": message.role, "content": message.content})
        if any(m["role"] == "assistant" for m in messages):
            rows.append({"messages": messages})
    return rows


class TrainDialog(QDialog):
    # (adapter folder, adapter name): training ended (done or stopped) with an adapter saved
    finished_training = Signal(str, str)

    def __init__(self, window: Any):
        super().__init__(window)
        self.setObjectName("trainDialog")
        self.setWindowTitle("Train an adapter")
        self.window_ = window
        self.started_at = 0.0
        layout = QVBoxLayout(self)
        self.chats = QListWidget(objectName="trainChats")
        for conv in window.store.list_conversations():
            item = QListWidgetItem(conv.title or f"Chat {conv.id}")
            item.setData(Qt.ItemDataRole.UserRole, conv.id)
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsUserCheckable)
            item.setCheckState(Qt.CheckState.Unchecked)
            self.chats.addItem(item)
        layout.addWidget(QLabel("Train on these chats (their assistant replies are the targets):"))
        layout.addWidget(self.chats)
        row = QHBoxLayout()
        self.data_file = QLineEdit(objectName="trainDataFile")
        self.data_file.setPlaceholderText("…or a .jsonl file, a folder with train.jsonl, or a folder of .txt/.md")
        browse = QPushButton("File…")
        browse.clicked.connect(self._browse)
        folder = QPushButton("Folder…")
        folder.setToolTip("A folder with train.jsonl (and valid.jsonl), or of .txt / .md files")
        folder.clicked.connect(self._browse_folder)
        row.addWidget(self.data_file, 1)
        row.addWidget(browse)
        row.addWidget(folder)
        layout.addLayout(row)
        form = QFormLayout()
        self.name = QLineEdit(time.strftime("trained-%Y%m%d-%H%M"), objectName="trainName")
        self.iters = QSpinBox(minimum=1, maximum=100_000, value=100)
        self.batch = QSpinBox(minimum=1, maximum=256, value=1)
        self.lr = QDoubleSpinBox(decimals=6, minimum=1e-6, maximum=1.0, singleStep=1e-5, value=1e-4)
        self.rank = QSpinBox(minimum=1, maximum=256, value=8)
        self.layers = QSpinBox(minimum=1, maximum=512, value=16)
        self.mask = QCheckBox("Train only the replies (mask the prompts)")
        self.mask.setChecked(True)
        for label, widget in (("Adapter name", self.name), ("Iterations", self.iters), ("Batch size", self.batch),
                              ("Learning rate", self.lr), ("Rank", self.rank), ("Last layers", self.layers)):  # fmt: skip
            form.addRow(label, widget)
        form.addRow("", self.mask)
        layout.addLayout(form)
        self.chart = LossChart(self)
        layout.addWidget(self.chart)
        self.stats = QLabel("", objectName="trainStats")
        layout.addWidget(self.stats)
        buttons = QHBoxLayout()
        self.start_button = QPushButton("Start", objectName="trainStart")
        self.stop_button = QPushButton("Stop", objectName="trainStop")
        self.stop_button.setEnabled(False)
        self.start_button.clicked.connect(self.start)
        self.stop_button.clicked.connect(self.stop)
        buttons.addStretch(1)
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.stop_button)
        layout.addLayout(buttons)
        layout.addWidget(self._compare_row())
        window.bridge.train_progress.connect(self._progress)

    def _compare_row(self) -> QWidget:
        """One prompt answered without and with the trained adapter, side by side."""
        box = QWidget(objectName="trainCompare")
        outer = QVBoxLayout(box)
        outer.setContentsMargins(0, 0, 0, 0)
        row = QHBoxLayout()
        self.compare_prompt = QLineEdit(objectName="comparePrompt")
        self.compare_prompt.setPlaceholderText("A prompt to answer without and with the adapter")
        self.compare_button = QPushButton("Compare", objectName="compareButton")
        self.compare_button.setEnabled(False)
        self.compare_button.clicked.connect(self.start_compare)
        row.addWidget(self.compare_prompt, 1)
        row.addWidget(self.compare_button)
        outer.addLayout(row)
        answers = QHBoxLayout()
        self.without_answer = QPlainTextEdit(objectName="withoutAnswer", readOnly=True)
        self.with_answer = QPlainTextEdit(objectName="withAnswer", readOnly=True)
        self.without_answer.setPlaceholderText("Without the adapter")
        self.with_answer.setPlaceholderText("With the adapter")
        answers.addWidget(self.without_answer)
        answers.addWidget(self.with_answer)
        outer.addLayout(answers)
        self.trained_name: str | None = None
        self.stopped_name: str | None = None  # the run Start resumes (same name, stopped early)
        self.comparisons = 0  # comparisons finished (either way)
        return box

    def start_compare(self) -> None:
        from app import tasks

        tasks.spawn(self.compare())

    async def compare(self) -> None:
        """Greedy answers to the prompt with the adapters off, then with only the trained one
        on; the chat's own choice of adapters is put back afterwards."""
        from engine.api import GenerationParams, SamplingParams

        bridge, name = self.window_.bridge, self.trained_name
        prompt = self.compare_prompt.text().strip()
        if name is None or not prompt:
            return
        if self.window_.chat.busy:
            self.stats.setText("Wait for the reply to finish, then compare.")
            return
        chosen = self.window_.adapters_menu.choice()
        messages = [{"role": "user", "content": prompt}]
        params = GenerationParams(max_tokens=96, sampling=SamplingParams(temperature=0.0))
        self.compare_button.setEnabled(False)
        try:
            for scales, view in (({}, self.without_answer), ({name: 1.0}, self.with_answer)):
                view.setPlainText("…")
                await bridge.set_active_adapters(scales)
                result = await bridge.generate(f"compare-{bool(scales)}", messages, params)
                view.setPlainText(result.text)
        except Exception as exc:  # noqa: BLE001 - every failure reaches the user as one line
            self.stats.setText(f"Could not compare: {exc}")
        finally:
            await bridge.set_active_adapters(chosen)
            self.compare_button.setEnabled(True)
            self.comparisons += 1

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Training data", "", "JSON Lines (*.jsonl)")
        if path:
            self.data_file.setText(path)

    def _browse_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Training data folder")
        if path:
            self.data_file.setText(path)

    def checked_chats(self) -> list[int]:
        items = [self.chats.item(i) for i in range(self.chats.count())]
        return [it.data(Qt.ItemDataRole.UserRole) for it in items if it.checkState() == Qt.CheckState.Checked]

    def _adapter_folder(self, name: str) -> Path:
        return Path(self.window_.store.data_dir) / "adapters" / name

    def _data(self, name: str) -> str | None:
        """The data to train on: the file given, or the checked chats written as rows."""
        if self.data_file.text().strip():
            return self.data_file.text().strip()
        rows = chat_rows(self.window_.store, self.checked_chats())
        if not rows:
            return None
        folder = Path(self.window_.store.data_dir) / "training" / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "train.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        return str(folder)

    def start(self) -> None:
        from app import tasks

        tasks.spawn(self.run())

    async def run(self) -> None:
        from engine.api import Train

        name = re.sub(r"[^\w.-]+", "-", self.name.text().strip()) or "trained"
        if self.window_.bridge.model_info is None:
            self.stats.setText("Load a model first: the adapter trains on the loaded model.")
            return
        data = self._data(name)
        if data is None:
            self.stats.setText("Tick chats that have replies, or give a data file.")
            return
        folder = self._adapter_folder(name)
        # Resume: a run of this name that was stopped goes on from the adapter it saved.
        resume = name == self.stopped_name and (folder / "adapters.safetensors").is_file()
        command = Train(
            data=data, adapter_out=str(folder), adapter_init=str(folder) if resume else None, iters=self.iters.value(),
            batch_size=self.batch.value(), lr=self.lr.value(), rank=self.rank.value(), layers=self.layers.value(),
            mask_prompt=self.mask.isChecked(), save_every=10,
        )  # fmt: skip
        self.chart.clear(command.iters)
        self.start_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self.started_at = time.monotonic()
        self.stats.setText("Starting…")
        try:
            result = await self.window_.bridge.train(command)
        except Exception as exc:  # noqa: BLE001 - every failure reaches the user as one line
            self.stats.setText(f"Training failed: {exc}")
            return
        finally:
            self.start_button.setEnabled(True)
            self.stop_button.setEnabled(False)
        how = "Stopped" if result.stopped else "Done"
        self.stats.setText(
            f"{how} after {len(result.train_losses)} iterations; the adapter {name} is mounted and on for this chat."
        )
        self.trained_name = name
        self.stopped_name = name if result.stopped else None
        self.start_button.setText("Resume" if result.stopped else "Start")
        self.compare_button.setEnabled(True)
        if not self.compare_prompt.text():
            self.compare_prompt.setText(self._first_question())
        emit(self.finished_training, result.adapter, name)

    def _first_question(self) -> str:
        for cid in self.checked_chats():
            for message in self.window_.store.thread(cid):
                if message.role == "user" and message.content:
                    return str(message.content)
        return ""

    def stop(self) -> None:
        bridge = self.window_.bridge
        if bridge.active_training is not None:
            bridge.cancel(bridge.active_training)
            self.stats.setText("Stopping after this iteration… the adapter trained so far is kept.")

    def _progress(self, event: Any) -> None:
        self.chart.add(event.iteration, event.loss, event.val_loss)
        if event.loss is None:
            return
        elapsed = time.monotonic() - self.started_at
        left = elapsed / max(1, event.iteration) * (event.iters - event.iteration)
        skipped = f" · {len(event.skipped_rows)} bad rows skipped" if event.skipped_rows else ""
        self.stats.setText(
            f"Iteration {event.iteration}/{event.iters} · loss {event.loss:.3f} · {event.tokens_per_second:.0f} tok/s"
            f" · about {left:.0f} s left · peak {event.peak_memory_bytes / 1e6:.0f} MB{skipped}"
        )

    def done(self, result: int) -> None:  # closing the dialog stops a run still going
        self.stop()
        super().done(result)
