"""gc tells the truth, in a form cron can keep (issue 14, cases 5 and 6).

- ``bytes_freed`` is what this run deleted from the locations, byte for byte;
  what becomes free only after the grace period is ``bytes_pending``.
- One ``gc --grace 0s`` reclaims everything reclaimable, packs it repacked included.
- A dry run says "would"; the stderr line is readable, never a raw dict.
- ``--json`` is one line per run (JSON Lines), without per-version decisions
  unless ``--explain``; a refused or locked-out run still prints one JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from doubles import ForkedPython
from typer.testing import CliRunner

import casckpt
from casckpt.catalog.locks import gc_lock
from casckpt.cli.main import app
from casckpt.testing.internals import internals

CHUNK = 4096


def _noise(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _open(root: Path) -> casckpt.Store:
    return casckpt.open(root, chunk_size=CHUNK, pack_size=1 << 20)


def _objects(root: Path) -> dict[str, int]:
    return {p.relative_to(root).as_posix(): p.stat().st_size for top in ("packs", "manifests")
            for p in (root / top).rglob("*") if p.is_file()}


def _disk_bytes(root: Path) -> int:
    return sum(_objects(root).values())


def _cli(root: Path, *args: str) -> Any:
    return CliRunner().invoke(app, ["--store", str(root), *args])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Step 1 holds a big tensor and a small one in one pack; step 2 keeps only the small one."""
    root = tmp_path / "store"
    with _open(root) as store:
        store.commit({"big": _noise(1, 60_000), "small": _noise(2, 3_000)}, run="r", step=1)
        store.commit({"small": _noise(2, 3_000), "other": _noise(3, 2_000)}, run="r", step=2)
    return root


def test_bytes_freed_is_what_left_the_disk_and_one_grace_0_run_reclaims_everything(root: Path) -> None:
    with _open(root) as store:
        store.delete("r@1")
        before = _objects(root)
        report = store.gc(grace=0)
        after = _disk_bytes(root)
        gone = sum(size for key, size in before.items() if key not in _objects(root))
        assert report.packs_repacked == 1  # the small tensor's chunks moved out of the dead pack
        assert report.bytes_freed == gone > 60_000 * 4 * 0.9
        assert report.bytes_pending == 0
        again = store.gc(grace=0)  # nothing was left for a second run
        assert (again.packs_deleted, again.packs_repacked, again.orphans_deleted, again.bytes_freed) == (
            0, 0, 0, 0)
        assert _disk_bytes(root) == after
        assert torch.equal(store.restore("r@2")["small"], _noise(2, 3_000))
        assert store.ops.check(read_data=True).ok


def test_inside_the_grace_period_nothing_is_freed_and_the_pending_bytes_are_reported(root: Path) -> None:
    with _open(root) as store:
        store.delete("r@1")
        before = _disk_bytes(root)
        report = store.gc()  # default grace: six hours
        assert report.bytes_freed == 0 == before - _disk_bytes(root)
        assert report.bytes_pending > 60_000 * 4 * 0.8  # fp32 noise in byte planes: ~0.87 of raw
        assert "more is freed by a gc after the 21600 s grace period" in report.describe()


def test_dry_run_says_would_and_estimates_what_a_real_run_frees(root: Path) -> None:
    with _open(root) as store:
        store.retention.set("r", keep_last=1)
        dry = store.gc(dry_run=True, grace=0)
        assert dry.dry_run and dry.versions_deleted == 1
        assert dry.describe().startswith("gc would delete 1 version(s) by retention")
        real = store.gc(grace=0)
        assert real.describe().startswith("gc deleted 1 version(s) by retention")
        # the same packs go, whether step 1's big tensor shared a pack with the kept one
        # (repacked, then deleted) or not (deleted whole)
        assert (dry.packs_deleted, dry.packs_repacked) == (real.packs_deleted - real.packs_repacked,
                                                           real.packs_repacked), (dry, real)
        assert 0 < dry.bytes_freed <= real.bytes_freed, (dry, real)
    result = _cli(root, "gc", "--dry-run", "--grace", "0s")
    assert result.exit_code == 0, result.output
    assert "casckpt: gc would delete" in result.stderr and "{'" not in result.stderr
    assert "would be chunks swept" in result.stdout


def test_json_is_one_line_per_run_and_small(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with _open(root) as store:
        for step in range(68):
            store.commit({"w": torch.full((100,), float(step))}, run="r", step=step)
        store.retention.set("r", keep_last=5)
    log = tmp_path / "gc.jsonl"
    for _ in range(3):
        result = _cli(root, "gc", "--json", "--grace", "0s")
        assert result.exit_code == 0, result.output
        assert result.stdout.count("\n") == 1
        with log.open("a") as f:
            f.write(result.stdout)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["versions_deleted"] for r in runs] == [63, 0, 0]
    assert runs[0]["ok"] is True and runs[0]["retention"] == {"r": {"kept": 5, "deleted": 63}}
    assert all(len(line) < 2000 for line in log.read_text().splitlines())  # not 60 KB of decisions
    explained = _cli(root, "gc", "--json", "--explain", "--dry-run")
    doc = json.loads(explained.stdout)
    assert explained.stdout.count("\n") == 1 and len(doc["decisions"][0]["decisions"]) == 5


def test_a_locked_out_run_prints_a_json_object_and_exits_6(root: Path) -> None:
    with _open(root) as store, gc_lock(internals(store).catalog):
        result = _cli(root, "gc", "--json")
    assert result.exit_code == 6
    doc = json.loads(result.stdout)
    assert doc == {"ok": False, "error": "GCRunningError", "exit_code": 6, "message": doc["message"]}
    assert "another casckpt gc is running" in doc["message"]


KILLED = """
import os, signal, sys
import casckpt
from casckpt.testing.internals import internals
store = casckpt.open(sys.argv[1], create=False)
scratch = internals(store).staging.path()  # what a commit writes its staging packs into
(scratch / "half-written.pack").write_bytes(b"x" * 4096)
print(scratch, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_gc_reclaims_the_staging_files_of_a_killed_committer(root: Path, forked_python: ForkedPython) -> None:

    with _open(root) as store:  # open before the committer dies: opening did not reclaim it
        child = forked_python.run(["-c", KILLED, str(root)], timeout=120)
        assert child.returncode == -9, child.stderr
        scratch = Path(child.stdout.strip())
        assert (scratch / "half-written.pack").exists()
        report = store.gc()
        assert report.leftovers_deleted == 1 and report.bytes_freed >= 4096
        assert not scratch.exists()
        assert store.ops.check().ok
