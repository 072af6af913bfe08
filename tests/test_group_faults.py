"""A save of many ranks killed -9 mid-publish, and gc running beside one in flight.

A group commit (``Store.commit(group=)``) or a DCP save takes its GC lease before any rank
writes, when the version id is not known; the coordinator names the version on that lease
once it has composed the manifest, before it writes the manifest object
(``casckpt/catalog/leases.py``). Without that, a coordinator killed between the manifest
write and the publishing transaction left a manifest gc knew as neither a version, a
tombstone nor a commit in flight: ``check`` reported a missing version and every later
``gc`` refused to run (``GCRefusedError``) until ``--force``; and a gc run while a live save
had written its manifest refused the same way.

Ranks are forked by tests/helpers/dist_worker.py on a gloo group; the coordinator (rank 0)
stops at one step of its publish (``arm`` there): SIGKILLed, or paused while this process
runs gc.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from sqlalchemy import select

import casckpt
from casckpt.catalog import schema as s
from casckpt.testing.internals import internals

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from crash_child import assert_same  # noqa: E402
from dist_worker import CHUNK, PACK, bits, full_state, group_state  # noqa: E402
from doubles import Zygote  # noqa: E402

WORKER = Path(__file__).parent / "helpers" / "dist_worker.py"
RUN = "g"


def _cases(points: list[tuple[Any, ...]]) -> list[Any]:
    """Every point for a group commit, and in the slow tier for a DCP save (the two share
    everything from the coordinator's compose on; a DCP save here takes 5-10 s, DTensors
    and DCP's planning on 2 loaded cores)."""
    return [pytest.param(kind, *point[1:], id=f"{point[0]}-{kind}",
                         marks=[pytest.mark.slow] if kind == "dcp" else [])
            for kind in ("group", "dcp") for point in points]


# (id, point, before/after the real call, whether the version is published when the coordinator dies)
KILL_POINTS = _cases([
    ("chunks-written", "catalog.add_pack", "after", False),
    ("packs-written-no-manifest", "blobs.put_manifest", "before", False),
    ("manifest-written-unpublished", "blobs.place_manifest", "after", False),
    ("publish-transaction-uncommitted", "catalog.audit_in", "after", False),
    ("published", "catalog.add_version", "after", True),
])


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    zygote = Zygote(WORKER)
    yield zygote
    zygote.close()


def _open(path: Path) -> casckpt.Store:
    return casckpt.open(path, chunk_size=CHUNK, pack_size=PACK)


def _save(ranks: Zygote, kind: str, path: Path, step: int, seed: int,
          *stops: dict[str, Any]) -> dict[str, Any]:
    """Save ``step`` of the run on 2 ranks (a group commit or a DCP save), stopping a rank
    where each of ``stops`` says (see ``arm`` in dist_worker.py)."""
    args: dict[str, Any] = {"path": str(path), "run": RUN, "step": step, "seed": seed, "stops": stops}
    scenario = "group_commit" if kind == "group" else "dcp_save"
    # a short process-group timeout: the survivor of a killed coordinator fails fast
    return ranks.ask({"scenario": scenario, "world": 2, "args": args, "timeout": 90, "pg_timeout": 20},
                     timeout=120)


def _saved(reply: dict[str, Any]) -> None:
    assert reply["codes"] == [0, 0], "\n".join(e for e in reply["errors"] if e)
    assert all("error" not in r for r in reply["results"]), reply["results"]


def _restores(store: casckpt.Store, kind: str, step: int, seed: int) -> None:
    """Version ``step`` restores bit for bit what the ranks saved."""
    if kind == "group":
        for rank in range(2):
            assert_same(store.restore(f"{RUN}@{step}", rank=rank), group_state(rank, seed))
        return
    restored, full = store.restore(f"{RUN}@{step}"), full_state(seed)
    for key, want in full.items():
        if isinstance(want, torch.Tensor):
            assert bits(restored[key]) == bits(want), key
        elif key == "meta":
            assert {k: restored[f"meta.{k}"] for k in want} == want
        else:
            assert restored[key] == want, key


def _objects(path: Path) -> set[str]:
    """The pack and manifest objects on the store's one location."""
    return {str(p.relative_to(path)) for top in ("packs", "manifests") for p in (path / top).rglob("*")
            if p.is_file()}


def _leases(store: casckpt.Store) -> list[Any]:
    with internals(store).catalog.read() as conn:
        return list(conn.execute(select(s.leases.c.id, s.leases.c.version_id)).all())


def _all_garbage_gone(store: casckpt.Store) -> None:
    """Two collections leave nothing for a third: no object deleted, none kept unexplained."""
    for _ in range(2):
        store.gc(grace=0)
    last = store.gc(grace=0)
    assert (last.bytes_freed, last.orphans_deleted, last.packs_deleted, last.chunks_swept) == (0, 0, 0, 0)
    assert last.kept == ()
    assert _leases(store) == []


@pytest.mark.parametrize(("kind", "point", "when", "published"), KILL_POINTS)
def test_coordinator_killed_mid_publish_leaves_only_what_gc_reclaims(
        ranks: Zygote, tmp_path: Path, kind: str, point: str, when: str, published: bool) -> None:
    path = tmp_path / "store"
    _open(path).close()
    _saved(_save(ranks, kind, path, step=1, seed=11))
    before = _objects(path)
    with _open(path) as store:
        stored_before = store.ops.stats().unique_bytes

    killed = _save(ranks, kind, path, 2, 12, {"point": point, "when": when, "how": "kill"})
    assert killed["codes"][0] == -9, killed  # the kill point was reached
    with _open(path) as store:
        assert [v.step for v in store.log(RUN)] == ([2, 1] if published else [1])
        # the dead coordinator's save lease is still there, naming the version once composed
        # (the coordinator writes under it: it takes no rank lease)
        named = [lease.version_id is not None for lease in _leases(store)]
        assert sorted(named) == ([] if published else [False] if point == "catalog.add_pack" else [True])
        report = store.ops.check()
        assert report.ok, report.problems
        _all_garbage_gone(store)  # gc reaps the dead lease, tombstones its version, reclaims
        if published:
            _restores(store, kind, 2, 12)
        else:  # every object and chunk the killed save wrote is gone, and only those
            assert _objects(path) == before
            assert store.ops.stats().unique_bytes == stored_before
        _restores(store, kind, 1, 11)
        assert store.ops.check(read_data=True).ok


def _wait_for(flag: Path, saving: Any) -> None:
    deadline = time.monotonic() + 90
    while not flag.exists():
        assert not saving.done(), saving.result()  # the save ended without reaching its pause
        assert time.monotonic() < deadline, "the coordinator never reached its pause point"
        time.sleep(0.02)


# where the coordinator waits while gc runs: its packs and tree nodes written; its manifest
# object written too; about to run the publishing transaction
PAUSE_POINTS = _cases([
    ("packs-written", "blobs.put_manifest", "before"),
    ("manifest-written", "blobs.place_manifest", "after"),
    ("about-to-publish", "catalog.add_version", "before"),
])


@pytest.mark.parametrize(("kind", "point", "when"), PAUSE_POINTS)
def test_gc_beside_a_group_publish_in_flight_deletes_nothing_it_needs(
        ranks: Zygote, tmp_path: Path, kind: str, point: str, when: str) -> None:
    path = tmp_path / "store"
    _open(path).close()
    _saved(_save(ranks, kind, path, step=1, seed=11))
    pause = tmp_path / "pause"
    pause.mkdir()
    stop = {"point": point, "when": when, "how": "pause", "dir": str(pause)}
    with ThreadPoolExecutor(1) as pool:
        saving = pool.submit(_save, ranks, kind, path, 2, 12, stop)
        try:
            _wait_for(pause / "paused", saving)
            with _open(path) as store:
                report = store.gc(grace=0)  # refused before the fix once the manifest was written
                assert report.kept == ()
                assert store.ops.check().ok  # the manifest in flight is a lease's version
        finally:
            (pause / "go").touch()
        _saved(saving.result())
    with _open(path) as store:
        assert [v.step for v in store.log(RUN)] == [2, 1]
        assert store.ops.check(read_data=True).ok  # gc deleted nothing the save needed
        _restores(store, kind, 2, 12)
        _restores(store, kind, 1, 11)
        _all_garbage_gone(store)
        _restores(store, kind, 2, 12)


def _coordinator_dead(path: Path, survivor: int) -> None:
    """Wait until every pid holding a lease but ``survivor`` is gone (the zygote reaps its ranks)."""
    deadline = time.monotonic() + 60
    with _open(path) as store, internals(store).catalog.read() as conn:
        pids = set(conn.execute(select(s.leases.c.pid)).scalars()) - {survivor}
    assert pids  # the coordinator's lease, still there
    for pid in pids:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the coordinator outlived its kill point"
            time.sleep(0.02)


@pytest.mark.parametrize("kind", ["group", pytest.param("dcp", marks=pytest.mark.slow)])
def test_a_rank_still_writing_when_its_coordinator_dies_keeps_what_it_records(
        ranks: Zygote, tmp_path: Path, kind: str) -> None:
    """Rank 1 has put a pack object and not yet recorded it when the coordinator, whose lease
    covers every rank's writes, is killed; gc (grace 0) then reaps that lease and takes the
    unrecorded object for an orphan. Rank 1 records the pack after all: its chunk rows must not
    stay live over an object that is gone, or the next save dedups against them: every rank
    writes under a lease of its own (``distributed.rank_lease``)."""
    path = tmp_path / "store"
    _open(path).close()
    _saved(_save(ranks, kind, path, step=1, seed=11))
    pause = tmp_path / "pause"
    pause.mkdir()
    with ThreadPoolExecutor(1) as pool:
        saving = pool.submit(
            _save, ranks, kind, path, 2, 12,
            {"rank": 0, "point": "catalog.add_pack", "when": "after", "how": "kill"},
            {"rank": 1, "point": "catalog.add_pack", "when": "before", "how": "pause", "dir": str(pause)})
        try:
            _wait_for(pause / "paused", saving)
            _coordinator_dead(path, survivor=int((pause / "paused").read_text()))
            with _open(path) as store:
                store.gc(grace=0)
        finally:
            (pause / "go").touch()
        assert saving.result()["codes"][0] == -9
    _saved(_save(ranks, kind, path, step=2, seed=12))  # the same state saved again
    with _open(path) as store:
        assert store.ops.check().ok
        _restores(store, kind, 2, 12)


@pytest.mark.parametrize("kind", ["group", pytest.param("dcp", marks=pytest.mark.slow)])
def test_a_rank_killed_on_another_host_leaves_no_lease_behind_its_save(
        ranks: Zygote, tmp_path: Path, kind: str) -> None:
    """Rank 1, on another host (its leases are judged by age alone, never by pid), is killed
    after recording a pack, under its own lease. The coordinator's end of the failed save ends
    that lease too: it held gc back for a day (``LEASE_TTL``) before."""
    path = tmp_path / "store"
    _open(path).close()
    _saved(_save(ranks, kind, path, step=1, seed=11))
    before = _objects(path)
    failed = _save(ranks, kind, path, 2, 12, {"rank": 1, "point": "catalog.add_pack", "when": "after",
                                              "how": "kill", "elsewhere": True})
    assert failed["codes"][1] == -9, failed
    if kind == "group":  # the survivor's collective failed: a GroupCommitError saying so, not gloo's
        assert failed["codes"][0] == 0, failed
        assert "a rank of the group stopped answering" in failed["results"][0]["error"], failed
        assert "no version was published" in failed["results"][0]["error"], failed
    with _open(path) as store:
        assert [v.step for v in store.log(RUN)] == [1]
        assert _leases(store) == []
        _all_garbage_gone(store)  # what rank 1 recorded is reclaimed now, not in a day
        assert _objects(path) == before
        _restores(store, kind, 1, 11)


@pytest.mark.parametrize("kind", ["group", pytest.param("dcp", marks=pytest.mark.slow)])
def test_a_rank_whose_lease_end_fails_once_still_saves(ranks: Zygote, tmp_path: Path, kind: str) -> None:
    """The catalog fails once as rank 1 ends its lease, after its writes: the save, which
    wrote everything, is published (before, the error failed it), and the coordinator's end
    of the save ends the rank's lease if the rank could not."""
    path = tmp_path / "store"
    _open(path).close()
    _saved(_save(ranks, kind, path, 1, 11, {"rank": 1, "point": "catalog.end_lease", "when": "before",
                                            "how": "raise"}))
    with _open(path) as store:
        assert [v.step for v in store.log(RUN)] == [1]
        assert _leases(store) == []
        _restores(store, kind, 1, 11)
        assert store.ops.check(read_data=True).ok
