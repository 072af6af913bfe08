"""The manifest object is written beside a commit's chunks, under its lease: the version is
never visible before it is durable, and a failed commit writes nothing after its lease ends."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.engine.write import packer as packer_module
from casckpt.errors import StorageFullError
from casckpt.storage import local


def _state(seed: int) -> dict[str, Any]:
    return {"w": torch.randn(64 * 1024, generator=torch.Generator().manual_seed(seed))}


def _open(root: Path) -> casckpt.Store:
    return casckpt.open(root, chunk_size=16 << 10, pack_size=128 << 10, workers=2)


class GatedManifests:
    """Manifest object writes wait for :attr:`go` once :attr:`entered` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered, self.go, self.done = threading.Event(), threading.Event(), threading.Event()
        real = local.LocalBlobStore.put

        def put(blobs: local.LocalBlobStore, key: str, data: bytes | memoryview) -> None:
            if key.startswith("manifests/"):
                self.entered.set()
                self.go.wait(60)
                real(blobs, key, data)
                self.done.set()
                return
            real(blobs, key, data)

        monkeypatch.setattr(local.LocalBlobStore, "put", put)


def test_a_version_is_not_visible_until_its_manifest_object_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    with _open(root) as store:
        store.commit(_state(0), run="r", step=0)
        gate = GatedManifests(monkeypatch)
        outcome: list[object] = []
        committer = threading.Thread(target=lambda: outcome.append(store.commit(_state(1), run="r", step=1)))
        committer.start()
        assert gate.entered.wait(60), "the commit never wrote its manifest"
        committer.join(1.0)  # time for it to publish, were it not waiting for the manifest
        with casckpt.open(root, create=False) as reader:  # the chunks may be written; not visible
            assert [v.step for v in reader.log("r")] == [0]
        gate.go.set()
        committer.join(60)
        assert outcome and gate.done.is_set()
        assert sorted(v.step for v in store.log("r")) == [0, 1]
        assert store.ops.check(read_data=True).ok


class _FullFile:
    """A staging file on a full disk; ``failed`` is set by its first write."""

    def __init__(self, path: Path, failed: threading.Event) -> None:
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close()
        self._failed = failed

    def write(self, data: bytes | memoryview) -> int:
        self._failed.set()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def close(self) -> None:
        self._file.close()


def test_a_failed_commit_waits_for_its_manifest_write_before_its_lease_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "store"
    with _open(root) as store:
        store.commit(_state(0), run="r", step=0)
        gate, failed, raised = GatedManifests(monkeypatch), threading.Event(), threading.Event()
        monkeypatch.setattr(packer_module, "open", lambda path, mode: _FullFile(Path(path), failed),
                            raising=False)

        def release() -> None:  # the manifest write goes on once the packer failed and the commit
            failed.wait(60)     # raised -- or, as it must not raise first, a second later
            raised.wait(1.0)
            gate.go.set()

        releaser = threading.Thread(target=release)
        releaser.start()
        with pytest.raises(StorageFullError):
            store.commit(_state(1), run="r", step=1)
        written = gate.done.is_set()
        raised.set()
        releaser.join(60)
        assert written, "the commit ended (and its lease with it) while its manifest was being written"
        monkeypatch.undo()
        assert [v.step for v in store.log("r")] == [0]
        store.gc(grace=0)  # the failed commit's manifest is tombstoned: gc may remove it
        assert store.ops.check(read_data=True).ok
        store.commit(_state(1), run="r", step=1)
        assert sorted(v.step for v in store.log("r")) == [0, 1]
