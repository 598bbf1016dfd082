"""Light and dark themes that follow the system's colour scheme."""

from __future__ import annotations

from app.qt import QApplication, QGuiApplication, Qt
from app.resources import resource_path

LIGHT = {
    "bg": "#ffffff",
    "sidebar": "#f6f7f9",
    "panel": "#ffffff",
    "field": "#ffffff",
    "text": "#1d2129",
    "muted": "#6b7280",
    "border": "#e4e7ec",
    "hover": "#eceef2",
    "selected": "#e3e9ff",
    "accent": "#3b6cf6",
    "accenthover": "#2f5be0",
    "danger": "#e5484d",
    "userbubble": "#eef2ff",
    "code": "#f7f8fa",
    "codeheader": "#eef0f3",
    "scroll": "#cfd4dc",
}
DARK = {
    "bg": "#17181c",
    "sidebar": "#1e2025",
    "panel": "#1e2025",
    "field": "#24262c",
    "text": "#e6e8ec",
    "muted": "#9097a3",
    "border": "#2f323a",
    "hover": "#2a2d34",
    "selected": "#2c3550",
    "accent": "#5b84ff",
    "accenthover": "#4a73ee",
    "danger": "#f2555a",
    "userbubble": "#262c3d",
    "code": "#1b1d22",
    "codeheader": "#23252b",
    "scroll": "#3a3e47",
}


def is_dark() -> bool:
    hints = QGuiApplication.styleHints()
    return hints.colorScheme() == Qt.ColorScheme.Dark


def style_sheet(dark: bool) -> str:
    colours = DARK if dark else LIGHT
    qss = resource_path("style.qss").read_text(encoding="utf-8")
    # Longest names first so "@accenthover" is not eaten by "@accent".
    for name in sorted(colours, key=len, reverse=True):
        qss = qss.replace("@" + name, colours[name])
    return qss.replace("@icons", resource_path("icons").as_posix())


def apply_theme(app: QApplication) -> bool:
    """Style the app for the current system scheme; returns whether it is dark."""
    dark = is_dark()
    app.setStyle("Fusion")
    app.setStyleSheet(style_sheet(dark))
    return dark
