"""LocalBlobStore passes the BlobStore conformance suite, plain and behind the retry wrapper; it
refuses hostile files at once, reports full disks typed and leaves no temporary file behind."""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.errors import (
    BlobNotFoundError,
    InvalidArgumentError,
    OversizedObjectError,
    StorageError,
    StorageFullError,
    UnsafeObjectError,
)
from casckpt.storage import BlobStore, LocalBlobStore, RetryingBlobStore, local
from casckpt.testing import BlobStoreConformance


class TestLocalBlobStore(BlobStoreConformance):
    def make_store(self, tmp_path: Path) -> BlobStore:
        return LocalBlobStore(tmp_path / "blobs")

    def raw_get(self, store: BlobStore, key: str) -> bytes | None:
        assert isinstance(store, LocalBlobStore)
        path = store.root / key
        return path.read_bytes() if path.exists() else None


class TestRetryingLocalBlobStore(BlobStoreConformance):
    list_count = 10

    def make_store(self, tmp_path: Path) -> BlobStore:
        return RetryingBlobStore(LocalBlobStore(tmp_path / "blobs"), attempts=3)

    def raw_get(self, store: BlobStore, key: str) -> bytes | None:
        assert isinstance(store, RetryingBlobStore) and isinstance(store.inner, LocalBlobStore)
        path = store.inner.root / key
        return path.read_bytes() if path.exists() else None


