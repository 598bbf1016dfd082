"""Always-visible memory gauge: weights | KV cache | other active | MLX cache, vs budget.

The budget is what the engine enforces: the label shows the KV caches against what the
budget leaves them beside the weights (MemoryEvent.kv_allowance_bytes), and the tooltip
says what happens at the limit.

Fed by the bridge's ``memory`` signal (MemoryEvent figures, live while generating)
and by the loaded model's memory plan (weights, KV bytes per token, budget). It
also projects the next reply: weights + the plan's KV cache for context + max tokens
(full-attention layers grow with every token, sliding-window layers stop at their
window). When
that nears the budget the gauge turns amber, when it passes it red, and
``check_context`` returns a warning for the status bar.
"""

from __future__ import annotations

from app.memory_units import fmt_bytes, machine_memory
from app.qt import QColor, QHBoxLayout, QLabel, QPainter, QPen, QRectF, QSize, Qt, QWidget

SEGMENTS = (  # (key, colour, label)
    ("weights", "#4f7cff", "weights"),
    ("kv", "#9b5cff", "KV cache"),
    ("other", "#2bb5a0", "other active"),
    ("cache", "#9aa3b2", "MLX cache"),
)
LEVEL_COLOURS = {"ok": "", "amber": "#f5a524", "red": "#e5484d"}
AMBER_AT = 0.85  # of the budget, for the projected need of the next reply


