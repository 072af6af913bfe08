"""Invariant 4 and 7: damaged or forged stored bytes are reported, never returned.

Each test builds a store holding two versions with disjoint packs (runs ``a``
and ``b``), damages what belongs to ``a`` on disk or in the catalog, and
checks that restoring ``a`` raises the right typed error naming what is
damaged, that ``check`` reports it, and that ``b`` still restores.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import casckpt
from casckpt.engine.versions.nodes import StoreNodes
from casckpt.errors import (
    CasckptError,
    CorruptChunkError,
    CorruptManifestError,
    IntegrityError,
    MissingDataError,
)
from casckpt.format.manifest import decode_manifest
from casckpt.format.pack import ENTRY_HEADER_SIZE, TRAILER_SIZE
from casckpt.testing.internals import internals

CHUNK = 4096


@dataclass(frozen=True)
class ChunkRow:
    id: str
    pack_id: str
    offset: int
    stored_len: int
    codec: int


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(40_000, generator=g),  # ~40 chunks, several packs
        "b": torch.randn(500, generator=g),
        "arr": np.arange(seed, seed + 700, dtype=np.int32),
        "n": seed,
    }


def _same(got: object, want: object) -> None:
    assert isinstance(got, dict) and isinstance(want, dict) and list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        elif isinstance(value, np.ndarray):
            assert np.array_equal(got[key], value) and got[key].dtype == value.dtype, key
        else:
            assert got[key] == value, key


def _build(root: Path) -> None:
    with casckpt.open(root, chunk_size=CHUNK, pack_size=64 << 10, workers=2) as store:
        store.commit(_state(1), run="a", step=1)
        store.commit(_state(2), run="b", step=1)


class Damaged:
    """A copy of a store with versions ``a@1`` and ``b@1``, and helpers to damage ``a``."""

    def __init__(self, template: Path, root: Path) -> None:
        shutil.copytree(template, root)
        self.root = root
        self.store = casckpt.open(root, create=False)
        self.a = self.store.resolve("a@1")
        self.b = self.store.resolve("b@1")
        assert not self.packs_of(self.a.id) & self.packs_of(self.b.id), "versions share a pack"
        assert self.store.ops.check(read_data=True).ok

    @contextmanager
    def db(self) -> Iterator[sqlite3.Connection]:
        with closing(sqlite3.connect(self.root / "catalog.db")) as conn, conn:
            yield conn

    def manifest(self, version_id: str) -> bytes:
        with self.db() as conn:
            row = conn.execute("SELECT manifest FROM versions WHERE id = ?", (version_id,)).fetchone()
        return bytes(row[0])

    def chunks_of(self, version_id: str, path: str | None = None) -> list[ChunkRow]:
        """Chunk rows of a version (or of one tensor of it), in manifest order."""
        m = decode_manifest(self.manifest(version_id), version_id, StoreNodes(internals(self.store).catalog))
        extents = [t.extent for t in m.tensors if path is None or t.path == path]
        ids = [c.hex() for i in extents for c in m.extents[i].chunks]
        with self.db() as conn:
            rows = {r[0]: ChunkRow(*r) for r in conn.execute(
                "SELECT id, pack_id, offset, stored_len, codec FROM chunks")}
        return [rows[cid] for cid in ids]

    def packs_of(self, version_id: str) -> set[str]:
        return {c.pack_id for c in self.chunks_of(version_id)}

    def pack_path(self, pack_id: str) -> Path:
        return self.root / "packs" / pack_id[:2] / pack_id

    def patch(self, pack_id: str, offset: int, data: bytes) -> None:
        path = self.pack_path(pack_id)
        path.chmod(0o644)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(data)

    def read(self, pack_id: str, offset: int, length: int) -> bytes:
        with open(self.pack_path(pack_id), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def assert_b_intact(self) -> None:
        _same(self.store.restore("b@1"), _state(2))
        _same(self.store.restore(self.b), _state(2))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template") / "store"
    _build(root)
    return root


@pytest.fixture(scope="module")
def raw_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("raw-template") / "store"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CASCKPT_COMPRESSION", "0")  # every chunk stored raw, 4096 bytes
        _build(root)
    return root


@pytest.fixture
def damaged(template: Path, tmp_path: Path) -> Iterator[Damaged]:
    d = Damaged(template, tmp_path / "store")
    yield d
    d.store.close()


def _problems(report: casckpt.CheckReport) -> set[tuple[str, str]]:
    """What check found, less the versions it names as affected by a lost pack."""
    return {(p.kind, p.subject) for p in report.problems if p.kind != "version"}


def test_flipped_payload_byte(damaged: Damaged) -> None:
    target = damaged.chunks_of(damaged.a.id, "w")[0]
    middle = target.offset + ENTRY_HEADER_SIZE + target.stored_len // 2
    damaged.patch(target.pack_id, middle, bytes([damaged.read(target.pack_id, middle, 1)[0] ^ 0x5A]))

    with pytest.raises(CorruptChunkError) as info:
        damaged.store.restore("a@1")
    err = info.value
    assert isinstance(err, IntegrityError) and isinstance(err, ValueError)
    assert (err.pack_id, err.chunk_id) == (target.pack_id, target.id)
    assert target.pack_id in str(err) and target.id in str(err)
    with pytest.raises(CorruptChunkError):
        damaged.store.load_tensor("a@1", "w")

    # A tensor of the same version whose chunks lie in other packs is still readable.
    b_packs = {c.pack_id for c in damaged.chunks_of(damaged.a.id, "b")}
    assert target.pack_id not in b_packs
    assert torch.equal(damaged.store.load_tensor("a@1", "b"), _state(1)["b"])

    assert damaged.store.ops.check().ok, "sizes are unchanged: a check without read_data passes"
    report = damaged.store.ops.check(read_data=True)
    assert not report.ok
    # the chunk that fails verification, and its pack, which no longer hashes to its id
    assert _problems(report) == {("chunk", target.id), ("pack", target.pack_id)}
    assert any(target.pack_id in p.detail for p in report.problems if p.kind == "chunk")
    damaged.assert_b_intact()


def test_damaged_entry_header(damaged: Damaged) -> None:
    target = damaged.chunks_of(damaged.a.id, "w")[5]
    at = target.offset + 40  # inside the recorded chunk id / lengths, covered by the header CRC
    damaged.patch(target.pack_id, at, bytes([damaged.read(target.pack_id, at, 1)[0] ^ 1]))
    with pytest.raises(CorruptChunkError) as info:
        damaged.store.restore("a@1")
    assert (info.value.pack_id, info.value.chunk_id) == (target.pack_id, target.id)
    assert _problems(damaged.store.ops.check(read_data=True)) == {
        ("chunk", target.id), ("pack", target.pack_id)
    }
    damaged.assert_b_intact()


def test_truncated_pack(damaged: Damaged) -> None:
    target = damaged.chunks_of(damaged.a.id, "w")[-1]
    path = damaged.pack_path(target.pack_id)
    full = path.stat().st_size
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.truncate(target.offset + ENTRY_HEADER_SIZE + 10)

    report = damaged.store.ops.check()
    assert not report.ok
    assert _problems(report) == {("pack", target.pack_id)}
    assert str(full) in report.problems[0].detail
    assert not damaged.store.ops.check(read_data=True).ok
    with pytest.raises(IntegrityError) as info:
        damaged.store.restore("a@1")
    assert isinstance(info.value, CasckptError)
    assert target.pack_id in str(info.value)
    damaged.assert_b_intact()


def test_deleted_pack(damaged: Damaged) -> None:
    target = damaged.chunks_of(damaged.a.id, "w")[0]
    damaged.pack_path(target.pack_id).unlink()

    with pytest.raises(MissingDataError) as info:
        damaged.store.restore("a@1")
    assert target.pack_id in str(info.value) and "missing" in str(info.value)
    with pytest.raises(MissingDataError):
        damaged.store.load_tensor("a@1", "w")
    for read_data in (False, True):
        report = damaged.store.ops.check(read_data=read_data)
        assert _problems(report) == {("pack", target.pack_id)}
        assert "missing" in report.problems[0].detail
        affected = [p for p in report.problems if p.kind == "version"]
        assert [p.subject for p in affected] == ["a@1"]
        assert "'w'" in affected[0].detail or "w" in affected[0].detail.split("tensors ")[1]
        assert target.pack_id in affected[0].detail
    damaged.assert_b_intact()


def test_chunk_row_deleted_from_catalog(damaged: Damaged) -> None:
    target = damaged.chunks_of(damaged.a.id, "b")[0]
    with damaged.db() as conn:
        conn.execute("DELETE FROM chunks WHERE id = ?", (target.id,))
    with pytest.raises(MissingDataError) as info:
        damaged.store.restore("a@1")
    assert target.id in str(info.value)
    assert ("chunk", target.id) in _problems(damaged.store.ops.check())
    damaged.assert_b_intact()


@pytest.mark.parametrize("how", ["garbage", "other-version", "bit-flip"])
def test_corrupt_manifest_in_catalog(damaged: Damaged, how: str) -> None:
    original = damaged.manifest(damaged.a.id)
    if how == "garbage":
        forged = b"\x28\xb5\x2f\xfd not a manifest"
    elif how == "other-version":
        forged = damaged.manifest(damaged.b.id)  # valid, but hashes to another id
    else:
        forged = bytearray(original)
        forged[len(forged) // 2] ^= 0x10
        forged = bytes(forged)
    with damaged.db() as conn:
        conn.execute("UPDATE versions SET manifest = ? WHERE id = ?", (forged, damaged.a.id))

    with pytest.raises(CorruptManifestError) as info:
        damaged.store.restore("a@1")
    assert isinstance(info.value, IntegrityError)
    with pytest.raises(CorruptManifestError):
        damaged.store.show("a@1")
    with pytest.raises(CorruptManifestError):
        damaged.store.load_tensor("a@1", "w")
    report = damaged.store.ops.check()
    assert _problems(report) == {("manifest", damaged.a.id)}
    assert [v.step for v in damaged.store.log("a")] == [1], "the catalog row itself is fine"
    damaged.assert_b_intact()


def test_deleted_manifest_object_is_reported(damaged: Damaged) -> None:
    (damaged.root / "manifests" / damaged.a.id).unlink()
    assert _problems(damaged.store.ops.check()) == {("manifest", damaged.a.id)}
    # The catalog's copy is authoritative, so the data itself is still there.
    _same(damaged.store.restore("a@1"), _state(1))


@pytest.fixture
def raw_damaged(raw_template: Path, tmp_path: Path) -> Iterator[Damaged]:
    d = Damaged(raw_template, tmp_path / "store")
    yield d
    d.store.close()


def _same_pack_pair(d: Damaged) -> tuple[ChunkRow, ChunkRow]:
    rows = d.chunks_of(d.a.id, "w")
    for first in rows:
        for second in rows:
            if (first.id != second.id and first.pack_id == second.pack_id
                    and first.stored_len == second.stored_len and first.codec == second.codec):
                return first, second
    raise AssertionError("no two chunks of equal size share a pack")


@pytest.mark.parametrize("what", ["payload", "whole-entry"])
def test_forged_pack_with_another_valid_chunk(raw_damaged: Damaged, what: str) -> None:
    """The footer and pack size are intact; one chunk's bytes are another chunk's."""
    d = raw_damaged
    victim, donor = _same_pack_pair(d)
    skip = ENTRY_HEADER_SIZE if what == "payload" else 0
    length = ENTRY_HEADER_SIZE + donor.stored_len - skip
    d.patch(victim.pack_id, victim.offset + skip, d.read(donor.pack_id, donor.offset + skip, length))

    assert d.store.ops.check().ok
    with pytest.raises(CorruptChunkError) as info:
        d.store.restore("a@1")
    assert (info.value.pack_id, info.value.chunk_id) == (victim.pack_id, victim.id)
    assert victim.id in str(info.value)
    assert _problems(d.store.ops.check(read_data=True)) == {("chunk", victim.id), ("pack", victim.pack_id)}
    d.assert_b_intact()


def test_damaged_pack_footer(damaged: Damaged) -> None:
    pack = damaged.chunks_of(damaged.a.id, "w")[0].pack_id
    size = damaged.pack_path(pack).stat().st_size
    at = size - TRAILER_SIZE - 10
    damaged.patch(pack, at, bytes([damaged.read(pack, at, 1)[0] ^ 0xFF]))
    assert damaged.store.ops.check().ok
    report = damaged.store.ops.check(read_data=True)
    assert _problems(report) == {("pack", pack)}
    assert any("footer" in p.detail for p in report.problems)
    # Restore reads through the catalog's index and verifies every chunk: the data is fine.
    _same(damaged.store.restore("a@1"), _state(1))


def test_corrupt_raw_chunk_read_into_its_destination_is_wiped(raw_damaged: Damaged) -> None:
    """A raw chunk is read straight into the tensor it restores and verified there: a flipped
    byte raises, and the chunk's bytes are not left in the tensor looking restored."""
    d = raw_damaged
    rows = d.chunks_of(d.a.id, "w")
    assert all(r.stored_len == CHUNK for r in rows[:-1]) and len({r.codec for r in rows}) == 1
    k = len(rows) // 2
    victim = rows[k]
    at = victim.offset + ENTRY_HEADER_SIZE + 100
    d.patch(victim.pack_id, at, bytes([d.read(victim.pack_id, at, 1)[0] ^ 0x01]))

    with pytest.raises(CorruptChunkError) as info:
        d.store.restore("a@1")
    assert (info.value.pack_id, info.value.chunk_id) == (victim.pack_id, victim.id)

    target = torch.full((40_000,), 7.0)
    with pytest.raises(CorruptChunkError) as info:
        d.store.restore("a@1", into={"w": target})
    assert info.value.chunk_id == victim.id
    span = target.view(torch.uint8)[k * CHUNK : (k + 1) * CHUNK]
    assert not span.any(), "the corrupt chunk's bytes were left in the target"
    stored = torch.frombuffer(bytearray(d.read(victim.pack_id, victim.offset + ENTRY_HEADER_SIZE, CHUNK)),
                              dtype=torch.uint8)
    assert not torch.equal(span, stored)
    d.assert_b_intact()


