"""Delta coding: chunks stored as compressed XOR against the previous version's chunk."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sqlalchemy import select
from typer.testing import CliRunner

import casckpt
from casckpt.catalog import schema
from casckpt.cli.main import app
from casckpt.errors import CorruptChunkError, InvalidArgumentError
from casckpt.format.codecs import CODECS, Delta
from casckpt.format.pack import ENTRY_HEADER_SIZE
from casckpt.testing.internals import internals

CHUNK = 16 << 10


def _open(path: Path, **kwargs: Any) -> casckpt.Store:
    return casckpt.open(path, chunk_size=CHUNK, pack_size=256 << 10, **kwargs)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    with _open(tmp_path / "store") as s:
        yield s
        assert s.ops.check(read_data=True).ok


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and _bits(got[key]) == _bits(want[key]), key


def _nudge(t: torch.Tensor, g: torch.Generator, scale: float, fraction: float = 1.0) -> torch.Tensor:
    """``t`` after an optimizer-like step: a small relative change of ``fraction`` of its elements."""
    if not t.is_floating_point():
        mask = torch.rand(t.shape, generator=g) < fraction
        return torch.where(mask, t + torch.randint(-2, 3, t.shape, generator=g, dtype=t.dtype), t)
    wide = t.float()
    mask = (torch.rand(t.shape, generator=g) < fraction).float()
    return (wide + wide * scale * torch.randn(t.shape, generator=g) * mask).to(t.dtype)


def _state(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "w32": torch.randn(24_000, generator=g),
        "w16": torch.randn(30_000, generator=g).bfloat16(),
        "h16": torch.randn(9_000, generator=g).half(),
        "steps": torch.randint(0, 1 << 40, (5_000,), generator=g, dtype=torch.int64),
    }


def _delta_rows(store: casckpt.Store) -> list[Any]:
    with internals(store).catalog.read() as conn:
        return list(conn.execute(select(schema.chunks).where(schema.chunks.c.base_id.is_not(None))))


def test_a_run_of_small_updates_is_stored_as_deltas_within_the_chain_policy(store: casckpt.Store) -> None:
    g = torch.Generator().manual_seed(1)
    state, versions = _state(g), []
    store.ops.set_delta_chain(3)
    for step in range(9):
        versions.append((store.commit(state, run="r", step=step), {k: v.clone() for k, v in state.items()}))
        state = {k: _nudge(v, g, 1e-3) for k, v in state.items()}
    for version, want in versions:
        _same(store.restore(version.id), want)
    first, later = versions[0][0], [v for v, _ in versions[1:]]
    deltas = [v for v in later if v.stored_bytes < 0.7 * first.stored_bytes]
    assert len(deltas) == 6  # 8 commits after the first: keyframes at steps 4 and 8 (chain 3)
    assert all(v.new_bytes == first.new_bytes for v in later)  # every chunk changed
    stats = store.ops.stats()
    assert 0 < stats.longest_chain <= 3 and stats.delta_chain == 3
    assert stats.delta_stored_bytes < 0.7 * stats.delta_raw_bytes
    codecs = {CODECS[row.codec] for row in _delta_rows(store)}
    assert {(c.delta, c.group) for c in codecs} <= {(Delta.XOR, 2), (Delta.XOR, 4), (Delta.XOR, 8)}
    detail = store.show("r@7")  # the third delta after the keyframe at step 4
    assert detail.delta_chunks > 0 and detail.longest_chain == 3
    assert store.show("r@8").delta_chunks == 0  # a keyframe


# each example is a new store and up to 9 commits: 6 examples in the default tier, 12 in the slow one
@pytest.mark.parametrize("examples", [6, pytest.param(12, marks=pytest.mark.slow)])
def test_long_chains_round_trip_bit_exact(tmp_path_factory: pytest.TempPathFactory, examples: int) -> None:
    @given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]),
           chain=st.integers(1, 6), scale=st.sampled_from([1e-4, 1e-3, 1e-1]),
           fraction=st.sampled_from([0.001, 0.3, 1.0]), commits=st.integers(2, 9), seed=st.integers(0, 1000))
    @settings(max_examples=examples, deadline=None)
    def round_trips(dtype: torch.dtype, chain: int, scale: float, fraction: float, commits: int,
                    seed: int) -> None:
        _long_chain_round_trips(tmp_path_factory, dtype, chain, scale, fraction, commits, seed)

    round_trips()


def _long_chain_round_trips(tmp_path_factory: pytest.TempPathFactory, dtype: torch.dtype, chain: int,
                            scale: float, fraction: float, commits: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tensor = (torch.randn(20_000, generator=g) * 100).to(dtype)
    kept = []
    with _open(tmp_path_factory.mktemp("chains")) as store:
        store.ops.set_delta_chain(chain)
        for step in range(commits):
            kept.append(tensor.clone())
            store.commit({"t": tensor, "step": step}, run="r", step=step)
            tensor = _nudge(tensor, g, scale, fraction)
        for step, want in enumerate(kept):
            got = store.restore(f"r@{step}")
            assert got["step"] == step and _bits(got["t"]) == _bits(want)
            assert _bits(store.load_tensor(f"r@{step}", "t")) == _bits(want)
        assert store.ops.stats().longest_chain <= chain
        assert store.ops.check(read_data=True).ok


def test_forks_delta_code_against_their_fork_point(store: casckpt.Store) -> None:
    g = torch.Generator().manual_seed(2)
    base = _state(g)
    store.commit(base, run="main", step=0)
    store.fork("main@0", "sweep")
    branch = {k: _nudge(v, g, 1e-3) for k, v in base.items()}
    version = store.commit(branch, run="sweep", step=1)
    assert version.stored_bytes < 0.7 * version.new_bytes
    _same(store.restore("sweep@1"), branch)
    _same(store.restore("main@0"), base)


def test_background_commits_delta_code_and_restore(store: casckpt.Store) -> None:
    g = torch.Generator().manual_seed(3)
    state, kept = _state(g), []
    for step in range(6):
        kept.append({k: v.clone() for k, v in state.items()})
        store.commit(state, run="bg", step=step, block=False)
        state = {k: v.copy_(_nudge(v, g, 1e-3)) for k, v in state.items()}  # mutated in place
    store.wait_commits()
    for step, want in enumerate(kept):
        _same(store.restore(f"bg@{step}"), want)
    assert store.ops.stats().delta_chunks > 0


def test_chain_zero_turns_delta_coding_off_and_policies_are_per_run(store: casckpt.Store) -> None:
    g = torch.Generator().manual_seed(4)
    state = _state(g)
    store.ops.set_delta_chain(0, run="plain")
    assert store.ops.delta_chain("plain") == 0 and store.ops.delta_chain() == store.ops.delta_chain("other")
    for step in range(3):
        store.commit(state, run="plain", step=step)
        state = {k: _nudge(v, g, 1e-3) for k, v in state.items()}
    assert store.ops.stats().delta_chunks == 0
    store.ops.set_delta_chain(-1, run="plain")  # follows the store again
    store.commit(state, run="plain", step=3)  # keeps its chunks as bases (chain 0 kept none) ...
    assert store.ops.stats().delta_chunks == 0
    store.commit({k: _nudge(v, g, 1e-3) for k, v in state.items()}, run="plain", step=4)
    assert store.ops.stats().delta_chunks > 0  # ... for this one
    with pytest.raises(InvalidArgumentError, match="0 \\(off\\) to 64"):
        store.ops.set_delta_chain(65)
    result = CliRunner().invoke(app, ["--store", str(store.path), "delta", "set", "2", "--run", "plain"])
    assert result.exit_code == 0 and store.ops.delta_chain("plain") == 2
    shown = CliRunner().invoke(app, ["--store", str(store.path), "delta", "show"])
    assert "run plain: 2" in shown.output and "delta chunks" in shown.output


def test_a_new_process_starts_with_keyframes(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(5)
    state = _state(g)
    with _open(tmp_path / "s") as store:
        store.commit(state, run="r", step=0)
    state = {k: _nudge(v, g, 1e-3) for k, v in state.items()}
    with _open(tmp_path / "s") as store:  # no bases at hand: never read back from storage
        first = store.commit(state, run="r", step=1)
        assert store.ops.stats().delta_chunks == 0
        state = {k: _nudge(v, g, 1e-3) for k, v in state.items()}
        second = store.commit(state, run="r", step=2)
        assert store.ops.stats().delta_chunks > 0 and second.stored_bytes < 0.7 * first.stored_bytes


def test_gc_of_intermediate_versions_keeps_their_bases(store: casckpt.Store) -> None:
    g = torch.Generator().manual_seed(6)
    state, kept = _state(g), {}
    store.ops.set_delta_chain(8)
    for step in range(8):
        store.commit(state, run="r", step=step)
        kept[step] = {k: v.clone() for k, v in state.items()}
        state = {k: _nudge(v, g, 1e-3) for k, v in state.items()}
    for step in range(1, 7):
        store.delete(f"r@{step}")
    plan = store.gc(dry_run=True, grace=0)
    assert plan.chunks_kept_as_bases > 0
    dry = CliRunner().invoke(app, ["--store", str(store.path), "gc", "--dry-run", "--grace", "0"])
    assert "kept only as delta bases" in dry.output
    store.gc(grace=0)
    report = store.gc(grace=0)
    assert report.chunks_kept_as_bases > 0
    for step in (0, 7):
        _same(store.restore(f"r@{step}"), kept[step])
    assert store.ops.check(read_data=True).ok


def test_repacking_a_base_out_of_a_mostly_dead_pack_keeps_its_chain(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(12)
    a = torch.randn(CHUNK // 2, generator=g).bfloat16()  # one chunk
    b = torch.randn(4 * CHUNK // 2, generator=g).bfloat16()  # four
    with _open(tmp_path / "s") as store:
        store.ops.set_delta_policy("max")  # a2 on a1 on a: a dense chain balanced would not extend
        store.commit({"a": a, "b": b}, run="r", step=0)
        a1, b1 = _nudge(a, g, 1e-3), _nudge(b, g, 1e-3)
        store.commit({"a": a1, "b": b1}, run="r", step=1)  # one pack: a1 and b1, both deltas
        a2 = _nudge(a1, g, 1e-3)
        fresh = torch.randn(4 * CHUNK // 2, generator=g).bfloat16()
        store.commit({"a": a2, "b": fresh}, run="r", step=2)  # a2 is coded on a1; b1 is no base
        assert len(_delta_rows(store)) == 1 + 4 + 1  # a1 and b1's four chunks; a2
        store.delete("r@1")
        report = store.gc(grace=0)
        assert report.packs_repacked >= 1 and report.chunks_kept_as_bases >= 1  # a1 moved, b1 gone
        _same(store.restore("r@2"), {"a": a2, "b": fresh})
        _same(store.restore("r@0"), {"a": a, "b": b})
        assert store.ops.check(read_data=True).ok


def _flip_payload_byte(store: casckpt.Store, chunk_id: str) -> None:
    with internals(store).catalog.read() as conn:
        row = conn.execute(select(schema.chunks.c.pack_id, schema.chunks.c.offset)
                           .where(schema.chunks.c.id == chunk_id)).one()
    path = next(p for p in Path(str(store.path)).rglob(row.pack_id) if p.is_file())
    data = bytearray(path.read_bytes())
    data[row.offset + ENTRY_HEADER_SIZE + 7] ^= 0x40
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def test_a_corrupt_base_is_found_through_its_dependents(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(4 * CHUNK // 2, generator=g).bfloat16()}
    with _open(tmp_path / "s") as store:
        store.ops.set_delta_policy("max")  # dense bf16 deltas in chains (balanced keeps them short)
        for step in range(4):
            store.commit(state, run="r", step=step)
            state = {"w": _nudge(state["w"], g, 1e-3)}
        deltas = _delta_rows(store)
        assert deltas
        keyframe = next(r.base_id for r in deltas if r.base_id not in {d.id for d in deltas})
        _flip_payload_byte(store, keyframe)
        with pytest.raises(CorruptChunkError):
            store.restore("r@3")
        report = store.ops.check(read_data=True)
        assert not report.ok
        named = [p for p in report.problems if p.subject == keyframe and "delta-coded on it" in p.detail]
        assert named and "r@3" in named[0].detail and "r@0" in named[0].detail


def test_with_copies_a_corrupt_base_is_repaired_first(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(8)
    state = {"w": torch.randn(4 * CHUNK // 2, generator=g).bfloat16()}
    kept = []
    with _open(tmp_path / "s", blobs=[str(tmp_path / "a"), str(tmp_path / "b")],
               redundancy="replicate:2") as store:
        for step in range(3):
            kept.append({"w": state["w"].clone()})
            store.commit(state, run="r", step=step)
            state = {"w": _nudge(state["w"], g, 1e-3)}
        base = next(r.base_id for r in _delta_rows(store))
        with internals(store).catalog.read() as conn:
            pack, offset = conn.execute(select(schema.chunks.c.pack_id, schema.chunks.c.offset)
                                        .where(schema.chunks.c.id == base)).one()
        for where in ("a", "b"):  # one of the two is the copy reads go to first
            copy = next(p for p in (tmp_path / where).rglob(f"{pack}*") if p.is_file())
            data = bytearray(copy.read_bytes())
            data[offset + ENTRY_HEADER_SIZE + 100] ^= 1
            os.chmod(copy, 0o644)
            copy.write_bytes(bytes(data))
            internals(store).packs.layouts.forget(pack)
            _same(store.restore("r@2"), kept[2])  # the base from a good copy (healing a bad one read)
            report = store.ops.check(read_data=True)  # a bad copy left is found; no chunk is corrupt
            assert all(p.kind in ("pack", "shard") for p in report.problems), report.problems
            store.ops.repair()
            assert store.ops.check(read_data=True).ok


def test_catalog_rebuild_keeps_delta_bases(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(9)
    state, kept = _state(g), []
    root = tmp_path / "s"
    with _open(root) as store:
        for step in range(4):
            kept.append({k: v.clone() for k, v in state.items()})
            store.commit(state, run="r", step=step)
            state = {k: _nudge(v, g, 1e-3) for k, v in state.items()}
        before = store.ops.stats()
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (root / name).unlink(missing_ok=True)
    with _open(root, recover=True) as store:
        store.ops.rebuild_catalog()
        after = store.ops.stats()
        assert (after.delta_chunks, after.longest_chain) == (before.delta_chunks, before.longest_chain)
        for step, want in enumerate(kept):
            _same(store.restore(f"r@{step}"), want)
        assert store.ops.check(read_data=True).ok


class DeltaGC(RuleBasedStateMachine):
    """Commits of small updates, deletions, retention and GC interleaved: every visible version
    restores bit-exact and check stays clean."""

    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="delta-gc-")
        self.store = _open(Path(self.dir))
        self.store.ops.set_delta_chain(3)
        self.g = torch.Generator().manual_seed(11)
        self.state = {"w": torch.randn(3 * CHUNK // 4, generator=self.g),
                      "b": torch.randn(CHUNK, generator=self.g).bfloat16()}
        self.kept: dict[int, dict[str, torch.Tensor]] = {}
        self.step = 0

    @rule(scale=st.sampled_from([1e-4, 1e-2]))
    def commit(self, scale: float) -> None:
        self.store.commit(self.state, run="r", step=self.step)
        self.kept[self.step] = {k: v.clone() for k, v in self.state.items()}
        self.step += 1
        self.state = {k: _nudge(v, self.g, scale) for k, v in self.state.items()}

    @precondition(lambda self: len(self.kept) > 1)
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.kept)))
        self.store.delete(f"r@{step}")
        del self.kept[step]

    @precondition(lambda self: len(self.kept) > 2)
    @rule(keep=st.integers(1, 2))
    def retention(self, keep: int) -> None:
        self.store.retention.set("r", keep_last=keep)
        self.store.gc(grace=0)
        self.kept = {s: self.kept[s] for s in sorted(self.kept)[-keep:]}
        self.store.retention.clear("r")

    @rule()
    def gc(self) -> None:
        self.store.gc(grace=0)

    @precondition(lambda self: bool(self.kept))
    @rule(data=st.data())
    def restore(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.kept)))
        _same(self.store.restore(f"r@{step}"), self.kept[step])

    @invariant()
    def visible_versions_match(self) -> None:
        steps = sorted(v.step for v in self.store.log("r")) if self.kept else []
        assert steps == sorted(self.kept)

    def teardown(self) -> None:
        try:
            assert self.store.ops.check(read_data=True).ok
            for step, want in self.kept.items():
                _same(self.store.restore(f"r@{step}"), want)
        finally:
            self.store.close()


# each example opens a store and gc's it up to 14 times: 4 in the default tier, 8 in the slow one
DeltaGC.TestCase.settings = settings(max_examples=4, stateful_step_count=14, deadline=None)
test_delta_gc_state_machine = DeltaGC.TestCase


@pytest.mark.slow
class TestDeltaGCThorough(DeltaGC.TestCase):
    settings = settings(max_examples=8, stateful_step_count=14, deadline=None)
