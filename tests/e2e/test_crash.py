"""Invariant 3: a SIGKILL at any instant of a commit leaves the store consistent.

A child process (tests/helpers/crash_child.py, forked warm from the fork
server of the ``forked_python`` fixture, which imported torch once) commits a sequence of deterministic
states into a store with small chunks and packs, and is killed with SIGKILL
either at a chosen protocol point (a wrapped function, in the child only) or
after a random delay while this process restores concurrently.
Afterwards: ``check(read_data=True)`` is clean, every version committed
before the kill restores bit-exact, the interrupted version is invisible (or,
killed after publishing, complete), and committing it again works.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
from doubles import ForkedPython, Zygote

import casckpt
from casckpt.errors import RefNotFoundError, VersionExistsError

CHILD = Path(__file__).resolve().parents[1] / "helpers" / "crash_child.py"
SEED = 7
KILLED = -signal.SIGKILL


def _load_child() -> ModuleType:
    spec = importlib.util.spec_from_file_location("casckpt_tests_crash_child", CHILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load_child()


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@dataclass
class Child:
    """One committing process forked by the zygote."""

    zygote: Zygote
    pid: int
    out: Path
    err: Path
    status: int | None = None

    def output(self) -> str:
        return f"stdout: {_text(self.out)}\nstderr: {_text(self.err)}"

    def kill(self) -> None:
        if self.status is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 120) -> int:
        """Reap the child and return its exit code (negative: killed by that signal)."""
        if self.status is not None:
            return self.status
        try:
            self.status = self.zygote.ask({"op": "wait", "pid": self.pid}, timeout)["status"]
        except TimeoutError:
            os.kill(self.pid, signal.SIGKILL)
            assert self.zygote.proc.stdout is not None
            self.status = json.loads(self.zygote.proc.stdout.readline())["status"]
            raise AssertionError(f"the child hung and was killed\n{self.output()}") from None
        assert self.status is not None
        return self.status

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while "ready" not in _text(self.out):
            assert time.monotonic() < deadline, f"the child did not start\n{self.output()}"
            time.sleep(0.002)


@pytest.fixture
def zygote(forked_python: ForkedPython) -> Zygote:
    """The worker's one warm fork server (children run ``python crash_child.py ARGS``)."""
    return forked_python.server


@contextmanager
def _child(zygote: Zygote, tmp: Path, steps: int, *kill: object) -> Iterator[Child]:
    """Fork a committing child; it is SIGKILLed and reaped on the way out if still running."""
    args = [str(CHILD), str(tmp / "store"), str(SEED), str(steps), str(tmp / "done"), *map(str, kill)]
    out, err = tmp / "child.out", tmp / "child.err"
    pid = zygote.ask({"op": "spawn", "args": args, "stdout": str(out), "stderr": str(err)}, 30)["pid"]
    proc = Child(zygote, pid, out, err)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _done_steps(done: Path) -> list[int]:
    if not done.exists():
        return []
    return [int(line) for line in done.read_text().split()]


def _open(store: Path) -> casckpt.Store:
    return casckpt.open(store, create=False, chunk_size=child.CHUNK_SIZE,
                        pack_size=child.PACK_SIZE, workers=2)


def _assert_restores(store: casckpt.Store, step: int) -> None:
    child.assert_same(store.restore(f"{child.RUN}@{step}"), child.make_state(SEED, step))


def _visible_steps(store: casckpt.Store) -> list[int]:
    if child.RUN not in {r.name for r in store.runs()}:
        return []
    return sorted(v.step for v in store.log(child.RUN))


def _assert_clean(store: casckpt.Store) -> None:
    report = store.ops.check(read_data=True)
    if report.problems:  # killed after publishing, before mirroring its tag: repair writes it
        assert {p.kind for p in report.problems} == {"record"}, report.problems
        assert store.ops.repair().records_written == len(report.problems)
        report = store.ops.check(read_data=True)
    assert report.ok, f"check found problems after the crash: {report.problems}"
    assert report.chunks_read == report.chunks
    assert report.chunks > 0 or report.versions == 0  # a kill before the first publish leaves none


