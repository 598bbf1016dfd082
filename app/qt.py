"""The one module that imports Qt (PySide6) for the rest of the app.

Keeping the binding behind one name means a switch of binding, or a shim for an
older PySide6, touches one file.
"""

from __future__ import annotations

import ctypes
import sys

from PySide6 import QtCore, QtGui, QtWidgets
from PySide6.QtCore import (
    QBuffer,
    QByteArray,
    QEvent,
    QIODevice,
    QMimeData,
    QObject,
    QPoint,
    QPointF,
    QRectF,
    QSize,
    QStandardPaths,
    Qt,
    QTimer,
    QUrl,
    Signal,
    Slot,
    qFormatLogMessage,
    qInstallMessageHandler,
)
from PySide6.QtGui import (
    QAction,
    QColor,
    QDesktopServices,
    QDropEvent,
    QFileOpenEvent,
    QFont,
    QFontDatabase,
    QGuiApplication,
    QIcon,
    QImage,
    QImageReader,
    QKeySequence,
    QPainter,
    QPainterPath,
    QPalette,
    QPen,
    QPixmap,
    QShortcut,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
)
from PySide6.QtNetwork import QLocalServer, QLocalSocket
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QFrame,
    QHBoxLayout,
    QHeaderView,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QSpinBox,
    QSplitter,
    QStatusBar,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QTextBrowser,
    QTextEdit,
    QToolButton,
    QVBoxLayout,
    QWidget,
    QWidgetAction,
)
from shiboken6 import isValid  # whether a Qt object still exists (work that ends late checks it)


def _emit_drops_a_reference() -> bool:
    """PySide6 6.12's SignalInstance.emit returns True without owning a reference, so
    every Python-side emit takes one reference from the True singleton and a busy app
    aborts ("bool_dealloc"). Probe once; ``emit`` below pays the reference back."""

    class _Probe(QObject):
        ping = Signal()

    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(16):
        probe.ping.emit()
    return before - sys.getrefcount(True) >= 16


_EMIT_DROPS_REF = _emit_drops_a_reference()
_incref = ctypes.pythonapi.Py_IncRef
_incref.argtypes = [ctypes.py_object]
_incref.restype = None


def emit(signal, *args) -> None:
    """``signal.emit(*args)``, safe from the reference bug above. Use it for every emit."""
    result = signal.emit(*args)
    if _EMIT_DROPS_REF and (result is True or result is False):
        _incref(result)


def _void_call_drops_a_reference() -> bool:
    """The same bug in a wider form: PySide6 6.12 returns None from every C++ void method
    (``setText``, ``hide``, ...) without a reference, and qasync's thread-safe wake-up emits
    without paying True back. Each call takes one reference from None, so an app that sets
    labels often aborts ("none_dealloc") once the calls outrun the references the rest of the
    program holds. Probe once."""
    probe = QObject()
    before = sys.getrefcount(None)
    for _ in range(16):
        probe.setObjectName("probe")
    return before - sys.getrefcount(None) >= 16


if _void_call_drops_a_reference() and sys.version_info < (3, 12):
    # Python 3.12 made these singletons immortal (their count is never checked); do the same
    # here: a count no run can spend (2**40 calls). The count is the object's first field.
    for _singleton in (None, True, False):
        ctypes.c_ssize_t.from_address(id(_singleton)).value += 1 << 40


# Qt messages that say nothing to a user: the offscreen platform (smoke tests, CI) cannot
# resize windows to their size hints, and says so for every window shown.
_NOISE = ("This plugin does not support propagateSizeHints()",)


def quiet_platform_noise() -> None:
    """Drop the known-harmless platform messages above; print every other as Qt would."""
    default = qInstallMessageHandler(None)

    def handler(mode, context, message):
        if message in _NOISE:
            return
        if default is not None:
            default(mode, context, message)
        else:  # Qt's own handler: honour QT_MESSAGE_PATTERN as it would
            sys.stderr.write(qFormatLogMessage(mode, context, message) + "\n")
            sys.stderr.flush()

    qInstallMessageHandler(handler)


__all__ = [name for name in dir() if not name.startswith("_")]
