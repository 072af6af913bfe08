"""The DCP writer and reader in one process (DCP's no-process-group mode), and ranged reads."""

from __future__ import annotations

import collections
import datetime
import gc
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadPlan

import casckpt
from casckpt.catalog import schema
from casckpt.engine.read.restore import read_ranges
from casckpt.engine.write import distributed
from casckpt.engine.write.distributed import TensorPiece, write_pieces
from casckpt.errors import InvalidArgumentError, InvalidNameError, UnsupportedStateError
from casckpt.format.pack import ENTRY_HEADER_SIZE
from casckpt.storage.erasure import Redundancy
from casckpt.testing.internals import internals

CHUNK = 4096


@pytest.fixture
def store(tmp_path: Path) -> Iterator[casckpt.Store]:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    with casckpt.open(tmp_path / "store", chunk_size=CHUNK) as s:
        yield s
        assert s.ops.check(read_data=True).ok


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(70, 33, generator=g), "h": torch.randn(9, 5, generator=g).half(),
                  "mask": torch.rand(100, generator=g) > 0.5},
        "step": seed, "none": None,
        "cfg": {"lr": float("-0.0"), "betas": (0.9, 0.95), "tag": b"\x00\x01", "layers": [1, 2, {"x": "y"}]},
    }


def _zeros(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _zeros(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else state


def _lease_count(store: casckpt.Store) -> int:
    with internals(store).catalog.read() as conn:
        return int(conn.execute(select(func.count()).select_from(schema.leases)).scalar_one())


def test_dcp_round_trip_in_one_process(store: casckpt.Store) -> None:
    state = _state(1)
    dcp.save(state, storage_writer=store.dcp_writer(run="r", step=1, message="first", tags=["t"]))
    target = _zeros(state)
    target["step"], target["cfg"] = 0, {"lr": 1.0, "betas": (), "tag": b"", "layers": [0, 0, {"x": ""}]}
    dcp.load(target, storage_reader=store.dcp_reader("tag:t"))
    for key in ("w", "h", "mask"):
        assert torch.equal(target["model"][key], state["model"][key])
    assert target["cfg"] == state["cfg"] and str(target["cfg"]["lr"]) == "-0.0" and target["step"] == 1
    version = store.resolve("r@1")
    # small pieces are packed at 16-byte boundaries, as a commit packs small tensors
    assert 0 <= version.new_bytes - version.logical_bytes < 16 * 3 and version.message == "first"
    detail = store.show("r@1")
    assert detail.world_size == 1 and detail.saved_with == "dcp"
    assert (detail.values["cfg.betas.1"], detail.values["cfg.layers.2.x"]) == (0.95, "y")
    assert _lease_count(store) == 0


def test_a_committed_version_loads_through_dcp(store: casckpt.Store) -> None:
    state = _state(2)
    store.commit(state, run="plain", step=5)
    target = _zeros(state)
    target["cfg"] = {"lr": 1.0, "betas": (), "tag": b"", "layers": [0, 0, {"x": ""}]}
    dcp.load(target, storage_reader=store.dcp_reader("plain@5"))
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["cfg"] == state["cfg"]
    dcp.save(state, storage_writer=store.dcp_writer(run="via-dcp", step=5))
    # the same content, chunked the same way, small tensors packed the same way: stored once
    assert store.resolve("via-dcp@5").new_bytes == 0


def test_a_value_that_is_not_plain_is_refused_and_nothing_is_published(store: casckpt.Store) -> None:
    state = {"w": torch.ones(10), "when": datetime.datetime(2026, 1, 1)}
    writer = store.dcp_writer(run="r", step=1)
    with pytest.raises(CheckpointException, match="UnsupportedStateError.*'when'"):
        dcp.save(state, storage_writer=writer)
    assert store.log() == []
    assert _lease_count(store) == 1  # DCP has no failure hook: the coordinator's lease is ended ...
    writer.reset()
    assert _lease_count(store) == 0  # ... when the writer is reused, released, or the store closes


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_the_deepest_value_a_save_accepts_reads_back(store: casckpt.Store) -> None:
    """A value sits one level below the version's root: one nesting 64 containers was saved,
    then every read of the version raised CorruptManifestError. A Counter (torch's allow-list
    admits it) saves as the dict it is."""
    state = {"w": torch.ones(2), "v": _nested(63), "c": (collections.Counter(b=1),)}
    dcp.save(state, storage_writer=store.dcp_writer(run="r", step=1))
    back = store.restore("r@1")
    assert back["v"] == _nested(63) and back["c"] == ({"b": 1},)
    with pytest.raises(CheckpointException, match="nests deeper than 63 containers"):
        dcp.save({"w": torch.ones(2), "v": _nested(64)}, storage_writer=store.dcp_writer(run="r", step=2))
    assert [v.step for v in store.log()] == [1]


def test_tensors_hidden_in_a_value_are_refused(store: casckpt.Store) -> None:
    with pytest.raises(CheckpointException, match="holds tensors inside an object"):
        dcp.save({"w": torch.ones(3), "pair": (torch.ones(2), 1)},  # DCP keeps tuples whole
                 storage_writer=store.dcp_writer(run="r", step=1))
    assert store.log() == []


def test_a_taken_step_is_refused_before_any_write(store: casckpt.Store) -> None:
    store.commit({"w": torch.ones(4)}, run="r", step=1)
    packs = store.ops.stats().packs
    with pytest.raises(CheckpointException, match="already has a version at step 1"):
        dcp.save({"w": torch.zeros(4)}, storage_writer=store.dcp_writer(run="r", step=1))
    assert store.ops.stats().packs == packs and _lease_count(store) == 0


def test_checkpoint_ids_and_collectives_are_checked(store: casckpt.Store) -> None:
    with pytest.raises(InvalidArgumentError, match="for r@1, not 'elsewhere'"):
        dcp.save({"w": torch.ones(2)}, checkpoint_id="elsewhere",
                 storage_writer=store.dcp_writer(run="r", step=1))
    dcp.save({"w": torch.ones(2)}, checkpoint_id="r@1", storage_writer=store.dcp_writer(run="r", step=1))
    writer = store.dcp_writer(run="r", step=2)
    with pytest.raises(InvalidArgumentError, match="use_collectives=False"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    reader = store.dcp_reader("r@1")
    plans = [LoadPlan([], storage_data=reader.checkpoint_id), LoadPlan([], storage_data="f" * 64)]
    with pytest.raises(InvalidArgumentError, match="ranks are loading different versions"):
        reader.prepare_global_plan(plans)


def test_store_close_ends_a_failed_saves_lease(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        writer = store.dcp_writer(run="r", step=1)
        with pytest.raises(CheckpointException):
            dcp.save({"bad": object()}, storage_writer=writer)
        assert _lease_count(store) == 1
    with casckpt.open(tmp_path / "s") as store:
        assert _lease_count(store) == 0


def test_a_dropped_writer_of_a_failed_save_ends_its_lease(store: casckpt.Store) -> None:
    with pytest.raises(CheckpointException):
        dcp.save({"bad": object()}, storage_writer=store.dcp_writer(run="r", step=1))
    gc.collect()  # the writer is gone: a long-lived process must not pin GC for a day
    assert _lease_count(store) == 0


def test_close_refuses_while_an_async_save_writes(store: casckpt.Store) -> None:
    release = threading.Event()

    class Slow(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            release.wait(30)
            return super().resolve_data(write_item)

    future = dcp.async_save({"w": torch.ones(100)}, storage_writer=store.dcp_writer(run="a", step=1),
                            planner=Slow())
    deadline = time.monotonic() + 30
    while not any(w.busy for w in internals(store).dcp_writers) and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(InvalidArgumentError, match="wait for it"):
        store.close()
    release.set()
    future.result()
    assert store.resolve("a@1").step == 1


def test_numpy_arrays_of_a_committed_version_do_not_stop_dcp_loads(store: casckpt.Store) -> None:
    state = {"w": torch.arange(10.0), "native": np.arange(6, dtype=np.float32),
             "swapped": np.arange(4, dtype=">i8")}
    store.commit(state, run="np", step=1)
    target = {"w": torch.zeros(10), "native": torch.zeros(6)}
    dcp.load(target, storage_reader=store.dcp_reader("np@1"))
    assert torch.equal(target["w"], state["w"]) and target["native"].tolist() == list(range(6))


def test_shards_are_confirmed_in_the_catalog_not_another_hosts_cache(tmp_path: Path) -> None:
    """A chunk GC swept that another host's cache still lists is written again, not skipped."""
    state = {"w": torch.randn(3 * CHUNK // 4, generator=torch.Generator().manual_seed(3))}
    with casckpt.open(tmp_path / "s", chunk_size=CHUNK, cache=tmp_path / "host-b") as other:
        other.commit(state, run="old", step=1)  # host b's cache now lists these chunks
    with casckpt.open(tmp_path / "s", chunk_size=CHUNK) as store:
        store.delete("old@1")
        store.gc(grace=0)
        store.gc(grace=0)
        assert store.ops.stats().chunks == 0
    with casckpt.open(tmp_path / "s", chunk_size=CHUNK, cache=tmp_path / "host-b") as other:
        dcp.save(state, storage_writer=other.dcp_writer(run="new", step=1))
        assert other.resolve("new@1").new_bytes == 3 * CHUNK
        assert torch.equal(other.restore("new@1")["w"], state["w"])
        assert other.ops.check(read_data=True).ok


@st.composite
def _ranges(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    nbytes = draw(st.integers(1, 6 * CHUNK))
    spans = draw(st.lists(st.tuples(st.integers(0, nbytes), st.integers(0, nbytes)), min_size=1, max_size=5))
    return nbytes, [(min(a, b), max(a, b)) for a, b in spans]


@given(case=_ranges())
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_ranged_reads_return_exact_bytes_and_read_only_covering_chunks(
        store: casckpt.Store, case: tuple[int, list[tuple[int, int]]]) -> None:
    nbytes, spans = case
    generator = torch.Generator().manual_seed(nbytes)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    run = f"r{nbytes}"
    if run not in {r.name for r in store.runs()}:
        store.commit({"bytes": data}, run=run, step=1)
    manifest = internals(store).manifest(f"{run}@1")
    read: list[int] = []
    outs = read_ranges(internals(store).context, manifest, [(0, a, b) for a, b in spans],
                       progress=lambda phase, done, total: read.append(total))
    for (a, b), out in zip(spans, outs, strict=True):
        assert bytes(out.numpy()) == bytes(data[a:b].numpy())
    covering = {i for a, b in spans for i in manifest.extents[0].covering(a, b)}
    limit = sum(min(CHUNK, nbytes - i * CHUNK) + ENTRY_HEADER_SIZE for i in covering)  # with headers
    assert (read[-1] if read else 0) <= limit
    assert not covering or read


def test_pieces_over_many_windows_write_each_chunk_once_and_count_it(tmp_path: Path) -> None:
    """Saves are hashed and packed window by window (half a pack each): a chunk that recurs in
    later windows is written and counted once, an unchanged re-save writes nothing, and every
    byte loads back."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randn(3 * CHUNK // 4, generator=g)  # three chunks, in four tensors
    state = {f"t{i}": shared.clone() if i % 2 == 0 else torch.randn(3 * CHUNK // 4, generator=g)
             for i in range(8)}
    state["small"] = torch.arange(7.0)
    unique = 5 * 3 * CHUNK + state["small"].nbytes  # t0 (= t2, t4, t6), t1, t3, t5, t7, small
    with casckpt.open(tmp_path / "s", chunk_size=CHUNK, pack_size=4 * CHUNK) as store:
        dcp.save(state, storage_writer=store.dcp_writer(run="r", step=1))
        first = store.resolve("r@1")
        assert first.new_bytes == unique and store.ops.stats().packs > 2  # several windows, packs
        dcp.save(state, storage_writer=store.dcp_writer(run="r", step=2))
        assert store.resolve("r@2").new_bytes == 0
        target = _zeros(state)
        dcp.load(target, storage_reader=store.dcp_reader("r@2"))
        assert all(torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)) for k, v in state.items())
        assert store.ops.check(read_data=True).ok


def test_a_save_failing_while_planning_ends_the_lease_taken_alongside(store: casckpt.Store) -> None:
    """The coordinator takes the GC lease while DCP plans: a save failing in planning leaves no
    version, and its lease ends with the writer."""

    class Failing(DefaultSavePlanner):
        def create_local_plan(self) -> Any:
            raise RuntimeError("planner failed")

    writer = store.dcp_writer(run="r", step=1)
    with pytest.raises(CheckpointException, match="planner failed"):
        dcp.save({"w": torch.ones(4)}, storage_writer=writer, planner=Failing())
    assert store.log() == []
    writer.release()  # ends the lease once begin_save, which runs alongside planning, returns
    deadline = time.monotonic() + 60
    while _lease_count(store) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _lease_count(store) == 0
    dcp.save({"w": torch.ones(4)}, storage_writer=writer)  # the writer can be used again
    assert store.resolve("r@1").new_bytes == 16 and _lease_count(store) == 0


def test_a_piece_that_cannot_be_stored_is_refused_before_any_window_is_packed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows are planned, hashed and packed one after another, but a piece refused in the
    last window (planning refuses a tensor for its dtype) leaves no pack behind."""
    plan = distributed.plan_extents

    def refusing(leaves: Any, **kwargs: Any) -> Any:
        if leaves[0].value.dtype == torch.float64:
            raise UnsupportedStateError(f"tensor at {leaves[0].path!r} cannot be stored as bytes")
        return plan(leaves, **kwargs)

    monkeypatch.setattr(distributed, "plan_extents", refusing)
    g = torch.Generator().manual_seed(9)
    pieces = [TensorPiece(f"t{i}", torch.randn(3 * CHUNK // 4, generator=g)) for i in range(6)]
    with casckpt.open(tmp_path / "s", chunk_size=CHUNK, pack_size=4 * CHUNK) as store:
        ctx = internals(store).context
        with pytest.raises(UnsupportedStateError, match="'last'"):
            write_pieces(ctx, [*pieces, TensorPiece("last", torch.ones(3, dtype=torch.float64))],
                         Redundancy("none"))
        assert store.ops.stats().packs == 0
        assert write_pieces(ctx, pieces, Redundancy("none")).new_bytes == 6 * 3 * CHUNK
        assert store.ops.stats().packs > 2


def test_dcp_load_of_small_tensors_packed_in_one_extent(store: casckpt.Store) -> None:
    """A commit packs small tensors into one extent; dcp.load reads each from its own offset."""
    g = torch.Generator().manual_seed(3)
    state = {"model": {"w": torch.randn(16, 8, generator=g), "b": torch.randn(16, generator=g),
                       "c": torch.arange(5)}}
    store.commit(state, run="packed", step=1)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp.load(target, storage_reader=store.dcp_reader("packed@1"))
    for key, tensor in state["model"].items():
        assert torch.equal(target["model"][key], tensor), key


def _pack_bytes(root: Path) -> int:
    """Bytes the store's location holds in packs (what saving wrote there)."""
    return sum(p.stat().st_size for p in (root / "packs").rglob("*") if p.is_file())


def _trained(seed: int, steps: int) -> list[dict[str, Any]]:
    """States of a model after each of ``steps`` small dense updates (every weight changes a little)."""
    g = torch.Generator().manual_seed(seed)
    state = {"model": {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g),
                       **{f"norm{i}": torch.ones(64) for i in range(8)}}, "step": 0}
    out = [state]
    for step in range(1, steps):
        model = {k: v * (1 + 1e-6 * torch.randn(v.shape, generator=g)) for k, v in out[-1]["model"].items()}
        out.append({"model": model, "step": step})
    return out


def test_a_dcp_save_stores_what_a_commit_of_the_same_state_stores(tmp_path: Path) -> None:
    """One write path: after a small dense update, a DCP save stores the bytes a one-process
    commit stores (delta-coded against the save before, small tensors packed), within 5%."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    states = _trained(7, 3)
    grew: dict[str, list[int]] = {"commit": [], "dcp": []}
    for how in grew:
        root = tmp_path / how
        with casckpt.open(root, chunk_size=CHUNK) as store:
            store.ops.set_delta_policy("max")  # dense fp32 deltas: balanced keeps them for cheap ones
            for step, state in enumerate(states):
                before = _pack_bytes(root)
                if how == "commit":
                    store.commit(state, run="r", step=step)
                else:
                    dcp.save(state, storage_writer=store.dcp_writer(run="r", step=step))
                grew[how].append(_pack_bytes(root) - before)
            assert store.ops.check(read_data=True).ok
            back = store.restore(f"r@{len(states) - 1}")
            flat = back["model"] if how == "commit" else {k.split(".", 1)[1]: v for k, v in back.items()
                                                           if k.startswith("model.")}
            assert all(torch.equal(flat[k], v) for k, v in states[-1]["model"].items())
    assert grew["commit"][1] < 0.5 * grew["commit"][0]  # delta-coded: the comparison can fail
    for step in range(len(states)):
        assert abs(grew["dcp"][step] - grew["commit"][step]) <= 0.05 * grew["commit"][step], grew


def test_small_pieces_of_two_ranks_pack_and_reshard_bit_exact(store: casckpt.Store) -> None:
    """Pieces small enough to pack (cut by rows, and by columns: strided in the whole tensor)
    saved by two ranks: each rank packs its own; restore assembles them, load_tensor reads
    one, DCP reshards them onto one process."""
    from casckpt.engine.write.commit import make_request
    from casckpt.format.manifest import World

    rows = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    cols = torch.arange(24, dtype=torch.int64).reshape(4, 6)
    ctx = internals(store).context
    req = make_request("small", 1, None, None, None, ())
    start = distributed.begin_save(ctx, req)
    wrote = [distributed.save_pieces(ctx, req, [
        TensorPiece("rows", rows[5 * r:5 * r + 5].clone(), (10, 3), (5 * r, 0)),
        TensorPiece("cols", cols[:, 3 * r:3 * r + 3].contiguous(), (4, 6), (0, 3 * r))]) for r in (0, 1)]
    pieces = [p for w in wrote for p in w.pieces]
    assert all(p.digest is not None and p.extent.packed for p in pieces)  # packed, each its own digest
    order = [0, 2, 1, 3]  # rows' pieces, then cols'
    root = {"t": "dict", "k": ["rows", "cols"],
            "v": [{"t": "sharded", "i": [0, 1]}, {"t": "sharded", "i": [2, 3]}]}
    distributed.publish_save(ctx, req, start, World(2, "dcp"), root, [pieces[i] for i in order],
                             sum(w.new_bytes for w in wrote), sum(w.stored_bytes for w in wrote), ())
    distributed.end_save(ctx, start.lease)
    back = store.restore("small@1")
    assert torch.equal(back["rows"], rows) and torch.equal(back["cols"], cols)
    assert torch.equal(store.load_tensor("small@1", "cols"), cols)
    target = {"rows": torch.zeros(10, 3), "cols": torch.zeros(4, 6, dtype=torch.int64)}
    dcp.load(target, storage_reader=store.dcp_reader("small@1"))
    assert torch.equal(target["rows"], rows) and torch.equal(target["cols"], cols)
    assert {t.path: t.shards for t in store.show("small@1").tensors} == {"rows": 2, "cols": 2}
    assert store.ops.check(read_data=True).ok


def test_a_dcp_save_and_a_commit_of_the_same_state_diff_as_equal(store: casckpt.Store) -> None:
    """A DCP save keys tensors by dotted name at its root (``model.w``), a commit nests them
    (``model`` -> ``w``), and a piece covering a whole tensor is a ``sharded`` value: the same
    tensors compare equal across the two, and a changed one is changed, not added."""
    state = _state(3)
    store.commit(state, run="r", step=1)
    dcp.save(state, storage_writer=store.dcp_writer(run="r", step=2))
    for a, b in (("r@1", "r@2"), ("r@2", "r@1")):
        diff = store.diff(a, b)
        assert (diff.added, diff.removed, diff.changed, diff.values) == ((), (), (), ())
        assert diff.unchanged == 3 and diff.changed_bytes == 0
    state["model"]["w"] = state["model"]["w"].clone()
    state["model"]["w"][0, 0] += 1
    dcp.save(state, storage_writer=store.dcp_writer(run="r", step=3))
    diff = store.diff("r@1", "r@3")
    assert (diff.added, diff.removed) == ((), ()) and [c.path for c in diff.changed] == ["model.w"]
    assert 0 < diff.changed_bytes <= CHUNK and diff.unchanged == 2


def test_a_tensor_a_dcp_save_keeps_in_one_piece_has_the_digest_of_a_commits(store: casckpt.Store) -> None:
    """A piece covering its whole tensor holds the bytes a commit stores whole: show lists the
    same digest for it, per-tensor history sees no change, and diff finds none."""
    state = _state(3)
    store.commit(state, run="r", step=1)
    dcp.save(state, storage_writer=store.dcp_writer(run="r", step=2))
    committed, saved = ({t.path: t.digest for t in store.show(ref).tensors} for ref in ("r@1", "r@2"))
    assert committed == saved and len(saved) == 3
    assert [(e.version.step, e.change) for e in store.history("r", "model.w")] == [(1, "added")]
    assert store.diff("r@1", "r@2").unchanged == 3


def test_a_dotted_key_and_the_nested_path_it_spells_are_matched_by_content(
        store: casckpt.Store) -> None:
    """``{"model.w": t}`` and ``{"model": {"w": t}}`` name one path: the diff matches the
    tensors there by content, whichever way each version spells it."""
    t1, t2 = (torch.full((40,), float(i)) for i in range(2))
    store.commit({"model.w": t1}, run="r", step=1)
    store.commit({"model": {"w": t1}}, run="r", step=2)
    store.commit({"model.w": t2}, run="r", step=3)
    for a, b in (("r@1", "r@2"), ("r@2", "r@1")):
        same = store.diff(a, b)
        assert (same.added, same.removed, same.changed, same.unchanged) == ((), (), (), 1)
    changed = store.diff("r@2", "r@3")
    assert [(c.path, c.changed_bytes) for c in changed.changed] == [("model.w", 160)]
    assert (changed.added, changed.removed, changed.unchanged) == ((), (), 0)


@pytest.mark.parametrize("key", ["a/b", "..", "", "x\ty", "back\\slash"])
def test_dcp_refuses_the_key_names_commit_refuses_before_any_write(store: casckpt.Store, key: str) -> None:
    state = {key: torch.ones(3), "ok": torch.zeros(2)}
    with pytest.raises(InvalidNameError):
        store.commit(state, run="c", step=1)
    with pytest.raises(CheckpointException, match="InvalidNameError"):
        dcp.save(state, storage_writer=store.dcp_writer(run="r", step=1))
    assert store.log() == [] and store.ops.stats().chunks == 0
    gc.collect()  # the refused writer is collected: its lease ends, nothing waits forever
    for thread in [t for t in threading.enumerate() if t.name == "casckpt-dcp-begin"]:
        thread.join(timeout=30)
        assert not thread.is_alive(), "a refused save's begin thread never finished"
