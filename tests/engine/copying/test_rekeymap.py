"""The re-key map: a copy across chunk-id keys reads from the source only the chunks it cannot
name at the destination (``casckpt.engine.copying.rekeymap``).

Real stores (SQLite catalogs, local directories). What the source reads is counted at the one
place a version's tensors are read (``restore.read_chunks``, wrapped: every call still reads).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.engine.copying import rekey, rekeymap
from casckpt.engine.read import restore
from casckpt.errors import CatalogError
from casckpt.testing import internals

OPTS: dict[str, Any] = {"chunk_size": 4096, "pack_size": 16 << 10}


def state(step: int) -> dict[str, Any]:
    """A fine-tune's state at ``step`` (as tests/engine/copying/test_copy.py's): a frozen part
    every step shares, an incompressible part new at each step, a counter that shifts."""
    base, new = torch.Generator().manual_seed(7), torch.Generator().manual_seed(1000 + step)
    return {
        "frozen": torch.randn(16384, generator=base),
        "head": torch.randint(0, 256, (32768,), dtype=torch.uint8, generator=new),
        "counter": torch.arange(step, step + 4096, dtype=torch.int64),
        "step": step, "name": "ft",
    }


def commit_run(store: casckpt.Store, steps: range, run: str = "ft") -> list[casckpt.Version]:
    return [store.commit(state(s), run=run, step=s) for s in steps]


def assert_same(got: dict[str, Any], step: int) -> None:
    want = state(step)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


FULL = sum(v.numel() * v.element_size() for v in state(1).values() if isinstance(v, torch.Tensor))


class Reads:
    """The chunks and raw bytes a store's version reads asked for, per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.calls)

    @property
    def chunks(self) -> int:
        return sum(c for c, _ in self.calls)


def _map_rows(store: casckpt.Store) -> list[tuple[str, str]]:
    """Every row of a store's re-key map (its SQLite catalog read directly)."""
    with sqlite3.connect(internals(store).catalog.where.removeprefix("sqlite:///")) as db:
        return db.execute("SELECT key, chunk_id FROM rekey_map").fetchall()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    out, real = Reads(), restore.read_chunks

    def counted(ctx: Any, wanted: Any, *args: Any, **kwargs: Any) -> int:
        out.calls.append((len(wanted), sum(len(views[0]) for views in wanted.values())))
        return real(ctx, wanted, *args, **kwargs)

    monkeypatch.setattr(restore, "read_chunks", counted)
    return out


@pytest.fixture
def key(tmp_path: Path) -> Path:
    casckpt.generate_key_file(tmp_path / "k")
    return tmp_path / "k"


@pytest.fixture
def stores(tmp_path: Path, key: Path) -> Iterator[tuple[casckpt.Store, casckpt.Store]]:
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "enc", key_file=key, **OPTS) as enc:
        yield src, enc
        assert enc.ops.check(read_data=True).ok


def test_the_tenth_version_across_keys_reads_only_its_new_chunks(stores: Any, reads: Reads) -> None:
    src, enc = stores
    made = commit_run(src, range(1, 11))
    src.copy("ft@9", to=enc)
    reads.calls.clear()
    report = src.copy("ft@10", to=enc)
    assert [v.step for v in report.versions] == [10]
    new = made[9].new_bytes  # the new head and the shifted counter; the frozen 64 KiB are mapped
    assert reads.bytes == new < FULL, (reads.bytes, new, FULL)
    assert reads.chunks == new // OPTS["chunk_size"]
    assert_same(enc.restore("ft@10"), 10)


def test_a_copy_of_many_versions_reads_each_shared_chunk_once(stores: Any, reads: Reads) -> None:
    src, enc = stores
    made = commit_run(src, range(1, 6))
    src.copy("ft@5", to=enc)
    assert reads.bytes == FULL + sum(v.new_bytes for v in made[1:])
    for step in range(1, 6):
        assert_same(enc.restore(f"ft@{step}"), step)


def test_a_chunk_the_destination_swept_is_read_from_the_source_again(stores: Any, reads: Reads) -> None:
    src, enc = stores
    src.commit(state(1), run="a", step=1)
    src.copy("a@1", to=enc)
    named = [c for _, c in _map_rows(enc)]
    enc.delete("a@1")
    enc.gc(grace=0)
    enc.gc(grace=0)  # swept: the map rows go with the chunks
    assert named and not internals(enc).catalog.find_chunks(named, live_only=False)
    assert _map_rows(enc) == []
    src.commit(state(1), run="b", step=1)  # the same bytes in another run
    reads.calls.clear()
    src.copy("b@1", to=enc)
    assert reads.bytes == FULL
    assert_same(enc.restore("b@1"), 1)


