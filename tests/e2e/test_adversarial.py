"""Findings of an adversarial review, kept as regression tests.

Each test is a way a hostile or careless operator made casckpt break a promise of
docs/GUARANTEES.md or an invariant of DESIGN.md (lose data, delete what it did not
write, exhaust memory, hang, or call a half-built catalog healthy); its docstring
says how it was done and what casckpt does now.
"""

from __future__ import annotations

import glob
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from doubles import ForkedPython

import casckpt
from casckpt.catalog import inventory
from casckpt.catalog import leases as leases_sql
from casckpt.errors import GCRefusedError, InvalidArgumentError, StorageError
from casckpt.testing.internals import internals

# -- helpers ---------------------------------------------------------------------------


def _backup_catalog(store_dir: Path, dest: Path) -> None:
    """An online SQLite backup of the store's catalog (what a nightly backup job makes)."""
    src = sqlite3.connect(store_dir / "catalog.db")
    dst = sqlite3.connect(dest)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


def _install_catalog(store_dir: Path, backup: Path) -> None:
    """Put a catalog backup in place of the store's catalog (the store must be closed)."""
    for suffix in ("-wal", "-shm"):
        (store_dir / f"catalog.db{suffix}").unlink(missing_ok=True)
    os.replace(backup, store_dir / "catalog.db")


def _move_catalog_away(store_dir: Path, dest: Path) -> None:
    os.replace(store_dir / "catalog.db", dest)
    for suffix in ("-wal", "-shm"):
        (store_dir / f"catalog.db{suffix}").unlink(missing_ok=True)


def _rebuilt(store_dir: Path, tmp_path: Path) -> casckpt.Store:
    """Move the catalog away and rebuild a new one from the locations alone."""
    _move_catalog_away(store_dir, tmp_path / "old-catalog.db")
    store = casckpt.open(store_dir, recover=True)
    store.ops.rebuild_catalog()
    return store


def _stale_catalog_after_repack(tmp_path: Path, *, blobs: list[str] | None,
                                redundancy: str | None) -> tuple[Path, torch.Tensor]:
    """A store whose catalog was restored from a backup taken just before a gc repacked a pack.

    r@1 = {a, b}, r@2 = {b}; r@1 deleted; backup; gc(grace=0) purges r@1 and repacks b's half
    dead pack P1 into a new pack P2 (P1 goes). The backup is put back: it knows r@2 and says b
    is in P1 (gone); P2, which holds the only copy of b, is unknown to it. Returns (store, b).
    """
    store_dir = tmp_path / "store"
    store = casckpt.open(store_dir, blobs=blobs, redundancy=redundancy)
    a, b = torch.randn(80_000), torch.randn(20_000)
    store.commit({"a": a, "b": b}, run="r", step=1)
    store.commit({"b": b}, run="r", step=2)
    store.delete("r@1")
    store.close()
    _backup_catalog(store_dir, tmp_path / "backup.db")
    store = casckpt.open(store_dir)
    report = store.gc(grace=0)
    assert report.packs_repacked == 1
    store.close()
    _install_catalog(store_dir, tmp_path / "backup.db")
    return store_dir, b


# -- 1. a location added twice under two spellings of its URL -------------------------


def test_an_alias_of_a_location_is_refused_so_gc_never_takes_its_packs_for_copies(tmp_path: Path) -> None:
    """GUARANTEES 3 / invariant 8. Found: `location add file://DIR/` on a store at DIR (the
    same directory, another spelling; or a bind mount, an NFS path) became a second location;
    gc then took every pack listed under the alias for a stale copy of a known pack and
    unlinked it -- the only copy. Now each location's identity record names its location, so
    the alias reads another location's record: add_location, opening with both names
    configured, and gc all refuse, and nothing is deleted.
    """
    from casckpt.engine.locations.identity import require_match
    from casckpt.errors import StoreIdentityError

    store_dir = tmp_path / "store"
    store = casckpt.open(store_dir)
    w = torch.randn(10_000)
    store.commit({"w": w}, run="r", step=1)
    with pytest.raises(StoreIdentityError, match="same storage under two names"):
        store.locations.add(f"file://{store_dir}/", name="alias")
    assert [loc.name for loc in store.locations.list()] == ["loc0"]
    store.gc(grace=0)
    assert torch.equal(store.restore("r@1")["w"], w)
    store.close()
    # two configured locations that are one directory: refused at open, before any write
    with pytest.raises(InvalidArgumentError, match="are the same place"):
        casckpt.open(tmp_path / "twice", blobs=[str(tmp_path / "d"), f"file://{tmp_path / 'd'}/"])
    assert not (tmp_path / "twice").exists()
    # a record moved in from another of the store's locations: gc deletes nothing
    two = casckpt.open(tmp_path / "two", blobs=[str(tmp_path / "a"), str(tmp_path / "b")])
    two.commit({"w": w}, run="r", step=1)
    shutil.copy(tmp_path / "a" / "casckpt-identity", tmp_path / "b" / "casckpt-identity")
    with pytest.raises(GCRefusedError, match="same storage under two names"):
        require_match(internals(two).catalog, internals(two).locations)
    with pytest.raises(GCRefusedError):
        two.gc(grace=0)
    two.close()


