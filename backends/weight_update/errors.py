"""The weight update's errors: every refusal and failure of the update path is a WeightUpdateError (a PolicycError
with a hint)."""

from __future__ import annotations

from typing import Optional

from precision_dsl.errors import PolicycError


class WeightUpdateError(PolicycError, RuntimeError):
    code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


class WeightUpdateMismatch(WeightUpdateError):
    """The receiver does not hold what the sender sent (equality check)."""


class WeightUpdateAborted(WeightUpdateError):
    """The update stopped part-way; the consumer did not apply it (or was rolled back: see `served_version`)."""

    def __init__(self, message: str, hint: str = "", served_version: Optional[str] = None):
        super().__init__(message, hint or "the rollout keeps serving its previous weights; fix the cause and resend")
        self.served_version = served_version