def test_local_store_writes_no_leftovers_in_tmp(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    store.put("packs/aa/one", b"x" * 1000)
    staged = tmp_path / "staged"
    staged.write_bytes(b"y" * 1000)
    store.put_file("packs/aa/two", staged)
    tmp = tmp_path / "blobs" / "tmp"
    # only this store's (empty) scratch directory and its lock, while it is open
    assert [p.name for p in tmp.rglob("*") if p.is_file() and p.suffix != ".lock"] == []
    assert {i.key for i in store.list()} == {"packs/aa/one", "packs/aa/two"}
    store.close()
    assert list(tmp.iterdir()) == []


# -- hostile files: refused at once, never opened, never read ---------------------------

KEY = "packs/ab/" + "ab" * 32


@pytest.fixture
def no_hang() -> Iterator[None]:
    """Fail (instead of hanging the suite) if the test blocks for more than 10 s: SIGALRM
    interrupts a blocking open() of a FIFO in this, the main, thread."""

    def expire(signum: int, frame: object) -> None:  # not an OSError, which the store would wrap
        raise AssertionError("blocked for more than 10 s: a read hangs on a hostile file")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _every_read(store: LocalBlobStore, key: str) -> list[Callable[[], object]]:
    return [lambda: store.get(key), lambda: store.get(key, max_size=1 << 20),
            lambda: store.get_range(key, 0, 100), lambda: store.size(key),
            lambda: store.read_into(key, 0, [memoryview(bytearray(100))])]


def _hostile(root: Path, kind: str, outside: Path) -> None:
    path = root / KEY
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "outside-file":
        outside.write_bytes(b"valid-looking bytes outside the location")
        path.symlink_to(outside)
    elif kind == "socket":
        cwd = os.getcwd()
        os.chdir(path.parent)  # a socket's path is limited to ~100 bytes
        try:
            sock = socket.socket(socket.AF_UNIX)
            sock.bind(path.name)
            sock.close()
        finally:
            os.chdir(cwd)
    elif kind == "dir-symlinked-out":  # an intermediate directory leaves the root
        outside.mkdir()
        (outside / KEY.rsplit("/", 1)[1]).write_bytes(b"x" * 100)
        path.parent.rmdir()
        path.parent.symlink_to(outside, target_is_directory=True)


HOSTILE = ["fifo", "directory", "dev-zero", "outside-file", "socket", "dir-symlinked-out"]


@pytest.mark.parametrize("kind", HOSTILE)
def test_hostile_object_is_refused_at_once(tmp_path: Path, no_hang: None, kind: str) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    _hostile(store.root, kind, tmp_path / "outside")
    for read in _every_read(store, KEY):
        with pytest.raises(UnsafeObjectError) as refused:
            read()
        assert isinstance(refused.value, StorageError) and KEY in str(refused.value)
    assert [i.key for i in store.list()] == []  # skipped by listing, which does not block either
    store.put("packs/cd/" + "cd" * 32, b"fine")
    assert [i.key for i in store.list("packs/")] == ["packs/cd/" + "cd" * 32]
    if kind == "dir-symlinked-out":  # nor is anything written through the link
        with pytest.raises(UnsafeObjectError):
            store.put("packs/ab/" + "ef" * 32, b"out")
        assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == [KEY.rsplit("/", 1)[1]]
    if kind in ("fifo", "dev-zero", "outside-file", "socket"):  # a rewrite replaces it (repair)
        store.put(KEY, b"healed")
        assert store.get(KEY, max_size=6) == b"healed"


def test_fifo_is_never_opened(tmp_path: Path, no_hang: None) -> None:
    """Opening a FIFO has effects (a writer waiting on it wakes up); reads must not even open it."""
    store = LocalBlobStore(tmp_path / "blobs")
    _hostile(store.root, "fifo", tmp_path / "outside")
    for read in _every_read(store, KEY):
        with pytest.raises(UnsafeObjectError):
            read()
    with pytest.raises(OSError) as no_reader:  # a writer still finds no reader has ever opened it
        os.open(store.root / KEY, os.O_WRONLY | os.O_NONBLOCK)
    assert no_reader.value.errno == errno.ENXIO


def test_symlink_inside_the_location_is_followed(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    store.put("packs/cd/real", b"inside")
    (store.root / KEY).parent.mkdir(parents=True)
    (store.root / KEY).symlink_to(store.root / "packs/cd/real")
    assert store.get(KEY, max_size=6) == b"inside"
    assert store.size(KEY) == 6
    assert {i.key for i in store.list()} == {KEY, "packs/cd/real"}


def test_listing_skips_dangling_links_and_vanished_files(tmp_path: Path, no_hang: None) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    store.put("packs/aa/kept", b"1")
    (store.root / "packs/aa/dangling").symlink_to(store.root / "packs/aa/nothing")
    (store.root / "packs/aa/dangling-out").symlink_to(tmp_path / "nowhere")
    os.mkfifo(store.root / "packs/aa/fifo")
    (store.root / "packs/aa/UPPER name").write_bytes(b"not a key")
    assert [i.key for i in store.list()] == ["packs/aa/kept"]
    with pytest.raises(BlobNotFoundError):
        store.get("packs/aa/dangling")
    assert store.size("packs/aa/dangling") is None
    with pytest.raises(UnsafeObjectError):
        store.get("packs/aa/dangling-out")


def test_oversized_object_is_refused_before_it_is_read(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    store.put(KEY, b"x" * 100)
    os.truncate(store.root / KEY, 1 << 30)  # a sparse gigabyte: reading it would cost 1 GiB
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(OversizedObjectError) as refused:
        store.get(KEY, max_size=100)
    assert "1073741824" in str(refused.value) and "100" in str(refused.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB
    assert store.get_range(KEY, 0, 100) == b"x" * 100  # ranges stay bounded by their length


# -- full disks -----------------------------------------------------------------------------


def _leftover_parts(store: LocalBlobStore) -> list[Path]:
    return [p for p in (store.root / "tmp").rglob("*") if p.is_file() and p.suffix != ".lock"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_full_disk_on_put_is_typed_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      code: int) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    real_write = local._write_all

    def half_then_full(fd: int, data: bytes | memoryview) -> None:
        real_write(fd, memoryview(data)[: len(data) // 2])  # some bytes did land
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(local, "_write_all", half_then_full)
    with pytest.raises(StorageFullError) as full:
        store.put(KEY, b"y" * 50_000)
    assert isinstance(full.value, OSError) and isinstance(full.value, StorageError)
    assert full.value.location == str(store.root) and full.value.needed == 50_000
    assert str(store.root) in str(full.value) and "50000 bytes" in str(full.value)
    assert store.size(KEY) is None and not (store.root / KEY).exists()
    assert _leftover_parts(store) == []
    monkeypatch.setattr(local, "_write_all", real_write)
    store.put(KEY, b"y" * 50_000)  # room again: the same key goes in whole
    assert store.get(KEY) == b"y" * 50_000


def test_other_write_errors_are_not_called_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalBlobStore(tmp_path / "blobs")

    def broken(fd: int, data: bytes | memoryview) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local, "_write_all", broken)
    with pytest.raises(StorageError) as failed:
        store.put(KEY, b"z")
    assert not isinstance(failed.value, StorageFullError)
    assert _leftover_parts(store) == []


def _cross_device(monkeypatch: pytest.MonkeyPatch, scratch: Path) -> None:
    """os.replace of a file from outside ``scratch`` fails as across file systems."""
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        if scratch not in Path(src).parents:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr(local.os, "replace", replace)


def test_put_file_across_file_systems_never_shows_a_partial_object(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    staged = tmp_path / "staged.pack"
    staged.write_bytes(b"p" * 100_000)
    _cross_device(monkeypatch, store.root / "tmp")
    real_write = local._write_all
    written = []

    def fill_up(fd: int, data: bytes | memoryview) -> None:
        real_write(fd, data)
        written.append(len(data))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "_write_all", fill_up)
    with pytest.raises(StorageFullError) as full:
        store.put_file(KEY, staged)
    assert written and full.value.needed == 100_000
    assert not (store.root / KEY).exists() and _leftover_parts(store) == []
    assert staged.read_bytes() == b"p" * 100_000  # the caller still has it
    monkeypatch.setattr(local, "_write_all", real_write)
    store.put_file(KEY, staged)
    assert store.get(KEY) == b"p" * 100_000 and not staged.exists()


# -- the temporary directory --------------------------------------------------------------


def test_tmp_is_made_again_when_removed_under_an_open_store(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    store.put("packs/aa/one", b"1")
    shutil.rmtree(store.root / "tmp")
    store.put("packs/aa/two", b"2")
    for child in list(store.root.iterdir()):  # the location wiped, its directory kept
        shutil.rmtree(child)
    store.put("packs/aa/three", b"3")
    assert [i.key for i in store.list()] == ["packs/aa/three"]
    store.close()
    assert list((store.root / "tmp").iterdir()) == []


def test_a_vanished_location_directory_is_not_made_again(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "mnt" / "disk")
    store.put("packs/aa/one", b"1")
    shutil.rmtree(store.root)  # the disk is gone: writing must not land on what lies beneath
    with pytest.raises(StorageError, match="is gone"):
        store.put("packs/aa/two", b"2")
    assert not store.root.exists()
    store.close()


def test_reclaim_temp_spares_a_live_store_and_takes_a_dead_ones(tmp_path: Path) -> None:
    live, other = LocalBlobStore(tmp_path / "blobs"), LocalBlobStore(tmp_path / "blobs")
    live.put("packs/aa/one", b"1")
    other.put("packs/aa/two", b"2")
    scratch = live._scratch.path()
    (scratch / "in-flight.part").write_bytes(b"w" * 10)
    assert other.reclaim_temp().files == 0  # another store in this process is alive
    assert (scratch / "in-flight.part").exists()
    os.close(live._scratch._lock_fd or -1)  # as if the process died: its lock is released
    live._scratch._lock_fd = None
    done = other.reclaim_temp()
    assert (done.files, done.nbytes) == (1, 10) and not scratch.exists()
    assert other.get("packs/aa/one") == b"1"  # objects are never touched
    other.close()


def test_put_file_into_a_vanished_location_or_through_an_outside_link_is_refused_typed(
        tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "disk")
    staged = tmp_path / "staged.pack"
    staged.write_bytes(b"s")
    (tmp_path / "elsewhere").mkdir()
    (store.root / "packs").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(UnsafeObjectError):
        store.put_file(KEY, staged)
    assert staged.exists() and list((tmp_path / "elsewhere").iterdir()) == []
    shutil.rmtree(store.root)
    with pytest.raises(StorageError, match="is gone"):
        store.put_file(KEY, staged)
    assert not store.root.exists()


@pytest.mark.parametrize("url", ["file://relblobs/sub", "file://otherhost/tmp/x"])
def test_a_file_url_naming_a_host_or_a_relative_path_is_refused_before_anything_is_written(
        tmp_path: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``file://dir/x`` parses as host ``dir``, path ``/x``: taken as it was, a store's packs
    went to ``/x``. It is refused, naming the fix, and the store's directory stays empty."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="file:///absolute/dir"):
        casckpt.open(tmp_path / "s", blobs=url)
    with pytest.raises(InvalidArgumentError, match="file:///absolute/dir"):
        casckpt.open(tmp_path / "t", blobs=[str(tmp_path / "ok"), {"url": url, "name": "b"}])
    assert not any(tmp_path.iterdir())


def test_a_file_url_on_localhost_names_this_hosts_directory(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s", blobs=f"file://localhost{tmp_path / 'blobs'}") as store:
        store.commit({"w": torch.ones(3)}, run="r", step=0)
        assert [loc.url for loc in store.locations.list()] == [(tmp_path / "blobs").as_uri()]
    assert any((tmp_path / "blobs").rglob("*"))