def _assert_recovered(store_dir: Path, done: list[int], interrupted: int | None,
                      interrupted_visible: bool) -> None:
    """The whole post-crash contract, then a fresh commit of the interrupted step."""
    with _open(store_dir) as store:
        _assert_clean(store)
        visible = _visible_steps(store)
        expected = sorted(done + ([interrupted] if interrupted_visible else []))
        assert visible == expected, f"visible steps {visible}, committed before the kill {done}"
        assert store.ops.stats().versions == len(expected)
        commits = [r.target for r in store.ops.audit(action="commit")]  # a row iff the version is visible
        assert sorted(commits) == sorted(v.id for v in store.log()), "audit rows != visible versions"
        if len(done) >= 2:  # the child delta-coded its later commits (the crash hit such a commit)
            assert store.ops.stats().delta_chunks > 0
        for step in expected:
            _assert_restores(store, step)
        if interrupted is None:
            return
        if interrupted_visible:
            with pytest.raises(VersionExistsError):
                store.commit(child.make_state(SEED, interrupted), run=child.RUN, step=interrupted)
            interrupted += 1
        else:
            with pytest.raises(RefNotFoundError):
                store.resolve(f"tag:s{interrupted}")
        store.commit(child.make_state(SEED, interrupted), run=child.RUN, step=interrupted,
                     tags=[f"s{interrupted}"])
        _assert_restores(store, interrupted)
        assert store.resolve(f"tag:s{interrupted}").step == interrupted
        _assert_clean(store)


# (point, before/after the real call, step being committed, n-th call during that step)
KILL_POINTS = [
    pytest.param("packer.add", "before", 2, 30, id="mid-pack"),
    pytest.param("blobs.put_file", "before", 2, 3, id="before-pack-upload"),
    pytest.param("blobs.put_file", "after", 2, 2, id="pack-uploaded-not-cataloged"),
    pytest.param("catalog.add_pack", "after", 2, 4, id="all-packs-cataloged"),
    pytest.param("blobs.put_manifest", "before", 2, 1, id="before-manifest"),
    pytest.param("blobs.put_manifest", "after", 2, 1, id="manifest-written"),
    pytest.param("catalog.add_version", "before", 2, 1, id="before-publish"),
    pytest.param("catalog._set_tag", "before", 2, 1, id="inside-publish-transaction"),
    pytest.param("catalog.audit_in", "after", 2, 1, id="audit-row-written-not-committed"),
    pytest.param("catalog.add_version", "after", 2, 1, id="after-publish"),
    pytest.param("catalog.add_pack", "before", 0, 3, id="first-commit-of-new-store"),
]


@pytest.mark.parametrize(("point", "when", "step", "nth"), KILL_POINTS)
def test_sigkill_at_protocol_point(zygote: Zygote, tmp_path: Path, point: str, when: str,
                                   step: int, nth: int) -> None:
    store_dir, done_file = tmp_path / "store", tmp_path / "done"
    with _child(zygote, tmp_path, step + 2, point, when, step, nth) as proc:
        status = proc.wait()
    assert status == KILLED, (
        f"the child was not killed at {point} ({when}, call {nth} of step {step}): "
        f"exit {status}\n{proc.output()}"
    )
    done = _done_steps(done_file)
    assert done == list(range(step)), f"steps committed before the kill: {done}"
    published = point == "catalog.add_version" and when == "after"
    _assert_recovered(store_dir, done, step, interrupted_visible=published)