def test_a_gc_sweeping_mapped_chunks_during_the_copy_says_copy_again(
        stores: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    src, enc = stores
    src.commit(state(1), run="a", step=1)
    src.copy("a@1", to=enc)
    src.commit(state(1), run="b", step=1)  # the same bytes: b@1 is taken from the map
    real = rekey._snapshot

    def then_gc(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        enc.delete("a@1")  # the mapped chunks' only holder goes, and gc sweeps them
        enc.gc(grace=0)
        enc.gc(grace=0)
        return out

    monkeypatch.setattr(rekey, "_snapshot", then_gc)
    with pytest.raises(CatalogError, match="copy again"):
        src.copy("b@1", to=enc)
    monkeypatch.setattr(rekey, "_snapshot", real)
    src.copy("b@1", to=enc)  # as it said: the chunks are read from the source
    assert_same(enc.restore("b@1"), 1)


def test_delta_coded_source_chunks_map_like_any_other(tmp_path: Path, key: Path, reads: Reads) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "enc", key_file=key, **OPTS) as enc:
        src.ops.set_delta_chain(8)
        made = commit_run(src, range(1, 7))
        src.copy("ft@5", to=enc)
        reads.calls.clear()
        src.copy("ft@6", to=enc)
        assert reads.bytes == made[5].new_bytes < FULL
        for step in range(1, 7):
            assert_same(enc.restore(f"ft@{step}"), step)
        assert enc.ops.check(read_data=True).ok


def test_another_chunk_size_at_the_destination_reads_whole_tensors(tmp_path: Path, key: Path,
                                                                   reads: Reads) -> None:
    with casckpt.open(tmp_path / "src", **OPTS) as src, \
            casckpt.open(tmp_path / "enc", key_file=key, chunk_size=2 * OPTS["chunk_size"],
                         pack_size=OPTS["pack_size"]) as enc:
        commit_run(src, range(1, 4))
        src.copy("ft@2", to=enc)
        reads.calls.clear()
        src.copy("ft@3", to=enc)
        assert reads.bytes == FULL  # no source chunk is a destination chunk: all read
        assert _map_rows(enc) == []  # nothing to map on: no grid in common
        for step in range(1, 4):
            assert_same(enc.restore(f"ft@{step}"), step)
        assert enc.ops.check(read_data=True).ok


def test_small_tensors_packed_together_are_read_and_arrive_whole(stores: Any, reads: Reads) -> None:
    src, enc = stores
    small = {f"bias{i}": torch.full((16,), float(i)) for i in range(8)}
    for step in (1, 2):
        src.commit({**state(step), **small, "lr": torch.tensor([0.1 * step])}, run="ft", step=step)
    src.copy("ft@1", to=enc)
    reads.calls.clear()
    src.copy("ft@2", to=enc)
    assert FULL - 16384 * 4 < reads.bytes < FULL  # the frozen part mapped, the packed extent read
    got = enc.restore("ft@2")
    assert all(torch.equal(got[k], v) for k, v in small.items())
    assert torch.equal(got["lr"], torch.tensor([0.2]))
    assert_same({k: v for k, v in got.items() if k in state(2)}, 2)


def test_an_extent_the_destination_lays_out_otherwise_is_read(stores: Any, reads: Reads,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    src, enc = stores
    commit_run(src, range(1, 3))
    src.copy("ft@1", to=enc)
    calls = []
    real = rekeymap.ExtentMatch.__call__

    def once_otherwise(self: rekeymap.ExtentMatch, entries: Any, sources: Any) -> Any:
        calls.append(bool(self.mapping.skip))
        if self.mapping.skip:
            raise rekeymap.Unmapped("planned otherwise")
        return real(self, entries, sources)

    monkeypatch.setattr(rekeymap.ExtentMatch, "__call__", once_otherwise)
    reads.calls.clear()
    src.copy("ft@2", to=enc)
    assert calls == [True, False]
    assert reads.calls[-1][1] == FULL  # the fallback read the version whole
    assert_same(enc.restore("ft@2"), 2)


def test_the_map_names_no_source_chunk_in_the_clear(tmp_path: Path, stores: Any) -> None:
    """A plain source's chunk ids are bare hashes of its bytes: the encrypted destination's
    catalog must not hold them (anyone reading it could confirm a guessed chunk)."""
    src, enc = stores
    commit_run(src, range(1, 3))
    src.copy("ft@2", to=enc)
    manifests = [internals(src).manifest(f"ft@{step}") for step in (1, 2)]
    source_ids = {c.hex() for m in manifests for c in m.chunk_ids()}  # tree nodes too
    rows = _map_rows(enc)
    assert len(rows) == len({c for m in manifests for e in m.extents for c in e.chunks})  # each mapped
    assert not source_ids & {k for k, _ in rows} and not source_ids & {c for _, c in rows}
    db = Path(internals(enc).catalog.where.removeprefix("sqlite:///"))
    files = sorted(db.parent.glob(db.name + "*"))  # WAL mode: the new rows are in catalog.db-wal
    assert len(files) > 1 and sum(f.stat().st_size for f in files) > 0, files
    catalog = b"".join(f.read_bytes() for f in files)
    assert not [i for i in source_ids if i.encode() in catalog]
