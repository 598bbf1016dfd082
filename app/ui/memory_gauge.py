"""Always-visible memory gauge: weights | KV cache | other active | MLX cache, vs budget."""

from __future__ import annotations

from app.qt import QColor, QHBoxLayout, QLabel, QPainter, QRectF, QSize, Qt, QWidget

GB = 1024**3

SEGMENTS = (  # (key, colour, label)
    ("weights", "#4f7cff", "weights"),
    ("kv", "#9b5cff", "KV cache"),
    ("other", "#2bb5a0", "other active"),
    ("cache", "#9aa3b2", "MLX cache"),
)


def fmt_bytes(n: float) -> str:
    if n >= GB:
        return f"{n / GB:.1f} GB"
    if n >= 1024**2:
        return f"{n / 1024**2:.0f} MB"
    return f"{n / 1024:.0f} KB"


class _Bar(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.parts: dict[str, float] = {}
        self.budget = 0.0
        self.peak = 0.0
        self.warn = False
        self.setFixedHeight(10)
        self.setMinimumWidth(160)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(200, 10)

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt override
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(self.palette().mid().color().lighter(130))
        p.drawRoundedRect(r, 4, 4)
        if self.budget > 0:
            x = r.left()
            for key, colour, _ in SEGMENTS:
                w = r.width() * min(1.0, self.parts.get(key, 0) / self.budget)
                w = min(w, r.right() - x)
                if w > 0:
                    p.setBrush(QColor("#e5484d") if self.warn and key == "kv" else QColor(colour))
                    p.drawRect(QRectF(x, r.top(), w, r.height()))
                    x += w
            if self.peak:
                px = r.left() + r.width() * min(1.0, self.peak / self.budget)
                p.setPen(self.palette().text().color())
                p.drawLine(int(px), int(r.top()), int(px), int(r.bottom()))
        p.end()


class MemoryGauge(QWidget):
    """Fed by the bridge's ``memory`` signal and by the loaded model's memory plan."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("memoryGauge")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 0, 8, 0)
        layout.setSpacing(8)
        layout.addWidget(QLabel("Memory", objectName="gaugeTitle"))
        self.bar = _Bar()
        layout.addWidget(self.bar)
        self.label = QLabel("no model loaded", objectName="gaugeText")
        layout.addWidget(self.label)
        self.figures: dict[str, int] = {}
        self.kv_per_token = 0
        self.warning = ""

    def set_plan(self, plan) -> None:
        """Take weights, KV bytes per token, budget and machine total from a MemoryPlan."""
        if plan is None:
            return
        self.kv_per_token = plan.kv_bytes_per_token
        self.update_figures({
            **self.figures, "weights_bytes": plan.weights_bytes,
            "budget_bytes": plan.budget_bytes, "total_bytes": plan.total_bytes,
        })

    def update_figures(self, figures: dict) -> None:
        self.figures = {**self.figures, **figures}
        f = self.figures
        active, weights, kv = f.get("active_bytes", 0), f.get("weights_bytes", 0), f.get("kv_bytes", 0)
        budget = f.get("budget_bytes") or f.get("total_bytes") or 0
        self.bar.budget = budget
        self.bar.peak = f.get("peak_bytes", 0)
        self.bar.parts = {
            "weights": weights, "kv": kv,
            "other": max(0, active - weights - kv), "cache": f.get("cache_bytes", 0),
        }
        used = max(active, weights + kv)
        self.label.setText(f"{fmt_bytes(used)} / {fmt_bytes(budget)}" if budget else "—")
        self.setToolTip("\n".join([
            f"MLX active: {fmt_bytes(active)}",
            f"MLX cache: {fmt_bytes(f.get('cache_bytes', 0))}",
            f"Peak: {fmt_bytes(f.get('peak_bytes', 0))}",
            f"Weights: {fmt_bytes(weights)}",
            f"KV cache: {fmt_bytes(kv)}",
            f"Budget: {fmt_bytes(budget)}",
            f"Machine: {fmt_bytes(f.get('total_bytes', 0))}",
        ] + ([self.warning] if self.warning else [])))
        self.bar.update()

    def check_context(self, context_tokens: int) -> str:
        """Warn when a conversation of this many tokens would overflow the budget."""
        f = self.figures
        budget = f.get("budget_bytes", 0)
        need = f.get("weights_bytes", 0) + self.kv_per_token * context_tokens
        warn = bool(budget and self.kv_per_token and need > 0.9 * budget)
        self.warning = (
            f"This conversation needs about {fmt_bytes(need)}, near the {fmt_bytes(budget)} "
            "budget: start a new chat or load a smaller model." if warn else ""
        )
        self.bar.warn = warn
        self.label.setProperty("warn", "true" if warn else "false")
        self.label.style().unpolish(self.label)
        self.label.style().polish(self.label)
        self.update_figures({})
        return self.warning
