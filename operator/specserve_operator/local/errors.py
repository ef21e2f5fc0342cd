"""Errors a newcomer hits when starting the local fleet, each with a hint that says what to do."""

from __future__ import annotations


class LocalFleetError(Exception):
    """A problem that stops the local fleet; `hint` tells the user how to fix it."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"
