"""Per-conversation settings: system prompt, presets, sampling (model defaults shown)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from app.controllers.choices import accepts_reasoning
from app.memory_units import GB, fmt_bytes
from app.qt import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSize,
    QSpinBox,
    Qt,
    QVBoxLayout,
    QWidget,
    Signal,
    emit,
)
from app.resources import resource_path

# key: (label, kind, min, max, step, engine default)
FIELDS: dict[str, tuple] = {
    "temperature": ("Temperature", float, 0.0, 2.0, 0.05, 0.0),
    "top_p": ("Top P", float, 0.0, 1.0, 0.05, 1.0),
    "top_k": ("Top K", int, 0, 1000, 1, 0),
    "min_p": ("Min P", float, 0.0, 1.0, 0.01, 0.0),
    "repetition_penalty": ("Repeat penalty", float, 0.5, 2.0, 0.05, 1.0),
    "max_tokens": ("Max tokens", int, 1, 131072, 64, 512),
    "seed": ("Seed (-1 random)", int, -1, 2**31 - 1, 1, -1),
}


MIN_BUDGET_GB = 0.01  # the spin box's floor; the ceiling is the machine's memory

SPECULATIVE = (("Off", None), ("N-gram lookup", "ngram"), ("Draft model", "draft"), ("Built-in (MTP)", "mtp"))

EFFORTS = ("low", "medium", "high")

# Context overflow policies (GenerationParams.context_policy); the first is a chat's default.
OVERFLOW = (("Truncate the middle", "truncate_middle"), ("Rolling window", "rolling"), ("Stop at the limit", "stop"))

# Context caps offered (tokens); None: the model's own context, as far as the budget holds.
CONTEXT_CHOICES: tuple[tuple[str, int | None], ...] = (
    ("Automatic (as memory allows)", None),  # the model's own context; a longer label was cut off
    *((f"{n // 1024}k tokens", n) for n in (4096, 8192, 16384, 32768, 65536, 131072)),
)

KV_CHOICES = (
    ("Full precision, shared by chats", None),
    ("Full precision, each chat its own", "unshared"),
    ("8-bit (half the memory)", 8),
    ("4-bit (a quarter of the memory)", 4),
    ("8-bit, shared by chats", "paged-8"),
    ("4-bit, shared by chats", "paged-4"),
)


class SettingsPanel(QFrame):
    changed = Signal(str, dict)  # system prompt, settings (only values the user set)
    draft_requested = Signal()  # "Choose…": pick a draft model folder
    draft_cleared = Signal()
    whisper_requested = Signal()  # "Choose…": pick a Whisper model folder
    tools_requested = Signal()  # "MCP servers…": the Tools dialog
    whisper_cleared = Signal()
    memory_budget_changed = Signal(object)  # bytes, or None for automatic
    cache_budget_changed = Signal(object)  # bytes of disk for saved chat caches
    kv_bits_changed = Signal(object)  # None (shared, the default), "unshared", 8 or 4, "paged-8" or "paged-4"
    context_cap_changed = Signal(object)  # tokens, None for automatic

    def __init__(self, data_dir: Path, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("settingsPanel")
        self.user_presets_path = Path(data_dir) / "presets.json"
        self.defaults: dict[str, Any] = {}
        self._loading = False
        # The fields scroll inside the panel: it never asks the window for more height than
        # the screen has (a laptop's 800 pixels), and squeezed fields keep their own height.
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        self.scroll = QScrollArea(objectName="settingsScroll")
        self.scroll.setWidgetResizable(True)
        self.scroll.setFrameShape(QFrame.Shape.NoFrame)
        self.scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        body = QWidget(objectName="settingsBody")
        self.scroll.setWidget(body)
        outer.addWidget(self.scroll)
        layout = QVBoxLayout(body)
        layout.setContentsMargins(14, 14, 14, 14)
        layout.setSpacing(10)
        layout.addWidget(QLabel("Chat settings", objectName="panelTitle"))

        row = QHBoxLayout()
        self.preset_box = QComboBox(objectName="presetBox")
        self.preset_box.activated.connect(self._apply_preset)
        save = QPushButton("Save…")
        save.setToolTip("Save the system prompt and sampling settings as a preset")
        save.clicked.connect(self._save_preset)
        row.addWidget(self.preset_box, 1)
        row.addWidget(save)
        layout.addLayout(row)

        layout.addWidget(QLabel("System prompt", objectName="fieldTitle"))
        self.system_edit = QPlainTextEdit(objectName="systemPrompt")
        self.system_edit.setPlaceholderText("You are a helpful assistant.")
        self.system_edit.setFixedHeight(110)
        self.system_edit.textChanged.connect(self._emit)
        layout.addWidget(self.system_edit)

        self._sampling_section(layout)

        layout.addWidget(QLabel("When the chat outgrows the context", objectName="fieldTitle"))
        self.overflow_box = QComboBox(objectName="overflowBox")
        for label, _ in OVERFLOW:
            self.overflow_box.addItem(label)
        self.overflow_box.setToolTip(
            "What happens once this chat is longer than the model can read at once.\n"
            "Truncate the middle: keep the system prompt and the first exchange, leave out the\n"
            "oldest turns after it. Rolling window: leave out the oldest turns. Stop at the\n"
            "limit: leave nothing out; the reply stops where the context ends."
        )
        self.overflow_box.currentIndexChanged.connect(self._emit)
        layout.addWidget(self.overflow_box)

        layout.addWidget(QLabel("Speculative decoding", objectName="fieldTitle"))
        self.speculative_box = QComboBox(objectName="speculativeBox")
        for label, _ in SPECULATIVE:
            self.speculative_box.addItem(label)
        self.speculative_box.setToolTip(
            "Guess several tokens ahead and check them in one pass: same output, often faster.\n"
            "N-gram lookup reuses text from the conversation; a draft model is a small model\n"
            "with the same vocabulary; built-in (MTP) uses the prediction layers some models\n"
            "(Qwen3.5, Qwen3-Next, DeepSeek V3, GLM-5) carry."
        )
        self.speculative_box.currentIndexChanged.connect(self._emit)
        layout.addWidget(self.speculative_box)
        self.set_mtp(False, "Load a model that carries MTP layers (Qwen3.5, Qwen3-Next, DeepSeek V3, GLM-5).")
        self.draft_label, self.draft_clear = self._picker_row(
            layout,
            "No draft model",
            "draft",
            "Pick the draft model's folder (or .gguf file)",
            "Unload the draft model",
            self.draft_requested,
            self.draft_cleared,
        )

        self._reasoning_section(layout)

        self.images_title = QLabel("Images", objectName="fieldTitle")
        layout.addWidget(self.images_title)
        self.pan_and_scan_box = QCheckBox("Split wide images", objectName="panAndScan")
        self.pan_and_scan_box.setToolTip(
            "Show a wide or tall picture (a receipt, a screenshot, a panorama) as the whole\n"
            "plus a few square crops, so small details stay readable. Each crop costs as many\n"
            "prompt tokens as another image. Starts as the model's own setting."
        )
        self.pan_and_scan_box.toggled.connect(self._emit)
        layout.addWidget(self.pan_and_scan_box)
        self.pan_and_scan_default: bool | None = None
        self._show_pan_and_scan()

        self._tools_section(layout)
        self._budget_section(layout)
        self._kv_section(layout)
        self._cache_budget_section(layout)

        layout.addWidget(QLabel("Speech to text", objectName="fieldTitle"))
        self.whisper_label, self.whisper_clear = self._picker_row(
            layout,
            "No Whisper model",
            "whisper",
            "Pick a Whisper model folder",
            "Forget the Whisper model",
            self.whisper_requested,
            self.whisper_cleared,
        )
        self.whisper_label.setToolTip(
            "Voice messages and audio files are transcribed with this Whisper model when the\n"
            "chat model cannot listen to audio itself. Pick a Whisper checkpoint folder\n"
            "(config.json, weights and tokenizer), e.g. openai/whisper-small."
        )

        reset = QPushButton("Reset to model defaults")
        reset.clicked.connect(lambda: self.load(self.system_edit.toPlainText(), {}))
        layout.addWidget(reset)
        layout.addStretch(1)
        for box in body.findChildren(QComboBox):  # a long choice elides instead of widening the panel
            box.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
            box.setMinimumContentsLength(12)
        self.presets = self._read_presets()
        self._fill_presets()

    def _sampling_section(self, layout: QVBoxLayout) -> None:
        """One field per sampling setting (FIELDS), and the stop strings."""
        layout.addWidget(QLabel("Sampling", objectName="fieldTitle"))
        form = QFormLayout()
        form.setSpacing(6)
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)
        self.inputs: dict[str, QSpinBox | QDoubleSpinBox] = {}
        for key, (label, kind, lo, hi, step, _default) in FIELDS.items():
            box = QDoubleSpinBox() if kind is float else QSpinBox()
            if kind is float:
                box.setDecimals(2)
            box.setRange(lo, hi)
            box.setSingleStep(step)
            box.valueChanged.connect(self._emit)
            self.inputs[key] = box
            form.addRow(label, box)
        self.stop_edit = QLineEdit()
        self.stop_edit.setPlaceholderText("comma-separated")
        self.stop_edit.textChanged.connect(self._emit)
        form.addRow("Stop strings", self.stop_edit)
        layout.addLayout(form)

    def _tools_section(self, layout: QVBoxLayout) -> None:
        """The MCP servers button, and whether the first answer must call a tool."""
        layout.addWidget(QLabel("Tools", objectName="fieldTitle"))
        tools_button = QPushButton("MCP servers…", objectName="toolsButton")
        tools_button.clicked.connect(lambda: emit(self.tools_requested))
        layout.addWidget(tools_button)
        self.tool_required_box = QCheckBox("First answer calls a tool", objectName="toolRequired")
        self.tool_required_box.setToolTip(
            "Constrain the model's first answer to one call of an MCP tool\n"
            "(for models that do not reach for tools on their own)."
        )
        self.tool_required_box.toggled.connect(self._emit)
        layout.addWidget(self.tool_required_box)

    def minimumSizeHint(self) -> QSize:  # noqa: N802 - Qt override
        """As narrow as the fields allow (beside the scroll bar); any height: the fields scroll."""
        body = self.scroll.widget().minimumSizeHint().width()
        return QSize(body + self.scroll.verticalScrollBar().sizeHint().width() + 2, 120)

    def _reasoning_section(self, layout: QVBoxLayout) -> None:
        """Per chat, for models whose chat template has a reasoning switch: on/off, or an effort."""
        self.reasoning_title = QLabel("Thinking", objectName="fieldTitle")
        layout.addWidget(self.reasoning_title)
        self.thinking_box = QCheckBox("Think before answering", objectName="thinkingBox")
        self.thinking_box.setToolTip(
            "Let the model reason first; its thinking shows in a collapsible block above the\n"
            "answer. Off answers sooner. Starts as the model's own setting; applies from the\n"
            "next reply."
        )
        self.thinking_box.toggled.connect(self._reasoning_edited)
        layout.addWidget(self.thinking_box)
        self.effort_box = QComboBox(objectName="effortBox")
        for effort in EFFORTS:
            self.effort_box.addItem(effort.capitalize(), effort)
        self.effort_box.setToolTip(
            "How much the model reasons before answering. Starts as the model's own setting;\n"
            "applies from the next reply."
        )
        self.effort_box.currentIndexChanged.connect(self._reasoning_edited)
        layout.addWidget(self.effort_box)
        self.reasoning_control: Any = None  # the loaded model's ReasoningControl
        self.reasoning_choice: bool | str | None = None  # None: the template's default
        self._show_reasoning()

    @staticmethod
    def _picker_row(
        layout: QVBoxLayout, empty: str, name: str, pick_tip: str, clear_tip: str, requested: Any, cleared: Any
    ) -> tuple[QLabel, QPushButton]:
        """A row naming a chosen model folder, with Choose… and ✕ (shown once one is chosen)."""
        row = QHBoxLayout()
        label = QLabel(empty, objectName=f"{name}Label")
        label.setWordWrap(True)
        pick = QPushButton("Choose…", objectName=f"{name}Pick")
        pick.setToolTip(pick_tip)
        pick.clicked.connect(requested)
        clear = QPushButton("✕", objectName=f"{name}Clear")
        clear.setToolTip(clear_tip)
        clear.clicked.connect(cleared)
        clear.setVisible(False)
        row.addWidget(label, 1)
        row.addWidget(pick)
        row.addWidget(clear)
        layout.addLayout(row)
        return label, clear

    def _budget_section(self, layout: QVBoxLayout) -> None:
        """App-wide, not per chat: how much memory a model may take when it loads."""
        layout.addWidget(QLabel("Memory budget", objectName="fieldTitle"))
        row = QHBoxLayout()
        self.budget_mode = QComboBox(objectName="budgetMode")
        self.budget_mode.addItems(["Automatic", "Custom"])
        self.budget_mode.setToolTip(
            "How much memory a model may take, for every chat. Automatic is what the device\n"
            "recommends (else 75% of its memory); a model that needs more is refused when it\n"
            "loads. A change applies from the next model load."
        )
        self.budget_value = QDoubleSpinBox(objectName="budgetValue")
        self.budget_value.setDecimals(2)
        self.budget_value.setSuffix(" GB")
        self.budget_value.setStepType(QDoubleSpinBox.StepType.AdaptiveDecimalStepType)
        self.budget_value.setKeyboardTracking(False)  # typed values count once, on Enter
        row.addWidget(self.budget_mode, 1)
        row.addWidget(self.budget_value)
        layout.addLayout(row)
        self.budget_note = QLabel("", objectName="budgetNote")
        self.budget_note.setWordWrap(True)
        layout.addWidget(self.budget_note)
        self._budget_quiet = False
        self.budget_mode.currentIndexChanged.connect(self._budget_mode_changed)
        self.budget_value.valueChanged.connect(self._budget_edited)

    def _kv_section(self, layout: QVBoxLayout) -> None:
        """App-wide: how the KV cache is held (applies from the next model load)."""
        layout.addWidget(QLabel("Context memory", objectName="fieldTitle"))
        self.kv_choice = QComboBox(objectName="kvChoice")
        for label, bits in KV_CHOICES:
            self.kv_choice.addItem(label, bits)
        self.kv_choice.setToolTip(
            "How the model's memory of the chat (its KV cache) is held. Shared: in blocks, and\n"
            "chats and server requests that start alike (a long system prompt, a document)\n"
            "hold that start once and skip its prefill (a model that cannot share loads with\n"
            "each chat its own, and says why). Full precision follows the per-layer setting a\n"
            "model ships in kv_config.json, if any. 8-bit takes about half the memory with\n"
            "nearly the same replies; 4-bit about a quarter, with replies that drift more.\n"
            "Applies from the next model load."
        )
        self.kv_choice.currentIndexChanged.connect(
            lambda _i: self._budget_quiet or emit(self.kv_bits_changed, self.kv_choice.currentData())
        )
        layout.addWidget(self.kv_choice)
        layout.addWidget(QLabel("Context length", objectName="fieldTitle"))
        self.context_choice = QComboBox(objectName="contextChoice")
        for label, tokens in CONTEXT_CHOICES:
            self.context_choice.addItem(label, tokens)
        self.context_choice.setToolTip(
            "The longest a chat may grow, in tokens. Automatic: the model's own context, as far\n"
            "as the memory budget holds its KV cache. A length the budget cannot hold is refused\n"
            "at load, saying what fits. Applies from the next model load."
        )
        self.context_choice.currentIndexChanged.connect(
            lambda _i: self._budget_quiet or emit(self.context_cap_changed, self.context_choice.currentData())
        )
        layout.addWidget(self.context_choice)
        self.context_advice = QLabel("", objectName="budgetNote")
        self.context_advice.setWordWrap(True)
        self.context_advice.setVisible(False)
        layout.addWidget(self.context_advice)

    def show_kv_bits(self, bits: int | str | None) -> None:
        self._budget_quiet = True
        index = self.kv_choice.findData(bits)
        self.kv_choice.setCurrentIndex(max(0, index))
        self._budget_quiet = False

    def show_context_cap(self, tokens: int | None) -> None:
        self._budget_quiet = True
        index = self.context_choice.findData(tokens)
        if index < 0 and tokens:  # a length set elsewhere (an older choice): offer it as it is
            self.context_choice.addItem(f"{tokens:,} tokens", tokens)
            index = self.context_choice.count() - 1
        self.context_choice.setCurrentIndex(max(0, index))
        self._budget_quiet = False

    def show_context_advice(self, advice: Any, name: str) -> None:
        """The planner's line for the loaded model: how long its chats can grow here, and
        the KV precision and length it recommends for this budget."""
        if advice is None or not advice.note:
            self.context_advice.setVisible(False)
            return
        limit = f"Chats with {name} can reach {advice.limit:,} tokens. " if advice.limit else ""
        self.context_advice.setText(limit + advice.note)
        self.context_advice.setVisible(True)

    def _cache_budget_section(self, layout: QVBoxLayout) -> None:
        """App-wide: the disk the chats' saved KV caches may take (least recently used go first)."""
        layout.addWidget(QLabel("Saved chat caches", objectName="fieldTitle"))
        self.cache_budget = QDoubleSpinBox(objectName="cacheBudget")
        self.cache_budget.setDecimals(1)
        self.cache_budget.setRange(0.0, 10_000.0)
        self.cache_budget.setSuffix(" GB on disk")
        self.cache_budget.setKeyboardTracking(False)
        self.cache_budget.setToolTip(
            "Each chat's memory of what it has read is kept on disk, so a long chat reopens\n"
            "without reading it all again. Past this size the least recently used go first;\n"
            "0 keeps none. Chat → Clear saved caches deletes them all."
        )
        self.cache_budget.valueChanged.connect(
            lambda gb: self._budget_quiet or emit(self.cache_budget_changed, int(round(gb * GB)))
        )
        layout.addWidget(self.cache_budget)

    def show_cache_budget(self, nbytes: int) -> None:
        self._budget_quiet = True
        self.cache_budget.setValue(nbytes / GB)
        self._budget_quiet = False

    # ---- values ----------------------------------------------------------------------

    def set_model_defaults(self, defaults: dict[str, Any]) -> None:
        """The model's generation_config: shown whenever the conversation sets nothing."""
        self.defaults = {k: v for k, v in (defaults or {}).items() if k in FIELDS}

    def set_pan_and_scan_default(self, default: bool | None) -> None:
        """The loaded model's pan-and-scan setting; None hides the toggle (no model, or
        one whose images cannot be split)."""
        self.pan_and_scan_default = default
        self._show_pan_and_scan()

    def _show_pan_and_scan(self) -> None:
        shown = self.pan_and_scan_default is not None
        self.images_title.setVisible(shown)
        self.pan_and_scan_box.setVisible(shown)

    def set_reasoning_control(self, control: Any) -> None:
        """The loaded model's template switch (ModelInfo.reasoning_control); None hides
        the Thinking control (no model, or a template without a switch)."""
        self.reasoning_control = control
        if not accepts_reasoning(control, self.reasoning_choice):
            self.reasoning_choice = None
        self._show_reasoning()

    def _show_reasoning(self) -> None:
        control = self.reasoning_control
        self.reasoning_title.setVisible(control is not None)
        self.thinking_box.setVisible(control is not None and control.is_switch)
        self.effort_box.setVisible(control is not None and not control.is_switch)
        if control is None:
            return
        shown = self.reasoning_choice if self.reasoning_choice is not None else control.default
        was, self._loading = self._loading, True
        if control.is_switch:
            self.thinking_box.setChecked(bool(shown))
        else:
            self.effort_box.setCurrentIndex(EFFORTS.index(shown) if shown in EFFORTS else 1)
        self._loading = was

    def _reasoning_edited(self, *_args) -> None:
        if self._loading or self.reasoning_control is None:
            return
        control = self.reasoning_control
        choice = self.thinking_box.isChecked() if control.is_switch else self.effort_box.currentData()
        # The template's own default is left undefined, as the model ships it.
        self.reasoning_choice = None if choice == control.default else choice
        self._emit()

    def load(self, system_prompt: str, settings: dict[str, Any]) -> None:
        self._loading = True
        self.system_edit.setPlainText(system_prompt)
        for key, box in self.inputs.items():
            value = settings.get(key, self.defaults.get(key, FIELDS[key][5]))
            box.setValue(-1 if value is None and key == "seed" else value)
        self.stop_edit.setText(", ".join(settings.get("stop_strings", [])))
        modes = [mode for _, mode in SPECULATIVE]
        spec = settings.get("speculative")
        self.speculative_box.setCurrentIndex(modes.index(spec) if spec in modes else 0)
        policies = [policy for _, policy in OVERFLOW]
        policy = settings.get("context_overflow")
        self.overflow_box.setCurrentIndex(policies.index(policy) if policy in policies else 0)
        split = settings.get("pan_and_scan")
        self.pan_and_scan_box.setChecked(bool(self.pan_and_scan_default if split is None else split))
        self.tool_required_box.setChecked(settings.get("tool_choice") == "required")
        choice = settings.get("reasoning")
        self.reasoning_choice = choice if accepts_reasoning(self.reasoning_control, choice) else None
        self._show_reasoning()
        self._loading = False
        # Showing a chat's settings writes nothing back: only the user's edits are changes.

    def values(self, everything: bool = False) -> dict[str, Any]:
        """What the user set; values equal to the model's defaults are left out so a
        conversation follows the model it runs on (``everything`` keeps them)."""
        out: dict[str, Any] = {}
        for key, box in self.inputs.items():
            value = box.value()
            if key == "seed":
                value = None if value < 0 else int(value)
            else:
                value = round(value, 4) if isinstance(value, float) else int(value)
            default = self.defaults.get(key, FIELDS[key][5])
            if everything or value != (None if key == "seed" and default == -1 else default):
                out[key] = value
        stops = [s.strip() for s in self.stop_edit.text().split(",") if s.strip()]
        if stops:
            out["stop_strings"] = stops
        spec = SPECULATIVE[max(0, self.speculative_box.currentIndex())][1]
        if spec:
            out["speculative"] = spec
        policy = OVERFLOW[max(0, self.overflow_box.currentIndex())][1]
        if everything or policy != OVERFLOW[0][1]:
            out["context_overflow"] = policy
        if self.pan_and_scan_default is not None:
            split = self.pan_and_scan_box.isChecked()
            if everything or split != self.pan_and_scan_default:
                out["pan_and_scan"] = split
        if self.reasoning_choice is not None:
            out["reasoning"] = self.reasoning_choice
        if self.tool_required_box.isChecked():
            out["tool_choice"] = "required"
        return out

    def set_mtp(self, available: bool, note: str = "") -> None:
        """Offer "Built-in (MTP)" only for a model that carries MTP layers; otherwise it is
        greyed out and its tooltip says why."""
        index = [mode for _, mode in SPECULATIVE].index("mtp")
        item = self.speculative_box.model().item(index)
        item.setEnabled(available)
        item.setToolTip("" if available else (note or "The loaded model has no built-in MTP layers."))

    def set_draft(self, name: str | None) -> None:
        """Show which draft model is loaded (None: none)."""
        self.draft_label.setText(f"Draft: {name}" if name else "No draft model")
        self.draft_clear.setVisible(bool(name))

    def set_whisper(self, path: str | None) -> None:
        """Show which Whisper model transcribes audio (None: none chosen)."""
        self.whisper_label.setText(f"Whisper: {Path(path).name}" if path else "No Whisper model")
        self.whisper_clear.setVisible(bool(path))

    def show_memory_budget(self, setting: Any, note: str = "") -> None:
        """Show a BudgetSetting (custom or automatic, bounded by the machine) without
        emitting a change."""
        self._budget_quiet = True
        total_gb = setting.total / GB if setting.total else 4096.0
        self.budget_value.setRange(MIN_BUDGET_GB, max(MIN_BUDGET_GB, round(total_gb, 2)))
        self.budget_value.setToolTip(f"At most this machine's {fmt_bytes(setting.total)}" if setting.total else "")
        self.budget_mode.setCurrentIndex(0 if setting.custom is None else 1)
        self.budget_value.setValue((setting.effective or 0) / GB)
        self.budget_value.setEnabled(setting.custom is not None)
        self._budget_quiet = False
        self.budget_note.setText(note)
        self.budget_note.setVisible(bool(note))

    def memory_budget(self) -> int | None:
        """The chosen budget in bytes; None: automatic."""
        if self.budget_mode.currentIndex() == 0:
            return None
        return int(round(self.budget_value.value() * GB))

    def _budget_mode_changed(self, index: int) -> None:
        self.budget_value.setEnabled(index == 1)
        if not self._budget_quiet:
            emit(self.memory_budget_changed, self.memory_budget())

    def _budget_edited(self, _value: float) -> None:
        if not self._budget_quiet and self.budget_mode.currentIndex() == 1:
            emit(self.memory_budget_changed, self.memory_budget())

    def _emit(self, *_args) -> None:
        if not self._loading:
            emit(self.changed, self.system_edit.toPlainText(), self.values())

    # ---- presets ---------------------------------------------------------------------

    def _read_presets(self) -> list[dict[str, Any]]:
        presets: list[dict[str, Any]] = []
        for path in (resource_path("presets.json"), self.user_presets_path):
            try:
                presets += json.loads(Path(path).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
        return presets

    def _fill_presets(self) -> None:
        self.preset_box.clear()
        self.preset_box.addItem("Preset…")
        for p in self.presets:
            self.preset_box.addItem(p.get("name", "Unnamed"))

    def _apply_preset(self, index: int) -> None:
        if index <= 0:
            return
        preset = dict(self.presets[index - 1])
        preset.pop("name", None)
        system = preset.pop("system_prompt", self.system_edit.toPlainText())
        self.load(system, {**self.values(everything=True), **preset})
        self._emit()

    def _save_preset(self) -> None:
        name, ok = QInputDialog.getText(self, "Save preset", "Preset name:")
        if ok and name.strip():
            self.save_preset(name.strip())

    def save_preset(self, name: str) -> None:
        preset = {"name": name, "system_prompt": self.system_edit.toPlainText(), **self.values(everything=True)}
        try:
            existing = json.loads(self.user_presets_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            existing = []
        existing = [p for p in existing if p.get("name") != name] + [preset]
        self.user_presets_path.write_text(json.dumps(existing, indent=2), encoding="utf-8")
        self.presets = self._read_presets()
        self._fill_presets()
