"""engine/task.py: char tokenizer, arithmetic task + exact-match reward, dapo-style JSONL + boxed reward."""

from __future__ import annotations

import json
import random

import pytest

from precision_dsl.engine.model import bundled_model_dir
from precision_dsl.engine.task import (TINY_VOCAB, ArithmeticTask, JsonlMathTask, Problem, TaskError, last_boxed,
                                       load_tokenizer, make_task)


def test_bundled_vocab_matches_config_and_roundtrips():
    tok = load_tokenizer(bundled_model_dir("tiny-moe"))
    cfg = json.loads((bundled_model_dir("tiny-moe") / "config.json").read_text())
    assert len(tok) == len(TINY_VOCAB) == cfg["vocab_size"] == 32
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"])
    assert tok.decode(tok.encode("12+7=19")) == "12+7=19"
    assert tok.decode(tok.encode("\\boxed{42}")) == "\\boxed{42}"
    assert tok.decode(tok.encode("19") + [tok.eos_id] + tok.encode("99")) == "19"  # stops at EOS
    assert tok.decode(tok.encode("Q!")) == "??"  # unknown characters -> <unk>


def test_arithmetic_problems_and_reward():
    task = ArithmeticTask(digits=2, operators="+-*")
    probs = task.sample(random.Random(0), 200)
    for p in probs:
        a, rest = p.prompt[:-1], p.prompt[-1]
        assert rest == "="
        assert str(eval(a)) == p.answer  # noqa: S307  (test-only check of our own generated strings)
    p = Problem("12+7=", "19")
    assert task.reward(p, "19") == 1.0
    assert task.reward(p, "019") == 0.0 and task.reward(p, "") == 0.0 and task.reward(p, "1") == 0.0
    assert task.max_new_tokens >= 5  # 2-digit products have 4 digits + EOS


def test_arithmetic_is_seeded_and_validated():
    t = ArithmeticTask()
    assert t.sample(random.Random(5), 10) == t.sample(random.Random(5), 10)
    with pytest.raises(TaskError, match="digits"):
        ArithmeticTask(digits=0)
    with pytest.raises(TaskError, match="operators"):
        ArithmeticTask(operators="+/")


def test_boxed_answer():
    assert last_boxed("so \\boxed{3} or \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unclosed") is None


def test_jsonl_reader_and_reward(tmp_path):
    f = tmp_path / "dapo.jsonl"
    f.write_text(json.dumps({"prompt": "What is 6*7?", "label": "42"}) + "\n\n"
                 + json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "label": 2}) + "\n")
    task = make_task(str(f))
    assert isinstance(task, JsonlMathTask) and len(task.problems) == 2
    assert task.problems[1] == Problem("1+1?", "2")
    p = task.problems[0]
    assert task.reward(p, "thinking... \\boxed{ 42 }") == 1.0
    assert task.reward(p, "42") == 0.0  # an answer must be boxed


def test_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "x", "label": "1"}) + "\n{oops\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:2:2: invalid JSON"):
        JsonlMathTask(f)
    f.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(TaskError, match=r"bad.jsonl:1: each line needs 'prompt' and 'label'"):
        JsonlMathTask(f)
    with pytest.raises(TaskError, match="no such file"):
        JsonlMathTask(tmp_path / "missing.jsonl")
    with pytest.raises(TaskError, match="unknown task"):
        make_task("gsm8k")
