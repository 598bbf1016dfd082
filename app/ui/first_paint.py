"""When the window is up: a future resolved by the main window's first paint."""

from __future__ import annotations

import asyncio

from app.qt import (
    QApplication,
    QEvent,
    QObject,
    QTimer,
    QWidget,
)


class _FirstPaint(QObject):
    """Resolves a future when a widget of ``window`` first paints (the window is up)."""

    def __init__(self, window: QWidget, future: asyncio.Future):
        super().__init__(window)
        self.window, self.future = window, future

    def eventFilter(self, obj, event) -> bool:  # noqa: N802 - Qt override
        if (
            event.type() == QEvent.Type.Paint
            and isinstance(obj, QWidget)
            and obj.window() is self.window
            and not self.future.done()
        ):
            # Resolve after this paint has finished and been flushed to the screen.
            QTimer.singleShot(0, lambda: self.future.done() or self.future.set_result(None))
            QApplication.instance().removeEventFilter(self)
        return False


def first_paint(window: QWidget) -> asyncio.Future:
    """A future that is done once ``window`` has been painted for the first time.
    Call before ``show()``, with the asyncio loop (qasync) installed."""
    future = asyncio.get_event_loop().create_future()
    QApplication.instance().installEventFilter(_FirstPaint(window, future))
    return future
