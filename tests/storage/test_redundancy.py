"""Redundancy: blob locations in failure domains, replicated and erasure-coded packs.

Stores here keep their blob locations inside the store directory (relative
paths in casckpt.toml), so a built store can be copied whole with
``shutil.copytree``. Damage is done to the shard objects themselves (files,
or S3 objects through boto3), found by scanning the locations, never through
the catalog; the catalog is read only to cross-check what the store reports.

Covered: losing or corrupting any M shards of every pack (restores stay
bit-exact, heal on read, repair, scrub), losing more than M (typed errors
naming version, tensors and pack), bit rot found by scrubs, a lost or
retired location, catalog rebuild (SQLite, PostgreSQL), S3 and mixed
locations, write quorum, replication, and SIGKILL during an erasure-coded
commit.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from doubles import ForkedPython, WriteHookStore, empty_postgres_catalog
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import casckpt
from casckpt.catalog import inventory
from casckpt.errors import (
    CasckptError,
    InvalidArgumentError,
    MissingDataError,
    RefNotFoundError,
    StorageError,
)
from casckpt.format.pack import ENTRY_HEADER_SIZE, PACK_HEADER_SIZE
from casckpt.format.shard import SHARD_HEADER_SIZE, decode_shard_header
from casckpt.storage import LocalBlobStore
from casckpt.testing.internals import internals

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
CHUNK = 16 << 10
PACK = 128 << 10
RUN = "r"
STEPS = (0, 1, 2, 3)
SHARD_FILE = re.compile(r"^packs/[0-9a-f]{2}/([0-9a-f]{64})\.s(\d+)$")
COPY_FILE = re.compile(r"^packs/[0-9a-f]{2}/([0-9a-f]{64})$")
MODES = ("delete", "flip", "truncate", "header")


# -- states ---------------------------------------------------------------------------


def make_state(step: int, seed: int = 0) -> dict[str, Any]:
    """A deterministic state: a tensor shared by every step (deduplicated) and fresh ones."""
    shared = torch.randn(20_000, generator=torch.Generator().manual_seed(10_000 + seed))
    g = torch.Generator().manual_seed(seed * 1_000 + step + 1)
    return {
        "model": {
            "shared": shared,
            "w": torch.randn(40_000, generator=g).reshape(-1, 40),
            "b": torch.arange(step, step + 100, dtype=torch.int64),
            "h": torch.randn(2_000, generator=g).to(torch.bfloat16),
        },
        "np": np.random.default_rng(seed * 100 + step).standard_normal(700),
        "step": step,
        "name": f"s{step}",
    }


def assert_same(got: object, want: object, path: str = "<root>") -> None:
    """Equal, types, dtypes and bytes included."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path  # type: ignore[attr-defined]
        assert torch.equal(got, want), f"{path}: tensor bytes differ"  # type: ignore[arg-type]
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), path  # type: ignore[attr-defined]
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), path
        for key, value in want.items():
            assert_same(got[key], value, f"{path}.{key}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def restore_all(store: Any, steps: Sequence[int] = STEPS, run: str = RUN, seed: int = 0) -> None:
    """Every version restores bit-exact, whole and tensor by tensor."""
    for step in steps:
        want = make_state(step, seed)
        assert_same(store.restore(f"{run}@{step}"), want, f"{run}@{step}")
        for path in ("model.w", "model.h"):
            part, name = path.split(".")
            got = store.load_tensor(f"{run}@{step}", path)
            assert torch.equal(got, want[part][name]), f"load_tensor {run}@{step} {path}"


def commit_steps(store: Any, steps: Sequence[int] = STEPS, run: str = RUN, seed: int = 0) -> None:
    for step in steps:
        store.commit(make_state(step, seed), run=run, step=step, metrics={"loss": 1.0 / (step + 1)})


# -- stores on local directories ----------------------------------------------------------


def blob_dirs(root: Path, n: int) -> list[Path]:
    return [root / "blobs" / f"d{i}" for i in range(n)]


def open_store(root: Path, n: int = 6, redundancy: str | None = None, *, cache: Path | None = None,
               blobs: Sequence[Any] | None = None, chunk_size: int = CHUNK, pack_size: int = PACK,
               **kwargs: Any) -> Any:
    """A store at ``root`` with ``n`` blob directories inside it (relative paths: copyable).

    A new store gets ``redundancy`` (default ec:4+2); an existing one keeps its own.
    """
    if not (root / "casckpt.toml").exists():
        blobs = blobs if blobs is not None else [f"blobs/d{i}" for i in range(n)]
        redundancy = redundancy or "ec:4+2"
    return casckpt.open(root, blobs=blobs, redundancy=redundancy, chunk_size=chunk_size,
                        pack_size=pack_size, workers=2,
                        cache=cache or root.parent / f"{root.name}-cache", **kwargs)


def scan_shards(dirs: Sequence[Path]) -> dict[tuple[str, int], Path]:
    """Every erasure-coded shard object on ``dirs``: (pack id, index) -> file (each exactly once)."""
    out: dict[tuple[str, int], Path] = {}
    for d in dirs:
        for f in sorted((d / "packs").rglob("*")) if (d / "packs").is_dir() else ():
            m = SHARD_FILE.match(f.relative_to(d).as_posix())
            if m is not None:
                key = (m.group(1), int(m.group(2)))
                assert key not in out, f"shard {key} stored twice: {out[key]} and {f}"
                out[key] = f
    return out


def scan_copies(dirs: Sequence[Path]) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for d in dirs:
        for f in sorted((d / "packs").rglob("*")) if (d / "packs").is_dir() else ():
            m = COPY_FILE.match(f.relative_to(d).as_posix())
            if m is not None:
                out.setdefault(m.group(1), []).append(f)
    return out


def packs_of(shards: dict[tuple[str, int], Path]) -> list[str]:
    return sorted({pack for pack, _ in shards})


def data_offset(shard: Path) -> int:
    """Where the pack bytes start in a shard file (header + erasure-code fragment header)."""
    return SHARD_HEADER_SIZE + decode_shard_header(shard.read_bytes(), str(shard)).data_offset


def damage(path: Path, mode: str, rng: random.Random) -> None:
    """Delete, flip a payload byte, truncate, or flip a header byte of one stored object."""
    if mode == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if mode == "truncate":
        path.write_bytes(bytes(data[: rng.randrange(0, len(data))]))
        return
    header = mode == "header"
    at = rng.randrange(0, SHARD_HEADER_SIZE) if header else rng.randrange(SHARD_HEADER_SIZE, len(data))
    data[at] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def shard_problems(report: Any) -> set[str]:
    return {p.subject for p in report.problems if p.kind == "shard"}


def kinds(report: Any) -> set[str]:
    return {p.kind for p in report.problems}


def location(store: Any, name: str) -> Any:
    return next(info for info in store.locations.list() if info.name == name)


def assert_identical(shards: dict[tuple[str, int], Path], original: dict[tuple[str, int], bytes]) -> None:
    """Every shard is stored again, byte for byte as first written (the encoding is deterministic)."""
    assert set(shards) == set(original)
    for key, path in shards.items():
        assert path.read_bytes() == original[key], f"shard {key} differs from the original"


def assert_spread(shards: dict[tuple[str, int], Path], k_plus_m: int) -> None:
    """Each pack has all its shards, on distinct locations."""
    by_pack: dict[str, list[Path]] = {}
    for (pack, _), path in shards.items():
        by_pack.setdefault(pack, []).append(path)
    for pack, paths in by_pack.items():
        assert len(paths) == k_plus_m, pack
        homes = {p.parents[2] for p in paths}  # <location>/packs/<xx>/<file>
        assert len(homes) == k_plus_m, f"pack {pack} has two shards on one location: {sorted(homes)}"


@dataclass
class Template:
    """A closed ec:4+2 store over 6 directories holding run ``r`` at STEPS, ready to copy."""

    root: Path
    shards: dict[tuple[str, int], bytes]

    def copy(self, dest: Path) -> Path:
        shutil.copytree(self.root, dest)
        return dest


@pytest.fixture(scope="module")
def ec_template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    root = tmp_path_factory.mktemp("ec-template") / "store"
    with open_store(root) as store:
        commit_steps(store)
    shards = scan_shards(blob_dirs(root, 6))
    assert len(packs_of(shards)) >= 6, "the template should have several packs"
    assert len(shards) == 6 * len(packs_of(shards))
    return Template(root, {k: p.read_bytes() for k, p in shards.items()})


# -- 1. any two shards of every pack: restore, heal, scrub, repair -------------------------


def test_ec_two_damaged_shards_of_every_pack_restore_then_repair(ec_template: Template,
                                                                   tmp_path: Path) -> None:
    root = ec_template.copy(tmp_path / "store")
    dirs = blob_dirs(root, 6)
    rng = random.Random(1234)
    shards = scan_shards(dirs)
    damaged: dict[tuple[str, int], str] = {}
    for n, pack in enumerate(packs_of(shards)):
        for j, index in enumerate(rng.sample(range(6), 2)):
            mode = MODES[(2 * n + j) % len(MODES)]  # every mode, on data and parity shards alike
            damage(shards[(pack, index)], mode, rng)
            damaged[(pack, index)] = mode
    assert set(damaged.values()) == set(MODES)

    with open_store(root) as store:
        restore_all(store)  # reads around (and heals) whatever it meets
        report = store.ops.check(read_data=True)
        assert kinds(report) <= {"shard"}, report.problems  # nothing lost, no version affected
        assert shard_problems(report) <= {f"{p}:{i}" for p, i in damaged}
        assert report.packs_read == report.packs == len(packs_of(shards))
        repaired = store.ops.repair()
        assert repaired.ok, repaired.unrepaired
        assert repaired.shards_moved == 0  # every location is active: shards go back home
        after = store.ops.check(read_data=True)
        assert after.ok, after.problems
        assert after.chunks_read == after.chunks > 0
        assert all(info.damaged == 0 for info in store.locations.list())
        assert_identical(scan_shards(dirs), ec_template.shards)
        restore_all(store)


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_ec_any_two_shards_scrub_finds_exactly_them_and_repair_rewrites_them(
    ec_template: Template, tmp_path_factory: pytest.TempPathFactory, data: st.DataObject,
) -> None:
    root = ec_template.copy(tmp_path_factory.mktemp("ec-hypo") / "store")
    dirs = blob_dirs(root, 6)
    shards = scan_shards(dirs)
    rng = data.draw(st.randoms(use_true_random=False), label="rng")
    damaged = set()
    for pack in packs_of(shards):
        indexes = data.draw(st.lists(st.integers(0, 5), min_size=2, max_size=2, unique=True), label=pack[:8])
        for index in indexes:
            damage(shards[(pack, index)], data.draw(st.sampled_from(MODES)), rng)
            damaged.add(f"{pack}:{index}")

    with open_store(root) as store:
        report = store.ops.check(read_data=True)
        assert shard_problems(report) == damaged
        assert kinds(report) == {"shard"}, report.problems
        assert report.chunks_read == report.chunks  # every chunk verified despite the damage
        repaired = store.ops.repair()
        assert repaired.ok, repaired.unrepaired
        assert repaired.packs == len(packs_of(shards))
        assert repaired.shards_rewritten == len(damaged)
        assert store.ops.check(read_data=True).ok
        assert_identical(scan_shards(dirs), ec_template.shards)
        restore_all(store)


def test_heal_on_read_rewrites_the_data_shard_a_restore_needed(ec_template: Template, tmp_path: Path) -> None:
    """Shard 0 (the pack's first bytes, always read) deleted or corrupted in the first chunk."""
    root = ec_template.copy(tmp_path / "store")
    dirs = blob_dirs(root, 6)
    shards = scan_shards(dirs)
    packs = packs_of(shards)
    for i, pack in enumerate(packs):
        first = shards[(pack, 0)]
        if i % 2:
            first.unlink()
        else:  # a byte of the first chunk's payload
            data = bytearray(first.read_bytes())
            data[data_offset(first) + PACK_HEADER_SIZE + ENTRY_HEADER_SIZE + 100] ^= 0x10
            first.write_bytes(bytes(data))

    with open_store(root) as store:
        restore_all(store)
        # healed during the restores: back in place, byte-identical, nothing queued
        assert_identical(scan_shards(dirs), ec_template.shards)
        assert all(info.damaged == 0 for info in store.locations.list())
        assert store.ops.repair().packs == 0
        assert store.ops.check(read_data=True).ok


# -- 2. more shards lost than the code tolerates -------------------------------------------


def pack_users(store: Any, pack: str, refs: Sequence[str]) -> dict[str, set[str]]:
    """ref -> tensor paths of that version with a chunk in ``pack`` (from manifests + catalog)."""
    catalog = internals(store).catalog
    out: dict[str, set[str]] = {}
    for ref in refs:
        manifest = internals(store).manifest(ref)
        for tensor in manifest.tensors:
            ids = {c.hex() for c in manifest.extents[tensor.extent].chunks}
            if any(loc.pack_id == pack for loc in catalog.find_chunks(ids, live_only=False).values()):
                out.setdefault(ref, set()).add(tensor.path)
    return out


@pytest.mark.parametrize("mode", ["delete", "flip"])
def test_three_lost_shards_name_version_tensors_and_pack(ec_template: Template, tmp_path: Path,
                                                         mode: str) -> None:
    root = ec_template.copy(tmp_path / "store")
    dirs = blob_dirs(root, 6)
    shards = scan_shards(dirs)
    refs = [f"{RUN}@{s}" for s in STEPS]
    with open_store(root) as store:
        users = {pack: pack_users(store, pack, refs) for pack in packs_of(shards)}
    # a pack some versions need and others do not
    pack = next(p for p in packs_of(shards) if 0 < len(users[p]) < len(refs))
    rng = random.Random(5)
    for index in (0, 1, 4):
        damage(shards[(pack, index)], mode, rng)

    with open_store(root) as store:
        for ref in refs:
            step = int(ref.split("@")[1])
            if ref not in users[pack]:
                assert_same(store.restore(ref), make_state(step))
                continue
            with pytest.raises(MissingDataError) as err:
                store.restore(ref)
            assert isinstance(err.value, CasckptError)
            message = str(err.value)
            assert ref in message and pack in message, message
            for path in users[pack][ref]:
                assert f"'{path}'" in message, (path, message)
            failed = 0
            for path in users[pack][ref]:  # a tensor whose bytes sit on healthy shards still loads
                try:
                    got = store.load_tensor(ref, path)
                except MissingDataError as exc:
                    assert pack in str(exc) and f"'{path}'" in str(exc) and ref in str(exc), str(exc)
                    failed += 1
                else:
                    want = make_state(step)
                    for part in path.split("."):
                        want = want[part]
                    if isinstance(want, np.ndarray):
                        assert np.array_equal(got, want)
                    else:
                        assert torch.equal(got, want)
            assert failed > 0

        for report in (store.ops.check(), store.ops.check(read_data=True)):
            versions = {p.subject for p in report.problems if p.kind == "version"}
            assert versions == set(users[pack]), report.problems
            for p in report.problems:
                if p.kind == "version":
                    assert pack in p.detail and all(t in p.detail for t in users[pack][p.subject])
            assert {p.subject for p in report.problems if p.kind == "pack"} == {pack}, report.problems
            assert {f"{pack}:{i}" for i in (0, 1, 4)} <= shard_problems(report)

        repaired = store.ops.repair()
        assert not repaired.ok and len(repaired.unrepaired) == 1
        assert repaired.unrepaired[0].startswith(pack)


# -- 3. bit rot and scrubbing ----------------------------------------------------------------


def test_bit_rot_in_one_percent_of_shards_is_found_by_a_full_scrub(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    monkeypatch.setenv("CASCKPT_COMPRESSION", "0")  # raw: planes would shrink the state below 150 shards
    with open_store(root, chunk_size=4 << 10, pack_size=32 << 10) as store:
        commit_steps(store)
    dirs = blob_dirs(root, 6)
    shards = scan_shards(dirs)
    original = {k: p.read_bytes() for k, p in shards.items()}
    assert len(shards) >= 150
    rng = random.Random(99)
    rotten = rng.sample(sorted(shards), max(6, len(shards) // 100))
    for n, key in enumerate(rotten):
        damage(shards[key], "header" if n % 3 == 0 else "flip", rng)  # sizes unchanged

    with open_store(root) as store:
        assert store.ops.check().ok  # sizes match: only reading the data finds rot
        report = store.ops.check(read_data=True)
        assert shard_problems(report) == {f"{p}:{i}" for p, i in rotten}
        assert kinds(report) == {"shard"}
        assert report.packs_read == report.packs
        assert {info.name: info.damaged for info in store.locations.list()} == {
            f"loc{i}": sum(1 for k in rotten if shards[k].parents[2] == dirs[i]) for i in range(6)}
        assert store.ops.repair().ok
        assert store.ops.check(read_data=True).ok
        assert_identical(scan_shards(dirs), original)


def pack_verified_at(store: Any) -> dict[str, float | None]:
    from sqlalchemy import select

    from casckpt.catalog import schema

    with internals(store).catalog.read() as conn:
        rows = conn.execute(select(schema.packs.c.id, schema.packs.c.verified_at))
        return {r.id: r.verified_at for r in rows}


def test_two_half_scrubs_cover_every_pack_least_recently_verified_first(ec_template: Template,
                                                                          tmp_path: Path) -> None:
    root = ec_template.copy(tmp_path / "store")
    with open_store(root) as store:
        total, pack_bytes = store.ops.stats().packs, store.ops.stats().pack_bytes
        assert set(pack_verified_at(store).values()) == {None}
        first = store.ops.check(read_data_subset="50%")
        mid = pack_verified_at(store)
        read1 = {p for p, at in mid.items() if at is not None}
        assert first.ok and 0 < first.packs_read < total and first.packs_read == len(read1)
        assert first.bytes_read >= pack_bytes / 2
        second = store.ops.check(read_data_subset=0.5)
        after = pack_verified_at(store)
        read2 = {p for p, at in after.items() if at != mid[p]}
        assert second.ok and second.packs_read == len(read2)
        # together they read every pack; the second took the never-verified ones first
        assert read1 | read2 == set(after) and set(after) - read1 <= read2
        if read1 & read2:  # re-reads, if any, are of the earliest verified
            oldest = sorted(read1, key=lambda p: (mid[p], p))
            assert set(oldest[: len(read1 & read2)]) == read1 & read2
        third = store.ops.check(read_data_subset="50%")
        latest = pack_verified_at(store)
        read3 = {p for p, at in latest.items() if at != after[p]}
        assert third.ok and read3 and set(after) - read3
        assert max((after[p], p) for p in read3) < min((after[p], p) for p in set(after) - read3)


def test_half_scrubs_find_rot_in_the_half_they_read(ec_template: Template, tmp_path: Path) -> None:
    """A scrub reports exactly the rotten shards of the packs it read; two halves find them all."""
    root = ec_template.copy(tmp_path / "store")
    shards = scan_shards(blob_dirs(root, 6))
    rng = random.Random(3)
    rotten = {pack: rng.randrange(6) for pack in packs_of(shards)}  # one shard of every pack
    for pack, index in rotten.items():
        damage(shards[(pack, index)], "flip", rng)
    with open_store(root) as store:
        first = store.ops.check(read_data_subset="50%")
        assert 0 < first.packs_read < len(rotten) and kinds(first) == {"shard"}
        found = shard_problems(first)  # rot in the packs read; the others look fine by size
        assert len(found) == first.packs_read
        second = store.ops.check(read_data_subset="50%")
        assert kinds(second) == {"shard"}
        # a damaged pack that still rebuilds counts as verified (its shards wait in repair's
        # queue), so the second scrub reads the other half instead of the same one again;
        # shards found before are reported from the catalog
        assert second.packs_read >= len(rotten) - first.packs_read
        assert shard_problems(second) == {f"{p}:{i}" for p, i in rotten.items()}


# -- 4. a whole location lost; retiring a location -------------------------------------------


def test_lost_location_restores_then_fail_and_repair_replace_its_shards(ec_template: Template,
                                                                        tmp_path: Path) -> None:
    root = ec_template.copy(tmp_path / "store")
    dirs = blob_dirs(root, 6)
    with open_store(root) as store:
        assert location(store, "loc3").shards == len(packs_of(ec_template.shards))
        shutil.rmtree(dirs[3])  # the disk is gone while the store is open
        restore_all(store)
        info = store.locations.fail("loc3")
        assert info.state == "failed"
        report = store.ops.check()
        assert kinds(report) <= {"shard", "redundancy"} and report.problems  # gone, or healed doubled up
        repaired = store.ops.repair()  # five domains for six shards: every pack doubles one up
        assert repaired.unrepaired == () and not repaired.ok
        assert len(repaired.degraded) == len(packs_of(ec_template.shards))
        assert location(store, "loc3").shards == 0
        assert sum(i.shards for i in store.locations.list()) == len(ec_template.shards)
        assert not dirs[3].exists()  # a failed location is never touched
        after = store.ops.check(read_data=True)
        assert kinds(after) == {"redundancy"}, after.problems  # whole, but degraded
        restore_all(store)
        # five domains left: still at the write quorum (k+1), so commits go on
        commit_steps(store, (4,))
        restore_all(store, (4,))
        assert location(store, "loc3").shards == 0
        assert kinds(store.ops.check(read_data=True)) == {"redundancy"}
    survivors = scan_shards(dirs[:3] + dirs[4:])
    assert {key for key in survivors if key in ec_template.shards} == set(ec_template.shards)


def test_repair_spreads_doubled_up_shards_once_a_location_is_added(ec_template: Template,
                                                                  tmp_path: Path) -> None:
    root = ec_template.copy(tmp_path / "store")
    dirs = blob_dirs(root, 7)
    with open_store(root) as store:
        shutil.rmtree(dirs[3])
        store.locations.fail("loc3")
        first = store.ops.repair()  # five domains left: each pack doubles one shard up
        assert not first.ok and len(first.degraded) == len(packs_of(ec_template.shards))
        store.locations.add(str(dirs[6]))
        assert store.ops.repair().ok
        assert location(store, "loc6").shards == len(packs_of(ec_template.shards))
        assert store.ops.check(read_data=True).ok
        store.gc(grace=0)  # the moved shards' old objects are orphans now
    assert_spread(scan_shards(dirs), 6)


def test_retire_location_moves_shards_off_and_deletes_them(tmp_path: Path) -> None:
    root = tmp_path / "store"
    dirs = blob_dirs(root, 7)
    with open_store(root, 7) as store:
        commit_steps(store)
        before = scan_shards(dirs)
        original = {key: path.read_bytes() for key, path in before.items()}
        on_d6 = [key for key, path in before.items() if path.parents[2] == dirs[6]]
        assert on_d6 and location(store, "loc6").shards == len(on_d6)
        assert store.locations.retire("loc6").state == "retiring"
        repaired = store.ops.repair()
        assert repaired.ok, repaired.unrepaired
        assert repaired.shards_moved == repaired.shards_rewritten == len(on_d6)
        info = location(store, "loc6")
        assert (info.state, info.shards, info.bytes) == ("retiring", 0, 0)
        assert any(path.parents[2] == dirs[6] for path in scan_shards(dirs[6:]).values()), \
            "old objects stay for readers holding the old layout until gc's grace period passes"
        store.gc(grace=0)
        after = scan_shards(dirs)  # each shard once: gc deleted the old copies on loc6 as orphans
        assert set(after) == set(before)
        assert not any(path.parents[2] == dirs[6] for path in after.values())
        assert_spread(after, 6)  # each moved shard went to the one domain its pack did not use
        assert_identical(after, original)
        commit_steps(store, (4,))  # new packs avoid the retiring location
        assert location(store, "loc6").shards == 0
        assert not any(path.parents[2] == dirs[6] for path in scan_shards(dirs).values())
        assert store.ops.check(read_data=True).ok
        restore_all(store, (*STEPS, 4))


def test_failure_domains_put_each_shard_of_a_pack_in_another_domain(tmp_path: Path) -> None:
    """Six directories in three domains, ec:2+1: losing a whole domain costs a pack one shard."""
    root = tmp_path / "store"
    blobs = [casckpt.BlobLocation(f"blobs/d{i}", domain=f"rack{i // 2}", name=f"disk{i}") for i in range(6)]
    with open_store(root, blobs=blobs, redundancy="ec:2+1") as store:
        commit_steps(store)
        domains = {i.name: i.domain for i in store.locations.list()}
        assert domains == {f"disk{i}": f"rack{i // 2}" for i in range(6)}
    dirs = blob_dirs(root, 6)
    shards = scan_shards(dirs)
    for pack in packs_of(shards):
        racks = {int(shards[(pack, i)].parents[2].name[1:]) // 2 for i in range(3)}
        assert racks == {0, 1, 2}, pack
    shutil.rmtree(dirs[2])
    shutil.rmtree(dirs[3])  # all of rack1
    with open_store(root) as store:
        restore_all(store)
    # a scheme wider than the failure domains is refused
    with open_store(tmp_path / "other", 3, redundancy="none") as store:
        with pytest.raises(InvalidArgumentError, match="6 failure domains, but the store has 3"):
            store.locations.set_redundancy("ec:4+2")
        assert store.locations.set_redundancy("ec:2+1") == "ec:2+1"


# -- 5. catalog disaster recovery --------------------------------------------------------------


def _history(store: Any) -> dict[str, Any]:
    """Everything a rebuild must bring back (byte counts, durations and stalls excepted: a
    rebuild leaves stall_s unknown, ARCHITECTURE's rebuild table)."""
    def strip(v: Any) -> Any:
        return replace(v, new_bytes=0, stored_bytes=0, duration_s=0.0, stall_s=None,
                       tags=tuple(sorted(v.tags)))
    return {
        "log": [strip(v) for v in store.log(order="asc")],
        "tree": store.lineage(),
        "retention": {run: store.retention.get(run) for run in ("r", "ft")},
        "redundancy": {run: store.locations.redundancy(run) for run in (None, "r", "ft")},
        "tags": {t: store.resolve(f"tag:{t}").id for t in ("best", "release", "first", "s1")},
        "stats": replace(store.ops.stats(), stored_bytes=0),
        # tree nodes too: rebuild counts them
        "all_chunks": inventory.live_chunk_count(internals(store).catalog),
    }


def _fill_history(store: Any) -> None:
    for step in STEPS:
        store.commit(make_state(step), run=RUN, step=step,
                     metrics={"loss": 1.0 / (step + 1), "acc": step / 10},
                     metadata={"lr": 0.1, "opt": "adamw"}, message=f"step {step}",
                     tags=["first"] if step == 0 else [f"s{step}"])
    store.tag("r@1", "best")
    store.tag("r@2", "best")  # moved: the newest record wins
    store.tag("r@3", "release")
    store.tag("r@3", "s1")  # a commit-time tag moved later
    store.retention.set(RUN, keep_last=2, keep_best=("loss", 1, "min"))
    store.fork("r@1", "ft")
    store.locations.set_redundancy("replicate:2", run="ft")
    store.retention.set("ft", keep_every=5, keep_tagged=False)
    for step in (10, 11):
        store.commit(make_state(step, seed=1), run="ft", step=step, metrics={"loss": 0.01 * step},
                     message=None if step == 10 else "tuned")


def _check_rebuilt(store: Any, expected: dict[str, Any]) -> None:
    report = store.ops.rebuild_catalog()
    assert report.lost_packs == () and report.skipped == ()
    assert report.versions == len(expected["log"]) and report.runs == 2
    assert report.packs == expected["stats"].packs and report.chunks == expected["all_chunks"]
    got = _history(store)
    for key in expected:
        assert got[key] == expected[key], key
    assert [n.name for n in got["tree"]] == ["r", "ft"] and got["tree"][1].parent_run == "r"
    assert got["tree"][1].fork_step == 1
    restore_all(store)
    restore_all(store, (10, 11), run="ft", seed=1)
    assert store.ops.check(read_data=True).ok
    with pytest.raises(InvalidArgumentError, match="not empty"):
        store.ops.rebuild_catalog()
    assert store.ops.rebuild_cache() == expected["all_chunks"]
    restore_all(store, (3,))


def test_rebuild_sqlite_catalog_from_blobs(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with open_store(root) as store:
        _fill_history(store)
        expected = _history(store)
        assert expected["stats"].versions == 6
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (root / name).unlink(missing_ok=True)
    with open_store(root, cache=tmp_path / "cache2", recover=True) as store:
        assert store.log() == []
        _check_rebuilt(store, expected)
    with open_store(root, cache=tmp_path / "cache2") as store:  # and it persists
        assert _history(store) == expected


def test_rebuild_postgres_catalog_from_blobs(tmp_path: Path, pg_url: str) -> None:

    root = tmp_path / "store"
    with open_store(root, catalog=pg_url) as store:
        _fill_history(store)
        expected = _history(store)
    empty_postgres_catalog(pg_url)
    with open_store(root, cache=tmp_path / "cache2", recover=True) as store:
        assert store.log() == []
        _check_rebuilt(store, expected)


# -- 6. S3 locations ---------------------------------------------------------------------------


def _s3_client(endpoint: str) -> Any:
    import boto3

    from casckpt.testing import s3 as s3_testing

    return boto3.client("s3", endpoint_url=endpoint, region_name=s3_testing.REGION)


def _s3_shards(client: Any, url: str) -> dict[tuple[str, int], tuple[str, str]]:
    bucket, prefix = url[len("s3://"):].split("/", 1)
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/packs/"):
        for obj in page.get("Contents", []):
            m = SHARD_FILE.match(obj["Key"][len(prefix) + 1:])
            if m is not None:
                out[(m.group(1), int(m.group(2)))] = (bucket, obj["Key"])
    return out


def test_ec_over_s3_buckets(tmp_path: Path, s3_bucket_url: Callable[[], str], moto_endpoint: str) -> None:
    urls = [s3_bucket_url() for _ in range(3)]
    client = _s3_client(moto_endpoint)
    root = tmp_path / "store"
    with open_store(root, redundancy="ec:2+1", blobs=urls, s3={"endpoint_url": moto_endpoint}) as store:
        commit_steps(store, STEPS[:2])
        where = {key: obj for url in urls for key, obj in _s3_shards(client, url).items()}
        packs = sorted({p for p, _ in where})
        assert len(where) == 3 * len(packs) and len(packs) >= 2
        rng = random.Random(8)
        lost = {(pack, rng.randrange(3)) for pack in packs}
        for key in lost:
            bucket, obj = where[key]
            client.delete_object(Bucket=bucket, Key=obj)
        restore_all(store, STEPS[:2])
        report = store.ops.check(read_data=True)
        assert kinds(report) <= {"shard"} and shard_problems(report) <= {f"{p}:{i}" for p, i in lost}
        repaired = store.ops.repair()
        assert repaired.ok, repaired.unrepaired
        assert store.ops.check(read_data=True).ok
        assert {key for url in urls for key in _s3_shards(client, url)} == set(where)
        restore_all(store, STEPS[:2])


def test_ec_over_mixed_local_and_s3_locations(tmp_path: Path, s3_bucket_url: Callable[[], str],
                                              moto_endpoint: str) -> None:
    urls = [s3_bucket_url() for _ in range(3)]
    client = _s3_client(moto_endpoint)
    root = tmp_path / "store"
    blobs = ["blobs/d0", "blobs/d1", "blobs/d2", *urls]
    with open_store(root, blobs=blobs, s3={"endpoint_url": moto_endpoint}) as store:
        commit_steps(store, STEPS[:2])
    local = scan_shards(blob_dirs(root, 3))
    remote = {key: obj for url in urls for key, obj in _s3_shards(client, url).items()}
    packs = packs_of(local)
    assert packs == sorted({p for p, _ in remote}) and len(local) == len(remote) == 3 * len(packs)
    lost = set()
    for pack in packs:  # one local and one S3 shard of every pack
        key = next(k for k in sorted(local) if k[0] == pack)
        local[key].unlink()
        lost.add(f"{key[0]}:{key[1]}")
        key = next(k for k in sorted(remote) if k[0] == pack)
        client.delete_object(Bucket=remote[key][0], Key=remote[key][1])
        lost.add(f"{key[0]}:{key[1]}")
    with open_store(root) as store:
        report = store.ops.check()  # without reading data: the objects are missing
        assert kinds(report) == {"shard"} and shard_problems(report) == lost
        restore_all(store, STEPS[:2])
        assert store.ops.repair().ok
        assert store.ops.check(read_data=True).ok
        restore_all(store, STEPS[:2])
    assert set(scan_shards(blob_dirs(root, 3))) == set(local)
    assert {key for url in urls for key in _s3_shards(client, url)} == set(remote)


# -- 7. write quorum ------------------------------------------------------------------------------


class RefusingWrites(WriteHookStore):
    """A local blob store whose writes fail while ``refusing`` is set (a full or read-only disk)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.refusing = True
        self.refused = 0

    def before_write(self, key: str) -> None:
        if self.refusing:
            self.refused += 1
            raise StorageError(f"cannot write {key} under {self.inner.root}: injected: disk full")


def _with_refusing(base: Path, n: int, refusing: Sequence[int]) -> tuple[list[Any], list[RefusingWrites]]:
    """Blob stores on ``base``/d0..; those at ``refusing`` refuse writes (opened before the store)."""
    blobs: list[Any] = []
    bad = []
    for i, d in enumerate(base / f"d{i}" for i in range(n)):
        if i in refusing:
            bad.append(RefusingWrites(d))
            blobs.append(bad[-1])
        else:
            blobs.append(LocalBlobStore(d))
    return blobs, bad


def test_quorum_commit_with_a_refusing_location_then_repair(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blobs, (bad,) = _with_refusing(tmp_path / "ext", 6, [1])
    with open_store(root, blobs=blobs) as store:
        commit_steps(store, STEPS[:2])  # 5 of 6 shards reach quorum (k+1)
        assert bad.refused > 0
        info = location(store, "loc1")
        assert info.shards > 0 and info.damaged == info.shards  # recorded, as missing
        assert not scan_shards([tmp_path / "ext" / "d1"])
        report = store.ops.check()  # its shards, and the recovery data it could not take
        assert kinds(report) == {"shard", "identity", "manifest", "record"}
        assert len([p for p in report.problems if p.kind == "shard"]) == info.shards
        bad.refusing = False  # the disk is back
        repaired = store.ops.repair()
        assert repaired.ok and repaired.shards_rewritten == info.shards and repaired.shards_moved == 0
        assert location(store, "loc1").damaged == 0
        assert store.ops.check(read_data=True).ok
        assert_spread(scan_shards([tmp_path / "ext" / f"d{i}" for i in range(6)]), 6)
        restore_all(store, STEPS[:2])


def test_refused_shard_goes_to_a_spare_failure_domain(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blobs, (bad,) = _with_refusing(tmp_path / "ext", 7, [2])
    with open_store(root, blobs=blobs) as store:
        commit_steps(store, STEPS[:2])
        assert bad.refused > 0
        assert location(store, "loc2").shards == 0
        assert all(i.damaged == 0 for i in store.locations.list())
        report = store.ops.check(read_data=True)  # every pack whole; only loc2 lacks recovery data
        assert kinds(report) == {"identity", "manifest", "record"}
        assert all("loc2" in p.subject or "/d2" in p.detail for p in report.problems), report.problems
        assert_spread(scan_shards([tmp_path / "ext" / f"d{i}" for i in range(7)]), 6)
        restore_all(store, STEPS[:2])


def test_commit_below_quorum_fails_and_publishes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blobs, bad = _with_refusing(tmp_path / "ext", 6, [0, 4])
    for b in bad:
        b.refusing = False
    with open_store(root, blobs=blobs) as store:
        commit_steps(store, STEPS[:1])
        for b in bad:
            b.refusing = True
        with pytest.raises(StorageError, match="quorum"):
            store.commit(make_state(1), run=RUN, step=1)
        assert [v.step for v in store.log(RUN)] == [0]
        with pytest.raises(RefNotFoundError):
            store.resolve("r@1")
        assert store.ops.check(read_data=True).ok
        restore_all(store, STEPS[:1])
        for b in bad:
            b.refusing = False
        commit_steps(store, (1,))
        assert store.ops.check(read_data=True).ok
        restore_all(store, STEPS[:2])


# -- 8. replication ------------------------------------------------------------------------------


def test_replicate3_survives_two_lost_or_damaged_copies_of_every_pack(tmp_path: Path) -> None:
    root = tmp_path / "store"
    dirs = blob_dirs(root, 3)
    with open_store(root, 3, redundancy="replicate:3") as store:
        commit_steps(store)
    copies = scan_copies(dirs)
    assert copies and all(len(paths) == 3 for paths in copies.values())
    assert not scan_shards(dirs)
    original = {pack: paths[0].read_bytes() for pack, paths in copies.items()}
    rng = random.Random(21)
    for paths in copies.values():
        for path in rng.sample(paths, 2):
            if rng.random() < 0.5:
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[rng.randrange(len(data))] ^= 0x04
                path.write_bytes(bytes(data))
    with open_store(root) as store:
        restore_all(store)
        report = store.ops.check(read_data=True)
        assert kinds(report) <= {"shard"}, report.problems  # never more than the copies damaged
        repaired = store.ops.repair()
        assert repaired.ok, repaired.unrepaired
        assert store.ops.check(read_data=True).ok
        restore_all(store)
    after = scan_copies(dirs)
    assert set(after) == set(copies)
    for pack, paths in after.items():
        assert len(paths) == 3 and all(p.read_bytes() == original[pack] for p in paths)


# -- 9. SIGKILL during an erasure-coded commit -----------------------------------------------------


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


crash = _load("casckpt_tests_redundancy_crash_child", HELPERS / "crash_child.py")
CRASH_SEED = 11


@pytest.mark.parametrize(("point", "when", "step", "nth"), [
    pytest.param("shard.put", "before", 1, 4, id="mid-shards-of-a-pack"),
    pytest.param("catalog.add_pack", "after", 1, 2, id="pack-recorded"),
    pytest.param("catalog.add_version", "before", 2, 1, id="before-publish"),
])
def test_sigkill_during_ec_commit_leaves_store_consistent(forked_python: ForkedPython, tmp_path: Path,
                                                          point: str, when: str, step: int, nth: int) -> None:
    root = tmp_path / "store"
    dirs = blob_dirs(root, 6)
    open_store(root, chunk_size=crash.CHUNK_SIZE, pack_size=crash.PACK_SIZE).close()
    done = tmp_path / "done"
    args = [str(root), str(CRASH_SEED), "4", str(done), point, when, str(step), str(nth)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASCKPT_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg-cache")
    killed = forked_python.run([str(HELPERS / "ec_crash_child.py"), *args], env=env)
    assert killed.returncode == -signal.SIGKILL, f"exit {killed.returncode}\n{killed.stdout}\n{killed.stderr}"
    committed = [int(s) for s in done.read_text().split()] if done.exists() else []
    assert committed == list(range(step))

    with open_store(root, chunk_size=crash.CHUNK_SIZE, pack_size=crash.PACK_SIZE) as store:
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems
        assert sorted(v.step for v in store.log(crash.RUN)) == committed
        for s in committed:
            crash.assert_same(store.restore(f"{crash.RUN}@{s}"), crash.make_state(CRASH_SEED, s))
        with pytest.raises(RefNotFoundError):
            store.resolve(f"{crash.RUN}@{step}")
        store.commit(crash.make_state(CRASH_SEED, step), run=crash.RUN, step=step)
        crash.assert_same(store.restore(f"{crash.RUN}@{step}"), crash.make_state(CRASH_SEED, step))
        assert store.ops.check(read_data=True).ok
        gc = store.gc(grace=0)
        assert store.ops.check(read_data=True).ok
        # what the kill left behind (shards of unrecorded packs) is gone after gc
        recorded = sum(info.shards for info in store.locations.list())
        assert len(scan_shards(dirs)) == recorded, gc
        for s in (*committed, step):
            crash.assert_same(store.restore(f"{crash.RUN}@{s}"), crash.make_state(CRASH_SEED, s))


def test_open_refuses_more_shards_than_failure_domains_before_creating_anything(tmp_path: Path) -> None:
    root = tmp_path / "store"
    with pytest.raises(InvalidArgumentError, match="6 failure domains.*span 2"):
        casckpt.open(root, blobs=[str(tmp_path / "a"), str(tmp_path / "b")], redundancy="ec:4+2")
    assert not root.exists()
    labelled = [casckpt.BlobLocation(str(tmp_path / f"d{i}"), domain=f"rack{i % 2}") for i in range(4)]
    with pytest.raises(InvalidArgumentError, match="3 failure domains"):
        casckpt.open(root, blobs=labelled, redundancy="ec:2+1")
    with casckpt.open(root, blobs=labelled, redundancy="replicate:2") as store:
        assert store.locations.redundancy() == "replicate:2"
    with casckpt.open(root, redundancy="replicate:2") as store:  # an existing store: no blobs= needed
        assert len(store.locations.list()) == 4


# -- regressions from review ----------------------------------------------------------------


def test_a_commit_after_a_pack_is_lost_writes_its_chunks_again(tmp_path: Path) -> None:
    """Dedup must not reference chunks of a pack known lost: the next commit rewrites them."""
    root = tmp_path / "store"
    dirs = blob_dirs(root, 6)
    with open_store(root) as store:
        commit_steps(store, (0,))
        shards = scan_shards(dirs)
        for pack in packs_of(shards):
            for index in (0, 1, 2):
                shards[(pack, index)].unlink()
        assert not store.ops.check(read_data=True).ok  # found lost: its chunks stop counting for dedup
        assert not store.ops.repair().ok
        version = store.commit(make_state(0), run=RUN, step=1)  # the same content again
        assert version.new_bytes == version.logical_bytes
        assert_same(store.restore(f"{RUN}@1"), make_state(0))


def test_repair_of_replicas_never_deletes_a_live_copy(tmp_path: Path) -> None:
    """A copy that could not be written shares its key with the others: moving it must not
    remove another copy's object."""
    root = tmp_path / "store"
    dirs = blob_dirs(root, 3)
    with open_store(root, 3, "replicate:3") as store:
        store.locations.fail("loc2")
        commit_steps(store, (0,))
        store.locations.activate("loc2")
        assert store.ops.repair().ok
        store.gc(grace=0)
        assert all(len(paths) == 3 for paths in scan_copies(dirs).values())
        assert store.ops.check(read_data=True).ok
        shutil.rmtree(dirs[0])
        shutil.rmtree(dirs[1])
        restore_all(store, (0,))


def test_rebuild_recovers_a_pack_with_a_rotten_data_shard_and_restores_its_redundancy(
        ec_template: Template, tmp_path: Path) -> None:
    root = ec_template.copy(tmp_path / "store")
    dirs = blob_dirs(root, 6)
    shards = scan_shards(dirs)
    pack = packs_of(shards)[0]
    last_data = shards[(pack, 3)]
    data = bytearray(last_data.read_bytes())
    data[-5] ^= 0x40  # near the pack's footer
    last_data.write_bytes(bytes(data))
    shards[(pack, 5)].unlink()  # and a parity shard gone
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (root / name).unlink(missing_ok=True)
    with open_store(root, recover=True) as store:
        report = store.ops.rebuild_catalog()
        assert report.lost_packs == () and report.skipped == ()
        repaired = store.ops.repair()  # rebuild recorded the rotten and the absent shard
        assert repaired.ok and repaired.shards_rewritten == 2
        restore_all(store)
        assert store.ops.check(read_data=True).ok
    assert {index for p, index in scan_shards(dirs) if p == pack} == set(range(6))


def test_rebuild_keeps_a_tag_moved_by_a_later_commit(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blob_dirs(root, 6)
    with open_store(root) as store:
        store.commit(make_state(0), run=RUN, step=0)
        store.tag(f"{RUN}@0", "best")
        newest = store.commit(make_state(1), run=RUN, step=1, tags=["best"])
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (root / name).unlink(missing_ok=True)
    with open_store(root, recover=True) as store:
        store.ops.rebuild_catalog()
        assert store.resolve("tag:best").id == newest.id


def test_gc_repack_keeps_the_redundancy_of_the_pack(tmp_path: Path) -> None:
    root = tmp_path / "store"
    blob_dirs(root, 3)
    with open_store(root, 3, "none") as store:
        store.locations.set_redundancy("ec:2+1", run=RUN)
        for step in range(4):
            store.commit({"a": torch.full((20_000,), float(step)), "keep": torch.arange(5_000)},
                         run=RUN, step=step)
        store.retention.set(RUN, keep_last=1)
        store.gc(grace=0)
        store.gc(grace=0)
        live = inventory.live_packs(internals(store).catalog)
        schemes = {layout.scheme for layout in
                   (internals(store).packs.layouts.get(p.id, fresh=True) for p in live) if layout is not None}
        assert schemes == {"ec"}
        assert store.ops.check(read_data=True).ok
