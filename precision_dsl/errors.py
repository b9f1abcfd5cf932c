"""The root of every error policyc reports to a user (one hierarchy, one CLI guard).

Every expected failure — a bad policy, model config, layout, checkpoint, a backend that cannot express the plan,
a plan-hash mismatch, non-finite weights, a refused weight update, a busy output — is a `PolicycError` subclass
carrying `code` (the exit status: 1 = valid input a consumer refuses, 2 = bad input) and `hint` (how to fix it).
`console.guard` catches exactly this class (plus OSError), so a new error type needs no CLI change, and anything
else reaching the guard is a bug that must show its traceback.

Subclasses keep their historic builtin bases too (ValueError, RuntimeError) so existing `except ValueError`
callers are unaffected.
"""

from __future__ import annotations


class PolicycError(Exception):
    code: int = 2
    hint: str = ""