class _Bar(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.parts: dict[str, float] = {}
        self.budget = 0.0
        self.peak = 0.0
        self.projected = 0.0
        self.level = "ok"
        self.setFixedHeight(16)
        self.setMinimumWidth(240)

    def sizeHint(self) -> QSize:  # noqa: N802 - Qt override
        return QSize(280, 16)

    def paintEvent(self, _event) -> None:  # noqa: N802 - Qt override
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        r = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        warn = LEVEL_COLOURS[self.level]
        track = self.palette().mid().color()
        track.setAlpha(70)
        p.setPen(QPen(QColor(warn), 1.5) if warn else Qt.PenStyle.NoPen)
        p.setBrush(track)
        p.drawRoundedRect(r, 5, 5)
        if self.budget > 0:
            inner = r.adjusted(1.5, 1.5, -1.5, -1.5)
            x = inner.left()
            p.setPen(Qt.PenStyle.NoPen)
            for key, colour, _ in SEGMENTS:
                w = inner.width() * min(1.0, self.parts.get(key, 0) / self.budget)
                w = min(w, inner.right() - x)
                if w > 0:
                    p.setBrush(QColor(warn) if warn and key == "kv" else QColor(colour))
                    # A sliver stays visible even when a small model is a speck of the budget.
                    p.drawRoundedRect(QRectF(x, inner.top(), max(w, 3.0), inner.height()), 3, 3)
                    x += w
            text = self.palette().text().color()
            if self.peak:
                px = inner.left() + inner.width() * min(1.0, self.peak / self.budget)
                p.setPen(QPen(text, 1.5))
                p.drawLine(int(px), int(r.top()), int(px), int(r.bottom()))
            if self.projected:
                # Where the next reply would take memory: a dashed tick.
                px = inner.left() + inner.width() * min(1.0, self.projected / self.budget)
                pen = QPen(QColor(warn) if warn else text, 1.5, Qt.PenStyle.DotLine)
                p.setPen(pen)
                p.drawLine(int(px), int(r.top()), int(px), int(r.bottom()))
        p.end()


class MemoryGauge(QWidget):
    """Fed by the bridge's ``memory`` signal and by the loaded model's memory plan."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("memoryGauge")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(8, 2, 8, 2)
        layout.setSpacing(8)
        layout.addWidget(QLabel("Memory", objectName="gaugeTitle"))
        self.bar = _Bar()
        layout.addWidget(self.bar)
        self.label = QLabel("", objectName="gaugeText")
        layout.addWidget(self.label)
        total = machine_memory()
        self.figures: dict[str, int] = {"total_bytes": total} if total else {}
        self.plan = None  # the loaded model's MemoryPlan
        self.kv_per_token = 0
        self.context_tokens = 0
        self.max_tokens = 0
        self.level = "ok"
        self.warning = ""
        self.next_budget = 0  # the budget Settings gives the next load
        self.update_figures({})

    def set_plan(self, plan) -> None:
        """Take weights, the KV cache's growth, budget and machine total from a MemoryPlan."""
        if plan is None:
            return
        self.plan = plan
        self.kv_per_token = plan.kv_bytes_per_token
        self.update_figures(
            {
                "weights_bytes": plan.weights_bytes,
                "budget_bytes": plan.budget_bytes,
                "total_bytes": plan.total_bytes,
            }
        )

    def set_next_budget(self, budget: int) -> None:
        """The budget chosen in Settings: shown while no model is loaded, and in the tooltip
        when the loaded model runs under another one."""
        self.next_budget = int(budget or 0)
        self.update_figures({})

    def clear_model(self) -> None:
        """No model is loaded any more: drop its figures, keep the machine's."""
        self.plan = None
        self.kv_per_token = 0
        self.figures = {k: v for k, v in self.figures.items() if k == "total_bytes"}
        self.check_context(0, 0)

    def update_figures(self, figures: dict) -> None:
        # A zero from a MemoryEvent sent before a load must not erase the plan's figures.
        self.figures = {
            **self.figures,
            **{k: v for k, v in figures.items() if v or k in ("kv_bytes", "active_bytes", "kv_pool")},
        }
        f = self.figures
        active, weights, kv = f.get("active_bytes", 0), f.get("weights_bytes", 0), f.get("kv_bytes", 0)
        cache, peak, total = f.get("cache_bytes", 0), f.get("peak_bytes", 0), f.get("total_bytes", 0)
        budget = f.get("budget_bytes") or 0
        # What the engine enforces for KV caches: the budget less the weights.
        allowance = f.get("kv_allowance_bytes") or (max(0, budget - weights) if budget else 0)
        self.bar.budget = budget
        self.bar.peak = peak
        self.bar.projected = self.projected_need() if self.plan is not None else 0
        self.bar.parts = {"weights": weights, "kv": kv, "other": max(0, active - weights - kv), "cache": cache}
        used = max(active, weights + kv)
        slab = f.get("expert_slab_bytes", 0)
        extras = f"  ·  experts {fmt_bytes(slab)} slab, {f.get('expert_hit_rate', 1.0):.0%} hits" if slab else ""
        pool = f.get("kv_pool")
        if pool:
            extras += f"  ·  KV blocks {pool['used']} ({pool['shared']} shared)"
        if budget:
            self.label.setText(
                f"weights {fmt_bytes(weights)}  ·  KV {fmt_bytes(kv)} of {fmt_bytes(allowance)}  ·  "
                f"{fmt_bytes(used)} of {fmt_bytes(budget)}{extras}"
            )
        else:
            parts = ["no model"]
            if self.next_budget:
                parts.append(f"budget {fmt_bytes(self.next_budget)}")
            if total:
                parts.append(f"{fmt_bytes(total)} machine")
            self.label.setText("  ·  ".join(parts))
        lines = [
            f"MLX active: {fmt_bytes(active)}  (weights {fmt_bytes(weights)}, "
            f"KV cache {fmt_bytes(kv)}, other {fmt_bytes(max(0, active - weights - kv))})",
            f"MLX cache: {fmt_bytes(cache)}",
            f"Peak: {fmt_bytes(peak)}",
            f"Budget: {fmt_bytes(budget)}"
            if budget
            else f"Budget: {fmt_bytes(self.next_budget)} when a model loads"
            if self.next_budget
            else "Budget: set when a model loads",
            f"Machine: {fmt_bytes(total)}",
        ]
        if slab:
            lines.append(
                f"Experts: {fmt_bytes(slab)} of them held (part of the weights); the others are read from "
                f"the model's files when routed. {f.get('expert_hit_rate', 1.0):.1%} of routed experts were held."
            )
        if pool:
            lines.append(
                f"KV blocks of {pool['block_size']} tokens: {pool['used']} held by chats and requests, "
                f"{pool['shared']} of them shared by several (a common start held once), {pool['cached']} "
                f"kept for reuse; {fmt_bytes(pool['bytes'])} in all."
            )
        if budget:
            lines.append(
                f"The budget is enforced. A model that does not fit in it is refused before it loads. "
                f"Chats' KV caches may hold {fmt_bytes(allowance)} beside the weights: past that, the "
                "least recently used other chats give back their caches and re-read their messages "
                "on their next turn (slower, same answers)."
            )
        if budget and self.next_budget and self.next_budget != budget:
            lines.append(f"Next load: {fmt_bytes(self.next_budget)} (chosen in Settings)")
        if self.plan is not None:
            windows = getattr(self.plan, "kv_window_bytes", 0)
            growth = f"KV per token: {fmt_bytes(self.kv_per_token)}"
            if windows:
                growth += f" (sliding windows: {fmt_bytes(windows)} at most)"
            lines.append(
                f"{growth}; next reply ({self.context_tokens:,} + {self.max_tokens:,} tokens) "
                f"needs about {fmt_bytes(self.projected_need())}"
            )
        if self.warning:
            lines.append(self.warning)
        self.setToolTip("\n".join(lines))
        self.bar.update()

    def projected_need(self) -> int:
        """Weights plus the KV cache of the context and the whole next reply."""
        tokens = self.context_tokens + self.max_tokens
        kv = self.plan.kv_bytes(tokens) if self.plan is not None else 0
        return self.figures.get("weights_bytes", 0) + kv

    def check_context(self, context_tokens: int, max_tokens: int = 0) -> str:
        """Project the next reply (``context_tokens`` so far plus up to ``max_tokens``) against
        the budget. Sets the level ("ok", "amber", "red"); returns a warning line or ""."""
        self.context_tokens, self.max_tokens = max(0, context_tokens), max(0, max_tokens)
        budget = self.figures.get("budget_bytes", 0)
        need = self.projected_need()
        level = "ok"
        if budget and self.plan is not None:
            level = "red" if need > budget else "amber" if need > AMBER_AT * budget else "ok"
        self.level = self.bar.level = level
        tokens = self.context_tokens + self.max_tokens
        if level == "red":
            self.warning = (
                f"The next reply may not fit in memory: {tokens:,} tokens need about "
                f"{fmt_bytes(need)}, over the {fmt_bytes(budget)} budget. Start a new "
                "chat, lower Max tokens or load a smaller model."
            )
        elif level == "amber":
            self.warning = (
                f"This conversation is nearing the memory budget: {tokens:,} tokens "
                f"need about {fmt_bytes(need)} of {fmt_bytes(budget)}."
            )
        else:
            self.warning = ""
        self.label.setProperty("level", level)
        self.label.style().unpolish(self.label)
        self.label.style().polish(self.label)
        self.update_figures({})
        return self.warning
