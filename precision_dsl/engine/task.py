"""Verifiable tasks for the embedded RL loop, and the tokenizer they use.

* `ArithmeticTask` (bundled): prompts like `12+7=`, answer `19`, exact-match reward on the decoded completion
  (up to EOS). Difficulty: number of digits per operand and the operator set.
* `JsonlMathTask`: dapo-math-17k style JSONL (`prompt`, `label` per line); reward 1 if the last `\\boxed{...}` in
  the completion equals the label (whitespace-insensitive), else 0.

`CharTokenizer` maps characters to ids from the model directory's `vocab.json` (a JSON list; index = id).
The bundled tiny-moe vocabulary has 32 entries: <pad> <bos> <eos> <unk>, digits, operators and the characters of
`\\boxed{}`; anything else encodes as <unk> (a real checkpoint brings its own HF tokenizer, see `load_tokenizer`).
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Sequence

TINY_VOCAB: tuple[str, ...] = (
    "<pad>", "<bos>", "<eos>", "<unk>",
    "0", "1", "2", "3", "4", "5", "6", "7", "8", "9",
    "+", "-", "*", "/", "=", " ", "(", ")", "{", "}", "\\", ".", ",",
    "b", "o", "x", "e", "d",
)
from ..errors import PolicycError


class TaskError(PolicycError, ValueError):
    """Bad task input (file:line and a hint in the message)."""


class Tokenizer(Protocol):
    pad_id: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class CharTokenizer:
    def __init__(self, vocab: Sequence[str]):
        self.vocab = list(vocab)
        self.index = {t: i for i, t in enumerate(self.vocab)}
        for special in ("<pad>", "<bos>", "<eos>", "<unk>"):
            if special not in self.index:
                raise TaskError(f"vocab lacks {special!r} (hint: vocab.json must contain <pad> <bos> <eos> <unk>)")
        self.pad_id, self.bos_id = self.index["<pad>"], self.index["<bos>"]
        self.eos_id, self.unk_id = self.index["<eos>"], self.index["<unk>"]

    def encode(self, text: str) -> list[int]:
        return [self.index.get(c, self.unk_id) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            tok = self.vocab[i] if 0 <= i < len(self.vocab) else "<unk>"
            if tok in ("<pad>", "<bos>"):
                continue
            out.append("?" if tok == "<unk>" else tok)
        return "".join(out)

    def __len__(self) -> int:
        return len(self.vocab)


def load_tokenizer(model_dir: Path) -> CharTokenizer:
    path = Path(model_dir) / "vocab.json"
    if not path.exists():
        raise TaskError(f"{path}: missing (hint: the embedded engine's char tokenizer needs vocab.json; the bundled "
                        "tiny-moe ships one)")
    try:
        vocab = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TaskError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(vocab, list) or not all(isinstance(v, str) for v in vocab):
        raise TaskError(f"{path}: expected a JSON list of token strings")
    return CharTokenizer(vocab)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class Task(Protocol):
    name: str
    max_new_tokens: int

    def sample(self, rng: random.Random, n: int) -> list[Problem]: ...

    def reward(self, problem: Problem, completion: str) -> float: ...


# ---------------------------------------------------------------------------------------------------------------
class ArithmeticTask:
    """`a op b =` with operands of 1..`digits` digits; `+`, `-` (answers may be negative) and `*`."""

    def __init__(self, digits: int = 2, operators: str = "+", max_new_tokens: Optional[int] = None):
        if digits < 1 or digits > 6:
            raise TaskError(f"arithmetic digits must be 1..6, got {digits}")
        bad = set(operators) - set("+-*")
        if not operators or bad:
            raise TaskError(f"arithmetic operators must be a non-empty subset of '+-*', got {operators!r}")
        self.digits, self.operators = digits, operators
        self.name = f"arithmetic(digits={digits},ops={operators})"
        longest = 2 * digits + 1 if "*" in operators else digits + 2  # sign or carry, + EOS
        self.max_new_tokens = max_new_tokens or longest + 1

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        hi = 10 ** self.digits - 1
        out = []
        for _ in range(n):
            a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.operators)
            val = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(Problem(prompt=f"{a}{op}{b}=", answer=str(val)))
        return out

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion.strip() == problem.answer else 0.0


# ---------------------------------------------------------------------------------------------------------------
_BOXED = re.compile(r"\\boxed\{")


def last_boxed(text: str) -> Optional[str]:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    i, depth = starts[-1], 1
    j = i
    while j < len(text):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
        j += 1
    return None


def normalise_answer(s: str) -> str:
    return "".join(s.split()).rstrip(".")


class JsonlMathTask:
    """dapo-math-17k style: one JSON object per line with `prompt` (str, or a chat list whose last `content` is
    used) and `label`. Problems are sampled with replacement from the file."""

    def __init__(self, path: Path, max_new_tokens: int = 64):
        self.path = Path(path)
        self.name = f"jsonl({self.path.name})"
        self.max_new_tokens = max_new_tokens
        self.problems = self._read()

    def _read(self) -> list[Problem]:
        if not self.path.exists():
            raise TaskError(f"{self.path}: no such file (hint: --task arithmetic or a dapo-math style .jsonl)")
        out = []
        for ln, line in enumerate(self.path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{self.path}:{ln}:{e.colno}: invalid JSON: {e.msg}") from None
            if not isinstance(obj, dict) or "prompt" not in obj or "label" not in obj:
                raise TaskError(f"{self.path}:{ln}: each line needs 'prompt' and 'label' keys")
            prompt = obj["prompt"]
            if isinstance(prompt, list):  # chat format: [{"role": ..., "content": ...}, ...]
                try:
                    prompt = prompt[-1]["content"]
                except (IndexError, KeyError, TypeError):
                    raise TaskError(f"{self.path}:{ln}: chat-style prompt needs a last message with 'content'") \
                        from None
            if not isinstance(prompt, str):
                raise TaskError(f"{self.path}:{ln}: 'prompt' must be a string or a chat message list")
            out.append(Problem(prompt=prompt, answer=str(obj["label"])))
        if not out:
            raise TaskError(f"{self.path}: no problems found")
        return out

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [rng.choice(self.problems) for _ in range(n)]

    def reward(self, problem: Problem, completion: str) -> float:
        got = last_boxed(completion)
        return 1.0 if got is not None and normalise_answer(got) == normalise_answer(problem.answer) else 0.0


def make_task(spec: str, digits: int = 2, operators: str = "+") -> Task:
    if spec == "arithmetic":
        return ArithmeticTask(digits=digits, operators=operators)
    if spec.endswith(".jsonl"):
        return JsonlMathTask(Path(spec))
    raise TaskError(f"unknown task {spec!r} (hint: --task arithmetic or --task PATH.jsonl)")
