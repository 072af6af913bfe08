"""Scratch directories (storage/scratch.py): a reclaim removes exactly what dead owners left.

Owners run in real processes: one killed with SIGKILL, one alive (blocked on
its stdin) while this process reclaims, then let go. Nothing a live owner
holds is ever removed, in this process or another.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from casckpt.storage.scratch import Reclaimed, ScratchDir, reclaim

OWNER = """
import os, sys
from pathlib import Path
from casckpt.storage.scratch import ScratchDir
scratch = ScratchDir(Path(sys.argv[1]))
(scratch.path() / "half.pack").write_bytes(b"s" * 1000)
print(scratch.path(), flush=True)
sys.stdin.read()  # alive until the test closes our stdin
os._exit(0)  # dies without close(): the files stay, the lock goes with the process
"""


@contextmanager
def _owner(base: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with subprocess.Popen([sys.executable, "-c", OWNER, str(base)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env) as proc:  # closes its pipes
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            assert line, "the owner process did not start"
            yield proc, Path(line)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


def test_a_live_owner_in_another_process_is_never_reclaimed(tmp_path: Path) -> None:
    base = tmp_path / "staging"
    with _owner(base) as (proc, directory):
        for _ in range(3):
            assert reclaim(base, grace=0) == Reclaimed()
        assert (directory / "half.pack").read_bytes() == b"s" * 1000
        assert proc.stdin is not None
        proc.stdin.close()  # the owner exits without cleaning up
        proc.wait(timeout=30)
    assert (directory / "half.pack").exists()
    assert reclaim(base) == Reclaimed(1, 1000)
    assert list(base.iterdir()) == []


def test_an_owner_killed_with_sigkill_is_reclaimed(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    with _owner(base) as (proc, directory):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert sorted(p.name for p in base.iterdir()) == sorted([directory.name, f"{directory.name}.lock"])
    assert reclaim(base) == Reclaimed(1, 1000)
    assert list(base.iterdir()) == []


def test_live_owners_in_this_process_are_never_reclaimed(tmp_path: Path) -> None:
    base = tmp_path / "staging"
    first, second = ScratchDir(base), ScratchDir(base)
    mine = first.path()
    (mine / "a.pack").write_bytes(b"a")
    (second.path() / "b.pack").write_bytes(b"bb")
    assert mine != second.path()
    assert reclaim(base, grace=0) == Reclaimed()
    first.close()  # removes its own directory and lock, and only those
    assert not mine.exists() and not (base / f"{mine.name}.lock").exists()
    assert reclaim(base, grace=0) == Reclaimed()
    assert (second.path() / "b.pack").read_bytes() == b"bb"
    second.close()
    assert list(base.iterdir()) == []


def test_a_removed_scratch_directory_is_claimed_afresh(tmp_path: Path) -> None:
    base = tmp_path / "cache" / "staging"
    scratch = ScratchDir(base)
    old = scratch.path()
    for path in base.iterdir():  # a cleared cache
        path.unlink() if path.is_file() else os.rmdir(path)
    new = scratch.path()
    assert new != old and new.is_dir() and (base / f"{new.name}.lock").is_file()
    assert reclaim(base, grace=0) == Reclaimed()  # the new claim is locked
    scratch.close()
    assert list(base.iterdir()) == []


def test_loose_files_go_by_age_and_nothing_else_is_touched(tmp_path: Path) -> None:
    base = tmp_path / "tmp"
    base.mkdir()
    now = time.time()
    old, fresh = base / f"{'01' * 16}.part", base / f"{'45' * 16}.pack"  # casckpt's before scratch dirs
    old.write_bytes(b"o" * 7)
    fresh.write_bytes(b"f")
    os.utime(old, (now - 7200, now - 7200))
    foreign = base / "results.csv"  # a location may share its directory with other files
    foreign.write_bytes(b"someone else's")
    os.utime(foreign, (now - 7200, now - 7200))
    os.mkfifo(base / "fifo.part")
    os.utime(base / "fifo.part", (now - 7200, now - 7200))
    (base / "link.part").symlink_to("/dev/zero")
    (base / "not-a-token").mkdir()
    orphan = base / ("ab" * 16)  # a token directory whose lock is gone: its owner is
    orphan.mkdir()
    (orphan / "x.part").write_bytes(b"xyz")
    done = reclaim(base, grace=3600, now=now)
    assert done == Reclaimed(2, 10)
    assert sorted(p.name for p in base.iterdir()) == [
        f"{'45' * 16}.pack", "fifo.part", "link.part", "not-a-token", "results.csv"]


def test_reclaim_of_a_missing_base_is_nothing(tmp_path: Path) -> None:
    assert reclaim(tmp_path / "never-made") == Reclaimed()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_removes_its_parents_directory(tmp_path: Path) -> None:
    scratch = ScratchDir(tmp_path / "staging")
    directory = scratch.path()
    pid = os.fork()
    if pid == 0:  # the child closes its copy (as a DataLoader worker's exit might) and writes
        try:
            scratch.close()
            mine = scratch.path()
            os._exit(0 if mine != directory and directory.is_dir() else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert directory.is_dir()
    assert reclaim(tmp_path / "staging", grace=0).files == 0  # the child's own went with it
    scratch.close()
