"""Messages that name the real problem (not a neighbouring one): what a new user sees on a wrong path, an empty
task file, an inverted slice, a backend hint, a run note, a parameter count, a resumed conversion."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import StrictCliRunner

from precision_dsl.cli import app

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "precision_dsl/models/tiny-moe"
runner = StrictCliRunner()


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("path, says", [("policies", "is a directory"), ("/dev/null", "not a regular file")])
def test_plan_on_a_directory_or_device_says_what_it_is(path, says):
    r = runner.invoke(app, ["plan", path, "--model", "tiny-moe"])
    assert r.exit_code == 2 and says in _flat(r.output) and "does not exist" not in r.output, r.output


def test_verify_on_a_missing_directory_says_it_does_not_exist():
    r = runner.invoke(app, ["verify", "/nonexistent", "--source", str(TINY)])
    assert r.exit_code == 2 and "does not exist" in r.output and "policyc_plan.json" not in r.output, r.output


def test_an_empty_task_file_does_not_read_like_success(tmp_path):
    from precision_dsl.engine.task import TaskError, make_task

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(TaskError) as err:
        make_task(str(empty))
    assert "no problems found" not in str(err.value) and "empty" in str(err.value), err.value


def test_a_selector_with_a_slice_is_quoted_whole(tmp_path):
    p = tmp_path / "s.policy"
    p.write_text('policy "s" { default bf16\n layers[5:2]: mxfp8 }\n')
    r = runner.invoke(app, ["plan", str(p), "--model", "tiny-moe"])
    assert r.exit_code == 2 and "selector `layers[5:2]` matches no tensor" in r.output, r.output


def test_the_megatron_share_scale_hint_is_valid_policy_syntax(tmp_path):
    from precision_dsl.arch import load_architecture
    from precision_dsl.backends import megatron
    from precision_dsl.backends.common import UnsupportedByBackend
    from precision_dsl.resolve import resolve

    arch = load_architecture("tiny-moe")
    text = 'policy "n" { default bf16\n routed_experts: nvfp4\n'
    p = tmp_path / "n.policy"
    p.write_text(text + "}\n")
    with pytest.raises(UnsupportedByBackend) as err:
        megatron.emit(resolve(p, arch, None))
    hint = err.value.hint
    suggested = re.search(r"`(share_scale [^`]+)`", hint)
    assert suggested, hint
    p.write_text(text + f" {suggested.group(1)}\n}}\n")
    megatron.emit(resolve(p, arch, None))  # the suggestion, pasted in, is accepted


def test_the_run_note_names_the_formats_the_plan_has():
    from precision_dsl.arch import load_architecture
    from precision_dsl.engine.report import emulated_formats, numerics_note
    from precision_dsl.resolve import resolve

    arch = load_architecture("tiny-moe")
    fp8 = emulated_formats(resolve(REPO / "policies/fp8-blockwise-hopper.policy", arch, None))
    note = numerics_note(fp8)
    assert "FP8-block" in note and "MXFP8" not in note and "NVFP4" not in note, note
    mx = numerics_note(emulated_formats(resolve(REPO / "policies/mxfp8-e2e.policy", arch, None)))
    assert "MXFP8 " in mx and "NVFP4" not in mx, mx
    assert not emulated_formats(resolve(REPO / "policies/bf16.policy", arch, None))


def test_parameter_counts_use_a_unit_that_fits():
    r = runner.invoke(app, ["plan", "bf16", "--model", "tiny-moe"])
    line = next(ln for ln in r.output.splitlines() if ln.startswith("routed+shared experts"))
    assert "0.0B" not in line and re.search(r"\d\.\dM of \d\.\dM parameters", line), line
    r = runner.invoke(app, ["arch", "tiny-moe"])
    assert "0.00B" not in r.output and re.search(r"tensors, \d\.\d+M parameters", r.output), r.output
    big = runner.invoke(app, ["plan", "bf16", "--model", "deepseek-v3"])
    assert "routed+shared experts: 656.5B of 671.0B parameters (97.8%)" in big.output  # as in the README


def test_a_resumed_convert_counts_every_input_byte(tmp_path):
    from precision_dsl.arch import load_architecture
    from precision_dsl.backends import converter
    from precision_dsl.backends.synthetic import write_synthetic_checkpoint
    from precision_dsl.resolve import resolve

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    arch = load_architecture(str(src / "config.json"))
    write_synthetic_checkpoint(arch, src, shards=3, seed=1)
    (tmp_path / "p.policy").write_text('policy "p" { default bf16\n attn: mxfp8 }\n')
    plan = resolve(tmp_path / "p.policy", arch, None)

    def stop(shard):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        converter.convert(src, plan, tmp_path / "out", on_shard_done=stop)
    rep = converter.convert(src, plan, tmp_path / "out")
    assert len(rep.shards_resumed) == 1 and len(rep.shards_written) == 2
    assert rep.bytes_in == sum(t.bytes_before for t in plan.tensors)
