"""backends/converter.py (+ safetensors_io, quantize): HF checkpoint -> quantized checkpoint, verify, resume."""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from precision_dsl.backends import converter
from precision_dsl.backends.common import PLAN_FILE
from precision_dsl.backends.safetensors_io import CheckpointError, read_header
from precision_dsl.backends.synthetic import write_synthetic_checkpoint
from precision_dsl.arch import load_architecture
from precision_dsl.formats import dequantize, group_amax, quantize
from precision_dsl.resolve import resolve
from conftest import StrictCliRunner

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "precision_dsl" / "models" / "tiny-moe"
SPLIT = "model.layers.1.mlp.experts.5.gate_proj.weight"  # gate in one shard, up in the next
FP8_BLOCK_POLICY = """
policy "fp8b" {
    target hopper
    default bf16
    attn: fp8_block(scales=fp32) backward=quantized
    routed_experts: fp8_block(scales=fp32) backward=quantized
}
"""


@functools.lru_cache(maxsize=None)
def arch():
    return load_architecture("tiny-moe")


@functools.lru_cache(maxsize=None)
def seed_plan(name):
    return resolve(REPO / "policies" / f"{name}.policy", arch(), None)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    write_synthetic_checkpoint(arch(), d, shards=3, seed=1, split_after=SPLIT)
    (d / "pytorch_model.bin").write_bytes(b"not read: pickles are never opened")
    return d


def fp8_block_plan(tmp_path):
    p = tmp_path / "fp8b.policy"
    p.write_text(textwrap.dedent(FP8_BLOCK_POLICY))
    return resolve(p, arch(), None)


def tree_digest(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def source_tensor(src: Path, name: str) -> torch.Tensor:
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(src / idx[name]), "pt") as f:
        return f.get_tensor(name)


def test_source_fixture_splits_a_share_scale_group(src):
    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    assert idx[SPLIT] != idx[SPLIT.replace("gate_proj", "up_proj")]


@pytest.mark.parametrize("policy", ["mxfp8-e2e", "nvfp4-pertoken-hp-backward", "bf16", "fp8_block"])
def test_convert_verify_and_read_back_to_plan_formats(src, tmp_path, policy):
    plan = fp8_block_plan(tmp_path) if policy == "fp8_block" else seed_plan(policy)
    before = tree_digest(src)
    dst = tmp_path / "out"
    rep = converter.convert(src, plan, dst)
    assert tree_digest(src) == before, "the source checkpoint was modified"
    assert len(rep.shards_written) == 3 and "tokenizer_config.json" in rep.copied_files
    assert "pytorch_model.bin" in rep.skipped_files and not (dst / "pytorch_model.bin").exists()
    assert converter.verify(dst, src) == []
    saved = json.loads((dst / PLAN_FILE).read_text())
    assert saved["content_hash"] == plan.content_hash()

    # what was written is exactly what the emitted manifest announced
    manifest = json.loads(converter.emit(plan)[0].content)
    announced = {n: (dt, tuple(sh)) for specs in manifest["tensors"].values() for n, dt, sh in specs}
    written = {}
    for f in dst.glob("*.safetensors"):
        written.update({n: (i["dtype"], tuple(i["shape"])) for n, i in read_header(f).items()})
    assert written == announced

    plan_back, tensors = converter.load_converted(dst)
    assert plan_back.content_hash() == plan.content_hash()
    groups = {m: g for g in plan.share_scale_groups for m in g.members}
    for t in plan.tensors:
        x = source_tensor(src, t.hf_name)
        got = tensors[t.hf_name]
        if not (t.is_linear and t.weight.is_quantized):
            assert torch.equal(got, x.to(torch.bfloat16)), t.hf_name
            continue
        assert got.fmt == t.weight, t.hf_name
        ga = None
        if t.weight.global_scale == "group":
            ga = group_amax([source_tensor(src, m) for m in groups[t.hf_name].members])
        ref = quantize(x, t.weight, axis="row", global_amax=ga)
        assert torch.equal(dequantize(got), dequantize(ref)), t.hf_name


