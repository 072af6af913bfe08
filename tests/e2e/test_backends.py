"""The core commit / restore / check behaviour on every backend combination.

Runs once per {local dir, S3 (moto on loopback)} x {SQLite, PostgreSQL}.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from casckpt.errors import CorruptChunkError, RefNotFoundError, VersionExistsError
from casckpt.format.state import iter_leaves
from casckpt.storage import open_blob_store
from casckpt.testing.internals import internals

CHUNK = 4096


def _state(seed: int, *, changed: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    frozen = torch.randn(64, 256, generator=g)  # 64 KiB: 16 chunks that never change
    head = torch.randn(32, 64, generator=g)
    if changed:
        head = head + 1
    return {
        "model": {"backbone.weight": frozen, "head.weight": head, "head.bias": torch.zeros(32)},
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": head * 0.1}},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}]},
        "rng": torch.get_rng_state(),
        "data": {"epoch": 2, "position": 1234, "name": "shard-07", "blob": b"\x00\xff"},
    }


def _chunks(state: Any) -> dict[bytes, int]:
    """Distinct chunk contents of a state, cut the way the store cuts them."""
    found: dict[bytes, int] = {}
    for _, leaf in iter_leaves(state):
        if isinstance(leaf, torch.Tensor) and leaf.numel():
            raw = leaf.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            size = CHUNK - CHUNK % leaf.element_size()
            for i in range(0, len(raw), size):
                found[raw[i : i + size]] = len(raw[i : i + size])
    return found


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any) -> None:
    """Bit-exact equality of two states, types included."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and (a.dtype, a.shape) == (b.dtype, b.shape)
        assert _raw(a).equal(_raw(b))
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert type(a) is type(b) and a == b


def test_commit_restore_dedup_and_check(store_config: Any) -> None:
    first_state, second_state = _state(0), _state(0, changed=True)
    first_chunks, second_chunks = _chunks(first_state), _chunks(second_state)
    with store_config.open(chunk_size=CHUNK) as store:
        first = store.commit(first_state, run="train", step=100, metrics={"loss": 2.5}, tags=["v1"])
        second = store.commit(second_state, run="train", step=200, metrics={"loss": 2.0})
        again = store.commit(second_state, run="train", step=300)
        assert first.new_bytes == sum(first_chunks.values())
        assert second.new_bytes == sum(n for c, n in second_chunks.items() if c not in first_chunks)
        assert second.new_bytes < second.logical_bytes / 2  # the backbone was not written again
        assert again.new_bytes == 0 and again.stored_bytes == 0
        assert_same(first_state, store.restore("train@100"))
        assert_same(second_state, store.restore("train@latest"))
        assert_same(first_state, store.restore("tag:v1"))
        assert_same(second_state, store.restore(second.id[:10]))
        head = store.load_tensor("train@~1", "model.head.weight")
        assert torch.equal(head, second_state["model"]["head.weight"])
        assert [v.step for v in store.log("train")] == [300, 200, 100]
        assert store.log("train")[-1].metrics == {"loss": 2.5}
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems
        assert report.chunks_read == report.chunks > 0


def test_reopen_by_path_alone(store_config: Any) -> None:
    state = _state(1)
    with store_config.open(chunk_size=CHUNK) as store:
        version = store.commit(state, run="r", step=1)
    # every later open needs only the path: blobs and catalog come from casckpt.toml
    import casckpt

    with casckpt.open(store_config.root, create=False) as store:
        assert store.resolve("r@latest").id == version.id
        assert_same(state, store.restore("r@1"))
        with pytest.raises(VersionExistsError):
            store.commit(state, run="r", step=1)
        with pytest.raises(RefNotFoundError):
            store.restore("r@2")


def test_flipped_byte_is_caught(store_config: Any) -> None:
    with store_config.open(chunk_size=CHUNK) as store:
        good = store.commit({"w": _noise(2, 10_000)}, run="a", step=1)
        other = store.commit({"v": _noise(3, 5000)}, run="b", step=1)
        assert store.ops.stats().packs == 2
    blobs = open_blob_store(_blob_url(store_config), _backend_options(store_config))
    keys = sorted(info.key for info in blobs.list("packs/"))
    damaged = next(k for k in keys if _pack_holds(blobs, k, _noise(2, 10_000)))
    data = bytearray(blobs.get(damaged))
    data[len(data) // 3] ^= 0x01
    blobs.delete(damaged)
    blobs.put(damaged, bytes(data))
    blobs.close()
    with store_config.open(chunk_size=CHUNK) as store:
        with pytest.raises(CorruptChunkError) as err:
            store.restore(good.id)
        assert err.value.pack_id == damaged.rsplit("/", 1)[1]
        assert torch.equal(store.restore(other.id)["v"], _noise(3, 5000))
        report = store.ops.check(read_data=True)
        assert not report.ok
        assert {p.kind for p in report.problems} <= {"chunk", "pack", "shard", "version"}


def _noise(seed: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _blob_url(config: Any) -> str:
    return config.blobs or config.root.resolve().as_uri()


def _backend_options(config: Any) -> dict[str, Any]:
    from casckpt.config import read_config_file, recorded_backends

    return recorded_backends(read_config_file(config.root / "casckpt.toml"))


def _pack_holds(blobs: Any, key: str, tensor: torch.Tensor) -> bool:
    """Whether the pack holds ``tensor``'s bytes: raw, or (fp32 in byte planes) its raw low plane."""
    raw = tensor.numpy().tobytes()
    low_plane = raw[0 : 4 * 64 : 4]
    data = blobs.get(key)
    return raw[:64] in data or low_plane in data


def test_gc_and_retention(store_config: Any) -> None:
    """Retention + GC reclaim space on every backend, and only one GC runs at a time."""
    from casckpt.catalog.locks import gc_lock
    from casckpt.errors import GCRunningError

    with store_config.open(chunk_size=CHUNK, pack_size=16 << 10) as store:
        states = {step: {"w": _noise(10 + step, 8000)} for step in range(4)}
        for step, state in states.items():
            store.commit(state, run="r", step=step)
        store.retention.set("r", keep_last=2)
        before = store.ops.stats()
        with gc_lock(internals(store).catalog), pytest.raises(GCRunningError):
            store.gc(grace=0)
        report = store.gc(grace=0)
        assert report.versions_deleted == 2 and report.versions_purged == 2
        assert report.packs_deleted > 0
        after = store.ops.stats()
        assert after.unique_bytes == before.unique_bytes // 2
        assert after.pack_bytes < before.pack_bytes
        assert [v.step for v in store.log("r")] == [3, 2]
        for step in (2, 3):
            assert torch.equal(store.restore(f"r@{step}")["w"], states[step]["w"])
        assert store.ops.check(read_data=True).ok
    blobs = open_blob_store(_blob_url(store_config), _backend_options(store_config))
    try:
        listed = {info.key for info in blobs.list("packs/")}
    finally:
        blobs.close()
    with store_config.open() as store:
        from casckpt.catalog.gc import known_shard_keys

        assert listed == {key for _, key in known_shard_keys(internals(store).catalog)}  # nothing left behind
