"""GC against other processes: concurrent committers, and a GC killed with SIGKILL."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app

HELPER = Path(__file__).parents[2] / "helpers" / "gc_worker.py"
sys.path.insert(0, str(HELPER.parent))

from gc_worker import content  # noqa: E402

CHUNK = 4096


def _spawn(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(HELPER), *args])


def _visible_steps(done: Path) -> set[int]:
    steps: set[int] = set()
    for line in done.read_text().split():  # "+STEP" committed, "-STEP" deleted
        if line[0] == "+":
            steps.add(int(line[1:]))
        else:
            steps.discard(int(line[1:]))
    return steps


@pytest.mark.slow
def test_commits_racing_a_gc_loop_lose_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    casckpt.open(root, chunk_size=CHUNK).close()
    stop, count = tmp_path / "stop", tmp_path / "gc-runs"
    gc_proc = _spawn("collector", str(root), str(stop), str(count))
    writers = [
        _spawn("writer", str(root), str(tmp_path / f"cache{w}"), str(w), "8", str(stop),
               str(tmp_path / f"done{w}"))
        for w in range(3)
    ]
    try:
        assert [p.wait(timeout=300) for p in writers] == [0, 0, 0]
    finally:
        stop.touch()
        assert gc_proc.wait(timeout=300) == 0
    assert int(count.read_text()) >= 2  # the collector really ran alongside
    with casckpt.open(root, create=False) as store:
        for w in range(3):
            expected = _visible_steps(tmp_path / f"done{w}")
            assert {v.step for v in store.log(f"w{w}")} == expected
            for step in expected:
                restored = store.restore(f"w{w}@{step}")
                want = content(w, step)
                assert all(torch.equal(restored[k], want[k]) for k in want), (w, step)
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems[:3]
        store.gc(grace=0)
        assert store.ops.check(read_data=True).ok


def _prepare(root: Path) -> tuple[dict[int, dict[str, torch.Tensor]], int]:
    """Versions 0..7 of run r, sharing some chunks; 0..5 deleted. Returns survivors and packs."""
    with casckpt.open(root, chunk_size=CHUNK, pack_size=32 << 10) as store:
        states = {i: content(0, i + 4 * (i // 4)) for i in range(8)}  # some chunks shared
        for i, state in states.items():
            store.commit(state, run="r", step=i)
        for i in range(6):
            store.delete(f"r@{i}")
        pack_bytes = store.ops.stats().pack_bytes
    return {i: states[i] for i in (6, 7)}, pack_bytes


@pytest.mark.parametrize("point,n", [
    ("mark", 1), ("delete-object", 1),  # one kill before anything is deleted, one midway
    *(pytest.param(p, n, marks=pytest.mark.slow) for p, n in [
        ("purge", 1), ("condemn", 1), ("mark", 2), ("sweep", 1), ("delete-object", 3), ("relocate", 1)]),
])
def test_gc_killed_at_any_point_leaves_a_consistent_store(tmp_path: Path, point: str, n: int) -> None:
    root = tmp_path / "store"
    survivors, pack_bytes_before = _prepare(root)
    proc = _spawn("killed-gc", str(root), point, str(n))
    assert proc.wait(timeout=120) == -signal.SIGKILL  # killed where intended, not finished
    with casckpt.open(root, create=False) as store:
        assert store.ops.check(read_data=True).ok
        assert {v.step for v in store.log("r")} == set(survivors)
        for step, state in survivors.items():
            restored = store.restore(f"r@{step}")
            assert all(torch.equal(restored[k], state[k]) for k in state)
        store.gc(grace=0)  # the next run finishes the job (and repacks)
        store.gc(grace=0)  # packs emptied by repacking go one run later
        stats = store.ops.stats()
        assert stats.versions == 2 and stats.pack_bytes < pack_bytes_before
        distinct = {t.numpy().tobytes() for s in survivors.values() for t in s.values()}
        assert stats.unique_bytes == sum(len(b) for b in distinct)  # everything else reclaimed
        assert store.ops.check(read_data=True).ok
        orphans = [p for p in (root / "packs").rglob("*") if p.is_file()]
        assert len(orphans) == stats.packs  # no object left that the catalog does not know


def test_gc_history_counts_what_a_killed_gc_committed(tmp_path: Path) -> None:
    """A gc killed with -9 prints no JSON line; `gc --history` still counts its deletions,
    exactly as the catalog shows them, and adds them to the totals of the runs after it."""
    root = tmp_path / "store"
    with casckpt.open(root, chunk_size=CHUNK, pack_size=32 << 10) as store:
        for i in range(8):
            store.commit(content(0, i + 4 * (i // 4)), run="r", step=i)
        store.retention.set("r", keep_last=2)
        packs_before = store.ops.stats().packs
    proc = _spawn("killed-gc", str(root), "purge", "1")  # killed once the purge committed
    assert proc.wait(timeout=120) == -signal.SIGKILL
    with sqlite3.connect(root / "catalog.db") as db:
        purged = db.execute("SELECT count(*) FROM tombstones WHERE reason = 'purged'").fetchone()[0]
        packs_after = db.execute("SELECT count(*) FROM packs").fetchone()[0]
    with casckpt.open(root, create=False) as store:
        assert {v.step for v in store.log("r")} == {6, 7}
        [killed] = store.ops.gc_history()
        assert killed.outcome == "unfinished"
        assert (killed.versions_deleted, killed.versions_purged) == (6, 6) == (6, purged)
        assert killed.packs_deleted == packs_before - packs_after > 0
        assert killed.bytes_freed > 0
        store.gc(grace=0, dry_run=True)  # a dry run deletes nothing and is not a run here
        store.commit(content(0, 20), run="r", step=8)
        finished = store.gc(grace=0)  # retention drops step 6 and purges it
    result = CliRunner().invoke(app, ["--store", str(root), "gc", "--history", "--since", "1h", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [r["outcome"] for r in doc["runs"]] == ["unfinished", "finished"]
    total = doc["total"]
    assert total["runs"] == 2
    assert total["versions_deleted"] == 6 + finished.versions_deleted == 7
    assert total["versions_purged"] == 6 + finished.versions_purged == 7
    assert total["bytes_freed"] == killed.bytes_freed + finished.bytes_freed
    table = CliRunner().invoke(app, ["--store", str(root), "gc", "--history"])
    assert table.exit_code == 0 and "unfinished" in table.stdout and "total (2)" in table.stdout