def test_nvfp4_gate_up_share_weight_scale_2_across_shards(src, tmp_path):
    plan = seed_plan("nvfp4-pertoken-hp-backward")
    dst = tmp_path / "nv"
    converter.convert(src, plan, dst)
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    hq = json.loads((dst / "hf_quant_config.json").read_text())
    assert cfg["quant_algo"] == "NVFP4" and hq["quantization"]["exclude_modules"] == cfg["ignore"]
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    mod_g, mod_u = SPLIT.rsplit(".", 1)[0], SPLIT.replace("gate_proj", "up_proj").rsplit(".", 1)[0]
    vals = []
    for mod in (mod_g, mod_u):
        with safe_open(str(dst / idx[f"{mod}.weight_scale_2"]), "pt") as f:
            vals.append(f.get_tensor(f"{mod}.weight_scale_2"))
            assert f.get_tensor(f"{mod}.weight").dtype == torch.uint8
            assert f.get_tensor(f"{mod}.weight_scale").dtype == torch.float8_e4m3fn
    g = group_amax([source_tensor(src, SPLIT), source_tensor(src, SPLIT.replace("gate_proj", "up_proj"))])
    assert vals[0].shape == () and torch.equal(vals[0], vals[1])
    assert torch.equal(vals[0].reshape(1), quantize(source_tensor(src, SPLIT),
                                                    plan.by_name()[SPLIT].weight, global_amax=g).global_scale)