# -- 2. the lease floor waived gc's completeness proof ----------------------------------

_LEASE_HOLDER = """
import sys, time
import casckpt
from casckpt.catalog.leases import begin_lease
from casckpt.testing.internals import internals
store = casckpt.open(sys.argv[1])
begin_lease(internals(store).catalog)  # as a commit before its first write; this one stays in flight
print("leased", flush=True)
time.sleep(600)
"""


def test_a_stale_catalog_backup_carrying_an_old_lease_still_makes_gc_refuse(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GUARANTEES 3: gc "refuses to run when the locations hold manifests the catalog neither
    knows nor has tombstoned" -- a stale catalog backup must never make gc delete anything.

    Found: gc only counted manifests older than the oldest lease as unknown. A catalog backup
    taken while a commit was in flight carries that lease; with its process alive (or on
    another host, where leases are kept for 24 h) every manifest written after the backup was
    exempt. Now no age exempts a manifest: a commit in flight names its version on its lease.

    Reproduction: commit r@0 = {a: X}, r@1; delete r@0 (soft); >5 s later a process starts a
    commit and stays in flight (holds a lease); back up catalog.db; commit r@2 = {a: X} (it
    dedups X's chunk, still live); lose the catalog and restore the backup. `check` reports
    r@2's manifest as unknown, but `gc --grace 0` runs: it purges r@0, condemns and sweeps X's
    chunk (nothing the stale catalog knows references it) and deletes its pack. r@2 is gone for
    good: a catalog rebuild skips it ("1 of its chunks were not found").
    """
    store_dir = tmp_path / "store"
    store = casckpt.open(store_dir)
    x = torch.arange(50_000, dtype=torch.float32)
    store.commit({"a": x}, run="r", step=0)
    store.commit({"b": torch.ones(1000)}, run="r", step=1)
    store.delete("r@0")
    store.close()
    monkeypatch.setattr(leases_sql, "CLOCK_SKEW_S", 0.5)  # 5 s in the product: the sleep would be 6 s
    time.sleep(1)  # the chunks above predate the lease by more than the clock-skew margin
    holder = subprocess.Popen([sys.executable, "-c", _LEASE_HOLDER, str(store_dir)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "leased"
        _backup_catalog(store_dir, tmp_path / "backup.db")
        store = casckpt.open(store_dir)
        store.commit({"a": x.clone()}, run="r", step=2)
        store.close()
        _install_catalog(store_dir, tmp_path / "backup.db")  # the catalog was lost: restore it
        store = casckpt.open(store_dir)
        assert any(p.kind == "manifest" for p in store.ops.check().problems)  # check sees it
        with pytest.raises(GCRefusedError, match="1 manifest"):
            store.gc(grace=0)
        store.close()
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
    store = _rebuilt(store_dir, tmp_path)
    assert torch.equal(store.restore("r@2")["a"], x)
    store.close()


# -- 3. the footer guard gave up on packs it could still read ---------------------------


def test_gc_keeps_an_unknown_ec_pack_it_can_reconstruct_without_a_data_shard(tmp_path: Path) -> None:
    """GUARANTEES 3: "a pack object goes only if its footer lists no chunk a visible version
    references that the catalog does not verifiably hold in another pack; objects gc cannot
    prove are left in place".

    Found: gc read an unknown pack's footer through its *data* shards only; with a data
    shard missing it took the pack for "serving no chunk", although K of its K+M shards were
    there and decode it. Now it rebuilds such a pack in memory to read its footer.

    Reproduction: 3 dirs, ec:2+1; r@1 = {a, b}, r@2 = {b}; delete r@1; back up the catalog;
    gc --grace 0 (repacks b into a new pack P2); restore the backup (a stale catalog: it says
    b is in the old pack). Lose data shard 1 of P2 (one disk's file; ec:2+1 survives that).
    gc --grace 0 with the stale catalog keeps P2's other two shards, and a catalog rebuild
    recovers r@2 from them.
    """
    blobs = [str(tmp_path / f"d{i}") for i in range(3)]
    store_dir, b = _stale_catalog_after_repack(tmp_path, blobs=blobs, redundancy="ec:2+1")
    with sqlite3.connect(store_dir / "catalog.db") as conn:
        known = {r[0] for r in conn.execute("SELECT id FROM packs")}  # r@2's own pack (its tree)

    def unknown(pattern: str) -> list[str]:  # shards of P2, the pack the stale catalog lacks
        return [p for p in glob.glob(str(tmp_path / "d*" / "packs" / "*" / pattern))
                if Path(p).name.split(".")[0] not in known]

    (lost,) = unknown("*.s1")
    os.remove(lost)  # one disk lost one shard: ec:2+1 is meant to survive this
    store = casckpt.open(store_dir)
    store.gc(grace=0)
    store.close()
    left = unknown("*.s*")
    assert len(left) == 2, f"gc deleted shards of a pack it could still decode; left: {left}"
    store = _rebuilt(store_dir, tmp_path)
    assert torch.equal(store.restore("r@2")["b"], b)
    store.close()


def test_gc_keeps_an_unknown_pack_it_cannot_read_for_now(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """GUARANTEES 3 and gcguard's own docstring: a pack "that cannot be read *now* (a storage
    error) stays for a later run".

    Found: every StorageError on a footer read became MissingDataError, so one EIO or a 503
    that outlasted the S3 retries on an orphan pack holding the only copy of a version's chunk
    made gc delete it. Now only an object that is gone (or unreadable for good: a FIFO, a
    symlink out, larger than recorded) counts as serving nothing; other errors keep it.

    Reproduction: the stale-catalog-after-repack store of the test above, one location, no
    redundancy (P2 is an unknown pack holding r@2's chunk b; gc normally keeps it). Make reads
    of P2 fail with a StorageError (here: LocalBlobStore.get_range patched, as an I/O error
    would) and run gc --grace 0: P2 stays, and a rebuild recovers r@2.
    """
    from casckpt.storage.local import LocalBlobStore

    store_dir, b = _stale_catalog_after_repack(tmp_path, blobs=None, redundancy=None)
    store = casckpt.open(store_dir)
    known = {p.id for p in inventory.live_packs(internals(store).catalog)}
    listed = [Path(p).name for p in glob.glob(str(store_dir / "packs" / "*" / "*"))]
    (p2,) = [name for name in listed if name not in known]
    real = LocalBlobStore.get_range

    def flaky(self: LocalBlobStore, key: str, offset: int, length: int) -> bytes:
        if p2 in key:
            raise StorageError(f"{key}: [Errno 5] Input/output error")
        return real(self, key, offset, length)

    monkeypatch.setattr(LocalBlobStore, "get_range", flaky)
    store.gc(grace=0)
    monkeypatch.setattr(LocalBlobStore, "get_range", real)
    store.close()
    assert glob.glob(str(store_dir / "packs" / "*" / p2)), "gc deleted a pack it could not read"
    store = _rebuilt(store_dir, tmp_path)
    assert torch.equal(store.restore("r@2")["b"], b)
    store.close()


# -- 4. huge sparse files in packs/ were read whole -----------------------------------

_SPARSE_RUN = """
import os, resource, struct, sys
import casckpt, torch
mode, store_dir, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
store = casckpt.open(store_dir)
store.commit({"a": torch.ones(10)}, run="r", step=1)
store.close()
path = os.path.join(store_dir, "packs", "ab", "ab" + "0" * 62)  # a name a pack could have
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "wb") as f:  # sparse: no disk space; a pack trailer at the end
    f.truncate(size)
    f.seek(size - 32)
    f.write(struct.pack("<Q16s8s", size - 32 - 24, bytes(16), b"CKPEND01"))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if mode == "gc":
    store = casckpt.open(store_dir)
    store.gc(grace=0)
else:
    os.rename(os.path.join(store_dir, "catalog.db"), os.path.join(store_dir, "..", "old.db"))
    store = casckpt.open(store_dir, recover=True)
    store.ops.rebuild_catalog()
store.close()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("mode", ["gc", "rebuild"])
def test_a_sparse_file_named_like_a_pack_costs_gc_and_rebuild_no_memory(
        tmp_path: Path, mode: str, forked_python: ForkedPython) -> None:
    """Invariant 10 / GUARANTEES 6: "every read is bounded ... nothing can make casckpt hang or
    exhaust memory". Found: gc's orphan pass read a forged footer whole, and catalog rebuild
    read every unknown pack object whole. Now a footer is at most 64 MiB (format/pack.py) and
    rebuild streams packs through scrub.verify (memory: one window).

    Reproduction: in a store's `packs/ab/`, create `ab000...0` (64 hex) as a sparse file of
    SIZE bytes (no disk space) whose last 32 bytes are a pack trailer claiming a footer of
    SIZE - 56 bytes. `casckpt gc --grace 0` judges it as an orphan pack and reads the whole
    "footer" into memory (gcguard -> discovery.read_footer -> get_range(SIZE - 56));
    `casckpt catalog rebuild` read every unknown pack object in full. Peak RSS grew by at
    least SIZE in both (+1 GiB for a 1 GiB file, +4 GiB for a 2 GiB file). Here SIZE = 1 GiB
    and the bound asserted is 512 MiB.
    """
    size = 1 << 30
    out = forked_python.run(["-c", _SPARSE_RUN, mode, str(tmp_path / "store"), str(size)], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    growth_mib = int(out.stdout.strip().splitlines()[-1])
    assert growth_mib < 512, f"{mode} grew its peak RSS by {growth_mib} MiB reading a sparse file"


# -- 5. a catalog rebuild killed before the tags left a catalog check called healthy ------

_KILLED_REBUILD = """
import os, signal, sys
import casckpt
from casckpt.engine.maintenance import rebuild
def crash(*args, **kwargs):  # power loss right after the versions were published
    os.kill(os.getpid(), signal.SIGKILL)
rebuild._restore_tags = crash
store = casckpt.open(sys.argv[1], recover=True)
store.ops.rebuild_catalog()
"""


def test_a_rebuild_killed_midway_leaves_a_catalog_nobody_uses(
        tmp_path: Path, forked_python: ForkedPython) -> None:
    """Invariant 3, GUARANTEES 3-5. Found: a catalog rebuild killed after publishing versions
    and runs (retention) but before the tags left a catalog that opened normally and that
    `check --read-data` called healthy; `tag:release` no longer resolved and gc then deleted
    the tagged version. Now a rebuild marks the catalog until its last step: a marked catalog
    is refused at open (and by rebuild itself), and a rebuild into a new catalog recovers all.

    Reproduction: commit r@1, r@2; tag r@1 release; retention keep_last=1 (tagged versions
    are kept); lose the catalog; `casckpt catalog rebuild` killed (SIGKILL) right before it
    restores tags.
    """
    from casckpt.errors import InvalidArgumentError, StoreIdentityError

    store_dir = tmp_path / "store"
    store = casckpt.open(store_dir)
    keep = torch.randn(1000)
    store.commit({"w": keep}, run="r", step=1)
    store.commit({"w": torch.randn(1000)}, run="r", step=2)
    store.tag("r@1", "release")
    store.retention.set("r", keep_last=1)
    store.close()
    _move_catalog_away(store_dir, tmp_path / "lost.db")
    crashed = forked_python.run(["-c", _KILLED_REBUILD, str(store_dir)], timeout=120)
    assert crashed.returncode == -9, crashed.stderr
    with pytest.raises(StoreIdentityError, match="rebuild that did not finish"):
        casckpt.open(store_dir)
    with casckpt.open(store_dir, recover=True) as half:
        with pytest.raises(InvalidArgumentError, match="did not finish"):
            half.ops.rebuild_catalog()
        with pytest.raises(StoreIdentityError):
            half.gc(grace=0)
    store = _rebuilt(store_dir, tmp_path)  # into a new, empty catalog
    assert store.resolve("tag:release").step == 1
    store.gc(grace=0)
    assert torch.equal(store.restore("r@1")["w"], keep)
    assert store.ops.check(read_data=True).ok
    store.close()


# -- 6. leftover reclaim deleted files casckpt never wrote -----------------------------


def _old_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not casckpt's")
    old = time.time() - 2 * 3600
    os.utime(path, (old, old))
    return path


def test_a_symlinked_tmp_is_never_reclaimed(tmp_path: Path) -> None:
    """Invariant 8 (nothing is deleted without positive proof it is garbage) and ARCHITECTURE
    "On disk": in tmp/, "FIFOs, symlinks and foreign directories there are left alone".

    Found: the reclaim of leftovers followed a symlinked `tmp` itself and unlinked every
    regular file there older than an hour. Now a symlinked base is left alone, and only files
    named as casckpt names its own are considered.

    Reproduction: a store at DIR; `rm -r DIR/tmp; ln -s /some/other/dir DIR/tmp` (an operator
    moving scratch space to a bigger disk, or a hostile link to /etc); any `casckpt.open(DIR)`
    -- every command does one -- deletes every file in /some/other/dir older than an hour.
    """
    victim = _old_file(tmp_path / "elsewhere" / "precious.txt")
    store_dir = tmp_path / "store"
    casckpt.open(store_dir).close()
    shutil.rmtree(store_dir / "tmp")
    (store_dir / "tmp").symlink_to(victim.parent, target_is_directory=True)
    casckpt.open(store_dir).close()
    assert victim.exists(), "opening the store deleted a file outside it"


def test_files_casckpt_did_not_write_in_a_locations_tmp_are_kept(tmp_path: Path) -> None:
    """Invariant 8: nothing is deleted without positive proof it is garbage.

    Found: a directory shared with other users' files, used as a location, lost every file
    in its `tmp/` older than an hour at every open and gc. Now only `<32 hex>.part|.pack`
    files (what casckpt wrote there before scratch directories) and locked scratch
    directories are reclaimed.

    Reproduction: `casckpt.open("ckpts", blobs="/scratch")` on a shared scratch file system
    where /scratch/tmp/ holds other people's files (or `casckpt location add /scratch`):
    every file in /scratch/tmp older than an hour is deleted.
    """
    shared = tmp_path / "scratch"
    victim = _old_file(shared / "tmp" / "colleague-results.csv")
    store = casckpt.open(tmp_path / "ckpts", blobs=str(shared))
    store.commit({"w": torch.ones(10)}, run="r", step=1)
    store.close()
    assert victim.exists(), "casckpt deleted a file it never wrote"


# -- 7. a FIFO in the index cache hung every open -------------------------------------

_OPEN_WITH_FIFO_CACHE = """
import os, sys
import casckpt, torch
store_dir = sys.argv[1]
store = casckpt.open(store_dir)
store.commit({"w": torch.ones(10)}, run="r", step=1)
store.close()
data = os.path.join(store_dir, "cache", "index", "data.mdb")
os.remove(data)
os.mkfifo(data)
print("opening", flush=True)
casckpt.open(store_dir).close()
print("opened", flush=True)
"""


def test_a_fifo_in_the_index_cache_does_not_hang_open(tmp_path: Path, forked_python: ForkedPython) -> None:
    """Invariant 10 / GUARANTEES 6: nothing can make casckpt hang; invariant 6: the LMDB
    cache is a hint ("any LMDB failure degrades to a cache miss").

    Found: IndexCache handed `<store>/cache/index` to lmdb.open(), which blocked forever on a
    FIFO `data.mdb`. Now a data.mdb or lock.mdb that is not a regular file makes the cache
    unusable (the store runs without it) before LMDB opens anything.

    Reproduction: `rm DIR/cache/index/data.mdb; mkfifo DIR/cache/index/data.mdb`; then any
    command (`casckpt --store DIR check`, `casckpt.open(DIR)`) hangs in cache.py
    (lmdb.open).
    """
    try:
        done = forked_python.run(["-c", _OPEN_WITH_FIFO_CACHE, str(tmp_path / "store")], timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("casckpt.open hung on a FIFO in cache/index (killed after 30 s)")
    assert "opened" in done.stdout, done.stderr


# -- absurd numbers at the API: a typed error or a result, never a raw one -------------------

_NUMERIC_KEYWORDS: dict[str, Any] = {
    "log(limit=)": lambda s, v: s.log(limit=v),
    "log(min_step=)": lambda s, v: s.log(min_step=v),
    "log(max_step=)": lambda s, v: s.log(max_step=v),
    "log(since=)": lambda s, v: s.log(since=v),
    "log(until=)": lambda s, v: s.log(until=v),
    "audit(limit=)": lambda s, v: s.ops.audit(limit=v),
    "audit(since=)": lambda s, v: s.ops.audit(since=v),
    "drill(count=)": lambda s, v: s.ops.drill("r", count=v),
    "drill(seed=)": lambda s, v: s.ops.drill("r", count=1, seed=v),
    "drill_history(limit=)": lambda s, v: s.ops.drill_history(limit=v),
    "advise(mtbf=)": lambda s, v: s.ops.advise("r", mtbf=v),
    "advise(restart=)": lambda s, v: s.ops.advise("r", mtbf=3600, restart=v),
    "gc(grace=)": lambda s, v: s.gc(dry_run=True, grace=v),
    "set_retention(keep_last=)": lambda s, v: s.retention.set("r", keep_last=v),
    "set_retention(keep_every=)": lambda s, v: s.retention.set("r", keep_every=v),
    "set_retention(keep_hourly=)": lambda s, v: s.retention.set("r", keep_hourly=v),
    "set_retention(keep_daily=)": lambda s, v: s.retention.set("r", keep_daily=v),
    "set_retention(keep_weekly=)": lambda s, v: s.retention.set("r", keep_weekly=v),
    "set_retention(keep_within=)": lambda s, v: s.retention.set("r", keep_within=v),
    "set_retention(keep_best=)": lambda s, v: s.retention.set("r", keep_best=("loss", v, "min")),
    "run(retention=)": lambda s, v: s.run("r", retention={"keep_last": v}),
    "set_delta_chain(chain)": lambda s, v: s.ops.set_delta_chain(v),
    "set_delta_chain(chain, run=)": lambda s, v: s.ops.set_delta_chain(v, run="r"),
    "wait_durable(timeout=)": lambda s, v: s.tier.wait_durable(timeout=v),
    "wait_commits(timeout=)": lambda s, v: s.wait_commits(timeout=v),
    "locations(timeout=)": lambda s, v: s.locations.list(timeout=v),
    "check(read_data_subset=)": lambda s, v: s.ops.check(read_data_subset=v),
    "commit(step=)": lambda s, v: s.commit({"w": torch.zeros(2)}, run="fuzzed", step=v),
    "commit(metrics=)": lambda s, v: s.commit({"w": torch.zeros(2)}, run="metrics", step=1,
                                              metrics={"m": v}),
}


def test_absurd_numbers_at_the_api_give_typed_errors(tmp_path: Path) -> None:
    """GUARANTEES 6 for numeric keywords: huge, negative, NaN, infinite and bool values give a
    CasckptError (an InvalidArgumentError) or a result; never a raw OverflowError or ValueError.

    Found: `Store.log(limit=10**23)` raised OverflowError from SQLite, `locations(timeout=1e18)`
    one from the clock, and `set_delta_chain(True)` stored "True", after which every commit
    raised ValueError.
    """
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    from casckpt.errors import CasckptError

    with casckpt.open(tmp_path / "store") as store:
        for step in (1, 2):
            store.commit({"w": torch.arange(8.0) * step}, run="r", step=step, metrics={"loss": 1 / step})
        numbers = st.one_of(
            st.integers(min_value=-(10**30), max_value=10**30), st.floats(), st.booleans(),
            st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 10**23, float("inf"), float("nan")]))

        @settings(max_examples=300, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(keyword=st.sampled_from(sorted(_NUMERIC_KEYWORDS)), value=numbers)
        @example(keyword="log(limit=)", value=10**23)
        @example(keyword="audit(limit=)", value=2**63)
        @example(keyword="drill_history(limit=)", value=2**63)
        @example(keyword="locations(timeout=)", value=1e18)
        @example(keyword="set_delta_chain(chain)", value=True)
        def check(keyword: str, value: object) -> None:
            try:
                _NUMERIC_KEYWORDS[keyword](store, value)
            except CasckptError:
                pass

        check()
        store.commit({"w": torch.ones(2)}, run="after", step=1)  # nothing accepted broke the store
        assert store.ops.check().ok
