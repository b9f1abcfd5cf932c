"""A hostile-input corpus the test generates: damaged safetensors headers, indexes and config.json files, damaged
converted outputs for `verify`, markup in user text, non-finite casts. Every case must end in a PolicycError (the
one error hierarchy; at the CLI: `error:` + exit code) or a clean result, never any other exception. CLI runs use
catch_exceptions=False (tests/conftest.py), so an uncaught exception fails the test.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from conftest import StrictCliRunner

from precision_dsl.arch import load_architecture
from precision_dsl.backends import converter
from precision_dsl.backends.safetensors_io import read_header
from precision_dsl.backends.synthetic import write_synthetic_checkpoint
from precision_dsl.cli import app
from precision_dsl.errors import PolicycError
from precision_dsl.resolve import resolve

REPO = Path(__file__).resolve().parents[1]
MICRO = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def st_file(header_json: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header_json)) + header_json + data


def _t(shape=(2,), off=(0, 4), dtype="BF16"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(off)}


HEADERS = {
    "deep-nesting": b"[" * 50_000 + b"]" * 50_000,
    "5000-digit-offset": b'{"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, ' + b"9" * 5000 + b"]}}",
    "huge-int-shape": json.dumps({"a": _t(shape=(2**70,))}).encode(),
    "duplicate-names": b'{"a": ' + json.dumps(_t()).encode() + b', "a": ' + json.dumps(_t()).encode() + b"}",
    "not-an-object": b"[1, 2, 3]",
    "metadata-not-str": json.dumps({"__metadata__": {"x": 1}, "a": _t()}).encode(),
    "nan-constant": b'{"a": {"dtype": "BF16", "shape": [NaN], "data_offsets": [0, 4]}}',
    "invalid-utf8": b'{"\xff\xfe": 1}',
    "bool-shape": json.dumps({"a": _t(shape=(True, 2))}).encode(),
    "float-offsets": json.dumps({"a": _t(off=(0.0, 4.0))}).encode(),
    "unknown-dtype": json.dumps({"a": _t(dtype="Q8")}).encode(),
    "overlap": json.dumps({"a": _t(), "b": _t()}).encode(),
    "entry-not-dict": b'{"a": [1, 2]}',
    "extra-key": json.dumps({"a": {**_t(), "evil": 1}}).encode(),
    "empty": b"",
    "truncated-json": b'{"a": {"dtype": "BF1',
}


@pytest.mark.parametrize("kind", sorted(HEADERS))
def test_hostile_safetensors_headers(tmp_path, kind):
    p = tmp_path / "x.safetensors"
    p.write_bytes(st_file(HEADERS[kind], b"\0" * 8))
    with pytest.raises(PolicycError):
        read_header(p)


def test_header_length_lies(tmp_path):
    p = tmp_path / "x.safetensors"
    for raw in (struct.pack("<Q", 2**63) + b"{}", struct.pack("<Q", 100) + b"{}", b"\x01\x02"):
        p.write_bytes(raw)
        with pytest.raises(PolicycError):
            read_header(p)


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    d = tmp_path_factory.mktemp("micro")
    (d / "config.json").write_text(json.dumps(MICRO))
    (d / "bf16.policy").write_text('policy "bf16" { default bf16 }\n')
    (d / "fp16.policy").write_text('policy "fp16" { default fp16 }\n')
    (d / "mx.policy").write_text('policy "mx" { default bf16\n attn: mxfp8 }\n')
    return d


@pytest.fixture(scope="module")
def src(micro, tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    write_synthetic_checkpoint(load_architecture(str(micro / "config.json")), d, shards=2, seed=1)
    return d


def plan(micro, name):
    return resolve(micro / f"{name}.policy", load_architecture(str(micro / "config.json")), None)


INDEXES = {
    "weight_map-list": {"weight_map": ["a"]},
    "weight_map-str": {"weight_map": "model.safetensors"},
    "weight_map-null": {"metadata": {}},
    "value-not-str": {"weight_map": {"model.embed_tokens.weight": 3}},
    "absolute-shard": {"weight_map": {"model.embed_tokens.weight": "/etc/passwd"}},
    "parent-shard": {"weight_map": {"model.embed_tokens.weight": "../x.safetensors"}},
    "nul-shard": {"weight_map": {"model.embed_tokens.weight": "a\u0000b"}},
    "missing-shard": {"weight_map": {"model.embed_tokens.weight": "nope.safetensors"}},
    "top-list": [1],
}
RAW_INDEXES = {"deep": b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
               "bigint": b'{"weight_map": {}, "metadata": {"total_size": ' + b"7" * 5000 + b"}}",
               "dup-keys": b'{"weight_map": {}, "weight_map": {}}', "garbage": b"\x00\x01garbage"}


@pytest.mark.parametrize("kind", sorted(INDEXES) + sorted(RAW_INDEXES))
def test_hostile_index_files(micro, src, tmp_path, kind):
    d = tmp_path / "s"
    shutil.copytree(src, d)
    raw = RAW_INDEXES.get(kind) or json.dumps(INDEXES[kind]).encode()
    (d / "model.safetensors.index.json").write_bytes(raw)
    with pytest.raises(PolicycError):
        converter.convert(d, plan(micro, "bf16"), tmp_path / "o")
    r = StrictCliRunner().invoke(app, ["convert", str(d), "--policy", str(micro / "bf16.policy"), "--out",
                                 str(tmp_path / "o2"), "--model", str(micro / "config.json"), "--no-progress"])
    assert r.exit_code == 2 and "error:" in r.output


CONFIGS = {"deep": b'{"model_type": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
           "bigint": b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}",
           "huge-hidden": json.dumps({**MICRO, "hidden_size": 10**30}).encode(),
           "nan": b'{"model_type": "llama", "hidden_size": NaN}', "list": b"[]", "dup": b'{"a": 1, "a": 2}',
           "str-layers": json.dumps({**MICRO, "num_hidden_layers": "2"}).encode(), "binary": bytes(range(256))}


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_hostile_config_json(tmp_path, kind):
    p = tmp_path / "config.json"
    p.write_bytes(CONFIGS[kind])
    with pytest.raises(PolicycError):
        load_architecture(str(p))
    r = StrictCliRunner().invoke(app, ["plan", str(REPO / "policies" / "bf16.policy"), "--model", str(p)])
    assert r.exit_code == 2 and "error" in r.output


def _damage(dst: Path, kind: str) -> None:
    shards = sorted(dst.glob("*.safetensors"))
    if kind == "truncated-shard":
        shards[0].write_bytes(shards[0].read_bytes()[:-64])
    elif kind == "missing-shard":
        shards[1].unlink()
    elif kind == "shard-header-garbage":
        b = bytearray(shards[0].read_bytes())
        b[8:24] = b"\xff" * 16
        shards[0].write_bytes(bytes(b))
    elif kind == "shard-is-a-directory":
        shards[0].unlink()
        shards[0].mkdir()
    elif kind == "no-plan":
        (dst / "policyc_plan.json").unlink()
    elif kind == "plan-garbage":
        (dst / "policyc_plan.json").write_bytes(b'{"content_hash": ' + b"[" * 100_000)
    elif kind == "plan-other-json":
        (dst / "policyc_plan.json").write_text('{"tensors": 5}')
    elif kind == "config-garbage":
        (dst / "config.json").write_bytes(b"\x00\x01" * 10)
    elif kind == "config-deep":
        (dst / "config.json").write_bytes(b"[" * 100_000)
    elif kind == "extra-tensor-shard":
        shutil.copy(shards[0], dst / "zz-extra.safetensors")
    elif kind == "flipped-byte":
        b = bytearray(shards[1].read_bytes())
        b[-3] ^= 0x40
        shards[1].write_bytes(bytes(b))
    elif kind == "hf-quant-garbage":
        (dst / "hf_quant_config.json").write_text("{")
    else:
        raise AssertionError(kind)


DAMAGE = ["truncated-shard", "missing-shard", "shard-header-garbage", "shard-is-a-directory", "no-plan",
          "plan-garbage", "plan-other-json", "config-garbage", "config-deep", "extra-tensor-shard", "flipped-byte",
          "hf-quant-garbage"]


@pytest.fixture(scope="module")
def converted(micro, src, tmp_path_factory):
    dst = tmp_path_factory.mktemp("conv") / "out"
    converter.convert(src, plan(micro, "mx"), dst)
    return dst


@pytest.mark.parametrize("kind", DAMAGE)
def test_verify_on_damaged_outputs_reports_never_crashes(converted, src, tmp_path, kind):
    dst = tmp_path / "d"
    shutil.copytree(converted, dst)
    _damage(dst, kind)
    try:
        problems = converter.verify(dst, src)
        assert problems, kind  # damage that verify cannot see would be a bug
    except PolicycError:
        pass
    r = StrictCliRunner().invoke(app, ["verify", str(dst), "--source", str(src)])
    assert r.exit_code in (1, 2) and ("error:" in r.output or "mismatch" in r.output), r.output


def test_finite_bf16_overflowing_fp16_is_refused_by_convert_and_verify(micro, src, tmp_path):
    d = tmp_path / "s"
    shutil.copytree(src, d)
    from safetensors.torch import load_file, save_file

    shard = sorted(d.glob("*.safetensors"))[0]
    w = load_file(str(shard))
    name = sorted(w)[0]
    w[name] = torch.full_like(w[name], 1e5)  # finite in BF16, Inf in FP16
    save_file(w, str(shard))
    r = StrictCliRunner().invoke(app, ["convert", str(d), "--policy", str(micro / "fp16.policy"), "--out",
                                 str(tmp_path / "o"), "--model", str(micro / "config.json"), "--no-progress"])
    assert r.exit_code == 1 and name in r.output and "fp16" in r.output
    assert not (tmp_path / "o").exists()
    # an output made under bf16 does not verify against the fp16 plan's expectations of this source either
    converter.convert(d, plan(micro, "bf16"), tmp_path / "ok")
    assert converter.verify(tmp_path / "ok", d) == []


@pytest.mark.parametrize("name", ["[/x]", "[bold red]boom[/]", "[link=http://x]y", "[/]"])
def test_markup_in_policy_names_and_echoed_source_is_printed_verbatim(tmp_path, name):
    p = tmp_path / "m.policy"
    p.write_text(f'policy "{name}" {{\n    default bf16\n    name("[/evil]"): bf16\n}}\n')
    r = StrictCliRunner().invoke(app, ["plan", str(p), "--model", "tiny-moe"])
    assert r.exit_code == 2 and "[/evil]" in r.output  # matches no tensor: the error echoes the rule verbatim
    p.write_text(f'policy "{name}" {{\n    default bf16\n}}\n')
    r = StrictCliRunner().invoke(app, ["plan", str(p), "--model", "tiny-moe"])
    assert r.exit_code == 0 and name in r.output
    p.write_text(f'policy "{name}" {{\n    default bf16 [/oops]\n}}\n')
    r = StrictCliRunner().invoke(app, ["check", str(p), "--model", "tiny-moe"])
    assert r.exit_code == 2 and "[/oops]" in r.output


@pytest.mark.parametrize("args,needle", [
    (["--prompts", "0"], "--prompts"), (["--samples", "0"], "--samples"), (["--samples", "1"], "--samples"),
    (["--lr", "nan"], "--lr"), (["--lr", "-1"], "--lr"), (["--kl-coef", "inf"], "--kl-coef"),
    (["--rollout-device", "bogus"], "--rollout-device"), (["--broken-contract", "xyz"], "--broken-contract"),
    (["--seed", "-1"], "--seed"), (["--digits", "99"], "--digits"), (["--rollout-device", "cuda:999"], "cuda"),
])
def test_run_options_are_validated_before_any_work(tmp_path, args, needle):
    out = tmp_path / "run"
    r = StrictCliRunner().invoke(app, ["run", "--steps", "1", "--out", str(out), *args])
    assert r.exit_code == 2 and "error:" in r.output and needle in r.output, r.output
    assert not out.exists()


def test_run_device_cuda_without_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = StrictCliRunner().invoke(app, ["run", "--steps", "1", "--device", "cuda", "--out", str(tmp_path / "r")])
    assert r.exit_code == 2 and "CUDA" in r.output


@pytest.mark.parametrize("spec", ["trainer:tp=" + "9" * 5000, "tp=" + "9" * 30, "tp=0", "tp=70000"])
def test_parallel_degrees_are_bounded(spec):
    r = StrictCliRunner().invoke(app, ["plan", str(REPO / "policies" / "bf16.policy"), "--model", "tiny-moe",
                                 "--parallel", spec])
    assert r.exit_code == 2 and "out of range" in r.output


_PEAK_RSS = """
import sys
from pathlib import Path
from precision_dsl.backends.safetensors_io import read_header
from precision_dsl.errors import PolicycError

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024  # MiB

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS: count only what reading the header costs
before = status("VmRSS")
try:
    read_header(Path(sys.argv[1]))
    print("accepted")
except PolicycError as err:
    print("refused:", str(err)[:300])
print(status("VmHWM") - before)
"""


@pytest.mark.parametrize("entry", [_t(), _t(shape=(0,), off=(0, 0))], ids=["overlapping", "zero-size"])
def test_a_header_of_200k_entries_is_refused_cheaply(tmp_path, entry):
    """200k entries (11 MiB of JSON) used to cost ~170 MiB of Python objects before the refusal: the entry count
    and the declared bytes are checked on the raw header, before any per-entry object is built."""
    import subprocess
    import sys

    body = json.dumps(entry, separators=(",", ":"))
    hdr = ("{" + ",".join(f'"t{i}":{body}' for i in range(200_000)) + "}").encode()
    p = tmp_path / "many.safetensors"
    p.write_bytes(st_file(hdr, b"\0" * 8))
    r = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(p)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    lines = r.stdout.split("\n")
    assert r.returncode == 0 and lines[0].startswith("refused:"), (r.stdout, r.stderr[-2000:])
    assert int(lines[1]) < 40, f"refusing cost {lines[1]} MiB of peak RSS: {lines[0]}"
