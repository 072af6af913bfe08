"""Hostile review of the fast tier (issue 20): each test pins a way the tier could lose data
or call a version durable too early, found in review and fixed."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.errors import IntegrityError, VersionLostError
from casckpt.storage.erasure import Redundancy
from casckpt.testing.internals import internals
from tests.test_tier import _drain_held, _durable_packs, _open, _same, _state, _tier_root


def test_a_pack_damaged_on_the_tier_before_it_drains_never_becomes_durable(tmp_path: Path) -> None:
    """The drain copies the only copy of a pack to the locations: bytes damaged on the local
    disk meanwhile must not be stored under the pack's id and the version called durable
    (it would then fail on every read, once the tier copy is evicted, with no error until then)."""
    with _open(tmp_path) as store:
        with _drain_held(store):
            v = store.commit(_state(1), run="r", step=1)
            for pack in (_tier_root(store) / "packs").glob("*/*"):
                with open(pack, "r+b") as f:
                    f.seek(200)
                    f.write(b"\xff" * 64)
        report = store.tier.drain()
        assert store.resolve(v.id).durability != "durable", report
        assert not _durable_packs(tmp_path)  # nothing damaged was stored under a pack id
        with pytest.raises((VersionLostError, IntegrityError)):
            store.restore(v.id)


def test_a_pack_that_waited_long_for_room_is_not_evicted_as_an_orphan(tmp_path: Path) -> None:
    """A pack written long ago (a commit blocked by backpressure for over an hour) keeps its
    old mtime when renamed onto the tier; until the commit records it, eviction must not take
    it for an orphan and delete the only copy."""
    with _open(tmp_path) as store, _drain_held(store):
        tier = internals(store).context.packs.tier
        assert tier is not None
        data = os.urandom(1 << 16)
        from casckpt.format.chunks import object_id

        pack_id = object_id(data)
        path = tmp_path / "staged.pack"
        path.write_bytes(data)
        old = time.time() - 2 * 3600
        os.utime(path, (old, old))
        layout = tier.write(pack_id, path, len(data), Redundancy("none", 1, 0), "raise")
        assert layout is not None and layout.tier == tier.id
        tier.budget = 1  # everything held is over budget: evict what it may
        tier.evict()
        assert tier.dir.holds(pack_id)  # not recorded yet, but just written: not an orphan


def test_a_tier_whose_manifest_folder_cannot_be_written_still_commits(tmp_path: Path) -> None:
    """A full or broken tier disk sends packs to the locations; the manifest copy kept on the
    tier is only a convenience (the catalog holds it), so it must not fail the commit."""
    state = _state(3)
    with _open(tmp_path) as store:
        root = _tier_root(store)
        if (root / "manifests").exists():
            os.rmdir(root / "manifests")
        (root / "manifests").write_bytes(b"not a directory")  # every manifest write fails
        v = store.commit(state, run="r", step=1)
        store.tier.wait_durable(v, timeout=60)
    with casckpt.open(tmp_path / "store", blobs=[str(tmp_path / "durable")]) as plain:
        assert _same(plain.restore(v.id), state)


def test_the_drain_does_not_finish_a_version_whose_pack_was_lost(tmp_path: Path) -> None:
    """A version whose dependency pack became ``lost`` (not ``fast``) must never be finished
    as durable, however it came to have that dependency."""
    from casckpt.catalog import schema as s
    from casckpt.catalog import tiers as tier_sql

    with _open(tmp_path) as store:
        with _drain_held(store):
            v = store.commit(_state(4), run="r", step=1)
            catalog = internals(store).context.catalog
            with catalog.write() as conn:  # as if the loss had not seen this version's deps
                conn.execute(s.packs.update().where(s.packs.c.state == "fast").values(state="lost"))
            assert v.id not in tier_sql.finishable(catalog)
            assert tier_sql.finish(catalog, [v.id]) == []


def test_the_same_state_committed_again_after_its_tier_was_lost_drains(tmp_path: Path) -> None:
    """A pack is named by its bytes: committing again, after the tier was wiped, the state it
    held writes packs with the same ids as the lost ones. The new copies must be recorded and
    drained, not hidden behind the old ``lost`` rows (the version would then be called durable
    while its packs are on no location)."""
    state = _state(5)
    store = _open(tmp_path)
    with _drain_held(store):
        store.commit(state, run="r", step=1)
        store.close()  # the drain is busy: nothing drained
    shutil.rmtree(tmp_path / "fast")
    with _open(tmp_path) as store:
        assert store.resolve("r@1").durability == "lost"
        v = store.commit(state, run="r", step=2, durable=True)
        assert v.durability == "durable" or store.resolve(v.id).durability == "durable"
    with casckpt.open(tmp_path / "store", blobs=[str(tmp_path / "durable")]) as plain:
        assert _same(plain.restore(v.id), state)
        problems = plain.ops.check(read_data=True).problems
        assert problems and all(p.kind == "version" and "lost" in p.detail for p in problems)


def _tweaked(state: dict[str, object]) -> dict[str, object]:
    out = dict(state)
    for k, t in state.items():
        if isinstance(t, torch.Tensor):
            t = t.clone()
            t[0, :8] += 1.0  # a small change: delta-coded against the previous chunk
            out[k] = t
    return out


def test_a_delta_on_an_undrained_base_waits_on_the_base_pack(tmp_path: Path) -> None:
    """A chunk delta-coded against a base in a pack not drained yet needs that pack too: the
    version must not become durable (nor survive the base pack's loss) on its own packs."""
    from casckpt.catalog import schema as s

    first = _state(6)
    second = _tweaked(first)
    with _open(tmp_path) as store:
        with _drain_held(store):
            v1 = store.commit(first, run="r", step=1)
            v1_packs = {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
            v2 = store.commit(second, run="r", step=2)
            catalog = internals(store).context.catalog
            with catalog.read() as conn:
                deltas = conn.execute(s.chunks.select().where(s.chunks.c.base_id.is_not(None))).all()
            assert deltas, "the second commit was expected to delta-code"
            for pack in (_tier_root(store) / "packs").glob("*/*"):
                if pack.name in v1_packs:
                    pack.unlink()  # v1's packs (v2's delta bases) are gone before they drain
        store.tier.drain()
        durability = {v.id: v.durability for v in store.log("r")}
        assert durability[v1.id] == "lost"
        assert durability[v2.id] == "lost"  # never "durable" without its bases
        with pytest.raises(VersionLostError):
            store.restore(v2.id)


def test_after_a_delta_base_was_lost_the_state_commits_again(tmp_path: Path) -> None:
    """A drained delta chunk whose base was lost with the tier is unreadable: a later commit of
    the same state must not keep deduplicating against it (and fail, or publish unreadable)."""
    first = _state(7)
    second = _tweaked(first)
    with _open(tmp_path) as store:
        with _drain_held(store):
            v1 = store.commit(first, run="r", step=1)
            v1_packs = {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
            store.commit(second, run="r", step=2)
            for pack in (_tier_root(store) / "packs").glob("*/*"):
                if pack.name in v1_packs:
                    pack.unlink()
        store.tier.drain()
        assert store.resolve(v1.id).durability == "lost"
        errors = []
        for attempt in range(2):
            try:
                v3 = store.commit(second, run="r", step=3 + attempt, durable=True)
                break
            except casckpt.errors.CasckptError as exc:
                errors.append(exc)
        else:
            pytest.fail(f"the state cannot be committed again: {errors}")
    with casckpt.open(tmp_path / "store", blobs=[str(tmp_path / "durable")]) as plain:
        assert _same(plain.restore(v3.id), second)
