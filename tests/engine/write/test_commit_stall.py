"""What a background commit does on the caller's thread: no catalog write (its lease begins on
the worker, once the snapshot is taken)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import casckpt
from casckpt.testing.internals import internals

N = 1 << 16  # fp32: 256 KiB per tensor


def test_a_background_commit_writes_nothing_to_the_catalog_before_it_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"a": torch.randn(N)}
    with casckpt.open(tmp_path / "s") as store:
        store.commit(state, run="r", step=1)
        catalog = internals(store).catalog
        writers: list[str] = []
        real = catalog.write

        def write(*args: Any, **kwargs: Any) -> Any:
            writers.append(threading.current_thread().name)
            return real(*args, **kwargs)

        monkeypatch.setattr(catalog, "write", write)
        state["a"].add_(1.0)
        handle = store.commit(state, run="r", step=2, block=False)
        on_caller = list(writers)
        handle.wait()
        assert on_caller == []
        assert "casckpt-commit" in writers and threading.current_thread().name not in writers
        assert torch.equal(store.restore("r@2")["a"], state["a"])
