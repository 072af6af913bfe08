"""Erasure-coded commits encode in worker processes: what a store sees of them.

A worker killed mid-encode fails that commit with a typed error and
publishes nothing, and the store goes on (next commit, gc, check); workers
start only when an erasure-coded pack is filled and stop with the store; a
store whose workers cannot start encodes in its own process. The shards a
worker makes are held byte for byte to the in-process code in
tests/storage/test_ecpool.py; healing and repairing packs written by workers
are covered by tests/storage/test_redundancy.py (every erasure-coded commit there
goes through workers).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import CasckptError, EncodeWorkerError, RefNotFoundError
from casckpt.storage import ecpool
from casckpt.testing.internals import internals

PACK = 256 << 10
RUN = "r"


def make_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "b": torch.randn(50_000, generator=g).to(torch.bfloat16),
            "step": step}


def open_store(root: Path, redundancy: str = "ec:4+2") -> casckpt.Store:
    return casckpt.open(root, blobs=[f"blobs/d{i}" for i in range(6)], redundancy=redundancy,
                        chunk_size=64 << 10, pack_size=PACK, workers=2)


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def shard_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blobs").rglob("*.s[0-9]*") if p.is_file())


def staging_files(store: casckpt.Store) -> list[Path]:
    return sorted(p for p in internals(store).staging.path().rglob("*") if p.is_file())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# A worker that stops itself (SIGSTOP) right after creating a shard file, once, when the test
# has armed it by creating ``<STOP_DIR>/<its pid>``: it is then certainly mid-encode when killed.
STOPPING_WORKER = """
import builtins, os, pathlib, runpy, signal
real_open = builtins.open
armed = pathlib.Path(os.environ["CASCKPT_TEST_STOP_DIR"]) / str(os.getpid())
def open_then_stop(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    if mode == "xb" and armed.exists():
        armed.unlink()
        os.kill(os.getpid(), signal.SIGSTOP)
    return f
builtins.open = open_then_stop
runpy.run_module("casckpt.storage.ecworker", run_name="__main__", alter_sys=True)
"""


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_worker_killed_mid_encode_fails_the_commit_cleanly_and_the_store_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, stop_dir = tmp_path / "store", tmp_path / "stop"
    stop_dir.mkdir()
    monkeypatch.setenv("CASCKPT_TEST_STOP_DIR", str(stop_dir))
    popen = ecpool.subprocess.Popen

    def stopping_popen(args: list[str], **kwargs: Any) -> Any:
        assert args[1:] == ["-m", "casckpt.storage.ecworker"]
        return popen([args[0], "-c", STOPPING_WORKER], **kwargs)

    monkeypatch.setattr(ecpool.subprocess, "Popen", stopping_popen)
    with open_store(root) as store:
        store.commit(make_state(0), run=RUN, step=0)
        before = shard_files(root)
        killed: list[int] = []
        send = ecpool._Worker.send

        def send_then_kill(self: Any, request: dict[str, Any]) -> None:
            if killed:
                send(self, request)
                return
            # the first pack of the next commit: its worker dies writing its first shard
            (stop_dir / str(self.pid)).touch()
            send(self, request)
            deadline = time.monotonic() + 60
            while not stopped(self.pid) and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(self.pid, signal.SIGKILL)
            killed.append(self.pid)
            # it was stopped holding a shard file it had just created (the pool removes it once
            # it sees the worker die, after this send returns)
            assert any(Path(path).exists() for path in request["out"])

        monkeypatch.setattr(ecpool._Worker, "send", send_then_kill)
        with pytest.raises(EncodeWorkerError) as info:
            store.commit(make_state(1), run=RUN, step=1)
        assert isinstance(info.value, CasckptError)
        assert "SIGKILL" in str(info.value) and "commit again" in str(info.value)
        assert killed and not alive(killed[0])
        assert [v.step for v in store.log(RUN)] == [0]
        with pytest.raises(RefNotFoundError):
            store.resolve(f"{RUN}@1")
        assert staging_files(store) == []  # no pack or shard file of the failed commit is left,
        # not even the shard files the worker was writing when it died

        monkeypatch.undo()
        store.commit(make_state(1), run=RUN, step=1)  # a fresh worker takes over
        assert killed[0] not in internals(store).packs.coder.worker_pids()
        for step in (0, 1):
            same(store.restore(f"{RUN}@{step}"), make_state(step))
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems
        store.gc(grace=0)
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems
        recorded = sum(info.shards for info in store.locations.list())
        assert len(shard_files(root)) == recorded  # shards of packs the failed commit stored are gone
        assert set(before) <= set(shard_files(root))


def test_workers_start_with_the_first_erasure_coded_pack_and_stop_with_the_store(tmp_path: Path) -> None:
    plain = open_store(tmp_path / "plain", redundancy="none")
    plain.commit(make_state(0), run=RUN, step=0)
    assert internals(plain).packs.coder.worker_pids() == []  # no erasure-coded pack, no worker
    plain.close()

    store = open_store(tmp_path / "ec")
    coder = internals(store).packs.coder
    assert coder.worker_pids() == []  # opening starts none
    store.commit(make_state(0), run=RUN, step=0)
    pids = coder.worker_pids()
    assert pids and all(alive(pid) for pid in pids)
    store.commit(make_state(1), run=RUN, step=1)
    assert set(pids) <= set(coder.worker_pids())  # kept from one commit to the next
    store.close()
    assert not any(alive(pid) for pid in pids)


def test_without_workers_a_store_encodes_in_its_own_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    root = tmp_path / "store"
    with caplog.at_level(logging.WARNING, logger="casckpt"), open_store(root) as store:
        store.commit(make_state(0), run=RUN, step=0)
        store.commit(make_state(1), run=RUN, step=1)
        assert internals(store).packs.coder.worker_pids() == []
        for step in (0, 1):
            same(store.restore(f"{RUN}@{step}"), make_state(step))
        assert store.ops.check(read_data=True).ok
    warnings = [r for r in caplog.records if "erasure coding runs in this process" in r.getMessage()]
    assert len(warnings) == 1  # said once, not per pack
    assert shard_files(root)


def _ec_store(tmp_path: Path) -> casckpt.Store:
    locations = [str(tmp_path / f"loc{i}") for i in range(3)]
    return casckpt.open(tmp_path / "s", blobs=locations, redundancy="ec:2+1", pack_size=1 << 20)


def _damage_shards(monkeypatch: pytest.MonkeyPatch, damage: object) -> None:
    from casckpt.storage import ecpool

    real = ecpool.EncodePool.encode

    def encode(pool: ecpool.EncodePool, *args: object, **kwargs: object) -> ecpool.EncodedPack:
        encoded = real(pool, *args, **kwargs)  # type: ignore[arg-type]
        damage(encoded.shards)  # type: ignore[operator]
        return encoded

    monkeypatch.setattr(ecpool.EncodePool, "encode", encode)


def test_short_shard_file_from_the_worker_is_never_stored(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Erasure-coding workers hand shards over as staging files, stored unread. Two of three
    shard files cut short after the worker replied: the commit published a version that could
    never be restored (fewer than k healthy shards). It must fail typed, publishing nothing."""
    from casckpt.errors import StorageError

    def cut(shards: tuple[object, ...]) -> None:
        for shard in shards[:2]:
            path = shard.path  # type: ignore[attr-defined]
            path.write_bytes(path.read_bytes()[:-100])

    torch.manual_seed(0)
    state = {"a": torch.randn(1 << 18)}
    with _ec_store(tmp_path) as store:
        _damage_shards(monkeypatch, cut)
        with pytest.raises(StorageError, match="not the"):
            store.commit(state, run="r", step=1)
        assert store.runs() == []
        monkeypatch.undo()
        version = store.commit(state, run="r", step=1)
        assert torch.equal(store.restore(version.id)["a"], state["a"])


@pytest.mark.xfail(strict=True, reason="shard files a worker made are stored without reading them "
                   "back: bytes damaged between the worker's write and the upload go under the "
                   "worker's checksum; verifying costs a read of every shard (see the report)")
def test_garbled_shard_files_from_the_worker_are_never_stored(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    def flip(shards: tuple[object, ...]) -> None:
        for shard in shards[:2]:
            path = shard.path  # type: ignore[attr-defined]
            data = bytearray(path.read_bytes())
            data[-10] ^= 0xFF
            path.write_bytes(bytes(data))

    torch.manual_seed(0)
    state = {"a": torch.randn(1 << 18)}
    with _ec_store(tmp_path) as store:
        _damage_shards(monkeypatch, flip)
        try:
            store.commit(state, run="r", step=1)
        except CasckptError:
            return  # refused: fine
        monkeypatch.undo()
        assert torch.equal(store.restore("r@1")["a"], state["a"])  # published: must restore


# -- a failure of a pack that is not the last in flight ----------------------------------------

def _assert_failed_cleanly(store: casckpt.Store, root: Path, before: list[Path]) -> None:
    """Nothing of the failed commit is visible or referenced; the store goes on."""
    assert [v.step for v in store.log(RUN)] == [0]
    with pytest.raises(RefNotFoundError):
        store.resolve(f"{RUN}@1")
    assert staging_files(store) == []
    report = store.ops.check(read_data=True)
    assert report.ok, report.problems
    same(store.restore(f"{RUN}@0"), make_state(0))
    store.gc(grace=0)  # the packs the failed commit did store are nobody's: gone, and only they
    assert len(shard_files(root)) == sum(info.shards for info in store.locations.list())
    assert set(before) <= set(shard_files(root))
    store.commit(make_state(1), run=RUN, step=1)
    for step in (0, 1):
        same(store.restore(f"{RUN}@{step}"), make_state(step))
    report = store.ops.check(read_data=True)
    assert report.ok, report.problems


def test_a_worker_killed_while_a_later_pack_is_in_flight_fails_the_commit_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first pack's worker dies mid-encode once the next pack was handed to the encoding
    pool (two packs in flight to the coders): the commit fails typed, as with one pack in
    flight, and the later pack, stored or not, is referenced by nothing."""
    root, stop_dir = tmp_path / "store", tmp_path / "stop"
    stop_dir.mkdir()
    monkeypatch.setenv("CASCKPT_TEST_STOP_DIR", str(stop_dir))
    popen = ecpool.subprocess.Popen
    monkeypatch.setattr(ecpool.subprocess, "Popen",
                        lambda args, **kwargs: popen([args[0], "-c", STOPPING_WORKER], **kwargs))
    with open_store(root) as store:
        store.commit(make_state(0), run=RUN, step=0)
        before = shard_files(root)
        handed: list[str] = []
        lock, later = threading.Lock(), threading.Event()
        overlapped: list[bool] = []
        killed: list[int] = []
        encode, send = ecpool.EncodePool.encode, ecpool._Worker.send

        def encode_noting(pool: ecpool.EncodePool, pack: Path, pack_id: str, *args: Any) -> Any:
            with lock:
                handed.append(pack_id)
                if len(handed) > 1:
                    later.set()
            return encode(pool, pack, pack_id, *args)

        def send_then_kill(self: Any, request: dict[str, Any]) -> None:
            if killed or request["id"] != handed[0]:
                send(self, request)
                return
            (stop_dir / str(self.pid)).touch()
            send(self, request)
            overlapped.append(later.wait(60))  # the next pack went to the pool meanwhile
            deadline = time.monotonic() + 60
            while not stopped(self.pid) and time.monotonic() < deadline:
                time.sleep(0.001)
            os.kill(self.pid, signal.SIGKILL)
            killed.append(self.pid)

        monkeypatch.setattr(ecpool.EncodePool, "encode", encode_noting)
        monkeypatch.setattr(ecpool._Worker, "send", send_then_kill)
        with pytest.raises(EncodeWorkerError) as info:
            store.commit(make_state(1), run=RUN, step=1)
        assert "SIGKILL" in str(info.value) and "commit again" in str(info.value)
        assert handed[0] in str(info.value)  # the error is the first pack's
        assert overlapped == [True] and len(set(handed)) >= 2
        assert killed and not alive(killed[0])
        monkeypatch.undo()
        _assert_failed_cleanly(store, root, before)


def test_a_pack_refused_by_its_locations_while_a_later_pack_is_in_flight_fails_the_commit_cleanly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every shard write of the first pack fails (below the write quorum) once the next pack
    is with a worker: the commit fails with the StorageError a single pack gets, and the
    later pack is referenced by nothing."""
    from casckpt.errors import StorageError
    from casckpt.format import objectnames
    from casckpt.storage.local import LocalBlobStore

    root = tmp_path / "store"
    with open_store(root) as store:
        store.commit(make_state(0), run=RUN, step=0)
        before = shard_files(root)
        encoded: list[str] = []
        lock, later = threading.Lock(), threading.Event()
        overlapped: list[bool] = []
        encode, put_file = ecpool.EncodePool.encode, LocalBlobStore.put_file

        def encode_noting(pool: ecpool.EncodePool, pack: Path, pack_id: str, *args: Any) -> Any:
            with lock:
                encoded.append(pack_id)
                if len(encoded) > 1:
                    later.set()
            return encode(pool, pack, pack_id, *args)

        def refuse_the_first(blobs: LocalBlobStore, key: str, path: Path) -> None:
            if key.startswith(objectnames.pack_name(encoded[0]) + "."):
                overlapped.append(later.wait(60))
                raise StorageError(f"{key}: refused (injected)")
            put_file(blobs, key, path)

        monkeypatch.setattr(ecpool.EncodePool, "encode", encode_noting)
        monkeypatch.setattr(LocalBlobStore, "put_file", refuse_the_first)
        with pytest.raises(StorageError, match="durable on only 0 of 6 shards") as info:
            store.commit(make_state(1), run=RUN, step=1)
        assert "write quorum is 5" in str(info.value) and encoded[0] in str(info.value)
        assert overlapped and all(overlapped) and len(encoded) >= 2
        monkeypatch.undo()
        _assert_failed_cleanly(store, root, before)
