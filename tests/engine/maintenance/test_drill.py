"""Restore drills (``store.ops.drill``, ``casckpt drill``) and the stall every commit records.

A drill reads versions back through the verified restore path into memory, records each
result in the catalog (``drills``, with a ``drill`` audit row) and changes nothing else: the
store with a deliberately corrupted pack below is compared file by file and table by table
before and after.
"""

from __future__ import annotations

import json
import random
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner, Result

import casckpt
from casckpt.catalog.rows import VersionRow
from casckpt.cli.main import app
from casckpt.cli.shared import EXIT_INTEGRITY
from casckpt.engine.maintenance.drill import pick
from casckpt.errors import InvalidArgumentError, RunNotFoundError

CHUNK = 4096


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(20_000, generator=g), "step": seed}


def _packs(root: Path) -> set[Path]:
    return set((root / "packs").rglob("*/*"))


def _build(root: Path) -> Path:
    """Runs ``a`` (steps 1..3) and ``b`` (step 1); returns a pack only ``a@3`` uses."""
    with casckpt.open(root, chunk_size=CHUNK, pack_size=64 << 10, workers=2) as store:
        for step in (1, 2):
            store.commit(_state(step), run="a", step=step)
        store.commit(_state(10), run="b", step=1)
        before = _packs(root)
        store.commit(_state(3), run="a", step=3)
    return max(_packs(root) - before, key=lambda p: p.stat().st_size)


