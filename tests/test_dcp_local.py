"""The DCP writer and reader in one process (DCP's no-process-group mode), and ranged reads."""

from __future__ import annotations

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
from casckpt.engine import distributed
from casckpt.engine.distributed import TensorPiece, write_pieces
from casckpt.engine.restore import read_ranges
from casckpt.errors import InvalidArgumentError, UnsupportedStateError
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
    assert version.new_bytes == version.logical_bytes and version.message == "first"
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
    # the same content, chunked the same way -- but for the small tensors, which a commit packs
    # together (h: 90 bytes, mask: 100) and DCP writes one by one
    small = state["model"]["h"].nbytes + state["model"]["mask"].nbytes
    assert store.resolve("via-dcp@5").new_bytes == small


def test_a_value_that_is_not_plain_is_refused_and_nothing_is_published(store: casckpt.Store) -> None:
    state = {"w": torch.ones(10), "when": datetime.datetime(2026, 1, 1)}
    writer = store.dcp_writer(run="r", step=1)
    with pytest.raises(CheckpointException, match="UnsupportedStateError.*'when'"):
        dcp.save(state, storage_writer=writer)
    assert store.log() == []
    assert _lease_count(store) == 1  # DCP has no failure hook: the coordinator's lease is ended ...
    writer.reset()
    assert _lease_count(store) == 0  # ... when the writer is reused, released, or the store closes


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
    writer.release()
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
