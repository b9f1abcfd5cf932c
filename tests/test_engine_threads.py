"""engine/threads.py: torch threads for `policyc run` from the cores really available (a pure rule)."""

from __future__ import annotations

import pytest

from precision_dsl.engine.threads import cgroup_cpu_quota, choose_threads


@pytest.mark.parametrize("cpus, load, quota, want", [
    (2, 0.0, None, 2),     # idle 2-core box: both
    (2, 0.3, None, 2),     # a little background noise leaves the cores free
    (2, 1.0, None, 1),     # one core busy with someone else
    (2, 8.0, None, 1),     # a busy box: never 0
    (64, 0.0, 4.0, 4),     # a container granted 4 cores of 64
    (64, 0.0, 0.5, 1),     # half a core: still 1 thread
    (16, 6.0, None, 10),   # the free part of a big box
    (8, None, None, 8),    # load unknown: the affinity
    (0, None, None, 1),    # nonsense in: 1
])
def test_choose_threads(cpus, load, quota, want):
    assert choose_threads(cpus, load, quota) == want


def test_cgroup_quota_files(tmp_path):
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 2.5
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 3.0


def test_progress_lines_come_at_least_every_10_s():
    from precision_dsl.engine.cli import PROGRESS_EVERY_S, progress_due

    assert PROGRESS_EVERY_S <= 10
    assert progress_due(1, 150, 0.0) and progress_due(150, 150, 0.0) and progress_due(20, 150, 0.1)
    assert not progress_due(7, 150, 3.0)
    assert progress_due(7, 150, 10.0)  # slow steps: a line anyway
