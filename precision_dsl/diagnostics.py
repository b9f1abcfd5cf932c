"""User-facing errors and diagnostics of the policy language.

`PolicyError` is the ONLY exception the language front half (parser, imports, resolver) lets escape for bad input.
It renders like a compiler error, in plain text (the CLI adds colour):

    policies/x.policy:4:21: error: unknown format 'nvfp5'
        4 |     routed_experts: nvfp5(act_scale=per_token)
          |                     ^^^^^
    hint: did you mean 'nvfp4'?

`Diagnostic` is what `checks.check()` returns for model / parallel-layout problems of a resolved plan.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Literal, Optional

from pydantic import BaseModel, ConfigDict
from .errors import PolicycError


class Span(BaseModel):
    """A source location (1-based, inclusive start). Defined here, not in lang.ast, so that the language imports
    its diagnostics and never the other way round."""

    model_config = ConfigDict(frozen=True)

    file: str
    line: int  # 1-based
    col: int  # 1-based
    end_line: int
    end_col: int


class PolicyError(PolicycError):
    """A policy-level error with a source location. `span` may be None for errors that have no location
    (e.g. a missing root file); `source` is the text of `span.file` (for the caret line); `notes` are extra lines
    such as "imported from a.policy:3:5"."""

    def __init__(self, message: str, span: Optional[Span] = None, hint: str = "", source: Optional[str] = None,
                 notes: Iterable[str] = ()):
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint
        self.source = source
        self.notes = tuple(notes)

    def with_note(self, note: str) -> "PolicyError":
        self.notes = self.notes + (note,)
        return self

    @property
    def location(self) -> str:
        if self.span is None:
            return ""
        return f"{self.span.file}:{self.span.line}:{self.span.col}"

    def render(self) -> str:
        """Plain-text rendering: `file:line:col: error: message`, the offending line, a caret under the span and
        a `hint:` line. Never raises (used on every error path)."""
        head = f"{self.location}: error: {self.message}" if self.span else f"error: {self.message}"
        lines = [head]
        line_text = _source_line(self.source, self.span)
        if self.span is not None and line_text is not None:
            number = str(self.span.line)
            gutter = " " * len(number)
            start = max(self.span.col, 1)
            if self.span.end_line == self.span.line and self.span.end_col > start:
                width = self.span.end_col - start
            else:  # multi-line or empty span: underline to the end of the line (at least one caret)
                width = max(len(line_text.rstrip()) - start + 1, 1)
            width = max(1, min(width, max(len(line_text) - start + 1, 1)))
            # keep tabs so the caret lines up with the source line in a terminal
            pad = "".join(c if c == "\t" else " " for c in line_text[: start - 1])
            lines.append(f"  {number} | {line_text}")
            lines.append(f"  {gutter} | {pad}{'^' * width}")
        for note in self.notes:
            lines.append(f"note: {note}")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _source_line(source: Optional[str], span: Optional[Span]) -> Optional[str]:
    if source is None or span is None:
        return None
    lines = source.splitlines()
    if 1 <= span.line <= len(lines):
        return lines[span.line - 1].rstrip("\r\n")
    if span.line == len(lines) + 1:  # error at end of file
        return ""
    return None


def did_you_mean(word: str, candidates: Iterable[str], what: str = "") -> str:
    """A 'did you mean' hint, or a list of valid choices when nothing is close."""
    cands = sorted(set(candidates))
    close = difflib.get_close_matches(word, cands, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    shown = ", ".join(cands[:24]) + (", ..." if len(cands) > 24 else "")
    return f"valid {what + ' ' if what else ''}values: {shown}"


class Diagnostic(BaseModel):
    """One finding of a static check on a resolved plan. `message` always names the tensor (HF name) when the
    finding is about tensors; `tensor` repeats the first such name for machine consumers."""

    model_config = ConfigDict(frozen=True)

    severity: Literal["error", "warning"]
    code: str  # stable id, e.g. "block-divisibility", "fused-siblings", "hardware", "etp-mismatch"
    message: str
    hint: str = ""
    tensor: Optional[str] = None

    def render(self) -> str:
        s = f"{self.severity}[{self.code}]: {self.message}"
        if self.hint:
            s += f"\nhint: {self.hint}"
        return s
