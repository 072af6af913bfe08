"""A commit that finds no room fails with StorageFullError, publishes nothing, and leaves nothing.

The file-size limit is real (``RLIMIT_FSIZE`` in a child process, which must
get EFBIG, not be killed by SIGXFSZ); a full disk or quota is injected at
the write boundary (``storage/local.py``'s ``_write_all``, the packer's
``open``), where the OS cannot be made to fail on demand.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from doubles import ForkedPython

import casckpt
from casckpt.engine.write import packer as packer_module
from casckpt.errors import StorageError, StorageFullError
from casckpt.storage import local

LIMITED = r"""
import json, resource, signal, sys
import torch
import casckpt

root = sys.argv[1]
store = casckpt.open(root, chunk_size=64 << 10, workers=2)
store.commit({"w": torch.randn(1000)}, run="r", step=0)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
state = {"w": torch.randn(4 << 20, generator=torch.Generator().manual_seed(1))}  # 16 MiB, raw
out = {"sigxfsz_ignored": signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN, "error": None}
resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, hard))
try:
    store.commit(state, run="r", step=1)
except Exception as exc:
    out.update(error=[c.__name__ for c in type(exc).__mro__], message=str(exc),
               location=getattr(exc, "location", None), needed=getattr(exc, "needed", None))
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
out["steps"] = [v.step for v in store.log("r")]
out["problems"] = [p.detail for p in store.ops.check(read_data=True).problems]
store.commit(state, run="r", step=1)  # no limit now: the same commit goes through
out["after"] = [v.step for v in store.log("r")]
store.close()
print(json.dumps(out))
"""


def _leftovers(root: Path) -> list[str]:
    """Files under the store's staging and tmp directories (lock files of open stores aside)."""
    found = []
    for base in (root / "cache" / "staging", root / "tmp"):
        found += [str(p) for p in base.rglob("*") if p.is_file() and p.suffix != ".lock"]
    return found


def test_file_size_limit_fails_the_commit_typed_and_leaves_nothing(
        tmp_path: Path, forked_python: ForkedPython) -> None:
    root = tmp_path / "store"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = forked_python.run(["-c", LIMITED, str(root)], env=env, timeout=300)
    assert done.returncode == 0, f"the committer died ({done.returncode}):\n{done.stderr[-3000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["sigxfsz_ignored"], "Python no longer ignores SIGXFSZ: a file-size limit would kill"
    assert out["error"] is not None, "the commit went through the file-size limit"
    assert {"StorageFullError", "StorageError", "OSError"} <= set(out["error"]), out
    staging = root / "cache" / "staging"
    assert Path(out["location"]).parent == staging and str(staging) in out["message"]
    assert out["needed"] >= 4 << 20 and "File too large" in out["message"]
    assert out["steps"] == [0], "a version became visible"
    assert out["problems"] == []
    assert sorted(out["after"]) == [0, 1]
    assert _leftovers(root) == []


def _state(seed: int) -> dict[str, Any]:
    return {"w": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(seed))}


def _open(root: Path, **kwargs: Any) -> casckpt.Store:
    return casckpt.open(root, chunk_size=16 << 10, pack_size=128 << 10, workers=2, **kwargs)


class FullDisk:
    """Between :meth:`start` and :meth:`stop`, every local object write finds the disk full
    after writing half of its bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tried: list[int] = []  # the sizes of the writes refused
        self._monkeypatch = monkeypatch

    def start(self) -> None:
        real = local._write_all

        def full(fd: int, data: bytes | memoryview) -> None:
            self.tried.append(len(data))
            real(fd, memoryview(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        self._monkeypatch.setattr(local, "_write_all", full)

    def stop(self) -> None:
        self._monkeypatch.undo()


@pytest.fixture
def full_location(monkeypatch: pytest.MonkeyPatch) -> FullDisk:
    return FullDisk(monkeypatch)


def test_full_location_fails_the_commit_at_the_manifest(tmp_path: Path, full_location: FullDisk) -> None:
    root = tmp_path / "store"
    with _open(root) as store:
        store.commit(_state(0), run="r", step=0)
    full_location.start()  # packs are renamed into place; the manifest is the first object written
    with _open(root) as store:
        with pytest.raises(StorageFullError) as full:
            store.commit(_state(1), run="r", step=1)
        assert full.value.location is not None and str(root) in full.value.location
        assert full.value.needed in full_location.tried and str(root) in str(full.value)
        assert "casckpt location add" in str(full.value)
        assert [v.step for v in store.log("r")] == [0]
        assert _leftovers(root) == []
        assert store.ops.check(read_data=True).ok
        full_location.stop()
        store.commit(_state(1), run="r", step=1)
        assert sorted(v.step for v in store.log("r")) == [0, 1]


def test_full_locations_of_a_replicated_store_fail_the_pack_typed(tmp_path: Path,
                                                                  full_location: FullDisk) -> None:
    root = tmp_path / "store"
    with _open(root, blobs=["blobs/d0", "blobs/d1"], redundancy="replicate:2") as store:
        full_location.start()  # copies are written from memory, through temporary files
        with pytest.raises(StorageFullError) as full:
            store.commit(_state(0), run="r", step=0)
        for d in ("d0", "d1"):  # both copies were refused for want of room; both are named
            assert d in str(full.value.location)
        assert full.value.needed in full_location.tried
        assert store.runs() == []
        for d in ("d0", "d1"):
            tmp = root / "blobs" / d / "tmp"
            assert [p for p in tmp.rglob("*") if p.is_file() and p.suffix != ".lock"] == []
        assert store.ops.check().ok


class _FillingFile:
    """A staging file on a disk with ``room`` bytes left: writes past it fail with ENOSPC."""

    def __init__(self, path: Path, room: int) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._room = room

    def write(self, data: bytes | memoryview) -> int:
        if len(data) > self._room:
            self._file.write(memoryview(data)[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._file.write(data)

    def close(self) -> None:
        self._file.close()


def test_full_staging_disk_fails_the_commit_typed_and_drops_the_staging_pack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    opened: list[Path] = []

    def filling_open(path: Path, mode: str) -> _FillingFile:
        opened.append(Path(path))
        return _FillingFile(Path(path), room=60_000)

    with _open(root) as store:
        monkeypatch.setattr(packer_module, "open", filling_open, raising=False)
        with pytest.raises(StorageFullError) as full:
            store.commit(_state(0), run="r", step=0)
        assert opened and full.value.location == str(opened[0].parent)
        assert "staging" in str(full.value) and "cache=" in str(full.value)
        assert full.value.needed is not None and full.value.needed > 60_000
        assert isinstance(full.value, StorageError) and isinstance(full.value, OSError)
        assert not any(p.exists() for p in opened) and _leftovers(root) == []
        assert store.runs() == []
        monkeypatch.undo()
        store.commit(_state(0), run="r", step=0)
        assert [v.step for v in store.log("r")] == [0]
        assert store.ops.check(read_data=True).ok
