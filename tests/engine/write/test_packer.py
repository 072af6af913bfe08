"""How deep a commit's pack pipeline runs, and what it may hold meanwhile.

A packer keeps at most ``upload_workers`` packs in flight (sealed, not yet stored and
recorded) beside the one filling; an erasure-coded store encodes those packs side by side,
one worker process each where it has twice as many cores. So a commit's staging
directory never holds more than ``upload_workers + 1`` packs, and no more than
``upload_workers`` packs are with the coders at once -- and, with four cores, two are.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.engine.packlayer.packwrite import PackWriter
from casckpt.storage import ecpool
from casckpt.testing.internals import internals


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(200_000, generator=g) for i in range(4)}  # 3.2 MB: ~12 packs


def test_a_commit_holds_at_most_upload_workers_packs_in_flight_and_encodes_them_side_by_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CASCKPT_UPLOAD_WORKERS", raising=False)  # the default, 2, is what is counted
    coders = min(2, max(1, (os.cpu_count() or 2) // 2))  # workers: upload_workers, half the cores
    lock, two = threading.Lock(), threading.Event()
    now = {"writing": 0, "encoding": 0}
    peak = {"writing": 0, "encoding": 0, "staged": 0}
    write, ask = PackWriter.write, ecpool._Worker.ask

    def enter(what: str) -> None:
        with lock:
            now[what] += 1
            peak[what] = max(peak[what], now[what])

    def leave(what: str) -> None:
        with lock:
            now[what] -= 1

    def counting_write(self: PackWriter, pack_id: str, path: Path, size: int, *args: Any) -> Any:
        enter("writing")
        with lock:  # the packs on the staging disk: in flight, and the one filling
            peak["staged"] = max(peak["staged"], len(list(path.parent.glob("*.pack"))))
        try:
            return write(self, pack_id, path, size, *args)
        finally:
            leave("writing")

    def counting_ask(worker: Any, request: dict[str, Any]) -> dict[str, Any]:
        enter("encoding")
        if now["encoding"] > 1:
            two.set()
        if coders > 1:
            two.wait(30)  # the first pack waits to see a second one with another worker
        try:
            return ask(worker, request)  # type: ignore[no-any-return]
        finally:
            leave("encoding")

    monkeypatch.setattr(PackWriter, "write", counting_write)
    monkeypatch.setattr(ecpool._Worker, "ask", counting_ask)
    state = _state()
    with casckpt.open(tmp_path / "s", blobs=[str(tmp_path / f"d{i}") for i in range(6)],
                      redundancy="ec:4+2", chunk_size=64 << 10, pack_size=256 << 10, workers=2) as store:
        limit = internals(store).context.config.upload_workers
        version = store.commit(state, run="r", step=1)
        restored = store.restore(version.id)
        assert all(torch.equal(restored[k], v) for k, v in state.items())
        assert store.ops.check(read_data=True).ok
        assert store.ops.stats().packs >= 2 * limit + 2  # deep enough to fill the pipeline
    assert limit == 2 and peak["encoding"] == coders  # with 4 cores, two packs at the coders at once
    assert peak["writing"] <= limit
    assert 2 <= peak["staged"] <= limit + 1
