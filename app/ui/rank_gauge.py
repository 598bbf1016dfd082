"""One bar per machine while the loaded model is split across several.

Fed by the bridge's ``memory`` signal: ``ranks`` (MemoryEvent.ranks) is each rank's
weights as the engine measured them on that rank once loaded (the bytes of the arrays
it holds), with its host and layers. Each bar is that rank's weights against its room
(its machine's free memory as Machines… probed it, ``rooms``; the largest rank's weights
when unknown). Hidden when the model runs on this machine alone.
"""

from __future__ import annotations

from app.memory_units import fmt_bytes
from app.qt import QHBoxLayout, QLabel, QProgressBar, QWidget

PER_MILLE = 1000


class RankGauge(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("rankGauge")
        self._layout = QHBoxLayout(self)
        self._layout.setContentsMargins(8, 2, 8, 2)
        self._layout.setSpacing(6)
        self._layout.addWidget(QLabel("Machines", objectName="gaugeTitle"))
        self.bars: list[QProgressBar] = []
        self.ranks: list[dict] = []  # as last reported
        self.rooms: dict[int, int] = {}  # rank -> room, when known
        self.setVisible(False)

    def update_figures(self, figures: dict) -> None:
        if "ranks" not in figures:
            return
        self.ranks = [dict(r) for r in figures["ranks"] or []]
        while len(self.bars) > len(self.ranks):
            bar = self.bars.pop()
            self._layout.removeWidget(bar)
            bar.deleteLater()
        while len(self.bars) < len(self.ranks):
            bar = QProgressBar(maximum=PER_MILLE, textVisible=True)
            bar.setFixedWidth(170)
            self.bars.append(bar)
            self._layout.addWidget(bar)
        top = max((r["weight_bytes"] for r in self.ranks), default=0)
        for bar, r in zip(self.bars, self.ranks):
            room = self.rooms.get(r["rank"]) or top
            bar.setValue(int(PER_MILLE * min(1.0, r["weight_bytes"] / room)) if room else 0)
            bar.setFormat(f"rank {r['rank']} · {r['host']}: {fmt_bytes(r['weight_bytes'])}")
            layers = r.get("layers") or []
            span = f", layers {layers[0]}–{layers[1] - 1}" if len(layers) == 2 else ""
            bar.setToolTip(f"rank {r['rank']} on {r['host']}: {fmt_bytes(r['weight_bytes'])} of weights held{span}")
        self.setVisible(bool(self.ranks))

    def set_rooms(self, rooms: list[int]) -> None:
        """Each rank's room (Machines…'s free memory), the scale of its bar."""
        self.rooms = dict(enumerate(rooms))
