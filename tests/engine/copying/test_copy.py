"""``Store.copy``: versions arrive in another store as the same versions, only what the
destination lacks travels, and a killed or raced copy leaves both stores consistent.

Every store here is real (SQLite catalogs and local directories; the S3 case a moto server
over HTTP), and every copied version is restored from the destination alone, with the
source's directory deleted first.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

import casckpt
from casckpt.catalog import schema, treechanges
from casckpt.engine.copying import copypipe
from casckpt.errors import (
    CopyConflictError,
    CopyTargetError,
    IntegrityError,
    ReadOnlyStoreError,
    RefNotFoundError,
    StorageError,
)
from casckpt.format.codecs import lookup
from casckpt.testing import internals

CHUNK = 4096
PACK = 16 << 10
OPTS: dict[str, Any] = {"chunk_size": CHUNK, "pack_size": PACK}
CHILD = Path(__file__).resolve().parents[2] / "helpers" / "copy_child.py"


def state(step: int, *, fresh: int = 8192) -> dict[str, Any]:
    """A fine-tune's state at ``step``: a frozen part every step shares, a part new at each
    step (incompressible), a counter that shifts (delta-coded by the source), plain values."""
    base = torch.Generator().manual_seed(7)
    new = torch.Generator().manual_seed(1000 + step)
    return {
        "frozen": torch.randn(16384, generator=base),
        "head": torch.randint(0, 256, (4 * fresh,), dtype=torch.uint8, generator=new),
        "counter": torch.arange(step, step + 4096, dtype=torch.int64),
        "step": step, "name": "ft", "extra": (None, b"\x00\x01", 1.5),
    }


def commit_run(store: casckpt.Store, steps: range, run: str = "ft") -> list[casckpt.Version]:
    return [store.commit(state(s), run=run, step=s, metrics={"loss": 1.0 / s}, metadata={"lr": 0.1},
                         message=f"step {s}", tags=["best"] if s == 2 else ()) for s in steps]


def pack_bytes(root: Path) -> int:
    """Bytes of every pack object under a local store's directory."""
    return sum(p.stat().st_size for p in (root / "packs").rglob("*") if p.is_file())