def test_mxfp8_checkpoint_layout(src, tmp_path):
    dst = tmp_path / "mx"
    converter.convert(src, seed_plan("mxfp8-e2e"), dst)
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "mxfp8" and cfg["weight_block_size"] == [1, 32] and cfg["scale_fmt"] == "ue8m0"
    assert "model.layers.3.mlp.experts" in cfg["modules_to_not_convert"]  # keep-bf16: last 15% of layers
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.o_proj"
    with safe_open(str(dst / idx[f"{name}.weight"]), "pt") as f:
        assert f.get_tensor(f"{name}.weight").dtype == torch.float8_e4m3fn
        s = f.get_tensor(f"{name}.weight_scale_inv")
        assert s.dtype == torch.uint8 and tuple(s.shape) == (128, 128 // 32)


def test_resume_after_interruption_is_byte_identical(src, tmp_path):
    plan = seed_plan("nvfp4-pertoken-dequant-backward")
    clean = tmp_path / "clean"
    converter.convert(src, plan, clean)

    class Interrupted(Exception):
        pass

    def stop_after_first(shard):
        raise Interrupted(shard)

    dst = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        converter.convert(src, plan, dst, on_shard_done=stop_after_first)
    assert not dst.exists() and converter._partial_dir(dst).is_dir()
    rep = converter.convert(src, plan, dst)
    assert rep.shards_resumed == ["model-00001-of-00003.safetensors"] and len(rep.shards_written) == 2
    assert tree_digest(dst) == tree_digest(clean)
    assert not converter._partial_dir(dst).exists()


def test_partial_dir_of_another_plan_is_discarded(src, tmp_path):
    dst = tmp_path / "o"

    def stop(shard):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        converter.convert(src, seed_plan("mxfp8-e2e"), dst, on_shard_done=stop)
    rep = converter.convert(src, seed_plan("nvfp4-pertoken-hp-backward"), dst)
    assert rep.shards_resumed == [] and converter.verify(dst, src) == []


def test_refuses_overwrite_without_force(src, tmp_path):
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "mine.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        converter.convert(src, seed_plan("bf16"), dst)
    assert (dst / "mine.txt").read_text() == "user data"
    converter.convert(src, seed_plan("bf16"), dst, force=True)
    assert not (dst / "mine.txt").exists() and converter.verify(dst, src) == []


def test_verify_detects_a_flipped_byte_and_plan_mismatch(src, tmp_path):
    dst = tmp_path / "v"
    converter.convert(src, seed_plan("mxfp8-e2e"), dst)
    shard = dst / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01
    shard.write_bytes(bytes(data))
    problems = converter.verify(dst, src)
    assert len(problems) == 1 and "differs" in problems[0]
    from precision_dsl.backends.common import PlanMismatch

    with pytest.raises(PlanMismatch):
        converter.verify(dst, src, expected_hash=seed_plan("bf16").content_hash())


@pytest.mark.parametrize("damage,msg", [
    (lambda b: b[:20], "header length"),
    (lambda b: struct.pack("<Q", 1 << 40) + b[8:], "header length"),
    (lambda b: b[:-10], "outside the file"),
])
def test_malformed_headers_rejected_before_allocation(tmp_path, damage, msg):
    from safetensors.torch import save_file

    good = tmp_path / "good.safetensors"
    save_file({"a": torch.zeros(16, 16)}, str(good))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(CheckpointError, match=msg):
        read_header(bad)


def test_source_must_match_the_plan(tmp_path):
    d = tmp_path / "s"
    write_synthetic_checkpoint(arch(), d, shards=1)
    from safetensors.torch import load_file, save_file

    w = load_file(str(d / "model.safetensors"))
    w["model.extra.weight"] = torch.zeros(4)
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not know"):
        converter.convert(d, seed_plan("bf16"), tmp_path / "o")


def test_vllm_mxfp8_checkpoint_same_bytes_vllm_names_and_config(src, tmp_path):
    """--rollout vllm: the E8M0 scales under vLLM's name (`weight_scale`), byte for byte SGLang's
    `weight_scale_inv`; config.json holds the vLLM backend's ModelOpt MXFP8 config; verify and read-back follow."""
    from precision_dsl.backends import vllm

    plan = seed_plan("mxfp8-e2e")
    sg, vl = tmp_path / "sg", tmp_path / "vl"
    converter.convert(src, plan, sg)
    converter.convert(src, plan, vl, rollout="vllm")
    cfg = json.loads((vl / "config.json").read_text())["quantization_config"]
    problems = converter.Problems()
    assert cfg == vllm.serve_config(plan, problems).quantization_config and not problems.items
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "MXFP8"
    assert not (vl / "hf_quant_config.json").exists()
    assert converter.rollout_of(vl, plan) == "vllm" and converter.rollout_of(sg, plan) == "sglang"
    sg_names = set(converter._dst_tensors(sg))
    vl_names = set(converter._dst_tensors(vl))
    renamed = {n.replace(".weight_scale_inv", ".weight_scale") for n in sg_names}
    assert vl_names == renamed and vl_names != sg_names
    name = "model.layers.0.mlp.experts.3.gate_proj"
    shard = json.loads((vl / "model.safetensors.index.json").read_text())["weight_map"][f"{name}.weight_scale"]
    with safe_open(str(sg / shard), "pt") as a, safe_open(str(vl / shard), "pt") as b:
        assert torch.equal(a.get_tensor(f"{name}.weight_scale_inv"), b.get_tensor(f"{name}.weight_scale"))
        assert torch.equal(a.get_tensor(f"{name}.weight").view(torch.uint8),
                           b.get_tensor(f"{name}.weight").view(torch.uint8))
    assert converter.verify(vl, src) == []
    _, back_vl = converter.load_converted(vl, [f"{name}.weight"])
    _, back_sg = converter.load_converted(sg, [f"{name}.weight"])
    assert torch.equal(back_vl[f"{name}.weight"].scale, back_sg[f"{name}.weight"].scale)
    # the converter's manifest for a vLLM deployment names what convert writes
    from precision_dsl.backends.registry import EmitOptions, get_backend

    arts = get_backend("converter").emit(plan, EmitOptions(rollout="vllm"), problems)
    doc = json.loads(arts[0].data())
    announced = {n for specs in (doc.get("tensors") or {}).values() for n, _dt, _sh in specs}
    assert announced == vl_names and doc["rollout"] == "vllm"
    derived = get_backend("converter").derive_formats({a.path: a.data() for a in arts}, arch())
    assert derived[f"{name}.weight"] == "mxfp8/e4m3[1x32]"


def test_cli_convert_rollout_vllm_and_unknown_engine(src, tmp_path):
    from precision_dsl.cli import app

    runner = StrictCliRunner()
    pol = str(REPO / "policies" / "mxfp8-e2e.policy")
    r = runner.invoke(app, ["convert", str(src), "--policy", pol, "--out", str(tmp_path / "v"), "--model",
                            "tiny-moe", "--rollout", "vllm", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "v" / "config.json").read_text())["quantization_config"]["quant_algo"] == "MXFP8"
    r = runner.invoke(app, ["convert", str(src), "--policy", pol, "--out", str(tmp_path / "w"), "--model",
                            "tiny-moe", "--rollout", "vlm", "--no-progress"])
    assert r.exit_code == 2 and "unknown rollout engine 'vlm'" in r.output
    assert not (tmp_path / "w").exists()


def test_cli_convert_verify_and_errors(src, tmp_path):
    from precision_dsl.cli import app

    runner = StrictCliRunner()
    pol = str(REPO / "policies" / "mxfp8-hp-backward.policy")
    dst = tmp_path / "cli"
    r = runner.invoke(app, ["convert", str(src), "--policy", pol, "--out", str(dst), "--model", "tiny-moe",
                            "--no-progress"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["verify", str(dst), "--source", str(src)])
    assert r.exit_code == 0 and "verified" in r.output
    r = runner.invoke(app, ["convert", str(src), "--policy", pol, "--out", str(dst), "--model", "tiny-moe"])
    assert r.exit_code == 2 and "--force" in r.output
    shard = dst / "model-00003-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", str(dst), "--source", str(src)])
    assert r.exit_code == 1 and "mismatch" in r.output
    r = runner.invoke(app, ["convert", str(tmp_path / "nope"), "--policy", pol, "--out", str(tmp_path / "x")])
    assert r.exit_code == 2


