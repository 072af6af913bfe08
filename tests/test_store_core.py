"""The engine of an open store is built on first use (issue 32): an open that only queries
the catalog starts no thread and builds no pool; the first commit, restore or pack read
builds it once, whichever thread asks first; close releases it (joining a background
commit's worker) and no engine is built after close."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import casckpt
from casckpt.errors import InvalidArgumentError
from casckpt.testing.internals import internals

RUN = "lazy"


class _Threads:
    """casckpt's threads started since this was made (another test's, left running, are not)."""

    def __init__(self) -> None:
        self.before = set(threading.enumerate())

    def started(self) -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("casckpt") and t not in self.before]


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    threads = _Threads()
    with casckpt.open(root) as store:
        store.commit({"w": torch.arange(8, dtype=torch.float32), "step": 0}, run=RUN, step=0)
    assert threads.started() == []  # close joined every thread the commit started
    return root


def test_queries_build_no_engine_and_start_no_thread(store_dir: Path) -> None:
    threads = _Threads()
    store = casckpt.open(store_dir, create=False)
    assert [v.step for v in store.log(RUN)] == [0]
    assert [r.name for r in store.runs()] == [RUN]
    assert store.show(f"{RUN}@0").version.step == 0
    assert store.pending_commits() == []
    store.wait_commits()  # nothing committed through this handle: nothing to wait for
    assert internals(store).core.started_committer is None
    assert threads.started() == []
    store.close()
    assert internals(store).core.started_committer is None
    assert threads.started() == []


def test_the_first_restore_builds_the_engine_and_close_releases_it(store_dir: Path) -> None:
    threads = _Threads()
    store = casckpt.open(store_dir, create=False)
    back = store.restore(f"{RUN}@0")
    assert torch.equal(back["w"], torch.arange(8, dtype=torch.float32))
    assert internals(store).core.started_committer is not None
    store.close()
    assert threads.started() == []


def test_close_joins_a_background_commit(store_dir: Path) -> None:
    threads = _Threads()
    state = {"w": torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))}
    store = casckpt.open(store_dir, create=False)
    handle = store.commit(state, run=RUN, step=1, block=False)
    assert "casckpt-commit" in [t.name for t in threads.started()]  # the worker the engine started
    store.close()  # finishes the commit first, then joins the worker
    assert handle.done()
    assert threads.started() == []
    with casckpt.open(store_dir, create=False) as again:
        assert torch.equal(again.restore(handle.wait())["w"], state["w"])
        again.ops.check()


def test_threads_racing_to_the_engine_share_one(store_dir: Path) -> None:
    threads = _Threads()
    store = casckpt.open(store_dir, create=False)
    core = internals(store).core
    start = threading.Barrier(8)
    seen: list[object] = []

    def first_use() -> None:
        start.wait()
        seen.append(core.ctx)

    racers = [threading.Thread(target=first_use) for _ in range(8)]
    for t in racers:
        t.start()
    for t in racers:
        t.join()
    assert len(seen) == 8 and all(ctx is seen[0] for ctx in seen)
    assert core.committer is core.started_committer
    store.close()
    assert threads.started() == []


def test_no_engine_is_built_after_close(store_dir: Path) -> None:
    threads = _Threads()
    store = casckpt.open(store_dir, create=False)
    store.close()
    with pytest.raises(InvalidArgumentError, match="closed"):
        _ = internals(store).core.ctx
    assert internals(store).core.started_committer is None
    assert threads.started() == []
