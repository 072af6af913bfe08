"""Erasure coding in worker processes (casckpt.storage.ecpool, casckpt.storage.ecworker).

The worker writes each shard object as a file; these tests hold it to the
in-process code byte for byte, check that every failure comes back typed,
and kill workers mid-encode.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from casckpt.errors import CasckptError, EncodeWorkerError, InvalidArgumentError, StorageError
from casckpt.format.shard import SHARD_HEADER_SIZE, decode_shard_header, payload_checksum
from casckpt.storage import ecpool
from casckpt.storage.ecpool import EncodedPack, EncodePool, WorkersUnavailableError
from casckpt.storage.erasure import DEFAULT_ALGORITHM, ErasureCode

PACK_ID = "5a" * 32


@pytest.fixture(scope="module")
def pool() -> Iterator[EncodePool]:
    shared = EncodePool(1)
    yield shared
    shared.close()


def _pack(directory: Path, data: bytes) -> tuple[Path, list[Path]]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "p.pack"
    path.write_bytes(data)
    return path, [directory / f"p.pack.s{i}" for i in range(32)]


def _exited(pid: int) -> bool:
    """The process has exited (a zombie until its parent reaps it), or is gone (Linux)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(1, 300_000), k=st.integers(1, 10), m=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1))
def test_worker_shards_are_byte_identical_to_the_in_process_code(
        pool: EncodePool, tmp_path_factory: pytest.TempPathFactory, size: int, k: int, m: int,
        seed: int) -> None:
    data = (seed.to_bytes(4, "little") * (size // 4 + 1))[:size] if seed % 3 else os.urandom(size)
    pack, out = _pack(tmp_path_factory.mktemp("ec"), data)
    encoded = pool.encode(pack, PACK_ID, size, k, m, DEFAULT_ALGORITHM, out[: k + m])
    stripe, offset, shards = ErasureCode(k, m).shards(PACK_ID, data)
    assert (encoded.stripe, encoded.offset) == (stripe, offset)
    expected = list(shards)
    assert [s.index for s in encoded.shards] == list(range(k + m))
    for got, want in zip(encoded.shards, expected, strict=True):
        on_disk = got.path.read_bytes()
        assert on_disk == want.header + want.fragment
        assert (got.size, got.checksum) == (len(on_disk), want.checksum)
        header = decode_shard_header(on_disk, "test")
        assert (header.pack_id, header.index, header.k, header.m) == (PACK_ID, got.index, k, m)
        assert payload_checksum(on_disk[len(want.header):]) == got.checksum
    assert pack.read_bytes() == data  # the worker reads the pack; removing it is the caller's job


def _data(encoded: EncodedPack, k: int) -> bytes:
    """The pack bytes the data shard files carry (the code is systematic)."""
    start = SHARD_HEADER_SIZE + encoded.offset
    return b"".join(f.path.read_bytes()[start : start + encoded.stripe] for f in encoded.shards[:k])


def test_the_data_shards_carry_the_pack_bytes_at_their_offset(pool: EncodePool, tmp_path: Path) -> None:
    data = os.urandom((1 << 20) + 3)
    pack, out = _pack(tmp_path, data)
    encoded = pool.encode(pack, PACK_ID, len(data), 4, 2, DEFAULT_ALGORITHM, out[:6])
    assert _data(encoded, 4)[: len(data)] == data


def test_failures_come_back_typed_and_leave_no_shard_files(pool: EncodePool, tmp_path: Path) -> None:
    data = os.urandom(50_000)
    pack, out = _pack(tmp_path, data)
    with pytest.raises(StorageError, match="holds 50000 bytes, not 50001"):
        pool.encode(pack, PACK_ID, len(data) + 1, 4, 2, DEFAULT_ALGORITHM, out[:6])
    with pytest.raises(StorageError, match="cannot read the staging pack"):
        pool.encode(tmp_path / "missing", PACK_ID, len(data), 4, 2, DEFAULT_ALGORITHM, out[:6])
    with pytest.raises(InvalidArgumentError, match="unavailable"):
        pool.encode(pack, PACK_ID, len(data), 4, 2, "no_such_code", out[:6])
    out[3].write_bytes(b"in the way")  # a shard file is never overwritten
    with pytest.raises(StorageError, match="staging shard"):
        pool.encode(pack, PACK_ID, len(data), 4, 2, DEFAULT_ALGORITHM, out[:6])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pack", "p.pack.s3"]
    assert out[3].read_bytes() == b"in the way"
    out[3].unlink()
    encoded = pool.encode(pack, PACK_ID, len(data), 4, 2, DEFAULT_ALGORITHM, out[:6])  # still serving
    assert len(encoded.shards) == 6


def _kill_after_sending(monkeypatch: pytest.MonkeyPatch, nth: int = 1) -> list[int]:
    """SIGKILL the worker right after the ``nth`` request reaches it (while it encodes)."""
    killed: list[int] = []
    send = ecpool._Worker.send
    calls = 0

    def send_then_kill(self: Any, request: dict[str, Any]) -> None:
        nonlocal calls
        send(self, request)
        calls += 1
        if calls == nth:
            os.kill(self.pid, signal.SIGKILL)
            killed.append(self.pid)

    monkeypatch.setattr(ecpool._Worker, "send", send_then_kill)
    return killed


def test_a_worker_killed_mid_encode_is_a_typed_error_and_a_fresh_one_takes_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(8 << 20)
    pack, out = _pack(tmp_path, data)
    pool = EncodePool(1)
    try:
        killed = _kill_after_sending(monkeypatch)
        with pytest.raises(EncodeWorkerError) as info:
            pool.encode(pack, PACK_ID, len(data), 4, 2, DEFAULT_ALGORITHM, out[:6])
        assert isinstance(info.value, CasckptError) and isinstance(info.value, OSError)
        message = str(info.value)
        assert f"pid {killed[0]}" in message and "SIGKILL" in message and PACK_ID in message
        assert "commit again" in message
        assert not _alive(killed[0])  # reaped, not a zombie
        assert pool.pids() == []
        for path in out[:6]:  # what the dead worker may have written: the caller removes it
            path.unlink(missing_ok=True)
        encoded = pool.encode(pack, PACK_ID, len(data), 4, 2, DEFAULT_ALGORITHM, out[:6])
        assert _data(encoded, 4)[: len(data)] == data
        assert pool.pids() and pool.pids()[0] != killed[0]
    finally:
        pool.close()


def test_a_worker_that_died_while_idle_is_replaced_without_an_error(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    pack, out = _pack(tmp_path, data)
    pool = EncodePool(1)
    try:
        pool.encode(pack, PACK_ID, len(data), 2, 1, DEFAULT_ALGORITHM, out[:3])
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not _exited(pid) and time.monotonic() < deadline:  # dead, not yet reaped
            time.sleep(0.01)
        encoded = pool.encode(pack, PACK_ID, len(data), 2, 1, DEFAULT_ALGORITHM, out[3:6])
        assert _data(encoded, 2)[: len(data)] == data
        assert pool.pids() != [pid]
    finally:
        pool.close()


def test_workers_start_on_first_use_and_stop_when_the_pool_closes(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    pack, out = _pack(tmp_path, data)
    pool = EncodePool(2)
    assert pool.pids() == []
    pool.encode(pack, PACK_ID, len(data), 2, 1, DEFAULT_ALGORITHM, out[:3])
    (pid,) = pool.pids()
    pool.warm()  # one is running: warm starts no other
    assert pool.pids() == [pid]
    pool.warm(5)  # two packs (or more) to encode at once: a second starts, up to the pool's size
    pool.warm(5)
    pids = pool.pids()
    assert len(pids) == 2 and pid in pids
    pool.close()
    assert not any(_alive(p) for p in pids)
    with pytest.raises(StorageError, match="closed"):
        pool.encode(pack, PACK_ID, len(data), 2, 1, DEFAULT_ALGORITHM, out[3:6])


def test_a_worker_that_cannot_start_is_reported_as_unavailable(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(10_000)
    pack, out = _pack(tmp_path, data)
    pool = EncodePool(1)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    pool.warm()  # never raises
    with pytest.raises(WorkersUnavailableError, match="cannot start"):
        pool.encode(pack, PACK_ID, len(data), 2, 1, DEFAULT_ALGORITHM, out[:3])
    assert isinstance(WorkersUnavailableError("x"), EncodeWorkerError)
    pool.close()


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(InvalidArgumentError):
        EncodePool(0)


def test_a_foreign_program_as_the_worker_is_reported_as_unavailable(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    echo = shutil.which("echo")
    if echo is None:
        pytest.skip("needs echo")
    data = os.urandom(10_000)
    pack, out = _pack(tmp_path, data)
    pool = EncodePool(1)
    monkeypatch.setattr(sys, "executable", echo)  # prints its arguments: not a worker's greeting
    with pytest.raises(WorkersUnavailableError, match="exited as it started"):
        pool.encode(pack, PACK_ID, len(data), 2, 1, DEFAULT_ALGORITHM, out[:3])
    pool.close()
