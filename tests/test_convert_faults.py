"""Crash safety of `policyc convert`, by fault injection at EVERY filesystem mutation point.

A clean run is instrumented (tests/faultfs.py) to enumerate its mutations (lock, state, shard temp + fsync +
rename, atomic markers, final-phase files, commit renames, clean-up). Then, for every point k, a run is "killed"
just before mutation k and (for every file creation) just after it, leaving exactly what a kill -9 would leave; a
plain re-run must then produce a tree byte-identical to an uninterrupted run, with no work dir, lock or trash
left. With --force, the previous output must never be lost: after any crash it is either still DST, or DST is the
new output, or (between the two commit renames) it waits in the work dir and the next run puts it back.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from precision_dsl.backends import converter
from precision_dsl.backends.durable import OutputBusy
from precision_dsl.backends.safetensors_io import CheckpointError
from precision_dsl.backends.synthetic import write_synthetic_checkpoint
from precision_dsl.arch import load_architecture
from precision_dsl.resolve import resolve

from faultfs import Crash, FaultFS

REPO = Path(__file__).resolve().parents[1]


# A 2-layer Llama-shaped model (~20 tensors, 3 shards): the mutation points of a conversion do not depend on the
# model size, and a small one keeps ~150 kill-and-resume cycles inside the CI budget.
MICRO = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 256,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
POLICIES = {"bf16": 'policy "bf16" { default bf16 }\n',
            "old": 'policy "old" { default bf16\n attn: mxfp8 }\n'}


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    d = tmp_path_factory.mktemp("micro")
    (d / "config.json").write_text(json.dumps(MICRO))
    for name, text in POLICIES.items():
        (d / f"{name}.policy").write_text(text)
    return d


@functools.lru_cache(maxsize=None)
def _plan(root: str, name: str):
    return resolve(Path(root) / f"{name}.policy", load_architecture(str(Path(root) / "config.json")), None)


_ROOT: list[Path] = []


def plan(name):
    return _plan(str(_ROOT[0]), name)


@pytest.fixture(scope="module")
def src(micro, tmp_path_factory):
    _ROOT[:] = [micro]
    d = tmp_path_factory.mktemp("src")
    write_synthetic_checkpoint(load_architecture(str(micro / "config.json")), d, shards=3, seed=3)
    (d / "tokenizer_config.json").write_text("{}")
    return d


def tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}."))


def enumerate_points(src, dst, **kw) -> list[tuple[str, str]]:
    fs = FaultFS()
    with fs.installed():
        converter.convert(src, plan("bf16"), dst, **kw)
    return fs.ops


def rerun(src, dst, name="bf16", **kw):
    with FaultFS().installed():  # no crash; only skips the real fsyncs (see faultfs)
        return converter.convert(src, plan(name), dst, **kw)


def crash_at(src, dst, k: int, after: bool, **kw) -> None:
    fs = FaultFS(crash_at=k, after=after)
    with pytest.raises(Crash):
        with fs.installed():
            converter.convert(src, plan("bf16"), dst, **kw)


def scenarios(ops):
    """Kill before every mutation, and after every one that creates a file (the "marker created but not yet
    written" window), plus after the very last one."""
    out = [(k, False) for k in range(len(ops))]
    out += [(k, True) for k, (op, _) in enumerate(ops) if op == "open-write"]
    out.append((len(ops) - 1, True))
    return out


def test_kill_at_every_mutation_point_then_resume_is_byte_identical(src, tmp_path, record_figure):
    clean = tmp_path / "clean"
    converter.convert(src, plan("bf16"), clean)
    want = tree(clean)
    ops = enumerate_points(src, tmp_path / "enum")
    assert {op for op, _ in ops} >= {"open-write", "fsync", "replace", "rename", "mkdir", "unlink", "rmdir"}
    cases = scenarios(ops)
    t0 = time.perf_counter()
    for i, (k, after) in enumerate(cases):
        dst = tmp_path / f"o{i}"
        crash_at(src, dst, k, after)
        try:
            rerun(src, dst)
        except FileExistsError:  # the kill hit the clean-up after the commit: the output is complete
            pass
        assert tree(dst) == want, f"kill {'after' if after else 'before'} mutation {k} {ops[k]}"
        assert leftovers(dst) == [], (k, after, ops[k], leftovers(dst))
    record_figure("convert_fault_points", {"mutation_points": len(ops), "kill_scenarios": len(cases),
                                           "seconds": round(time.perf_counter() - t0, 1)})


def test_force_never_loses_the_previous_output(src, tmp_path, record_figure):
    new = tmp_path / "new"
    converter.convert(src, plan("bf16"), new)
    want_new = tree(new)
    old = tmp_path / "old"
    converter.convert(src, plan("old"), old)
    want_old = tree(old)
    probe = tmp_path / "probe"
    os.rename(old, probe)
    converter.convert(src, plan("old"), old)  # `old` again, to copy per case
    ops = enumerate_points(src, probe, force=True)
    assert ("rename", probe.name) in ops  # the old output moves aside during the commit
    import shutil

    for i, (k, after) in enumerate(scenarios(ops)):
        dst = tmp_path / f"f{i}"
        shutil.copytree(old, dst)
        crash_at(src, dst, k, after, force=True)
        work = converter._work_dir(dst)
        if dst.exists():
            assert tree(dst) in (want_old, want_new), (k, after, ops[k])
        else:  # only possible between the two commit renames
            assert tree(work / "previous") == want_old, (k, after, ops[k])
        rerun(src, dst, force=True)
        assert tree(dst) == want_new and leftovers(dst) == [], (k, after, ops[k])
    record_figure("convert_force_fault_points", {"mutation_points": len(ops)})


def test_a_crash_in_the_final_phase_redoes_no_shard(src, tmp_path):
    ops = enumerate_points(src, tmp_path / "enum")
    last_marker = max(k for k, (op, name) in enumerate(ops) if op == "replace" and name.endswith(".json.tmp")
                      and name.startswith(".model-"))
    final_phase = [k for k in range(last_marker + 2, len(ops)) if ops[k] != ("rename", "out")]
    assert len(final_phase) >= 10
    for k in final_phase[:: max(1, len(final_phase) // 6)]:
        dst = tmp_path / f"fp{k}"
        crash_at(src, dst, k, after=False)
        if not converter._work_dir(dst).joinpath("out").is_dir():
            continue  # past the commit
        rep = rerun(src, dst)
        assert rep.shards_written == [] and len(rep.shards_resumed) == 3, (k, ops[k])


def test_interrupted_force_without_force_rerun_restores_the_old_output(src, tmp_path):
    import shutil

    old = tmp_path / "old"
    converter.convert(src, plan("old"), old)
    want_old = tree(old)
    ops = enumerate_points(src, tmp_path / "enum", force=False)
    dst = tmp_path / "d"
    shutil.copytree(old, dst)
    fs = FaultFS()
    with fs.installed():
        converter.convert(src, plan("bf16"), tmp_path / "probe2")
    commit = next(k for k, op in enumerate(fs.ops) if op == ("rename", "out"))
    # with force there is one extra rename (dst -> previous) right before the commit rename
    crash_at(src, dst, commit + 1, after=False, force=True)
    assert not dst.exists()
    with pytest.raises(FileExistsError):  # the next run first puts the old output back, then refuses
        converter.convert(src, plan("bf16"), dst)
    assert tree(dst) == want_old and ops


def test_real_kill_in_a_subprocess(src, tmp_path):
    """The simulation above against a real os._exit in a child process, at the historical failure point: the
    shard marker file created but empty."""
    clean = tmp_path / "clean"
    converter.convert(src, plan("bf16"), clean)
    ops = enumerate_points(src, tmp_path / "enum")
    k = next(i for i, (op, name) in enumerate(ops) if op == "open-write" and name.endswith(".json.tmp")
             and "model-00002" in name)
    dst = tmp_path / "killed"
    code = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from tests.faultfs import FaultFS
from precision_dsl.backends import converter
from precision_dsl.arch import load_architecture
from precision_dsl.resolve import resolve
plan = resolve({str(_ROOT[0] / 'bf16.policy')!r}, load_architecture({str(_ROOT[0] / 'config.json')!r}), None)
fs = FaultFS(crash_at={k}, after=True, on_crash=lambda: os._exit(137))
with fs.installed():
    converter.convert({str(src)!r}, plan, {str(dst)!r})
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 137, r.stderr[-2000:]
    marker = converter._work_dir(dst) / "done" / ".model-00002-of-00003.safetensors.json.tmp"
    assert not marker.exists() or marker.stat().st_size == 0
    rep = converter.convert(src, plan("bf16"), dst)
    assert rep.shards_resumed == ["model-00001-of-00003.safetensors"]
    assert tree(dst) == tree(clean) and leftovers(dst) == []


@pytest.mark.parametrize("target", ["done/model-00001-of-00003.safetensors.json", "state.json"])
@pytest.mark.parametrize("bad", [b"", b"{", b"[]", b'{"shard": 1}', b"null", b"\xff" * 10, b"[" * 100000,
                                 b'{"size": ' + b"9" * 5000 + b"}", b"x" * 100000, "symlink", "dir"],
                         ids=["empty", "torn", "list", "badtype", "null", "binary", "deep", "bigint", "huge",
                              "symlink", "dir"])
def test_bad_markers_and_state_mean_redo_never_a_traceback(src, tmp_path, bad, target):
    clean = tmp_path / "clean"
    rerun(src, clean)
    dst = tmp_path / "d"

    def stop(shard):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        converter.convert(src, plan("bf16"), dst, on_shard_done=stop)
    path = converter._work_dir(dst) / target
    path.unlink()
    if bad == "symlink":
        path.symlink_to("/etc/passwd")
    elif bad == "dir":
        path.mkdir()
    else:
        path.write_bytes(bad)
    rep = rerun(src, dst)
    assert rep.shards_resumed == [] and tree(dst) == tree(clean) and leftovers(dst) == []


def test_two_converters_on_one_out(src, tmp_path):
    """A second converter on the same --out is refused by name while the first runs; the first completes."""
    dst = tmp_path / "shared"
    inside, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def slow(shard):
        inside.set()
        release.wait(60)

    def first():
        try:
            converter.convert(src, plan("old"), dst, on_shard_done=slow)
        except BaseException as err:  # pragma: no cover - reported below
            errors.append(err)

    th = threading.Thread(target=first)
    th.start()
    assert inside.wait(60)
    with pytest.raises(OutputBusy, match=str(dst)):
        converter.convert(src, plan("bf16"), dst)
    with pytest.raises(OutputBusy):
        converter.convert(src, plan("bf16"), dst, force=True)
    release.set()
    th.join(60)
    assert not errors and converter.verify(dst, src) == []
    assert converter.read_plan(dst).content_hash() == plan("old").content_hash()


def test_symlinked_side_files_are_never_followed(micro, tmp_path):
    src = tmp_path / "src"
    write_synthetic_checkpoint(load_architecture(str(micro / "config.json")), src, shards=1, seed=0)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOKEN=hunter2")
    (src / "tokenizer.json").symlink_to(secret)
    (src / "environ").symlink_to("/proc/self/environ")
    (src / "inside.txt").write_text("ok")
    (src / "alias.txt").symlink_to(src / "inside.txt")  # stays inside: allowed
    os.mkfifo(src / "fifo")
    rep = converter.convert(src, plan("bf16"), tmp_path / "o")
    out = tmp_path / "o"
    assert not (out / "tokenizer.json").exists() and not (out / "environ").exists()
    assert not (out / "fifo").exists()
    assert {"tokenizer.json", "environ", "fifo"} <= set(rep.skipped_files)
    assert (out / "inside.txt").read_text() == "ok" and (out / "alias.txt").read_text() == "ok"
    for p in out.iterdir():
        assert b"hunter2" not in p.read_bytes()
    (src / "config.json").rename(src / "real-config.json")
    (src / "config.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match="regular file inside"):
        converter.convert(src, plan("bf16"), tmp_path / "o2")
    assert json.loads((out / "config.json").read_text())["model_type"]


def test_killed_after_the_commit_the_next_run_finishes_and_leaves_only_the_output(src, tmp_path):
    """A kill at any point after the output is in place (the last one: right before the lock file is removed)
    leaves a complete DST; the same command then finishes (nothing to redo) and leaves nothing beside DST."""
    clean = tmp_path / "clean"
    rerun(src, clean)
    want = tree(clean)
    ops = enumerate_points(src, tmp_path / "enum")
    commit = ops.index(("rename", "out"))
    assert ops[-1] == ("unlink", ".enum.policyc-lock")
    for k in range(commit + 1, len(ops)):
        dst = tmp_path / f"c{k}"
        crash_at(src, dst, k, after=False)
        assert tree(dst) == want
        rep = rerun(src, dst)
        assert rep.shards_written == [] and tree(dst) == want and leftovers(dst) == [], (k, ops[k])


def test_real_kill_before_the_lock_is_removed(src, tmp_path):
    ops = enumerate_points(src, tmp_path / "enum")
    dst = tmp_path / "killed"
    code = f"""
import os, sys
sys.path.insert(0, {str(REPO)!r})
from tests.faultfs import FaultFS
from precision_dsl.backends import converter
from precision_dsl.arch import load_architecture
from precision_dsl.resolve import resolve
plan = resolve({str(_ROOT[0] / 'bf16.policy')!r}, load_architecture({str(_ROOT[0] / 'config.json')!r}), None)
fs = FaultFS(crash_at={len(ops) - 1}, on_crash=lambda: os._exit(137))
with fs.installed():
    converter.convert({str(src)!r}, plan, {str(dst)!r})
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 137, r.stderr[-2000:]
    assert leftovers(dst) == [".killed.policyc-lock"]
    rep = converter.convert(src, plan("bf16"), dst)
    assert rep.shards_written == [] and converter.verify(dst, src) == [] and leftovers(dst) == []
