"""Locations change while a commit is writing: the commit keeps the set it started with.

The engine context is immutable; the store's locations sit behind a
``CurrentLocations`` holder whose ``swap`` replaces the whole set at once
(``store.locations.add``, ``retire``, ``fail`` and the periodic
refresh all go through it). A pack write takes one snapshot at its start, so
placement, the quorum count and any clean-up agree on one set.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from doubles import WriteHookStore

import casckpt
from casckpt.catalog import inventory
from casckpt.catalog import shards as shard_sql
from casckpt.storage.locations import CurrentLocations, Location, LocationSet
from casckpt.testing.internals import internals

CHUNK = 4096


class HeldPackWrites(WriteHookStore):
    """A local blob store whose pack writes wait while ``gate`` is clear (``held``: one waits).
    Manifests and records go through, so location changes can write theirs meanwhile."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()

    def before_write(self, key: str) -> None:
        if key.startswith("packs/"):
            self.held.set()
            assert self.gate.wait(30)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8 * CHUNK, generator=g), "b": torch.randn(1000, generator=g)}


def test_a_background_commit_keeps_its_location_set_while_locations_change(tmp_path: Path) -> None:
    blobs = [HeldPackWrites(tmp_path / f"d{i}") for i in range(3)]
    with casckpt.open(tmp_path / "store", blobs=blobs, redundancy="ec:2+1", chunk_size=CHUNK,
                      workers=2) as store:
        store.commit(_state(0), run="r", step=0)
        before = internals(store).locations
        old_packs = {p.id for p in inventory.live_packs(internals(store).catalog)}
        names = [info.name for info in store.locations.list()]
        for b in blobs:
            b.gate.clear()
            b.held.clear()
        handle = store.commit(_state(1), run="r", step=1, block=False)
        assert any(b.held.wait(30) for b in blobs), "the commit never reached its pack upload"
        retired = store.locations.retire(names[0])  # swaps the location set mid-upload
        store.locations.add(str(tmp_path / "d3"))  # and again
        after = internals(store).locations
        assert retired.state == "retiring" and after is not before and len(after.all) == 4
        assert before.get(before.all[0].id).state == "active"  # the old set itself never changes
        for b in blobs:
            b.gate.set()
        version = handle.wait()

        # every shard was written where the placement the commit took put it: the three
        # locations of the set it started with, one shard each, all healthy
        packs = {p.id for p in inventory.live_packs(internals(store).catalog)} - old_packs
        layouts = shard_sql.layouts(internals(store).catalog, sorted(packs))
        assert layouts
        original = {loc.id for loc in before.all}
        for layout in layouts.values():
            assert {sh.location_id for sh in layout.shards} == original, layout
            assert all(sh.state == "ok" for sh in layout.shards), layout
        assert store.ops.check(read_data=True).ok
        restored = store.restore(version.id)
        assert all(torch.equal(restored[k], v) for k, v in _state(1).items())
        store.ops.repair()  # moves the retired location's shards to the new one
        assert store.ops.check(read_data=True).ok


def test_current_locations_swap_is_atomic_and_snapshots_stay_put() -> None:
    sets = [LocationSet([Location(i, f"loc{i}", f"dom{i}", "active", WriteHookStore.__new__(WriteHookStore))])
            for i in range(2)]
    current = CurrentLocations(sets[0])
    taken = current.get()
    assert current.swap(sets[1]) is sets[0]
    assert current.get() is sets[1] and taken is sets[0]