def files(root: Path) -> dict[str, int]:
    """Every object of a local store's location (catalog and cache left out), with its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and p.parts[len(root.parts)] in {"packs", "manifests", "refs"}}


def assert_same(got: dict[str, Any], step: int) -> None:
    want = state(step)
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.fixture
def src(tmp_path: Path) -> Any:
    with casckpt.open(tmp_path / "src", **OPTS) as store:
        yield store


@pytest.fixture
def dst(tmp_path: Path) -> Any:
    with casckpt.open(tmp_path / "dst", **OPTS) as store:
        yield store
        assert store.ops.check(read_data=True).ok


def test_copied_versions_are_the_same_versions_and_restore_without_the_source(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, casckpt.open(tmp_path / "dst", **OPTS) as dst:
        made = commit_run(src, range(1, 5))
        report = src.copy("ft@3", to=dst)
        # the lineage comes whole: 1 and 2 are ancestors of 3, sent first
        assert [(v.step, v.asked, v.sent) for v in report.versions] == [(1, False, True), (2, False, True),
                                                                         (3, True, True)]
        assert report.ids == {v.id: v.id for v in made[:3]}
        assert report.tags == ("best",)
        logged = {v.step: v for v in dst.log("ft")}
        for v in made[:3]:
            there = logged[v.step]
            assert (there.id, there.parent, there.metrics, there.metadata, there.message,
                    there.created_at) == (v.id, v.parent, v.metrics, v.metadata, v.message, v.created_at)
        assert dst.resolve("tag:best").id == made[1].id
        assert 4 not in logged
    shutil.rmtree(tmp_path / "src")
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        for step in (1, 2, 3):
            assert_same(dst.restore(f"ft@{step}"), step)
        assert dst.ops.check(read_data=True).ok


def test_a_second_copy_sends_nothing(src: casckpt.Store, dst: casckpt.Store, tmp_path: Path) -> None:
    commit_run(src, range(1, 4))
    first = src.copy("ft", to=dst)
    assert first.chunks > 0 and not first.nothing_sent
    before = files(tmp_path / "dst")
    again = src.copy(["ft@latest", "ft@1", "tag:best"], to=dst)
    assert again.nothing_sent and again.chunks == 0 and again.bytes == 0
    assert all(not v.sent for v in again.versions)
    assert files(tmp_path / "dst") == before


def test_copying_the_tenth_version_writes_only_its_new_chunks(src: casckpt.Store, dst: casckpt.Store,
                                                             tmp_path: Path) -> None:
    made = commit_run(src, range(1, 11))
    src.copy("ft@9", to=dst)
    dry = src.copy("ft@10", to=dst, dry_run=True)
    before = pack_bytes(tmp_path / "dst")
    report = src.copy("ft@10", to=dst)
    written = pack_bytes(tmp_path / "dst") - before
    new = made[9].new_bytes  # what the source's commit of step 10 found new
    assert dry.bytes == report.bytes and dry.chunks == report.chunks and dry.dry_run
    assert [v.step for v in report.versions] == [10]
    # the new head (incompressible) and the shifted counter; frozen chunks stay at home
    assert new <= report.bytes <= 1.1 * new + 4096
    assert written <= 1.1 * new + 4096
    assert_same(dst.restore("ft@10"), 10)


def test_delta_coded_chunks_arrive_decodable_from_the_destination_alone(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, casckpt.open(tmp_path / "dst", **OPTS) as dst:
        src.ops.set_delta_chain(8)
        commit_run(src, range(1, 6))
        src_cat = internals(src).catalog
        ids = [c.hex() for c in internals(src).manifest("ft@5").chunk_ids()]
        assert any(lookup(loc.codec).is_delta for loc in src_cat.find_chunks(ids).values()), \
            "the source delta-codes nothing: this test would prove nothing"
        src.copy("ft@5", to=dst)
        dst_found = internals(dst).catalog.find_chunks(ids)
        assert set(dst_found) == set(ids)
        assert not any(lookup(loc.codec).is_delta for loc in dst_found.values())
    shutil.rmtree(tmp_path / "src")
    with casckpt.open(tmp_path / "dst", create=False) as dst:
        assert_same(dst.restore("ft@5"), 5)


def test_a_forked_run_arrives_forked(src: casckpt.Store, dst: casckpt.Store) -> None:
    commit_run(src, range(1, 3))
    src.fork("ft@1", "sweep")
    forked = src.commit(state(7), run="sweep", step=7)
    report = src.copy("sweep@7", to=dst)
    assert [(v.run, v.step) for v in report.versions] == [("ft", 1), ("sweep", 7)]
    assert dst.resolve("sweep@7").parent == src.resolve("ft@1").id == forked.parent
    nodes = {n.name: n for n in dst.lineage()}
    assert (nodes["sweep"].parent_run, nodes["sweep"].fork_step) == ("ft", 1)
    assert_same(dst.restore("sweep@7"), 7)


def test_a_read_only_source_copies(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src:
        commit_run(src, range(1, 3))
    with casckpt.open(tmp_path / "src", read_only=True, create=False) as src, \
            casckpt.open(tmp_path / "dst", **OPTS) as dst:
        assert [v.step for v in src.copy("ft@2", to=dst).versions] == [1, 2]
        assert_same(dst.restore("ft@2"), 2)


def test_tags_moved_on_the_source_move_at_the_next_copy(src: casckpt.Store, dst: casckpt.Store) -> None:
    commit_run(src, range(1, 4))
    src.copy("ft", to=dst)
    src.tag("ft@3", "best")
    report = src.copy("ft@3", to=dst)
    assert report.tags == ("best",) and report.chunks == 0
    assert dst.resolve("tag:best").step == 3


@pytest.mark.parametrize("keyed", [False, True])
def test_a_tag_the_destination_has_on_its_own_version_is_not_taken_over(
        tmp_path: Path, keyed: bool) -> None:
    """The destination's ``best`` on its own prod@1 kept that version from its retention; a copy
    moving ``best`` onto the source's version let the destination's next gc delete prod@1."""
    extra = {"key_file": _key(tmp_path / "key")} if keyed else {}
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "dst", **OPTS, **extra) as dst:
        commit_run(src, range(1, 3))  # ft@2 is tagged best
        for step in (1, 2, 3):
            dst.commit(state(100 + step), run="prod", step=step, tags=["best"] if step == 1 else ())
        dst.retention.set("prod", keep_last=1, keep_tagged=True)
        for dry_run in (True, False):
            report = src.copy("ft@2", to=dst, dry_run=dry_run)
            assert report.tags_kept == ("best",) and "best" not in report.tags
        assert dst.resolve("tag:best").run == "prod"
        dst.gc(grace=0)
        assert sorted(v.step for v in dst.log("prod")) == [1, 3]
        src.tag("ft@1", "latest-good")
        dst.tag("prod@3", "latest-good")  # taken by the destination too: kept
        assert src.copy("ft@1", to=dst).tags_kept == ("latest-good",)
        dst.tag("ft@1", "best")  # now on a version a copy made: it moves
        assert src.copy("ft@2", to=dst).tags == ("best",)
        assert dst.resolve("tag:best").step == 2 and dst.resolve("tag:best").run == "ft"


@pytest.mark.parametrize("keyed", [False, True])
def test_versions_the_destination_deleted_stay_deleted(tmp_path: Path, keyed: bool) -> None:
    """A nightly copy of a whole run into an archive whose retention deleted some of it: the
    copy goes on without them (it failed whole); asked for by name, one is refused (across
    keys it was reported copied and stayed deleted)."""
    extra = {"key_file": _key(tmp_path / "key")} if keyed else {}
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "dst", **OPTS, **extra) as dst:
        commit_run(src, range(1, 4))
        src.copy("ft", to=dst)
        dst.delete("ft@1")
        dst.delete("ft@2")
        commit_run(src, range(4, 5))
        report = src.copy("ft", to=dst)
        assert [(v.step, v.sent) for v in report.versions] == [(3, False), (4, True)]
        assert sorted(v.step for v in dst.log("ft")) == [3, 4]
        with pytest.raises(CopyConflictError, match="undelete"):
            src.copy("ft@2", to=dst)
        with pytest.raises(RefNotFoundError):
            dst.resolve("ft@2")
        assert dst.ops.check(read_data=True).ok


def test_a_run_older_than_trees_copies_its_new_versions_with_their_old_ancestors(tmp_path: Path) -> None:
    """A store written before tree manifests: a new version of an old run copies with its
    format 1 ancestor (which ended the line, and was refused when asked for), each restoring
    from the destination (more: test_copy_formats.py)."""
    old = tmp_path / "old"
    shutil.copytree(Path(__file__).parents[2] / "golden" / "store-formats", old)
    with casckpt.open(old, create=False) as src, casckpt.open(tmp_path / "dst", **OPTS) as dst:
        first = src.log("one")[-1]
        src.commit({"w": torch.arange(64.0)}, run="one", step=first.step + 1000)
        report = src.copy(f"one@{first.step + 1000}", to=dst)
        assert [(v.step, v.asked) for v in report.versions] == [(first.step, False),
                                                                (first.step + 1000, True)]
        assert torch.equal(dst.restore(f"one@{first.step + 1000}")["w"], torch.arange(64.0))
        assert dst.resolve(f"one@{first.step}").id == first.id
        assert src.copy(f"one@{first.step}", to=dst).nothing_sent


def test_gc_purging_a_version_a_copy_publishes_again_keeps_its_manifest(
        src: casckpt.Store, dst: casckpt.Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy is the one writer that publishes an id gc just purged (the same manifest bytes):
    gc deleted manifests/<id> by name after its purge, leaving a visible version without its
    manifest object (``check`` failed; a catalog rebuild would lose it)."""
    from casckpt.catalog import gc as gc_sql

    commit_run(src, range(1, 2))
    src.copy("ft@1", to=dst)
    dst.delete("ft@1")
    purge = gc_sql.purge_versions

    def purge_then_copy(*args: Any, **kwargs: Any) -> Any:
        purged = purge(*args, **kwargs)
        with casckpt.open(tmp_path / "dst", create=False, **OPTS) as other:  # another process's copy
            assert [v.sent for v in src.copy("ft@1", to=other).versions] == [True]
        return purged

    monkeypatch.setattr(gc_sql, "purge_versions", purge_then_copy)
    assert dst.gc(grace=0).versions_purged == 1
    assert [v.step for v in dst.log("ft")] == [1]
    assert dst.ops.check(read_data=True).ok
    assert_same(dst.restore("ft@1"), 1)


