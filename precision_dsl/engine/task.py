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

    def encode_prompt(self, text: str) -> list[int]: ...

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

    def encode_prompt(self, text: str) -> list[int]:
        return [self.bos_id] + self.encode(text)

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


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TaskError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(d, dict):
        raise TaskError(f"{path}: expected a JSON object")
    return d


class HFTokenizer:
    """A checkpoint's own tokenizer: `tokenizer.json` through the `tokenizers` library, special tokens from
    `tokenizer_config.json` (falling back to config.json ids), and its `chat_template` (rendered with jinja2 in a
    sandbox, as transformers' apply_chat_template does: trim_blocks, lstrip_blocks) for prompts when present."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        try:
            self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as e:  # tokenizers raises its own exception type for malformed files
            raise TaskError(f"{model_dir / 'tokenizer.json'}: not a readable tokenizers file ({e})") from None
        tc_path, cfg_path = model_dir / "tokenizer_config.json", model_dir / "config.json"
        tc = _read_json(tc_path) if tc_path.exists() else {}
        cfg = _read_json(cfg_path) if cfg_path.exists() else {}
        self.chat_template = tc.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default") or next(iter(named.values()), None)

        def special(key: str) -> Optional[int]:
            v = tc.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str) and self.tok.token_to_id(v) is not None:
                return self.tok.token_to_id(v)
            i = cfg.get(key + "_id")
            return i[0] if isinstance(i, list) and i else i

        self.eos_token = tc.get("eos_token") if isinstance(tc.get("eos_token"), str) else None
        self.bos_token = tc.get("bos_token") if isinstance(tc.get("bos_token"), str) else None
        eos = special("eos_token")
        if eos is None:
            raise TaskError(f"{model_dir}: no eos token (hint: set eos_token in tokenizer_config.json or "
                            "eos_token_id in config.json)")
        self.eos_id: int = eos
        pad = special("pad_token")
        self.pad_id: int = eos if pad is None else pad
        self.bos_id: Optional[int] = special("bos_token")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        if self.chat_template:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            try:
                rendered = env.from_string(self.chat_template).render(
                    messages=[{"role": "user", "content": text}], add_generation_prompt=True,
                    bos_token=self.bos_token or "", eos_token=self.eos_token or "")
            except TemplateError as e:
                raise TaskError(f"chat_template: {e}") from None
            return self.encode(rendered)
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return self.tok.decode(ids, skip_special_tokens=True)

    def __len__(self) -> int:
        return self.tok.get_vocab_size()


def load_tokenizer(model_dir: Path):
    """The model directory's own tokenizer (`tokenizer.json`) if it has one, else the char tokenizer (vocab.json)."""
    if (Path(model_dir) / "tokenizer.json").exists():
        return HFTokenizer(model_dir)
    path = Path(model_dir) / "vocab.json"
    if not path.exists():
        raise TaskError(f"{path}: missing (hint: a HF checkpoint brings tokenizer.json; the bundled tiny-moe ships "
                        "a char vocab.json)")
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
        if not out:  # "no problems found" read like a clean bill of health
            raise TaskError(f"{self.path}: the task file is empty (no JSON lines) (hint: one JSON object per line "
                            "with 'prompt' and 'label', dapo-math style)")
        return out

    def sample(self, rng: random.Random, n: int) -> list[Problem]:
        return [rng.choice(self.problems) for _ in range(n)]

    def reward(self, problem: Problem, completion: str) -> float:
        got = last_boxed(completion)
        return 1.0 if got is not None and normalise_answer(got) == normalise_answer(problem.answer) else 0.0


def make_task(spec: str, digits: int = 2, operators: str = "+", max_new_tokens: Optional[int] = None) -> Task:
    if spec == "arithmetic":
        return ArithmeticTask(digits=digits, operators=operators, max_new_tokens=max_new_tokens)
    if spec.endswith(".jsonl"):
        return JsonlMathTask(Path(spec), **({"max_new_tokens": max_new_tokens} if max_new_tokens else {}))
    raise TaskError(f"unknown task {spec!r} (hint: --task arithmetic or --task PATH.jsonl)")
