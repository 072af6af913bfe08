"""The fast tier (issue 20): commits land on local disk, drain to the locations, and every
version says how durable it is. Fault injection and many processes: test_tier_faults.py."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.config import parse_size
from casckpt.errors import (
    CommitBackpressureError,
    DrainTimeoutError,
    IntegrityError,
    InvalidArgumentError,
    VersionLostError,
    VersionNotDurableError,
)
from casckpt.storage.erasure import Redundancy
from casckpt.testing.internals import internals

MiB = 1 << 20


def _state(seed: int, n: int = 3) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(n)} | {"step": seed}


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _open(tmp: Path, fast: str = "fast", **kw: object) -> casckpt.Store:
    kw.setdefault("pack_size", MiB)
    kw.setdefault("fast_tier_bytes", "64MiB")
    return casckpt.open(tmp / "store", blobs=[str(tmp / "durable")], fast_tier=str(tmp / fast), **kw)


def _tier_root(store: casckpt.Store) -> Path:
    path = store.tier.status().local_path
    assert path is not None
    return Path(path)


@contextmanager
def _drain_held(store: casckpt.Store) -> Iterator[None]:
    """Hold the tier's drain lock, as another process draining it would: nothing drains."""
    fd = os.open(_tier_root(store) / "drain.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _durable_packs(tmp: Path) -> set[str]:
    return {p.name for p in (tmp / "durable" / "packs").glob("*/*")}


def test_commit_is_fast_then_drains_durable(tmp_path: Path) -> None:
    state = _state(1)
    with _open(tmp_path) as store:
        with _drain_held(store):
            v = store.commit(state, run="r", step=1)
            assert v.durability == "fast"
            assert store.resolve("r@1").durability == "fast"
            assert _durable_packs(tmp_path) == set()  # nothing remote yet
            held = {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
            assert held and store.tier.status().tiers[0].undrained_packs == len(held)
            assert not (tmp_path / "durable" / "manifests" / v.id).exists()
            with pytest.raises(DrainTimeoutError):
                store.tier.wait_durable(v, timeout=0.2)
        store.tier.wait_durable(timeout=30)
        assert store.resolve("r@1").durability == "durable"
        assert _durable_packs(tmp_path) == held
        assert (tmp_path / "durable" / "manifests" / v.id).is_file()
        status = store.tier.status()
        assert status.versions == {"durable": 1} and status.not_durable == ()
        assert status.tiers[0].undrained_bytes == 0 and status.durable_bytes > 0
        assert _same(store.restore("r@1"), state)
        assert store.ops.check(read_data=True).ok


def test_durable_true_returns_a_durable_version(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        v = store.commit(_state(2), run="r", step=1, durable=True)
        assert v.durability == "durable" == store.resolve(v.id).durability
        with pytest.raises(InvalidArgumentError):
            store.commit(_state(3), run="r", step=2, block=False, durable=True)


def test_restart_on_the_same_host_reads_nothing_remote(tmp_path: Path) -> None:
    state = _state(3)
    with _open(tmp_path) as store:
        store.commit(state, run="r", step=1, durable=True)
    hidden = tmp_path / "hidden-packs"
    (tmp_path / "durable" / "packs").rename(hidden)  # the remote packs are out of reach
    try:
        with _open(tmp_path) as store:
            assert _same(store.restore("r@latest"), state)
            assert torch.equal(store.load_tensor("r@1", "w1"), state["w1"])  # type: ignore[arg-type]
    finally:
        hidden.rename(tmp_path / "durable" / "packs")


def test_a_host_with_an_empty_tier_reads_the_locations(tmp_path: Path) -> None:
    state = _state(4)
    with _open(tmp_path) as store:
        store.commit(state, run="r", step=1, durable=True)
    with _open(tmp_path, fast="other") as store:
        assert _same(store.restore("r@1"), state)
        assert store.tier.status().held_packs == 0  # reads are not copied onto the tier


def test_close_drains_what_is_left(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        v = store.commit(_state(5), run="r", step=1)
    with casckpt.open(tmp_path / "store") as store:  # no tier: the drain finished at close
        assert store.resolve(v.id).durability == "durable"
        assert store.ops.check(read_data=True).ok


def test_close_waits_out_another_drain_then_drains_what_it_missed(tmp_path: Path) -> None:
    """Another process's drain holding the lock at close may have listed the tier's packs
    before this handle's last commit: close waits for it, then drains the rest itself."""
    store = _open(tmp_path)
    with _drain_held(store):
        v = store.commit(_state(9), run="r", step=1)
        assert v.durability == "fast"
        closer = threading.Thread(target=store.close)
        closer.start()
        closer.join(0.5)
        assert closer.is_alive()  # waiting for the other drain, not returning with work left
    closer.join(60)
    assert not closer.is_alive()
    with casckpt.open(tmp_path / "store") as store:  # no tier: the drain finished at close
        assert store.resolve(v.id).durability == "durable"
        assert store.ops.check(read_data=True).ok


def test_wiped_tier_loses_only_what_had_not_drained(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first, second, third = _state(6), _state(7), _state(8)
    store = _open(tmp_path, options=casckpt.Options(background_drain=False))  # no drain at close
    store.commit(first, run="r", step=1, durable=True)
    store.commit(second, run="r", step=2)
    v3 = store.commit(third, run="r", step=3)
    store.close()
    shutil.rmtree(tmp_path / "fast")  # the disk is wiped before anything drained
    with caplog.at_level(logging.WARNING), _open(tmp_path) as store:
        assert "lost" in caplog.text and v3.id[:12] in caplog.text
        durability = {v.step: v.durability for v in store.log("r")}
        assert durability == {1: "durable", 2: "lost", 3: "lost"}
        with pytest.raises(VersionLostError):
            store.restore("r@3")
        with pytest.raises(VersionLostError):
            store.load_tensor("r@2", "w0")
        caplog.clear()
        assert store.resolve("r@latest").step == 1  # skipped, with a warning
        assert "skips 2 version(s)" in caplog.text
        assert _same(store.restore("r@latest"), first)
        again = store.commit(third, run="r", step=4, durable=True)  # lost chunks written again
        assert again.durability == "durable"
        assert _same(store.restore("r@4"), third)
        assert store.tier.status().versions == {"durable": 2, "lost": 2}
        assert [a.action for a in store.ops.audit(action="tier.lost")] == ["tier.lost"]


def test_a_pack_gone_from_its_tier_before_the_drain_is_lost(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        base = store.commit(_state(9), run="r", step=1, durable=True)
        with _drain_held(store):
            v = store.commit(_state(10), run="r", step=2)
            for pack in (_tier_root(store) / "packs").glob("*/*"):
                if pack.name not in _durable_packs(tmp_path):
                    pack.unlink()
        report = store.tier.drain()
        assert report.lost_versions == (v.id,) and report.lost_packs
        assert store.resolve(v.id).durability == "lost"
        assert store.resolve("r@latest").id == base.id


def test_an_undrained_pack_grown_or_replaced_by_a_fifo_on_its_tier_is_lost_not_read(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        base = store.commit(_state(11), run="r", step=1, durable=True)
        with _drain_held(store):
            v = store.commit(_state(12), run="r", step=2)
            grown, fifo = [p for p in (_tier_root(store) / "packs").glob("*/*")
                           if p.name not in _durable_packs(tmp_path)][:2]
            with open(grown, "ab") as f:  # the catalog's size bounds the drain's read
                f.write(b"\0" * 4096)
            fifo.unlink()
            os.mkfifo(fifo)  # a drain that opened it would wait for a writer forever
        store.tier.drain()  # or the drain worker, woken by the commit, got there first
        assert store.resolve(v.id).durability == "lost"
        assert store.resolve("r@latest").id == base.id


def test_budget_evicts_drained_packs_least_recently_used(tmp_path: Path) -> None:
    states = [_state(20 + i) for i in range(4)]  # 3 MiB each, in 1 MiB packs
    with _open(tmp_path, fast_tier_bytes=7 * MiB, keep_fast_last=1) as store:
        versions = [store.commit(s, run="r", step=i, durable=True) for i, s in enumerate(states)]
        store.tier.drain()
        status = store.tier.status()
        assert status.held_bytes <= status.budget == 7 * MiB  # type: ignore[operator]
        held = {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
        newest = _packs_of(store, versions[-1].id)
        assert newest <= held  # keep_fast_last keeps the newest version resident
        assert not _packs_of(store, versions[0].id) & held  # the oldest went first
        for v, s in zip(versions, states, strict=True):  # evicted packs come from the locations
            assert _same(store.restore(v), s)


def _packs_of(store: casckpt.Store, version_id: str) -> set[str]:
    from casckpt.catalog import gc as gc_sql
    from casckpt.engine.versions.nodes import StoreNodes
    from casckpt.engine.versions.references import references

    core = internals(store).context
    ids: set[str] = set()
    for batch in gc_sql.manifest_batches(core.catalog, [version_id]):
        for row in batch:
            ids |= {c.hex() for c in references(row, StoreNodes(core.catalog), set())}
    return {loc.pack_id for loc in core.catalog.find_chunks(ids, live_only=False).values()}


def test_packs_not_drained_are_never_evicted_and_backpressure_raises(tmp_path: Path) -> None:
    with _open(tmp_path, fast_tier_bytes=4 * MiB, backpressure="raise") as store:
        with _drain_held(store):
            store.commit(_state(30), run="r", step=1)  # 3 MiB: fits
            before = {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
            with pytest.raises(CommitBackpressureError, match="fast_tier_bytes"):
                store.commit(_state(31), run="r", step=2)
            assert before <= {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
        store.tier.wait_durable(timeout=30)
        store.commit(_state(31), run="r", step=2, durable=True)  # room again once drained
        assert store.ops.check(read_data=True).ok


def test_backpressure_block_waits_for_the_drain(tmp_path: Path) -> None:
    with _open(tmp_path, fast_tier_bytes=4 * MiB) as store:
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            with _drain_held(store):
                held.set()
                release.wait()

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        store.commit(_state(32), run="r", step=1)  # 3 MiB: fits
        threading.Timer(1.0, release.set).start()
        started = time.monotonic()
        v = store.commit(_state(33), run="r", step=2)  # waits until the drain made room
        assert time.monotonic() - started >= 0.9
        holder.join()
        store.tier.wait_durable(timeout=30)
        assert _same(store.restore(v), _state(33))


def test_gc_leaves_fast_packs_alone(tmp_path: Path) -> None:
    state = _state(40)
    with _open(tmp_path) as store:
        old = store.commit(_state(41), run="old", step=1, durable=True)
        with _drain_held(store):
            v = store.commit(state, run="r", step=1)
            store.delete(old.id)
            store.gc(grace=0)
            assert _same(store.restore(v), state)
        store.tier.wait_durable(timeout=30)
        store.gc(grace=0)
        assert _same(store.restore(v), state)
        assert store.ops.check(read_data=True).ok


def test_another_tier_cannot_read_a_fast_version_until_it_drains(tmp_path: Path) -> None:
    state = _state(50)
    with _open(tmp_path) as a, _open(tmp_path, fast="b-tier") as b:
        with _drain_held(a):
            v = a.commit(state, run="r", step=1)
            with pytest.raises(VersionNotDurableError, match="not drained"):
                b.restore(v)
            with pytest.raises(VersionNotDurableError):
                b.load_tensor(v, "w0")
            with pytest.raises(casckpt.errors.RefNotFoundError):
                b.resolve("r@latest")  # nothing of r is restorable on b yet
            b_own = b.commit(state, run="s", step=1)  # never dedups against a's undrained packs
            assert b_own.new_bytes == v.new_bytes
        b.tier.wait_durable(v, timeout=30)  # a's worker drains it once the lock is free
        assert _same(b.restore(v), state)


def test_a_damaged_tier_copy_of_a_drained_pack_is_read_from_the_locations(tmp_path: Path) -> None:
    state = _state(60)
    with _open(tmp_path) as store:
        store.commit(state, run="r", step=1, durable=True)
        pack = max((_tier_root(store) / "packs").glob("*/*"), key=lambda p: p.stat().st_size)
        with open(pack, "r+b") as f:  # the largest: a tensor's chunks (not a small node pack)
            f.seek(200)
            f.write(b"\xff" * 64)
        assert _same(store.restore("r@1"), state)
        assert not pack.exists()  # the damaged copy was evicted


def test_a_damaged_tier_copy_of_an_undrained_pack_is_refused(tmp_path: Path) -> None:
    with _open(tmp_path) as store, _drain_held(store):
        store.commit(_state(61), run="r", step=1)
        for pack in (_tier_root(store) / "packs").glob("*/*"):
            with open(pack, "r+b") as f:
                f.seek(200)
                f.write(b"\xff" * 64)
        with pytest.raises(IntegrityError):
            store.restore("r@1")


def test_the_config_file_records_the_tier(tmp_path: Path) -> None:
    with _open(tmp_path, fast_tier_bytes="5MiB", keep_fast_last=2) as store:
        store.commit(_state(70), run="r", step=1)
    text = (tmp_path / "store" / "casckpt.toml").read_text()
    assert "fast_tier = " in text and "fast_tier_bytes = 5242880" in text and "keep_fast_last = 2" in text
    with casckpt.open(tmp_path / "store") as store:  # the recorded tier, without arguments
        status = store.tier.status()
        assert status.budget == 5 * MiB and status.local_path is not None


def test_a_read_only_store_uses_the_tier_and_writes_nothing(tmp_path: Path) -> None:
    state = _state(80)
    with _open(tmp_path) as store:
        store.commit(state, run="r", step=1, durable=True)
    with _open(tmp_path, read_only=True) as store:
        assert _same(store.restore("r@1"), state)
        with pytest.raises(casckpt.errors.ReadOnlyStoreError):
            store.tier.drain()


@pytest.mark.parametrize("bad", [0, -1, "lots", "5 XB", True, 1.5])
def test_bad_budgets_are_refused(tmp_path: Path, bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="fast_tier_bytes"):
        casckpt.open(tmp_path / "s", fast_tier=str(tmp_path / "f"), fast_tier_bytes=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "s").exists()


def test_sizes_parse() -> None:
    assert parse_size("200GiB", "x") == 200 << 30
    assert parse_size("1.5 TB", "x") == 1_500_000_000_000
    assert parse_size("4096", "x") == parse_size(4096, "x") == 4096
    assert parse_size("64mib", "x") == 64 * MiB


def test_a_store_without_a_tier_cannot_drain(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        store.commit(_state(90), run="r", step=1)
        assert store.resolve("r@1").durability == "durable"
        store.tier.wait_durable()  # nothing to wait for
        with pytest.raises(InvalidArgumentError, match="without a fast tier"):
            store.tier.drain()


def test_retention_keeps_the_newest_durable_version_while_newer_ones_are_fast(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        store.retention.set("r", keep_last=1)
        first = store.commit(_state(100), run="r", step=1, durable=True)
        with _drain_held(store):
            second = store.commit(_state(101), run="r", step=2)
            (plan,) = store.retention.plan("r")
            kept = {d.version.id: d.reasons for d in plan.decisions if d.keep}
            assert set(kept) == {first.id, second.id}
            assert any("newest durable" in r for r in kept[first.id])
            store.gc(grace=0)
            assert _same(store.restore(first), _state(100))
        store.tier.wait_durable(timeout=30)
        (plan,) = store.retention.plan("r")  # once drained, the policy alone decides
        assert {d.version.id for d in plan.decisions if d.keep} == {second.id}


def test_an_encrypted_store_seals_what_drains(tmp_path: Path) -> None:
    key = tmp_path / "key"
    casckpt.generate_key_file(key)
    state = _state(110)
    with _open(tmp_path, key_file=str(key)) as store:
        v = store.commit(state, run="r", step=1, durable=True)
        held = {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
        assert held and held == _durable_packs(tmp_path)
    for pack in (tmp_path / "durable" / "packs").glob("*/*"):  # sealed on the location
        assert pack.read_bytes() != (tmp_path / "fast").glob(f"*/packs/*/{pack.name}").__next__().read_bytes()
    with _open(tmp_path, fast="other", key_file=str(key)) as store:
        assert _same(store.restore(v), state)


def test_the_drain_rate_is_kept_for_every_process_of_the_host(tmp_path: Path) -> None:
    with _open(tmp_path) as store:
        store.commit(_state(120), run="r", step=1, durable=True)
    with _open(tmp_path) as store:  # another process, as far as the numbers go
        status = store.tier.status()
        # 3 MiB of fp32, ~2.6 MiB stored in byte planes
        assert status.drained_bytes > 2 * MiB and status.drain_rate is not None
        assert status.drain_rate > 0


def _pack_files(store: casckpt.Store) -> dict[str, Path]:
    return {p.name: p for p in (_tier_root(store) / "packs").glob("*/*")}


def test_a_version_reusing_undrained_chunks_waits_on_their_packs(tmp_path: Path) -> None:
    """Dependencies are every fast pack a version's chunks lie in, not only those it wrote:
    losing the first commit's packs loses the second, which reused its unchanged chunks."""
    from casckpt.catalog import tiers as tier_sql

    first = _state(130)
    second = dict(first) | {"w0": torch.zeros(256, 1024)}
    with _open(tmp_path) as store:
        with _drain_held(store):
            v1 = store.commit(first, run="r", step=1)
            v1_packs = set(_pack_files(store))
            v2 = store.commit(second, run="r", step=2)
            catalog = internals(store).context.catalog
            v2_packs = set(_pack_files(store)) - v1_packs
            assert sum(tier_sql.waiting_on(catalog, v2.id).values()) > len(v2_packs)
            for name in v1_packs:
                _pack_files(store)[name].unlink()
        store.tier.drain()  # this drain, or the worker's before it, finds v1's packs gone
        durability = {v.id: v.durability for v in store.log("r")}
        assert durability[v1.id] == durability[v2.id] == "lost"
        assert set(_durable_packs(tmp_path)) == v2_packs  # what was there still drained


def test_a_small_change_to_a_large_durable_state_depends_only_on_its_new_pack(tmp_path: Path) -> None:
    from casckpt.catalog import tiers as tier_sql

    big = _state(140, n=24)
    with _open(tmp_path) as store:
        store.commit(big, run="r", step=1, durable=True)
        with _drain_held(store):
            changed = dict(big) | {"w5": torch.ones(256, 1024)}
            v2 = store.commit(changed, run="r", step=2)
            catalog = internals(store).context.catalog
            new_packs = set(_pack_files(store)) - _durable_packs(tmp_path)
            assert sum(tier_sql.waiting_on(catalog, v2.id).values()) == len(new_packs) >= 1
        store.tier.wait_durable(v2, timeout=30)
        assert _same(store.restore(v2), changed)


def test_a_process_whose_tier_was_declared_lost_writes_to_the_locations(tmp_path: Path) -> None:
    from casckpt.engine.tiering.tier import declare_lost

    with _open(tmp_path) as store:
        catalog = internals(store).context.catalog
        declare_lost(catalog, store.tier.status().tiers[0].id, "wiped")  # another process found it wiped
        v = store.commit(_state(150), run="r", step=1)
        assert _durable_packs(tmp_path)  # straight to the locations
        store.tier.wait_durable(v, timeout=30)
        assert _same(store.restore(v), _state(150))


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs mounted inside ``tmp_path``: a fast tier's disk far smaller than its budget
    (skipped where this process may not mount: not root, no CAP_SYS_ADMIN)."""
    where = tmp_path / "tiny"
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)],
                              capture_output=True, text=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], check=False, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False, timeout=30)


def test_a_tier_on_a_disk_smaller_than_its_budget_never_wedges(tmp_path: Path, tiny_disk: Path) -> None:
    states = [_state(200 + i, n=1) for i in range(8)]  # 1 MiB each: 8 MiB through a 3 MiB disk
    with casckpt.open(tmp_path / "store", blobs=[str(tmp_path / "durable")], fast_tier=str(tiny_disk),
                      fast_tier_bytes="100MiB", pack_size=MiB) as store:
        versions = [store.commit(s, run="r", step=i) for i, s in enumerate(states)]  # none raises
        store.tier.wait_durable(timeout=60)  # the drain needs no room on the full tier
        status = store.tier.status()
        assert status.drained_bytes > 0  # the tier was used while it had room
        assert status.disk_bytes is not None and status.disk_bytes < 100 * MiB
        assert any("exceeds the file system" in w for w in status.warnings)
        for v, s in zip(versions, states, strict=True):
            assert store.resolve(v.id).durability == "durable"
            assert _same(store.restore(v), s)
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems
        assert any("exceeds the file system" in w for w in report.warnings)


def _fill(disk: Path) -> None:
    """Write on ``disk`` until it is full."""
    with open(disk / "filler", "wb", buffering=0) as f, suppress(OSError):
        while True:
            f.write(b"\0" * (4 << 10))


def test_a_full_tier_still_drains_and_commits_pass_it_by(tmp_path: Path, tiny_disk: Path) -> None:
    states = [_state(220 + i, n=1) for i in range(4)]
    with casckpt.open(tmp_path / "store", blobs=[str(tmp_path / "durable")], fast_tier=str(tiny_disk),
                      fast_tier_bytes="100MiB", pack_size=MiB) as store:
        with _drain_held(store):
            versions = [store.commit(s, run="r", step=i) for i, s in enumerate(states)]
            waiting = {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
            assert waiting and not waiting & _durable_packs(tmp_path)  # held here, not drained
            assert _durable_packs(tmp_path)  # what the disk had no room for went to the locations
            _fill(tiny_disk)  # not a byte left for the drain
            v = store.commit(_state(230, n=1), run="r", step=9)
        store.tier.wait_durable(timeout=60)
        assert waiting <= _durable_packs(tmp_path)
        for version, s in [*zip(versions, states, strict=True), (v, _state(230, n=1))]:
            assert store.resolve(version.id).durability == "durable"
            assert _same(store.restore(version), s)


def test_a_pack_filled_on_the_tier_survives_its_disk_filling_meanwhile(tmp_path: Path,
                                                                      tiny_disk: Path) -> None:
    state = _state(240, n=1)  # 1 MiB in 256 KiB chunks: one pack, filled a chunk at a time
    filled: list[bool] = []

    def fill_once(phase: str, done: int, total: int) -> None:
        if phase == "write" and not filled:  # the pack is open on the tier: take every free byte
            _fill(tiny_disk)
            filled.append(True)

    with casckpt.open(tmp_path / "store", blobs=[str(tmp_path / "durable")], fast_tier=str(tiny_disk),
                      fast_tier_bytes="100MiB", pack_size=MiB, chunk_size=256 << 10) as store:
        with _drain_held(store):
            v = store.commit(state, run="r", step=1, progress=fill_once)  # its room was reserved
            assert filled and {p.name for p in (_tier_root(store) / "packs").glob("*/*")}
        store.tier.wait_durable(v, timeout=60)
        assert _same(store.restore(v), state)
        assert store.ops.check(read_data=True).ok


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
    with _open(tmp_path, options=casckpt.Options(background_drain=False)) as store:
        store.commit(state, run="r", step=1)  # nothing drains, at close neither
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


def test_the_fast_tier_wraps_the_pack_layer_which_nothing_reassigns(tmp_path: Path) -> None:
    """The tier is built around the pack layer's reader (not assigned onto it after open); a
    view reading the locations only is a new pack layer, and the store's own still reads the
    tier: a pack not drained comes back from the tier and is refused by the locations view."""
    from dataclasses import FrozenInstanceError

    from casckpt.engine.packlayer.tierreads import TierReads
    from casckpt.format.chunks import object_id

    with _open(tmp_path) as store, _drain_held(store):
        ctx = internals(store).context
        packs = ctx.packs
        assert isinstance(packs.reads, TierReads) and packs.reads.located is packs.reader
        assert packs.tier is packs.reads.tier is not None
        with pytest.raises(FrozenInstanceError):
            packs.tier = None  # type: ignore[misc]
        with pytest.raises(FrozenInstanceError):
            ctx.packs = packs.on_locations()  # type: ignore[misc]
        store.commit(_state(1), run="r", step=1)
        held = [p.name for p in (_tier_root(store) / "packs").glob("*/*")]
        assert held
        located = packs.on_locations()
        assert located.tier is None and located.reads is packs.reader and located.coder is packs.coder
        for pack_id in held:
            assert object_id(packs.reads.get(pack_id)) == pack_id  # the tier's copy
            with pytest.raises(VersionNotDurableError):
                located.reads.get(pack_id)  # only on this host's tier: not on the locations yet
        assert ctx.packs is packs and packs.tier is not None


def test_a_drain_whose_lease_cannot_end_still_drains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The catalog refuses to end the drain's GC lease (unreachable after the pack went live):
    the pack is drained all the same, the failure is reported, not raised over the drain's
    outcome (a lease left behind only holds gc back until it expires)."""
    from casckpt.catalog import leases
    from casckpt.engine.tiering import tier
    from casckpt.errors import CatalogError

    def unreachable(*_: object, **__: object) -> None:
        raise CatalogError("the catalog is unreachable (injected)")

    with _open(tmp_path, background_drain=False) as store:
        v = store.commit(_state(21), run="r", step=1)
        monkeypatch.setattr(leases, "end_lease", unreachable)
        monkeypatch.setattr(tier, "end_lease", unreachable, raising=False)  # a name imported from leases
        with caplog.at_level(logging.WARNING, logger="casckpt.catalog.leases"):
            report = store.tier.drain()
        monkeypatch.undo()
        assert report.packs and not report.lost_versions
        assert store.resolve(v.id).durability == "durable"
        assert "could not end the GC lease of the drain of pack" in caplog.text
        assert _same(store.restore(v.id), _state(21))