def test_corrupt_planes_chunk_decoded_into_its_destination_is_wiped(tmp_path: Path) -> None:
    """A planes-coded chunk decodes straight into the tensor it restores: a flipped byte in
    one of its raw planes decodes cleanly but fails the hash, raises, and leaves no decoded
    byte of it in the target."""
    chunk = 64 << 10
    g = torch.Generator().manual_seed(5)
    weights = torch.randn(8 * chunk // 4, generator=g) * 0.02  # trained-like fp32: planes pay
    with casckpt.open(tmp_path / "s", chunk_size=chunk) as store:
        version = store.commit({"w": weights}, run="p", step=1)
        k = 3
        victim = _rows_of(store, version.id)[k]
        assert victim.codec == 10, "the state was meant to be planes-coded"
        pack = tmp_path / "s" / "packs" / victim.pack_id[:2] / victim.pack_id
        at = victim.offset + ENTRY_HEADER_SIZE + 2 + 100  # past the 2-byte planes header: a raw plane
        pack.chmod(0o644)
        with open(pack, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ 0x01]))

        target = torch.full_like(weights, 7.0)
        with pytest.raises(CorruptChunkError) as info:
            store.restore("p@1", into={"w": target})
        assert info.value.chunk_id == victim.id
        raw = target.view(torch.uint8)
        assert not raw[k * chunk : (k + 1) * chunk].any(), "the corrupt chunk's bytes were left in the target"


def _rows_of(store: casckpt.Store, version_id: str) -> list[ChunkRow]:
    manifest = internals(store).manifest(version_id)
    ids = [c.hex() for t in manifest.tensors for c in manifest.extents[t.extent].chunks]
    found = internals(store).catalog.find_chunks(ids, live_only=False)
    return [ChunkRow(cid, found[cid].pack_id, found[cid].offset, found[cid].stored_len, found[cid].codec)
            for cid in ids]