def test_a_run_the_destination_has_a_line_of_its_own_in_is_not_mixed(tmp_path: Path) -> None:
    """The destination's own train@1,2 and the source's train@10,11 were merged: train@latest
    became the foreign step 11 and the parent of the destination's next commit. (Across keys
    ids cannot tell a version the source purged from the destination's own: not refused.)"""
    extra: dict[str, Any] = {}
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "dst", **OPTS, **extra) as dst:
        commit_run(src, range(10, 12), run="train")
        commit_run(dst, range(1, 3), run="train")
        with pytest.raises(CopyConflictError, match="line of its own"):
            src.copy("train@11", to=dst)
        assert sorted(v.step for v in dst.log("train")) == [1, 2]
        src.copy("train@10", to=(other := casckpt.open(tmp_path / "other", **OPTS, **extra)))
        with other:  # a run a copy made there takes the source's next versions
            assert [v.step for v in src.copy("train@11", to=other).versions if v.sent] == [11]


def test_gc_on_both_sides_during_a_copy_deletes_nothing_it_needs(src: casckpt.Store, dst: casckpt.Store,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    commit_run(src, range(1, 4))
    src.copy("ft@1", to=dst)
    dst.delete("ft@1")  # its chunks are garbage at the destination now, until the copy needs them again
    with pytest.raises(CopyConflictError, match="undelete"):
        src.copy("ft@1", to=dst)  # deleted there: a copy does not undo it
    real = copypipe.Pipeline.pack
    batches: list[int] = []

    def pack_then_gc(*args: Any, **kwargs: Any) -> Any:
        # the batch is in the packer, its pack maybe uploading or stored and not recorded yet
        done = real(*args, **kwargs)
        batches.append(1)
        if len(batches) in (1, 5):
            dst.gc(grace=0)
            dst.gc(grace=0)
            src.gc(grace=0)
        return done

    monkeypatch.setattr(copypipe.Pipeline, "pack", pack_then_gc)
    plan = src.copy("ft@3", to=dst, dry_run=True)
    report = src.copy("ft@3", to=dst)
    # the deleted ancestor is not brought back; what the lease kept is not sent twice
    assert [v.step for v in report.versions] == [2, 3]
    assert report.chunks == plan.chunks and len(batches) > 1
    assert dst.resolve("ft@2").parent == src.resolve("ft@1").id
    dst.gc(grace=0)
    for step in (2, 3):
        assert_same(dst.restore(f"ft@{step}"), step)
    assert [v.step for v in src.copy("ft@1", to=dst).versions] == [1]  # purged there: copied anew
    assert_same(dst.restore("ft@1"), 1)


def test_one_packer_for_the_whole_copy_fills_the_destinations_packs(src: casckpt.Store,
                                                                    tmp_path: Path) -> None:
    commit_run(src, range(1, 5))  # a pack or so per version at the source
    with casckpt.open(tmp_path / "big", chunk_size=CHUNK, pack_size=1 << 20) as big:
        report = src.copy("ft@4", to=big)
        assert [v.step for v in report.versions] == [1, 2, 3, 4]
        # one packer across versions: the versions share the destination's 1 MiB pack, where a
        # copy that packed each version alone would write one pack (at least) per version
        assert len([p for p in (tmp_path / "big" / "packs").rglob("*") if p.is_file()]) == 1
        shutil.rmtree(tmp_path / "src")
        for step in range(1, 5):
            assert_same(big.restore(f"ft@{step}"), step)
        assert big.ops.check(read_data=True).ok


def test_a_copy_failing_midway_ends_every_lease_it_took(src: casckpt.Store, dst: casckpt.Store,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    commit_run(src, range(1, 4))
    real = copypipe.Pipeline.pack
    calls: list[int] = []

    def pack_or_fail(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 20:  # version 2's chunks in the packer, version 1's maybe published
            raise StorageError("the destination went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(copypipe.Pipeline, "pack", pack_or_fail)
    with pytest.raises(StorageError, match="went away"):
        src.copy("ft@3", to=dst)
    with internals(dst).catalog.read() as conn:
        assert conn.execute(select(schema.leases)).all() == []  # none left holding gc back
    visible = sorted(v.step for v in dst.log()) if "ft" in {r.name for r in dst.runs()} else []
    assert visible in ([], [1])
    monkeypatch.undo()
    resumed = [v.step for v in src.copy("ft@3", to=dst).versions if v.sent]
    assert resumed == [1, 2, 3][len(visible):]
    dst.gc(grace=0)
    for step in (1, 2, 3):
        assert_same(dst.restore(f"ft@{step}"), step)


def test_a_chunk_damaged_at_the_source_fails_the_copy_and_publishes_nothing(src: casckpt.Store,
                                                                           dst: casckpt.Store,
                                                                           tmp_path: Path) -> None:
    commit_run(src, range(1, 2))
    for pack in (tmp_path / "src" / "packs").rglob("*"):
        if pack.is_file() and pack.stat().st_size > 8192:
            data = bytearray(pack.read_bytes())
            data[len(data) // 2] ^= 0xFF
            pack.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        src.copy("ft@1", to=dst)
    assert dst.log() == []


@pytest.mark.parametrize(("point", "nth"), [("batch", 2), ("manifest", 2)])
def test_a_copy_killed_midway_leaves_the_destination_consistent_and_the_next_copy_completes(
        forked_python: Any, tmp_path: Path, point: str, nth: int) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, casckpt.open(tmp_path / "probe", **OPTS) as probe:
        commit_run(src, range(1, 4))
        plan = src.copy("ft@3", to=probe, dry_run=True)
    done = forked_python.run([str(CHILD), str(tmp_path / "src"), str(tmp_path / "dst"), "ft@3",
                              point, str(nth)])
    assert done.returncode == -9, done.stderr
    with casckpt.open(tmp_path / "dst", create=False, **OPTS) as dst:
        assert dst.ops.check(read_data=True).ok
        visible = sorted(v.step for v in dst.log()) if "ft" in {r.name for r in dst.runs()} else []
        # nothing half-copied is visible: killed at a pack, the versions whose packs all landed
        # may be published (in order), not the last one
        assert visible == ([1, 2][:len(visible)] if point == "batch" else [1])
        with casckpt.open(tmp_path / "src", create=False, **OPTS) as src:
            report = src.copy("ft@3", to=dst)
        assert report.chunks < plan.chunks  # what the killed copy stored is not sent again
        assert [v.step for v in dst.log("ft", order="asc")] == [1, 2, 3]
        dst.gc(grace=0)
        assert dst.ops.check(read_data=True).ok
        assert_same(dst.restore("ft@3"), 3)


def test_a_copy_across_keys_killed_midway_completes_without_writing_again_what_it_stored(
        forked_python: Any, tmp_path: Path) -> None:
    key = _key(tmp_path / "k")
    with casckpt.open(tmp_path / "src", **OPTS) as src:
        made = commit_run(src, range(1, 3))
    done = forked_python.run([str(CHILD), str(tmp_path / "src"), str(tmp_path / "dst"), "ft@2",
                              "recommit", "2", str(key)])
    assert done.returncode == -9, done.stderr
    with casckpt.open(tmp_path / "dst", key_file=key, create=False, **OPTS) as dst:
        assert dst.ops.check(read_data=True).ok
        assert [v.step for v in dst.log()] == [1]  # step 2 wrote its chunks, was not published
        with casckpt.open(tmp_path / "src", create=False, **OPTS) as src:
            report = src.copy("ft@2", to=dst)
        assert [(v.step, v.sent) for v in report.versions] == [(2, True)]
        assert report.bytes < made[1].new_bytes  # its new chunks were stored by the killed copy
        dst.gc(grace=0)
        assert dst.ops.check(read_data=True).ok
        assert_same(dst.restore("ft@2"), 2)


def test_local_to_s3(src: casckpt.Store, tmp_path: Path, s3_bucket_url: Callable[[], str],
                     moto_endpoint: str) -> None:
    commit_run(src, range(1, 3))
    with casckpt.open(tmp_path / "s3dst", blobs=s3_bucket_url(), s3={"endpoint_url": moto_endpoint},
                      **OPTS) as dst:
        report = src.copy("ft@2", to=dst)
        assert report.chunks > 0
        assert src.copy("ft@2", to=dst).nothing_sent
        assert_same(dst.restore("ft@2"), 2)
        assert dst.ops.check(read_data=True).ok


def test_what_a_copy_refuses(src: casckpt.Store, dst: casckpt.Store, tmp_path: Path) -> None:
    commit_run(src, range(1, 3))
    with pytest.raises(CopyTargetError, match="itself"):
        src.copy("ft@1", to=src)
    with casckpt.open(tmp_path / "src", create=False) as again, \
            pytest.raises(CopyTargetError, match="itself"):
        src.copy("ft@1", to=again)
    with pytest.raises(CopyTargetError, match="Store"):
        src.copy("ft@1", to=42)  # type: ignore[arg-type]
    with pytest.raises(CopyTargetError, match="itself"):  # a store's directory is opened
        src.copy("ft@1", to=str(tmp_path / "src"))
    assert not (tmp_path / "new").exists()
    assert src.copy("ft@1", to=tmp_path / "new", dry_run=True).chunks > 0  # plans, creates nothing
    assert not (tmp_path / "new").exists()
    assert [v.sent for v in src.copy("ft@1", to=tmp_path / "new").versions] == [True]
    with pytest.raises(RefNotFoundError):
        src.copy("ft@99", to=dst)
    with pytest.raises(RefNotFoundError):
        src.copy("nosuchrun", to=dst)
    with casckpt.open(tmp_path / "dst", read_only=True) as reader, pytest.raises(ReadOnlyStoreError):
        src.copy("ft@1", to=reader)
    dst.commit(state(1, fresh=16), run="ft", step=1)  # another version at ft@1
    with pytest.raises(CopyConflictError, match="diverged"):
        src.copy("ft@2", to=dst)
    assert [v.step for v in dst.log("ft")] == [1]


def _key(path: Path) -> Path:
    casckpt.generate_key_file(path)
    return path


def _leaks(location: Path, needles: list[bytes]) -> list[str]:
    """Objects of ``location`` holding any of ``needles``, or naming the run in the clear."""
    found = []
    for path in (p for p in location.rglob("*") if p.is_file()):
        data = path.read_bytes()
        # a name in the clear is a record's whole file name (a pack id may hold "6674" by chance)
        if any(n in data for n in needles) or path.name == b"ft".hex():
            found.append(str(path))
    return found


def test_a_copy_across_keys_commits_each_version_again_and_leaks_no_plaintext(tmp_path: Path) -> None:
    key = _key(tmp_path / "a.key")
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "enc", blobs=str(tmp_path / "encloc"), key_file=key, **OPTS) as enc:
        made = commit_run(src, range(1, 4))
        first = src.copy("ft@2", to=enc)
        assert [(v.step, v.sent) for v in first.versions] == [(1, True), (2, True)]
        assert all(v.id != v.source_id for v in first.versions)  # keyed ids: other versions ids
        report = src.copy("ft@3", to=enc)
        assert [v.step for v in report.versions] == [3]
        assert report.bytes <= 1.1 * made[2].new_bytes + 4096  # only what step 3 changed is written
        ids = {v.step: v.id for v in enc.log("ft")}
        assert enc.resolve("ft@3").parent == ids[2] and enc.resolve("ft@2").parent == ids[1]
        there = enc.resolve("ft@2")
        assert (there.metrics, there.metadata, there.message, there.created_at, there.tags) == (
            made[1].metrics, made[1].metadata, made[1].message, made[1].created_at, ("best",))
        assert src.copy("ft", to=enc).nothing_sent
    needles = [state(s)["head"].numpy().tobytes()[i:i + 32] for s in (1, 2, 3) for i in (0, 8000, 20000)]
    assert _leaks(tmp_path / "src" / "packs", needles), "the needles are not in a plain store: no proof"
    assert _leaks(tmp_path / "encloc", needles) == []
    shutil.rmtree(tmp_path / "src")
    with casckpt.open(tmp_path / "enc", blobs=str(tmp_path / "encloc"), key_file=key, create=False) as enc:
        for step in (1, 2, 3):
            assert_same(enc.restore(f"ft@{step}"), step)
        assert enc.ops.check(read_data=True).ok


def test_copies_between_two_keys_and_back_to_plain(tmp_path: Path) -> None:
    key_a, key_b = _key(tmp_path / "a.key"), _key(tmp_path / "b.key")
    with casckpt.open(tmp_path / "a", key_file=key_a, **OPTS) as a, \
            casckpt.open(tmp_path / "b", key_file=key_b, **OPTS) as b, \
            casckpt.open(tmp_path / "plain", **OPTS) as plain:
        commit_run(a, range(1, 3))
        a.fork("ft@1", "sweep")
        a.commit(state(5), run="sweep", step=5)
        assert [v.step for v in a.copy("sweep@5", to=b).versions] == [1, 5]
        assert [v.step for v in b.copy("sweep", to=plain).versions] == [1, 5]
        assert [(v.step, v.sent) for v in a.copy("ft@2", to=plain).versions] == [(2, True)]  # ft@1 held
        nodes = {n.name: n for n in plain.lineage()}
        assert (nodes["sweep"].parent_run, nodes["sweep"].fork_step) == ("ft", 1)
        assert b.copy("sweep@5", to=plain).nothing_sent
    shutil.rmtree(tmp_path / "a")
    shutil.rmtree(tmp_path / "b")
    with casckpt.open(tmp_path / "plain", create=False) as plain:
        for ref, step in (("sweep@5", 5), ("ft@2", 2), ("ft@1", 1)):
            assert_same(plain.restore(ref), step)
        assert plain.ops.check(read_data=True).ok


def test_copies_into_and_out_of_every_backend(store_config: Any, tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, store_config.open(**OPTS) as remote, \
            casckpt.open(tmp_path / "back", **OPTS) as back:
        commit_run(src, range(1, 3))
        assert src.copy("ft@2", to=remote).chunks > 0
        assert src.copy("ft@2", to=remote).nothing_sent
        report = remote.copy("ft", to=back)
        assert [v.step for v in report.versions] == [1, 2] and report.chunks > 0
        assert remote.ops.check(read_data=True).ok
    shutil.rmtree(tmp_path / "src")
    with casckpt.open(tmp_path / "back", create=False) as back:
        assert_same(back.restore("ft@2"), 2)
        assert back.ops.check(read_data=True).ok


_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float64]
_leaf = st.one_of(
    st.tuples(st.sampled_from(_DTYPES), st.integers(0, 3000), st.integers(0, 2**31 - 1)).map(
        lambda t: (torch.randn(t[1], generator=torch.Generator().manual_seed(t[2])) * 100).to(t[0])),
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8), st.binary(max_size=8))
_states = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4),
                          st.one_of(_leaf, st.lists(_leaf, max_size=3)), max_size=6)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))  # type: ignore[arg-type]
    return a == b


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(states=st.lists(_states, min_size=1, max_size=3))
def test_any_run_copied_restores_as_committed(tmp_path: Path, states: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as where:
        root = Path(where)
        with casckpt.open(root / "src", **OPTS) as src, casckpt.open(root / "dst", **OPTS) as dst:
            for step, value in enumerate(states):
                src.commit(value, run="p", step=step)
            src.copy("p", to=dst)
            assert src.copy("p", to=dst).nothing_sent
        shutil.rmtree(root / "src")
        with casckpt.open(root / "dst", create=False) as dst:
            for step, value in enumerate(states):
                assert _equal(dst.restore(f"p@{step}"), value)


def test_two_copies_at_once_report_each_version_sent_by_one_of_them(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Both copies planned every version missing and both sent its chunks; the one whose
    publish came second reported the version sent too (and its bytes), though the other
    copy had published it."""
    with casckpt.open(tmp_path / "src", **OPTS) as src:
        commit_run(src, range(1, 4))
    from casckpt.engine.copying import copy as copy_engine

    real = copy_engine._publish
    both_there = threading.Barrier(2, timeout=60)

    def publish_together(*args: Any, **kwargs: Any) -> Any:
        both_there.wait()  # each version: both copies sent its chunks and are about to publish it
        return real(*args, **kwargs)

    monkeypatch.setattr(copy_engine, "_publish", publish_together)
    casckpt.open(tmp_path / "dst", **OPTS).close()
    reports: list[casckpt.CopyReport] = []

    def one_copy() -> None:
        with casckpt.open(tmp_path / "src", create=False, **OPTS) as s, \
                casckpt.open(tmp_path / "dst", create=False, **OPTS) as d:
            reports.append(s.copy("ft@3", to=d))

    threads = [threading.Thread(target=one_copy) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(reports) == 2
    for step in (1, 2, 3):
        assert sorted(v.sent for r in reports for v in r.versions if v.step == step) == [False, True]
    for r in reports:  # what each stored is counted, whichever published the version
        assert r.bytes == sum(v.bytes for v in r.versions) and r.chunks == sum(v.chunks for v in r.versions)
    with casckpt.open(tmp_path / "src", create=False, **OPTS) as src, \
            casckpt.open(tmp_path / "dst", create=False, **OPTS) as dst:
        assert sorted(v.step for v in dst.log("ft")) == [1, 2, 3]
        assert src.copy("ft@3", to=dst).nothing_sent
        assert dst.ops.check(read_data=True).ok
        assert_same(dst.restore("ft@3"), 3)


def _tree_changes(store: casckpt.Store, version_id: str) -> Any:
    with internals(store).catalog.read() as conn:
        return treechanges.recorded(conn, version_id)


def test_copied_versions_carry_their_tree_changes_rows(src: casckpt.Store, dst: casckpt.Store) -> None:
    """A copy's publish wrote no ``tree_changes`` rows: tensor history at the destination read
    every copied version's tree instead of the rows a commit records."""
    made = commit_run(src, range(1, 4))
    src.copy("ft@3", to=dst)
    for version in made:
        rows = _tree_changes(src, version.id)
        assert rows is not None and rows[0] == version.parent
        assert _tree_changes(dst, version.id) == rows, version.step
    assert [(e.version.id, e.change) for e in dst.history("ft", "head")] == \
        [(e.version.id, e.change) for e in src.history("ft", "head")]


def test_a_copy_killed_right_after_publishing_a_tagged_version_leaves_its_tag_record_written(
        forked_python: Any, tmp_path: Path) -> None:
    """Killed between publishing ft@2 (tagged best, new there) and writing refs/tags/best:
    the record was missing (check failed) and the next copy, finding the tag in place in the
    catalog, left it missing until a repair."""
    with casckpt.open(tmp_path / "src", **OPTS) as src:
        commit_run(src, range(1, 4))
    # the 1st record of best is written before the publish, the 2nd after: killed there
    done = forked_python.run([str(CHILD), str(tmp_path / "src"), str(tmp_path / "dst"), "ft@3", "tag", "2"])
    assert done.returncode == -9, done.stderr
    with casckpt.open(tmp_path / "dst", create=False, **OPTS) as dst:
        assert dst.resolve("tag:best").step == 2
        assert dst.ops.check(read_data=True).ok


def test_the_next_copy_writes_again_a_tag_record_missing_or_wrong_on_a_location(
        src: casckpt.Store, dst: casckpt.Store, tmp_path: Path) -> None:
    """A tag record lost or left stale (a copy killed between publishing a moved tag and
    writing its record) stayed so through every later copy, until a repair."""
    commit_run(src, range(1, 4))
    src.copy("ft@3", to=dst)
    (record,) = (tmp_path / "dst" / "refs" / "tags").iterdir()
    record.write_bytes(b'{"name": "best", "version": "' + b"0" * 64 + b'", "seq": 1, "at": 1.0}')
    assert not dst.ops.check().ok
    assert src.copy("ft@2", to=dst).nothing_sent  # carries best: its record is read, found wrong
    assert dst.ops.check().ok
    record.unlink()
    assert src.copy("ft@2", to=dst).tags == ()  # nothing set or moved: the record written again
    assert dst.ops.check().ok


def _spread(root: Path) -> Any:
    """A destination on six directories, erasure-coded 4+2 (as tests/engine/locations/ have it)."""
    return casckpt.open(root, blobs=[str(root.parent / f"disk{i}") for i in range(6)], redundancy="ec:4+2",
                        **OPTS)


def test_a_copy_with_a_destination_location_down_reports_its_degraded_packs(
        src: casckpt.Store, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The pipeline counted packs stored below their redundancy and nothing showed them."""
    commit_run(src, range(1, 3))
    with _spread(tmp_path / "dst") as dst:
        assert src.copy("ft@1", to=dst).degraded_packs == 0
        shutil.rmtree(tmp_path / "disk1")
        with caplog.at_level(logging.WARNING, logger="casckpt.engine.copying.copy"):
            report = src.copy("ft@2", to=dst)
        assert [(v.step, v.sent) for v in report.versions] == [(2, True)] and report.degraded_packs > 0
        warning = next(r.getMessage() for r in caplog.records if "below their redundancy" in r.getMessage())
        assert "loc1" in warning and "casckpt repair" in warning
        assert_same(dst.restore("ft@2"), 2)  # readable, as the report says
        (tmp_path / "disk1").mkdir()
        assert dst.ops.repair().ok and dst.ops.check(read_data=True).ok


def test_chunks_the_destinations_gc_swept_after_they_were_found_held_are_sent_again_and_counted(
        src: casckpt.Store, dst: casckpt.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """ft@2 shares its frozen chunks with ft@1, deleted at the destination: found held there
    when the copy starts, swept by its gc before the publish, so sent again (through the
    copy's pipeline) -- and the report left them out of its bytes."""
    from casckpt.engine.copying import copy as copy_engine

    commit_run(src, range(1, 3))
    src.copy("ft@1", to=dst)
    dst.delete("ft@1")
    real = copy_engine.plan_batches
    swept: list[int] = []

    def plan_then_sweep(*args: Any, **kwargs: Any) -> Any:
        planned = real(*args, **kwargs)  # the chunks held are left out already
        if not swept:
            swept.append(dst.gc(grace=0).versions_purged + dst.gc(grace=0).versions_purged)
        return planned

    monkeypatch.setattr(copy_engine, "plan_batches", plan_then_sweep)
    plan = src.copy("ft@2", to=dst, dry_run=True)
    report = src.copy("ft@2", to=dst)
    assert swept == [1] and [(v.step, v.sent) for v in report.versions] == [(2, True)]
    assert report.chunks > plan.chunks and report.bytes > plan.bytes  # what was sent again, counted
    assert report.versions[0].bytes == report.bytes
    assert_same(dst.restore("ft@2"), 2)