@pytest.mark.skipif(not (TINY / "model.safetensors").is_file(), reason="bundled tiny-moe weights not present")
@pytest.mark.parametrize("policy", ["nvfp4-pertoken-hp-backward", "mxfp8-e2e"])
def test_bundled_tiny_moe_weights_convert_verify_and_dequantize(tmp_path, policy):
    from safetensors.torch import load_file

    plan = seed_plan(policy)
    dst = tmp_path / "tiny"
    converter.convert(TINY, plan, dst)
    assert converter.verify(dst, TINY) == []
    src = load_file(str(TINY / "model.safetensors"))
    groups = {m: g for g in plan.share_scale_groups for m in g.members}
    _, back = converter.load_converted(dst)
    for t in plan.quantized():
        ga = group_amax([src[m] for m in groups[t.hf_name].members]) if t.weight.global_scale == "group" else None
        assert back[t.hf_name].fmt == t.weight
        assert torch.equal(dequantize(back[t.hf_name]), dequantize(quantize(src[t.hf_name], t.weight, global_amax=ga)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["mxfp8-e2e", "nvfp4-pertoken-hp-backward", "fp8_block"])
def test_cuda_conversion_is_byte_identical_to_cpu(src, tmp_path, policy):
    plan = fp8_block_plan(tmp_path) if policy == "fp8_block" else seed_plan(policy)
    converter.convert(src, plan, tmp_path / "cpu")
    converter.convert(src, plan, tmp_path / "gpu", device="cuda")
    assert tree_digest(tmp_path / "cpu") == tree_digest(tmp_path / "gpu")


# ---- non-finite weights are refused on every path (host and device) ------------------------------------------------
def _with_nan(src: Path, dst: Path, name: str) -> Path:
    """A copy of checkpoint `src` whose tensor `name` holds one NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    shard = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(dst / shard))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[7] = float("nan")
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return dst


NAN_CASES = [("model.layers.1.mlp.experts.5.up_proj.weight", "nvfp4-pertoken-hp-backward"),  # a share-scale group
             ("model.layers.0.self_attn.q_proj.weight", "mxfp8-e2e"),
             ("model.layers.0.input_layernorm.weight", "mxfp8-e2e")]  # high precision, host path


@pytest.mark.parametrize("name,policy", NAN_CASES)
def test_nan_in_the_source_is_refused_by_name_and_nothing_is_committed(src, tmp_path, name, policy):
    from precision_dsl.backends.quantize import NonFiniteWeight

    bad = _with_nan(src, tmp_path / "bad", name)
    with pytest.raises(NonFiniteWeight, match=f"'{name}' contains 1 NaN/Inf"):
        converter.convert(bad, seed_plan(policy), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,policy", NAN_CASES)
def test_cuda_conversion_refuses_nan_with_the_cpu_message(src, tmp_path, name, policy):
    """The device path checks finiteness with one synchronisation per unit; a failure re-runs the sequential checks
    so the error is exactly the CPU path's."""
    from precision_dsl.backends.quantize import NonFiniteWeight

    bad = _with_nan(src, tmp_path / "bad", name)
    errors = []
    for device in ("cpu", "cuda"):
        with pytest.raises(NonFiniteWeight) as exc:
            converter.convert(bad, seed_plan(policy), tmp_path / f"out-{device}", device=device)
        errors.append(str(exc.value))
        assert not (tmp_path / f"out-{device}").exists()
    assert errors[0] == errors[1] and name in errors[0]


# ---- the streaming writer ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "page_cache"])
def test_streaming_writer_bytes_and_crc_across_buffer_boundaries(tmp_path, monkeypatch, direct):
    """Tiny staging buffers so tensors straddle buffer boundaries and the file ends mid-block: the file must be the
    header followed by the tensor bytes in order, and checksum()/size those of the file (what resume checks)."""
    import os
    import zlib

    from precision_dsl.backends import safetensors_io as sio

    monkeypatch.setattr(sio, "_CHUNK", 8192)
    monkeypatch.setattr(sio, "_POOL", [])
    g = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3000, generator=g).to(torch.bfloat16)), ("b", torch.randn(5, 7, generator=g)),
               ("c", torch.randint(0, 255, (12289,), generator=g, dtype=torch.uint8)),
               ("d", torch.zeros(0, dtype=torch.bfloat16)), ("e", torch.tensor(2.5))]
    specs = [(n, {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8"}[t.dtype], tuple(t.shape))
             for n, t in tensors]
    # "a" and "c" come straight from a file (the pass-through path), checked piece by piece; the rest from tensors
    blob = tmp_path / "blob"
    blob.write_bytes(b"xyz" + tensors[0][1].view(torch.uint8).numpy().tobytes() + tensors[2][1].numpy().tobytes())
    pieces = []
    w = sio.StreamingWriter(tmp_path / "x.safetensors", specs, metadata={"format": "pt"}, direct=direct)
    fd = os.open(blob, os.O_RDONLY)
    try:
        for n, t in tensors:
            if n in ("a", "c"):
                at = 3 if n == "a" else 3 + tensors[0][1].numel() * 2
                assert w.write_from_file(n, fd, at, lambda piece: pieces.append(bytes(piece)) or True)
            else:
                w.write(n, t)
        w.close()
    finally:
        w.abort()
        os.close(fd)
    assert len(pieces) > 2 and b"".join(pieces) == blob.read_bytes()[3:]  # several pieces, all bytes seen once
    data = (tmp_path / "x.safetensors").read_bytes()
    want = sio.header_bytes(specs, {"format": "pt"}) + b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes()
                                                                 for _, t in tensors)
    assert data == want and w.size == len(want) and w.checksum() == f"crc32:{zlib.crc32(want):08x}"
    assert converter.file_checksum(tmp_path / "x.safetensors") == w.checksum()
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert all(torch.equal(f.get_tensor(n), t) for n, t in tensors)


def test_streaming_writer_reports_a_write_error_from_its_thread(tmp_path, monkeypatch):
    """A full disk in the writer thread surfaces as the OSError on close (never a hang, never a silent short file)."""
    import errno
    import os

    from precision_dsl.backends import safetensors_io as sio

    monkeypatch.setattr(sio, "_CHUNK", 8192)
    monkeypatch.setattr(sio, "_POOL", [])
    real_write = os.write

    def full_disk(fd, data):
        if len(data) >= 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    w = sio.StreamingWriter(tmp_path / "x", [("a", "U8", (100000,))])
    with pytest.raises(OSError, match="No space"):
        try:
            w.write("a", torch.zeros(100000, dtype=torch.uint8))
            w.close()
        finally:
            w.abort()


def test_read_exact_fills_the_view_and_names_a_short_file(tmp_path):
    """The converter's positioned reads: the exact bytes at an offset; a file that ends early is a CheckpointError
    naming the tensor (and the shard, when given), never a partly filled buffer passed on."""
    import os

    from precision_dsl.backends.safetensors_io import CheckpointError, read_exact

    f = tmp_path / "shard.safetensors"
    f.write_bytes(bytes(range(100)))
    fd = os.open(f, os.O_RDONLY)
    try:
        buf = bytearray(10)
        read_exact(fd, memoryview(buf), 20, "w")
        assert bytes(buf) == bytes(range(20, 30))
        with pytest.raises(CheckpointError, match="shard.safetensors: unexpected end of file reading 'w'"):
            read_exact(fd, memoryview(bytearray(10)), 95, "w", f)
        with pytest.raises(CheckpointError, match="^unexpected end of file reading 'v'"):
            read_exact(fd, memoryview(bytearray(10)), 95, "v")
    finally:
        os.close(fd)
