"""Red-team findings: each test reproduces a way casckpt breaks a promise of docs/GUARANTEES.md
or an invariant of DESIGN.md, and fails until the product is fixed.

Every test's docstring says which promise it breaks and how to reproduce it by hand.
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

import pytest
import torch

import casckpt
from casckpt.errors import CasckptError, GCRefusedError, StorageError

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
    store.rebuild_catalog()
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


def test_alias_location_lets_gc_delete_every_pack(tmp_path: Path) -> None:
    """GUARANTEES 3 / invariant 8: gc must not delete an object without proof it is garbage.

    Reproduction: a one-location store at DIR with a committed version; then
    `casckpt location add file://DIR/` (the same directory, with a trailing slash -- or any
    other spelling that names it: a bind mount, `file://DIR/./`, an NFS path). add_location
    compares URL *strings* only (`file://` URLs are not resolved, unlike bare paths) and the
    identity check passes (the alias carries this store's own record), so the same directory
    becomes a second location. `check` finds nothing wrong. Then `gc` (grace 0 here; with the
    default grace, any pack older than 6 h) lists every pack object a second time under the
    alias, takes each for a "stale copy of a pack the catalog knows" (gcguard._superseded),
    and unlinks it -- which is the catalog's only copy. Every version is lost.
    """
    store_dir = tmp_path / "store"
    store = casckpt.open(store_dir)
    w = torch.randn(10_000)
    store.commit({"w": w}, run="r", step=1)
    try:
        store.add_location(f"file://{store_dir}/", name="alias")
    except CasckptError:
        return  # refusing the alias is a fix
    assert store.check().ok  # check sees nothing wrong with the alias
    store.gc(grace=0)
    restored = store.restore("r@1")  # MissingDataError today: gc deleted the only pack
    assert torch.equal(restored["w"], w)
    store.close()


# -- 2. the lease floor waives gc's completeness proof ---------------------------------

_LEASE_HOLDER = """
import sys, time
import casckpt
from casckpt.catalog.gc import begin_lease
store = casckpt.open(sys.argv[1])
begin_lease(store._ctx.catalog)  # what every commit does first; this one stays in flight
print("leased", flush=True)
time.sleep(600)
"""


def test_stale_catalog_with_old_lease_gc_deletes_newer_versions_data(tmp_path: Path) -> None:
    """GUARANTEES 3: gc "refuses to run when the locations hold manifests the catalog neither
    knows nor has tombstoned" -- a stale catalog backup must never make gc delete anything.

    gcguard._unknown_manifests only looks at manifests older than the oldest lease
    (safe_floor). A catalog backup taken while some commit was in flight carries that lease;
    if the committing process is still alive (a slow upload, a failed DCP save whose lease
    stays until the writer is reset) -- or lives on another host, where leases are kept for
    24 h -- every manifest written after the backup is newer than the floor and is exempt.

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
    time.sleep(6)  # the chunks above predate the lease by more than the clock-skew margin
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
        assert any(p.kind == "manifest" for p in store.check().problems)  # check sees it
        try:
            store.gc(grace=0)
        except GCRefusedError:
            pass  # what the guarantee promises
        store.close()
    finally:
        holder.kill()
        holder.wait()
    store = _rebuilt(store_dir, tmp_path)
    restored = store.restore("r@2")  # RefNotFoundError today: r@2's chunk was deleted
    assert torch.equal(restored["a"], x)
    store.close()


# -- 3. the footer guard gives up on packs it could still read -------------------------


def test_gc_deletes_recoverable_ec_pack_whose_data_shard_is_missing(tmp_path: Path) -> None:
    """GUARANTEES 3: "a pack object goes only if its footer lists no chunk a visible version
    references that the catalog does not verifiably hold in another pack; objects gc cannot
    prove are left in place".

    gcguard reads an unknown pack's footer through its *data* shards only
    (discovery.read_range); when a data shard is missing it gets MissingDataError and treats
    the pack as "serving no chunk" -- although K of its K+M shards are there and decode it.

    Reproduction: 3 dirs, ec:2+1; r@1 = {a, b}, r@2 = {b}; delete r@1; back up the catalog;
    gc --grace 0 (repacks b into a new pack P2); restore the backup (a stale catalog: it says
    b is in the old pack). Lose data shard 1 of P2 (one disk's file; ec:2+1 survives that).
    gc --grace 0 with the stale catalog deletes P2's other two shards as orphans. Without the
    lost shard the same gc keeps P2 ("holds 1 chunk(s) versions need"), and a catalog rebuild
    recovers r@2 from shards 0 and 2 -- after this gc nothing can.
    """
    blobs = [str(tmp_path / f"d{i}") for i in range(3)]
    store_dir, b = _stale_catalog_after_repack(tmp_path, blobs=blobs, redundancy="ec:2+1")
    (lost,) = glob.glob(str(tmp_path / "d*" / "packs" / "*" / "*.s1"))
    os.remove(lost)  # one disk lost one shard: ec:2+1 is meant to survive this
    store = casckpt.open(store_dir)
    store.gc(grace=0)
    store.close()
    left = glob.glob(str(tmp_path / "d*" / "packs" / "*" / "*.s*"))
    assert len(left) == 2, f"gc deleted shards of a pack it could still decode; left: {left}"
    store = _rebuilt(store_dir, tmp_path)
    assert torch.equal(store.restore("r@2")["b"], b)
    store.close()


def test_gc_deletes_unknown_pack_on_a_transient_read_error(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """GUARANTEES 3 and gcguard's own docstring: a pack "that cannot be read *now* (a storage
    error) stays for a later run".

    discovery.read_range turns every StorageError into MissingDataError (an IntegrityError),
    and DeletionGuard._judge deletes on MissingDataError ("no chunk can be read from it") --
    its `except StorageError: keep` branch is unreachable. So one EIO, a 503 that outlasted
    the S3 retries, a permission problem, on the footer read of an orphan pack that holds the
    only copy of chunks a version needs, and gc deletes it.

    Reproduction: the stale-catalog-after-repack store of the test above, one location, no
    redundancy (P2 is an unknown pack holding r@2's chunk b; gc normally keeps it). Make reads
    of P2 fail with a StorageError (here: LocalBlobStore.get_range patched, as an I/O error
    would) and run gc --grace 0: P2 is deleted; r@2 cannot be recovered by a rebuild.
    """
    from casckpt.storage.local import LocalBlobStore

    store_dir, b = _stale_catalog_after_repack(tmp_path, blobs=None, redundancy=None)
    store = casckpt.open(store_dir)
    known = {p.id for p in store._ctx.catalog.packs()}
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


# -- 4. huge sparse files in packs/ are read whole ------------------------------------

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
    store.rebuild_catalog()
store.close()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.parametrize("mode", ["gc", "rebuild"])
def test_sparse_file_in_packs_exhausts_memory(tmp_path: Path, mode: str) -> None:
    """Invariant 10 / GUARANTEES 6: "every read is bounded ... nothing can make casckpt hang or
    exhaust memory"; test_hostile covers check, not gc's orphan pass or catalog rebuild.

    Reproduction: in a store's `packs/ab/`, create `ab000...0` (64 hex) as a sparse file of
    SIZE bytes (no disk space) whose last 32 bytes are a pack trailer claiming a footer of
    SIZE - 56 bytes. `casckpt gc --grace 0` judges it as an orphan pack and reads the whole
    "footer" into memory (gcguard -> discovery.read_footer -> get_range(SIZE - 56));
    `casckpt catalog rebuild` reads every unknown pack object in full (packverify.read_detached,
    bounded only by the object's own size). Peak RSS grows by at least SIZE in both (measured:
    +1 GiB for a 1 GiB file, +4 GiB for a 2 GiB file); a 64 GiB sparse file kills the
    process. A real pack is at most ~64 MiB (CASCKPT_PACK_SIZE); here SIZE = 1 GiB and the
    bound asserted is 512 MiB.
    """
    size = 1 << 30
    out = subprocess.run([sys.executable, "-c", _SPARSE_RUN, mode, str(tmp_path / "store"), str(size)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    growth_mib = int(out.stdout.strip().splitlines()[-1])
    assert growth_mib < 512, f"{mode} grew its peak RSS by {growth_mib} MiB reading a sparse file"


# -- 5. a catalog rebuild killed before the tags leaves a catalog check calls healthy ------

_KILLED_REBUILD = """
import os, signal, sys
import casckpt
from casckpt.engine import rebuild
def crash(*args, **kwargs):  # power loss right after the versions were published
    os.kill(os.getpid(), signal.SIGKILL)
rebuild._restore_tags = crash
store = casckpt.open(sys.argv[1], recover=True)
store.rebuild_catalog()
"""


def test_rebuild_killed_before_tags_then_gc_deletes_tagged_version(tmp_path: Path) -> None:
    """Invariant 3 (a crash at any instant leaves the store consistent), GUARANTEES 4 (check
    proves what it says) and 5 (rebuild recovers tags), GUARANTEES 3 (retention keeps tagged
    versions: keep_tagged=True).

    rebuild publishes versions, then restores runs (retention), then tags, then the store's
    policies, with nothing marking the catalog as half-built. A rebuild killed after the
    retention policies but before the tags leaves a non-empty catalog: `catalog rebuild`
    refuses to run again ("the catalog is not empty"), opening the store works, and `check
    --read-data` reports nothing (it only compares the records the catalog implies). The tag
    records are still on every location, but nothing reads them.

    Reproduction: commit r@1, r@2; `casckpt tag r@1 release`; retention keep_last=1 (tagged
    versions are kept); lose the catalog; `casckpt catalog rebuild` killed (SIGKILL) right
    before it restores tags; open the store: `check --read-data` exits 0; `gc --grace 0`
    deletes and purges r@1, the tagged version.
    """
    store_dir = tmp_path / "store"
    store = casckpt.open(store_dir)
    keep = torch.randn(1000)
    store.commit({"w": keep}, run="r", step=1)
    store.commit({"w": torch.randn(1000)}, run="r", step=2)
    store.tag("r@1", "release")
    store.set_retention("r", keep_last=1)
    store.close()
    _move_catalog_away(store_dir, tmp_path / "lost.db")
    crashed = subprocess.run([sys.executable, "-c", _KILLED_REBUILD, str(store_dir)], timeout=120)
    assert crashed.returncode == -9
    store = casckpt.open(store_dir)
    report = store.check(read_data=True)
    if report.ok:  # check says the store is whole: then it must be
        assert store.resolve("tag:release").step == 1
    store.gc(grace=0)
    assert torch.equal(store.restore("r@1")["w"], keep), "gc deleted the tagged version"
    store.close()


# -- 6. leftover reclaim deletes files casckpt never wrote ----------------------------


def _old_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("not casckpt's")
    old = time.time() - 2 * 3600
    os.utime(path, (old, old))
    return path


def test_open_deletes_files_behind_a_symlinked_tmp(tmp_path: Path) -> None:
    """Invariant 8 (nothing is deleted without positive proof it is garbage) and ARCHITECTURE
    "On disk": in tmp/, "FIFOs, symlinks and foreign directories there are left alone".

    scratch.reclaim() lists `<location>/tmp` through os.scandir, which follows a symlinked
    `tmp` itself, and unlinks every regular file there older than an hour (taken for "loose
    files left by casckpt versions before this layout"). Nothing checks that `tmp` is a real
    directory inside the location.

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


def test_open_deletes_user_files_in_a_shared_locations_tmp(tmp_path: Path) -> None:
    """Invariant 8: nothing is deleted without positive proof it is garbage.

    A directory holding no packs/ or manifests/ is adopted as a location (identity check:
    "no record and no data: written"), however much else it holds; from then on every open
    (and every gc) unlinks each regular file in its `tmp/` older than an hour.

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


# -- 7. a FIFO in the index cache hangs every open ------------------------------------

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


def test_fifo_in_index_cache_hangs_open(tmp_path: Path) -> None:
    """Invariant 10 / GUARANTEES 6: nothing can make casckpt hang; invariant 6: the LMDB
    cache is a hint ("any LMDB failure degrades to a cache miss").

    IndexCache hands `<store>/cache/index` to lmdb.open() without looking at what is there;
    LMDB opens `data.mdb` and reads its header, which blocks forever on a FIFO.

    Reproduction: `rm DIR/cache/index/data.mdb; mkfifo DIR/cache/index/data.mdb`; then any
    command (`casckpt --store DIR check`, `casckpt.open(DIR)`) hangs in cache.py
    (lmdb.open). (A FIFO as catalog.db, casckpt-identity, refs/ records, tmp or staging is
    handled: a typed error or skipped.)
    """
    proc = subprocess.Popen([sys.executable, "-c", _OPEN_WITH_FIFO_CACHE, str(tmp_path / "store")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("casckpt.open hung on a FIFO in cache/index (killed after 30 s)")
    assert "opened" in out
