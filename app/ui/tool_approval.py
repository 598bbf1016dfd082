"""Asking the user about one tool call: a bar over the composer with the call and three
choices (Allow once, Always allow this tool, Deny). The chat waits until one is clicked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from app.qt import QFrame, QHBoxLayout, QLabel, QPushButton, QWidget


class ToolApprovalBar(QFrame):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent, objectName="toolApproval")
        row = QHBoxLayout(self)
        row.setContentsMargins(12, 6, 12, 6)
        self.label = QLabel("", objectName="toolApprovalText")
        self.label.setWordWrap(True)
        self.allow_button = QPushButton("Allow once")
        self.always_button = QPushButton("Always allow this tool")
        self.deny_button = QPushButton("Deny")
        row.addWidget(self.label, 1)
        for button, decision in (
            (self.allow_button, "once"),
            (self.always_button, "always"),
            (self.deny_button, "deny"),
        ):
            row.addWidget(button)
            button.clicked.connect(lambda _=False, d=decision: self._decide(d))
        self._pending: asyncio.Future | None = None
        self.setVisible(False)

    async def ask(self, server: str, tool: str, arguments: dict[str, Any]) -> str:
        """The user's decision on one call: "once", "always" or "deny"."""
        if self._pending is not None and not self._pending.done():
            self._pending.set_result("deny")  # a new question withdraws an unanswered one
        self._pending = asyncio.get_event_loop().create_future()
        args = json.dumps(arguments, ensure_ascii=False)
        self.label.setText(f"Run the tool <b>{tool}</b> from the MCP server <b>{server}</b> with {args[:300]}?")
        self.setVisible(True)
        try:
            return await self._pending
        finally:
            self.setVisible(False)

    def _decide(self, decision: str) -> None:
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(decision)

    def withdraw(self) -> None:
        """Stop asking (the reply was stopped): the call is denied."""
        self._decide("deny")