def _corrupt(pack: Path) -> None:
    data = bytearray(pack.read_bytes())
    data[len(data) // 2] ^= 0x5A
    pack.write_bytes(bytes(data))


def _files(root: Path) -> dict[str, bytes]:
    """Every file of the store but the catalog (compared table by table) and the cache."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and not p.name.startswith("catalog.db") and "cache" not in p.parts}


def _tables(root: Path) -> dict[str, list[tuple[object, ...]]]:
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {n: sorted(db.execute(f'SELECT * FROM "{n}"').fetchall(), key=repr) for n in names}


def cli(root: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["--store", str(root), *args])


@pytest.fixture
def damaged(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    _corrupt(_build(root))
    return root


def test_a_drill_finds_the_corrupt_pack_records_it_and_changes_nothing_else(damaged: Path) -> None:
    files, tables = _files(damaged), _tables(damaged)
    with casckpt.open(damaged, create=False) as store:
        bad = store.resolve("a@3")
        report = store.ops.drill(count=10, seed=0)
        assert report.recorded and not report.ok
        assert [(r.run, r.step) for r in report.results] == [("a", 1), ("a", 2), ("a", 3), ("b", 1)]
        assert [r.version_id for r in report.failed] == [bad.id]
        failure = report.failed[0]
        assert failure.error is not None and "corrupt" in failure.error  # the typed error's message
        assert all(r.ok and r.error is None and r.bytes == 80_000 for r in report.results if r is not failure)
        assert len({r.drill_id for r in report.results}) == 1
        assert store.ops.drill_history() == list(reversed(report.results))  # newest first
        assert store.ops.drill_history(limit=1, run="b") == [report.results[-1]]
        (row,) = store.ops.audit(action="drill")
        assert row.detail["drill_id"] == report.drill_id and row.detail["failed_versions"] == [bad.id]
        # a drill does not repair: a restore still fails the same way
        with pytest.raises(casckpt.errors.IntegrityError):
            store.restore("a@3")
    assert _files(damaged) == files  # the corrupt pack is as it was, nothing written
    after = _tables(damaged)
    assert after.pop("drills") == sorted(
        ((i + 1, r.drill_id, r.at, r.version_id, r.run, r.step, r.bytes, r.seconds, int(r.ok), r.error)
         for i, r in enumerate(report.results)), key=repr)
    assert tables.pop("drills") == []
    audit_before, audit_after = tables.pop("audit_log"), after.pop("audit_log")
    assert audit_after[: len(audit_before)] == audit_before and len(audit_after) == len(audit_before) + 1
    assert after == tables


def test_the_cli_exits_with_the_integrity_code_naming_the_version(damaged: Path) -> None:
    with casckpt.open(damaged, create=False) as store:
        bad = store.resolve("a@3")
    result = cli(damaged, "drill", "--run", "a", "--count", "1")
    assert result.exit_code == EXIT_INTEGRITY, result.output
    assert f"a@3 ({bad.short_id}) did not restore" in result.stderr
    assert "FAILED" in result.stdout

    result = cli(damaged, "drill", "--run", "b", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] and doc["recorded"] and [r["step"] for r in doc["results"]] == [1]

    result = cli(damaged, "drill", "--json", "--seed", "1")
    assert result.exit_code == EXIT_INTEGRITY
    doc = json.loads(result.stdout)
    assert not doc["ok"] and [r["ok"] for r in doc["results"] if r["version_id"] == bad.id] == [False]

    history = cli(damaged, "drill", "--history", "--json")
    past = json.loads(history.stdout)
    newest_first = [(r["run"], r["step"], r["ok"]) for r in past]
    assert newest_first[-2:] == [("b", 1, True), ("a", 3, False)]
    assert len(past) == 1 + 1 + 3  # three drills: a@3; b@1; the latest of each run and one more
    table = cli(damaged, "drill", "--history", "--run", "a", "--limit", "1")
    assert table.exit_code == 0 and "a@3" in table.stdout and "b@1" not in table.stdout


def test_a_read_only_store_drills_without_recording(damaged: Path) -> None:
    before = _tables(damaged)
    with casckpt.open(damaged, create=False, read_only=True) as store:
        report = store.ops.drill(runs=["b"])
        assert report.ok and not report.recorded and store.ops.drill_history() == []
    assert _tables(damaged) == before
    result = cli(damaged, "--read-only", "drill", "--run", "b")
    assert result.exit_code == 0 and "not recorded" in result.stderr


def test_a_lost_version_fails_the_drill_without_a_read(tmp_path: Path) -> None:
    root = tmp_path / "store"
    _build(root)
    with casckpt.open(root, create=False) as store:
        lost = store.resolve("b@1")
    with closing(sqlite3.connect(root / "catalog.db")) as db, db:  # as a lost fast tier leaves it
        db.execute("UPDATE versions SET durability = 'lost' WHERE id = ?", (lost.id,))
    with casckpt.open(root, create=False) as store:
        (result,) = store.ops.drill(runs="b").results
        assert not result.ok and result.error is not None and "lost before it drained" in result.error


def _row(run: str, step: int) -> VersionRow:
    return VersionRow(f"{run}{step:062d}", run, step, None, 0.0, 1, 0, 0, 0.0, "{}", "{}", None)


def test_pick_takes_the_latest_of_each_run_then_seeded_older_ones() -> None:
    rows = [_row(run, step) for run in ("a", "b") for step in range(1, 11)]
    latest = {("a", 10), ("b", 10)}
    assert {(r.run, r.step) for r in pick(rows, 1, random.Random(0))} == latest  # never fewer
    chosen = [(r.run, r.step) for r in pick(rows, 5, random.Random(7))]
    assert len(chosen) == 5 and latest <= set(chosen) and chosen == sorted(chosen)
    assert chosen == [(r.run, r.step) for r in pick(rows, 5, random.Random(7))]  # seeded: repeatable
    assert len(pick(rows, 100, random.Random(1))) == 20 and pick([], 3, random.Random(1)) == []


def test_bad_drill_arguments_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit(_state(1), run="a", step=1)
        with pytest.raises(RunNotFoundError, match="no run"):
            store.ops.drill(runs=["a", "nope"])
        for count in (0, -1, 1.5, True):
            with pytest.raises(InvalidArgumentError, match="count must be a positive int"):
                store.ops.drill(count=count)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="limit"):
            store.ops.drill_history(limit=0)
        assert store.ops.drill_history() == []


def test_commits_record_their_stall(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        blocking = store.commit(_state(1), run="a", step=1)
        assert blocking.stall_s == blocking.duration_s > 0
        background = store.commit(_state(2), run="a", step=2, block=False).wait()
        assert background.stall_s is not None and 0 < background.stall_s
        logged = {v.step: v.stall_s for v in store.log("a")}
        assert logged == {1: blocking.stall_s, 2: background.stall_s}
        assert store.show("a@2").version.stall_s == background.stall_s


def test_drills_are_recorded_in_a_postgresql_catalog(tmp_path: Path, pg_url: str) -> None:
    with casckpt.open(tmp_path / "store", catalog=pg_url) as store:
        store.commit(_state(1), run="a", step=1)
        store.commit(_state(2), run="a", step=2, block=False).wait()
        report = store.ops.drill(count=2)
        assert report.ok and store.ops.drill_history() == list(reversed(report.results))
        (row,) = store.ops.audit(action="drill")
        assert row.detail["versions"] == 2 and row.db_user  # the role that recorded it
        assert all(v.stall_s is not None and v.stall_s > 0 for v in store.log("a"))


def test_a_drill_reads_around_a_damaged_shard_without_healing_it(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with casckpt.open(root, blobs=["d0", "d1", "d2"]) as store:
        store.locations.set_redundancy("ec:2+1")
        store.commit(_state(1), run="a", step=1)
    with closing(sqlite3.connect(root / "catalog.db")) as db:  # data shard 0 of the biggest pack
        key, url = db.execute(
            "SELECT s.key, l.url FROM shards s JOIN locations l ON l.id = s.location_id "
            "JOIN packs p ON p.id = s.pack_id WHERE s.idx = 0 ORDER BY p.size DESC LIMIT 1").fetchone()
    shard = Path(url.removeprefix("file://")) / key
    _corrupt(shard)
    damaged = shard.read_bytes()
    with casckpt.open(root, create=False) as store:
        assert store.ops.drill().ok  # reconstructed from the other shards
        assert store.show("a@1").degraded  # marked for repair, as check marks it
    assert shard.read_bytes() == damaged  # ... and not healed: repair does that


def test_a_drill_reads_the_locations_not_this_hosts_fast_tier(tmp_path: Path) -> None:
    """A restore on the committing host reads its fast tier; a drill asks what a restart
    anywhere gets, so it reads the locations (here damaged) and fails, and it does not drill
    a version still waiting for its drain."""
    import fcntl
    import os

    state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    with casckpt.open(tmp_path / "s", blobs=[str(tmp_path / "durable")],
                      fast_tier=str(tmp_path / "fast")) as store:
        v1 = store.commit(state, run="r", step=1, durable=True)
        for pack in (tmp_path / "durable" / "packs").glob("*/*"):
            data = bytearray(pack.read_bytes())
            data[300:364] = b"\xff" * 64
            pack.write_bytes(bytes(data))
        assert torch.equal(store.restore(v1)["w"], state["w"])  # from the tier: intact
        tier = Path(store.tier.status().local_path or "")
        fd = os.open(tier / "drain.lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)  # nothing drains: step 2 stays on the tier
        try:
            store.commit({"w": state["w"] + 1}, run="r", step=2)
            report = store.ops.drill(count=5)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
    assert [(r.step, r.ok) for r in report.results] == [(1, False)]
    assert "corrupt" in (report.results[0].error or "").lower()


def test_drilling_a_named_run_with_nothing_to_restore_is_not_ok(tmp_path: Path) -> None:
    # `casckpt drill --run a` exited 0 ("the store has no versions to drill") when every version
    # of run a was deleted: a cron drill said all is well for a run no restart can bring back
    from typer.testing import CliRunner

    from casckpt.cli.main import app
    from casckpt.cli.shared import EXIT_NOT_FOUND

    root = tmp_path / "store"
    with casckpt.open(root) as store:
        store.commit({"w": torch.zeros(4)}, run="a", step=0)
        store.commit({"w": torch.zeros(4)}, run="b", step=0)
        store.delete("a@0")
        with pytest.raises(casckpt.errors.RefNotFoundError, match="no version to drill"):
            store.ops.drill(runs=["a", "b"])
        assert store.ops.drill_history() == []  # nothing recorded
        assert store.ops.drill().ok  # every run: b is drilled, a (empty) is not named
    result = CliRunner().invoke(app, ["--store", str(root), "drill", "--run", "a"])
    assert result.exit_code == EXIT_NOT_FOUND and "no version to drill" in result.output