@pytest.mark.parametrize("case", range(3))
def test_sigkill_at_random_time_while_restoring(zygote: Zygote, tmp_path: Path, case: int) -> None:
    rng = random.Random(1000 + case)
    delay = rng.uniform(0.05, 0.7)
    store_dir, done_file = tmp_path / "store", tmp_path / "done"
    with _child(zygote, tmp_path, 80) as proc:
        proc.wait_ready()
        deadline = time.monotonic() + delay
        with _open(store_dir) as reader:
            while time.monotonic() < deadline:
                # Whatever is visible while the child commits is complete.
                versions = reader.log(child.RUN, limit=1) if _visible_steps(reader) else []
                if versions:
                    child.assert_same(reader.restore(versions[0]),
                                      child.make_state(SEED, versions[0].step))
        proc.kill()
        status = proc.wait()
    assert status == KILLED, f"child finished before the kill at {delay:.3f}s\n{proc.output()}"
    done = _done_steps(done_file)
    with _open(store_dir) as store:
        visible = _visible_steps(store)
    # The kill may land after the publishing transaction but before the step was recorded.
    assert visible in (done, done + [len(done)]), f"visible {visible}, done {done}"
    interrupted_visible = visible != done
    _assert_recovered(store_dir, done, len(done), interrupted_visible)


# -- leftovers: what a killed commit leaves, the next open reclaims; a live one's, never --------


def _scratch_bases(store_dir: Path) -> list[Path]:
    return [store_dir / "cache" / "staging", store_dir / "tmp"]


def _leftover_files(store_dir: Path) -> list[Path]:
    """Staging packs and temporary objects (lock files aside)."""
    return [p for base in _scratch_bases(store_dir) if base.exists()
            for p in base.rglob("*") if p.is_file() and p.suffix != ".lock"]


@pytest.mark.parametrize(("point", "nth", "where"), [
    pytest.param("packer.add", 30, "staging", id="staging-pack"),
    pytest.param("blobs.place_manifest", 1, "tmp", id="temporary-object"),
])
def test_sigkill_leftovers_are_reclaimed_by_the_next_open(zygote: Zygote, tmp_path: Path, point: str,
                                                         nth: int, where: str) -> None:
    store_dir = tmp_path / "store"
    with _child(zygote, tmp_path, 4, point, "before", 2, nth) as proc:
        status = proc.wait()
    assert status == KILLED, f"the child was not killed at {point}\n{proc.output()}"
    left = _leftover_files(store_dir)
    assert any(where in p.parts for p in left), f"the kill left nothing in {where}: {left}"
    with _open(store_dir) as store:
        assert _leftover_files(store_dir) == []
        _assert_clean(store)
        assert _visible_steps(store) == [0, 1]
    for base in _scratch_bases(store_dir):  # nor does the reader leave anything of its own
        assert not base.exists() or list(base.iterdir()) == []


def test_opening_the_store_never_reclaims_a_live_committers_files(zygote: Zygote, tmp_path: Path) -> None:
    store_dir, done_file = tmp_path / "store", tmp_path / "done"
    steps = 10
    with _child(zygote, tmp_path, steps) as proc:
        deadline = time.monotonic() + 120
        while not _done_steps(done_file):  # its staging and temp directories exist from now on
            assert time.monotonic() < deadline, f"the child committed nothing\n{proc.output()}"
            time.sleep(0.01)
        live = [p for base in _scratch_bases(store_dir) for p in base.iterdir() if p.is_dir()]
        assert {p.parent.name for p in live} == {"staging", "tmp"}, live
        opened = 0
        while len(_done_steps(done_file)) < steps and time.monotonic() < deadline:
            with _open(store_dir):  # reclaims leftovers while the child commits
                opened += 1
            gone = [p for p in live if not p.is_dir()]
            # the child writes each step to the done file before it goes on (and, last, closes)
            assert not gone or len(_done_steps(done_file)) == steps, \
                f"a live committer's directories were reclaimed: {gone}"
        assert opened >= 2 and proc.wait() == 0, proc.output()
    assert _done_steps(done_file) == list(range(steps))
    _assert_recovered(store_dir, list(range(steps)), None, interrupted_visible=False)
