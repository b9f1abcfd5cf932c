"""The one error type the architecture catalog raises for bad input (never a raw KeyError / traceback)."""

from __future__ import annotations
from ..errors import PolicycError


class ArchitectureError(PolicycError, ValueError):
    """A model config could not be turned into an Architecture.

    `message` says what is wrong and where (file, field); `hint` says how to fix it. `str(err)` shows both, so a CLI
    can print it as is.
    """

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message
