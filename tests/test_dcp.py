"""torch.distributed.checkpoint through casckpt, and group commits: real gloo process groups.

Ranks are forked by tests/helpers/dist_worker.py (a zygote that imported torch
once) and join a gloo group on 127.0.0.1. The state has tensors sharded on
dim 0 with uneven rows, one sharded on dim 1, replicated tensors and plain
values (see ``full_state`` there).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import RestoreTargetError
from casckpt.testing.internals import internals

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
from dist_worker import CHUNK, PACK, PLACEMENT, bits, full_state, group_state  # noqa: E402
from doubles import Zygote  # noqa: E402

WORKER = Path(__file__).parent / "helpers" / "dist_worker.py"


@pytest.fixture(scope="module")
def ranks() -> Iterator[Zygote]:
    zygote = Zygote(WORKER)
    yield zygote
    zygote.close()


def launch(ranks: Zygote, scenario: str, world: int, *, ok: bool = True, **args: Any) -> dict[str, Any]:
    reply = ranks.ask({"scenario": scenario, "world": world, "args": args, "timeout": 150}, timeout=180)
    if ok:
        assert reply["codes"] == [0] * world, "\n".join(e for e in reply["errors"] if e)
    return reply


def _open(path: Path, **kwargs: Any) -> casckpt.Store:
    return casckpt.open(path, chunk_size=CHUNK, pack_size=PACK, **kwargs)


def _same_as_full(restored: dict[str, Any], full: dict[str, Any]) -> None:
    for key, want in full.items():
        if isinstance(want, torch.Tensor):
            assert bits(restored[key]) == bits(want), key
        elif key == "meta":
            assert {k: restored[f"meta.{k}"] for k in want} == want
        else:
            assert restored[key] == want


def _boundary_bytes(full: dict[str, Any], world: int) -> int:
    """At most how many bytes a save from ``world`` ranks adds to a store holding the same state
    saved whole: chunks cut by dim-0 shard boundaries, and the dim-1 sharded tensor in full."""
    total = 0
    for key, placement in PLACEMENT.items():
        tensor = full[key]
        if placement.dim == 1:
            total += tensor.numel() * tensor.element_size()
            continue
        rows = [len(piece) for piece in torch.chunk(tensor, world)]
        row_bytes = tensor[0].numel() * tensor.element_size()
        cuts = [sum(rows[:i]) * row_bytes for i in range(1, len(rows))]
        total += sum(CHUNK for cut in cuts if cut % CHUNK)  # the two pieces of one cut chunk
    return total


# (save worlds, load worlds, the world whose save goes through dcp.async_save). The full matrix
# loads every save on fewer and on more ranks than saved it; the default tier's subset loads a
# 1-rank save on more ranks and a 4-rank (async) save on fewer, and the slow tier runs the whole
# matrix, so no world size is lost (the other tests here save on 2 ranks).
RESHARD = [pytest.param((1, 4), (2,), 4, id="subset"),
           pytest.param((1, 2, 4), (1, 4), 2, id="every-world-size", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("saves", "loads", "async_world"), RESHARD)
def test_dcp_save_and_load_reshard_bit_exact_for_every_world_size(
        ranks: Zygote, tmp_path: Path, saves: tuple[int, ...], loads: tuple[int, ...],
        async_world: int) -> None:
    store_path = tmp_path / "store"
    _open(store_path).close()
    full = full_state(1)
    for world in saves:
        launch(ranks, "dcp_save", world, path=str(store_path), run=f"n{world}", step=1, seed=1,
               **{"async": world == async_world})
    refs = [[f"n{world}@1", 1] for world in saves]
    for world in loads:
        reply = launch(ranks, "dcp_load", world, path=str(store_path), refs=refs)
        for rank in range(world):
            assert reply["results"][rank]["bad"] == {ref: [] for ref, _ in refs}, (world, rank)

    with _open(store_path) as store:
        for world in saves:
            _same_as_full(store.restore(f"n{world}@1"), full)  # one process, no DCP: shards assembled
            assert bits(store.load_tensor(f"n{world}@1", "model.w2")) == bits(full["model.w2"])
            detail = store.show(f"n{world}@1")
            assert detail.world_size == world and detail.saved_with == "dcp"
            shards = {t.path: t.shards for t in detail.tensors}
            assert shards["model.emb"] == world and shards["model.bias"] == 1
        versions = {v.run: v for v in store.log()}
        logical = versions["n1"].logical_bytes
        assert versions["n1"].new_bytes == logical
        for world in saves[1:]:  # dedup across resharding: only chunks cut by new boundaries
            new = versions[f"n{world}"].new_bytes
            assert 0 < new <= _boundary_bytes(full, world), (world, new)
        assert store.ops.check(read_data=True).ok
    shown = CliRunner().invoke(app, ["--store", str(store_path), "show", "n4@1", "--tensors"])
    assert shown.exit_code == 0, shown.output
    assert "saved by 4 rank(s)" in shown.output and "4 on dim 0" in shown.output
    assert "4 on dim 1" in shown.output  # model.w2
    shown = CliRunner().invoke(app, ["--store", str(store_path), "show", f"n{saves[-2]}@1", "--json"])
    as_json = json.loads(shown.output)
    shards = {t["path"]: t["shards"] for t in as_json["tensors"]}
    assert as_json["world_size"] == saves[-2] and shards["model.emb"] == saves[-2]


def test_dcp_resave_from_same_world_writes_nothing_new(ranks: Zygote, tmp_path: Path) -> None:
    store_path = tmp_path / "store"
    _open(store_path).close()
    launch(ranks, "dcp_save", 2, path=str(store_path), run="r", step=1, seed=2)
    launch(ranks, "dcp_save", 2, path=str(store_path), run="r", step=2, seed=2)
    with _open(store_path) as store:
        first, second = store.resolve("r@1"), store.resolve("r@2")
        assert first.new_bytes == first.logical_bytes and second.new_bytes == 0
        assert second.parent == first.id and second.metrics == {"loss": 0.5}
        refused = launch(ranks, "dcp_save", 2, ok=False, path=str(store_path), run="r", step=2, seed=3)
        assert refused["codes"] == [1, 1] and "already has a version at step 2" in refused["errors"][0]
        assert [v.step for v in store.log("r")] == [2, 1]


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_dcp_rank_failure_publishes_nothing_and_gc_reclaims(ranks: Zygote, tmp_path: Path, how: str) -> None:
    store_path = tmp_path / "store"
    _open(store_path).close()
    failed = launch(ranks, "dcp_save", 2, ok=False, path=str(store_path), run="f", step=1, seed=5,
                    fail={"rank": 1, "after": 2, "how": how})
    assert failed["codes"][1] == (-9 if how == "kill" else 1) and failed["codes"][0] == 1
    with _open(store_path) as store:
        assert store.log() == []
        leftovers = store.ops.stats()
        assert leftovers.packs > 0 and leftovers.versions == 0  # rank 0 wrote its part
        assert store.ops.check().ok
    launch(ranks, "dcp_save", 2, path=str(store_path), run="f", step=1, seed=6)
    reply = launch(ranks, "dcp_load", 2, path=str(store_path), refs=[["f@1", 6]])
    assert all(r["bad"] == {"f@1": []} for r in reply["results"])
    with _open(store_path) as store:
        version = store.resolve("f@1")
        store.gc(grace=0)
        store.gc(grace=0)
        after = store.ops.stats()
        assert after.unique_bytes == version.new_bytes  # the failed save's chunks are gone
        on_disk = [p for p in (store_path / "packs").rglob("*") if p.is_file()]
        assert len(on_disk) == after.packs
        assert store.ops.check(read_data=True).ok
        _same_as_full(store.restore("f@1"), full_state(6))


@pytest.mark.slow
def test_dcp_on_s3_and_postgres(ranks: Zygote, tmp_path: Path, s3_bucket_url: Any, moto_endpoint: str,
                                pg_url: str) -> None:
    where = {"blobs": s3_bucket_url(), "catalog": pg_url, "s3": {"endpoint_url": moto_endpoint}}
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    _open(tmp_path / "store", **where).close()
    common = {"path": str(tmp_path / "store"), "open": where, "env": env}
    launch(ranks, "dcp_save", 2, run="s3", step=1, seed=7, **common)
    reply = launch(ranks, "dcp_load", 1, refs=[["s3@1", 7]], **common)  # resharded 2 -> 1
    assert all(r["bad"] == {"s3@1": []} for r in reply["results"])
    with _open(tmp_path / "store", **where) as store:
        _same_as_full(store.restore("s3@1"), full_state(7))
        assert store.ops.check(read_data=True).ok


def test_group_commit_writes_shared_chunks_once_and_restores_each_rank(ranks: Zygote, tmp_path: Path) -> None:
    store_path = tmp_path / "store"
    _open(store_path).close()
    reply = launch(ranks, "group_commit", 2, path=str(store_path), run="g", step=1, seed=11)
    ids = {r["id"] for r in reply["results"]}
    assert len(ids) == 1  # every rank got the same version
    states = [group_state(rank, 11) for rank in range(2)]
    w, b = (t.numel() * t.element_size() for t in states[0]["model"].values())
    rng = states[0]["rng"].numel()
    # the replicated weight written once; small tensors packed with each rank's own (as a
    # one-process commit packs them): b goes with each rank's rng
    assert reply["results"][0]["new_bytes"] == w + 2 * (b + rng)
    restored = launch(ranks, "group_restore", 2, path=str(store_path), ref="g@1", seed=11)
    assert [r["same"] for r in restored["results"]] == [True, True]

    with _open(store_path) as store:
        one = store.restore("g@1", rank=1)
        assert bits(one["rng"]) == bits(states[1]["rng"]) and one["loader"] == states[1]["loader"]
        assert bits(store.load_tensor("g@1", "rank0/rng")) == bits(states[0]["rng"])
        with pytest.raises(RestoreTargetError, match="pass group= .* or rank="):
            store.restore("g@1")
        with pytest.raises(RestoreTargetError, match="saved rank by rank"):
            store.dcp_reader("g@1")
        detail = store.show("g@1")
        assert detail.world_size == 2 and detail.saved_with == "group"
        assert {"rank0/model.w", "rank1/rng"} <= {t.path for t in detail.tensors}
        assert detail.values["rank1/loader.position"] == 1011
        assert store.ops.check(read_data=True).ok
        rows = [(t.path, t.digest) for t in detail.tensors]
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):  # the catalog is lost
        (store_path / name).unlink(missing_ok=True)
    with _open(store_path, recover=True) as store:
        store.ops.rebuild_catalog()  # ... and rebuilt from the manifests and packs alone
        assert [(t.path, t.digest) for t in store.show("g@1").tensors] == rows
        assert bits(store.restore("g@1", rank=1)["rng"]) == bits(states[1]["rng"])


def test_group_commit_failing_rank_fails_every_rank(ranks: Zygote, tmp_path: Path) -> None:
    store_path = tmp_path / "store"
    _open(store_path).close()
    reply = launch(ranks, "group_commit", 2, path=str(store_path), run="g", step=1, seed=12, bad_rank=1)
    for rank, result in enumerate(reply["results"]):
        assert "rank 1: UnsupportedStateError" in result["error"] and "loader.sampler" in result["error"]
        assert result["cause"] == ("UnsupportedStateError" if rank == 1 else "NoneType")
    with _open(store_path) as store:
        assert store.log() == []
    early = launch(ranks, "group_commit", 2, path=str(store_path), run="g", step=1, seed=12, preflight_fail=1)
    assert all("rank 1: StorageError: injected" in r["error"] for r in early["results"])  # no one hangs
    read_only = launch(ranks, "group_commit", 2, path=str(store_path), run="g", step=1, seed=12,
                       read_only_rank=1)  # refused before the commit's first collective
    assert all("rank 1: ReadOnlyStoreError" in r["error"] for r in read_only["results"]), read_only
    reply = launch(ranks, "group_commit", 2, path=str(store_path), run="g", step=1, seed=12)
    assert reply["results"][0]["id"] == reply["results"][1]["id"]
    with _open(store_path) as store:
        with internals(store).catalog.read() as conn:  # every failed attempt ended its lease
            assert conn.exec_driver_sql("SELECT COUNT(*) FROM leases").scalar_one() == 0


def test_boundary_bound_is_tight_enough_to_matter() -> None:
    """The dedup assertion above must be able to fail: its bound is far below a full re-save."""
    full = full_state(1)
    logical = sum(v.numel() * v.element_size() for v in full.values() if isinstance(v, torch.Tensor))
    assert _boundary_bytes(full, 4) < 0.3 * logical and _boundary_bytes(full, 2) < 0.15 * logical
    assert math.prod(full["model.emb"].shape) * 4 > 10 * CHUNK
