"""Background commits (``commit(block=False)``): same versions, loud failures, bounded memory.

- A background commit produces exactly the version a blocking one does
  (tensor rows, digests, new/logical/stored bytes, restores), even when the
  caller mutates its tensors in place as soon as ``commit`` returns and
  several commits are queued back to back; parents chain in commit order and
  dedup counts across commits still in flight.
- A failure in background work is raised by ``wait()`` (or, unseen, by the
  next commit / ``wait_commits()`` / ``close()`` as BackgroundCommitError)
  and leaves no visible version; the store stays consistent.
- Backpressure: staged copies never exceed ``commit_memory``, pending commits
  never exceed ``max_pending_commits``; "block" waits (no deadlock), "raise"
  refuses without losing anything; a commit bigger than the budget is written
  in the foreground.
- ``close()`` finishes pending commits, reports unseen failures after
  releasing everything; the context manager never masks an exception.
- A SIGKILL with commits pending leaves a consistent store.

Writes can be held (a gate) or made to fail (ENOSPC) by :class:`FaultyBlobs`,
a blob store wrapper passed to :func:`casckpt.open`.
"""

from __future__ import annotations

import copy
import errno
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from doubles import ForkedPython, WriteHookStore
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

import casckpt
import casckpt.engine.write.background as background
from casckpt import CommitHandle
from casckpt.catalog import schema
from casckpt.errors import (
    BackgroundCommitError,
    CatalogError,
    CommitBackpressureError,
    CommitTimeoutError,
    RefNotFoundError,
    StorageError,
    VersionExistsError,
)
from casckpt.storage import BlobStore
from casckpt.testing.internals import internals

CHUNK = 4096
ELEMS = CHUNK // 4  # float32 elements per chunk
WAIT = 30.0  # seconds: any wait longer than this is a hang

CHILD = Path(__file__).resolve().parents[2] / "helpers" / "bg_crash_child.py"


class FaultyBlobs(WriteHookStore):
    """A LocalBlobStore whose writes (``put``, ``put_file``) can be held or made to fail.

    - ``gate``: cleared, every write waits until it is set again (``held`` is
      set once a write is waiting).
    - ``failing``: the next N writes fail with ENOSPC (-1: every write).
    """

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()
        self.failing = 0
        self.failures = 0
        self._lock = threading.Lock()

    def before_write(self, key: str) -> None:
        if not self.gate.is_set():
            self.held.set()
        if not self.gate.wait(2 * WAIT):
            raise StorageError(f"the test never opened the gate for {key}")
        with self._lock:
            if self.failing == 0:
                return
            self.failing -= self.failing > 0
            self.failures += 1
        cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise StorageError(f"cannot write {key} under {self.inner.root}: {cause}") from cause


class Env:
    """One store directory, its FaultyBlobs, and every Store opened on it (closed at teardown)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = FaultyBlobs(root / "blobs")
        assert isinstance(self.blobs, BlobStore)  # what casckpt.open(blobs=...) accepts
        self.stores: list[casckpt.Store] = []

    def open(self, **kwargs: Any) -> casckpt.Store:
        kwargs.setdefault("blobs", self.blobs)
        store = casckpt.open(self.root / "store", chunk_size=CHUNK, pack_size=16 * CHUNK, workers=2,
                             **kwargs)
        self.stores.append(store)
        return store

    def reopen(self) -> casckpt.Store:
        """The store as another process would open it: the plain blob location, no faults."""
        store = casckpt.open(self.root / "store", create=False, chunk_size=CHUNK, workers=2)
        self.stores.append(store)
        return store

    def teardown(self) -> None:
        self.blobs.failing = 0
        self.blobs.gate.set()
        for store in self.stores:
            try:
                store.close()
            except BackgroundCommitError:
                pass


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    environment = Env(tmp_path)
    yield environment
    environment.teardown()


# --- states and comparisons -----------------------------------------------------------------


def _noise(seed: int, chunks: int) -> torch.Tensor:
    return torch.randn(chunks * ELEMS, generator=torch.Generator().manual_seed(seed))


def _state(seed: int = 1) -> dict[str, Any]:
    return {
        "model": {"w": _noise(seed, 4), "b": _noise(seed + 1, 2)},
        "optim": {"m": _noise(seed + 2, 3), "count": 0},
    }


def _tensors(tree: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}.{key}" if prefix else str(key))


def assert_same(got: Any, want: Any, path: str = "<root>") -> None:
    """Same structure and types; tensors bit for bit."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert got.numpy().tobytes() == want.numpy().tobytes(), f"{path}: bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            assert_same(got[key], want[key], f"{path}.{key}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def expected_new_bytes(states: Sequence[Any]) -> list[int]:
    """What each commit of ``states`` must write: the bytes of chunks no earlier commit had."""
    seen: set[bytes] = set()
    out = []
    for state in states:
        fresh: set[bytes] = set()
        for _, tensor in _tensors(state):
            raw = tensor.numpy().tobytes()
            fresh.update(raw[i : i + CHUNK] for i in range(0, len(raw), CHUNK))
        out.append(sum(len(c) for c in fresh - seen))
        seen |= fresh
    return out


def _settled(handle: CommitHandle, timeout: float = WAIT) -> None:
    """Wait until ``handle`` is done WITHOUT looking at its outcome (which would report it)."""
    deadline = time.monotonic() + timeout
    while not handle.done():
        assert time.monotonic() < deadline, f"{handle!r} never finished"
        time.sleep(0.005)


def _until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.005)


def _steps(store: casckpt.Store, run: str = "r") -> list[int]:
    if run not in {r.name for r in store.runs()}:
        return []
    return [v.step for v in store.log(run, order="asc")]


def _leases(store: casckpt.Store) -> int:
    with internals(store).catalog.read() as conn:
        return int(conn.execute(select(func.count()).select_from(schema.leases)).scalar_one())


def _assert_chain(store: casckpt.Store, ids: Sequence[str], run: str = "r") -> None:
    """``run``'s versions are exactly ``ids`` in step order, each the parent of the next."""
    versions = store.log(run, order="asc")
    assert [v.id for v in versions] == list(ids)
    assert [v.parent for v in versions[1:]] == [v.id for v in versions[:-1]]


def _commit_thread(target: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def _join(thread: threading.Thread, errors: list[BaseException]) -> None:
    thread.join(WAIT)
    assert not thread.is_alive(), "the committing thread is stuck (deadlock?)"
    if errors:
        raise errors[0]


# --- 1. background versions are the blocking versions ---------------------------------------


Mutation = Callable[[dict[str, Any]], None]


def _set_chunk(key: str, chunk: int, value: float) -> Mutation:
    def mutate(state: dict[str, Any]) -> None:
        tensor = state["model"][key] if key in state["model"] else state["optim"][key]
        tensor[chunk * ELEMS : (chunk + 1) * ELEMS : 7] = value
    return mutate


SCRIPT: list[Mutation] = [  # applied right after commit i returns
    lambda s: s["model"]["w"].add_(1.0),  # every chunk of w
    _set_chunk("b", 1, 7.0),  # one chunk of b
    lambda s: None,  # nothing: the next commit writes nothing
    lambda s: s["optim"]["m"].zero_(),  # three equal chunks: one written
    lambda s: s["optim"].update(count=5),  # a plain value only
    lambda s: s["model"]["b"].zero_(),  # zero chunks are held already (by m): nothing new
    _set_chunk("w", 2, -3.0),
    lambda s: None,
]


def _commit_both(blocking: casckpt.Store, background: casckpt.Store, mutations: Sequence[Mutation],
                 state: dict[str, Any], run: str = "r",
                 ) -> tuple[list[casckpt.Version], list[CommitHandle], list[dict[str, Any]]]:
    """Commit ``state`` to both stores, then mutate it; again for each mutation."""
    twin = copy.deepcopy(state)
    versions, handles, expected = [], [], []
    for step, mutate in enumerate(mutations):
        versions.append(blocking.commit(twin, run=run, step=step, metrics={"loss": 1 / (step + 1)}))
        handles.append(background.commit(state, run=run, step=step, block=False,
                                         metrics={"loss": 1 / (step + 1)}))
        assert (handles[-1].run, handles[-1].step) == (run, step)
        expected.append(copy.deepcopy(state))
        mutate(state)  # the training loop goes on at once
        mutate(twin)
    return versions, handles, expected


def _assert_equivalent(blocking: casckpt.Store, background: casckpt.Store,
                       versions: Sequence[casckpt.Version], handles: Sequence[CommitHandle],
                       expected: Sequence[dict[str, Any]], run: str = "r") -> None:
    done = [h.wait(WAIT) for h in handles]
    assert [v.id for v in done] == [h.id for h in handles]
    _assert_chain(background, [h.id for h in handles], run)
    _assert_chain(blocking, [v.id for v in versions], run)
    oracle = expected_new_bytes(expected)
    for a, b, want, new in zip(versions, done, expected, oracle, strict=True):
        assert background.resolve(b.id) == b
        assert blocking.show(a.id).tensors == background.show(b.id).tensors
        assert (a.new_bytes, a.logical_bytes, a.stored_bytes) == (b.new_bytes, b.logical_bytes,
                                                                  b.stored_bytes)
        assert b.new_bytes == new, f"step {b.step}: wrote {b.new_bytes} bytes, {new} are new"
        assert_same(background.restore(b.id), want)
        assert_same(blocking.restore(a.id), want)
    assert blocking.ops.stats() == background.ops.stats()
    assert background.ops.check(read_data=True).ok


def test_background_versions_equal_blocking_ones_even_when_queued(env: Env, tmp_path: Path) -> None:
    blocking = casckpt.open(tmp_path / "blocking", chunk_size=CHUNK, pack_size=16 * CHUNK, workers=2)
    env.stores.append(blocking)
    background = env.open(max_pending_commits=len(SCRIPT))
    env.blobs.gate.clear()  # every commit queues behind the first: each snapshot stands alone
    versions, handles, expected = _commit_both(blocking, background, SCRIPT, _state())
    assert background.pending_commits() == handles
    assert not any(h.done() for h in handles)
    env.blobs.gate.set()
    _assert_equivalent(blocking, background, versions, handles, expected)
    new = [h.wait().new_bytes for h in handles]
    assert new == [9 * CHUNK, 4 * CHUNK, CHUNK, 0, CHUNK, 0, 0, CHUNK]  # dedup across queued commits
    # each queued commit holds a staging copy of the state, within the budget
    assert 0 < internals(background).committer.peak_staged <= internals(background).committer.memory


OP = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(["w", "b", "m"]), st.integers(1, 3)),
    st.tuples(st.just("set"), st.sampled_from(["w", "b", "m"]), st.integers(0, 3), st.integers(-2, 2)),
    st.tuples(st.just("zero"), st.sampled_from(["w", "b", "m"])),
)


def _apply(ops: Sequence[tuple[Any, ...]]) -> Mutation:
    def mutate(state: dict[str, Any]) -> None:
        tensors = {**state["model"], "m": state["optim"]["m"]}
        for op in ops:
            tensor = tensors[op[1]]
            if op[0] == "add":
                tensor.add_(float(op[2]))
            elif op[0] == "set":
                chunk = op[2] % (tensor.numel() // ELEMS)
                tensor[chunk * ELEMS + 3 : (chunk + 1) * ELEMS : 5] = float(op[3])
            else:
                tensor.zero_()
    return mutate


# each example opens two new stores: 4 examples in the default tier, 8 in the slow one
@pytest.mark.parametrize("examples", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_background_commits_snapshot_the_state_at_commit_time(examples: int) -> None:
    """Random in-place mutations right after each commit; held (all queued) or racing the worker."""

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(plan=st.lists(st.lists(OP, max_size=3), min_size=2, max_size=5), hold=st.booleans())
    def snapshots(plan: list[list[tuple[Any, ...]]], hold: bool) -> None:
        _snapshot_at_commit_time(plan, hold)

    snapshots()


def _snapshot_at_commit_time(plan: list[list[tuple[Any, ...]]], hold: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="casckpt-bg-") as tmp:
        root = Path(tmp)
        env = Env(root)
        try:
            blocking = casckpt.open(root / "blocking", chunk_size=CHUNK, pack_size=16 * CHUNK, workers=2)
            env.stores.append(blocking)
            background = env.open(max_pending_commits=len(plan))
            if hold:
                env.blobs.gate.clear()
            versions, handles, expected = _commit_both(blocking, background, [_apply(p) for p in plan],
                                                       _state(3))
            env.blobs.gate.set()
            _assert_equivalent(blocking, background, versions, handles, expected)
            for step, ops in enumerate(plan[:-1]):
                if not ops:  # nothing changed since the previous commit: nothing written
                    assert handles[step + 1].wait().new_bytes == 0
        finally:
            env.teardown()


# --- 2. failures surface, and leave no version ------------------------------------------------


def _assert_enospc(exc: BaseException | None) -> None:
    assert isinstance(exc, StorageError), repr(exc)
    assert "No space left on device" in str(exc)


@pytest.mark.parametrize("where", ["pack", "manifest"])
def test_failed_background_commit_raises_on_wait_and_leaves_no_version(env: Env, where: str) -> None:
    store = env.open()
    state = _state()
    first = store.commit(state, run="r", step=0)
    if where == "pack":
        state["model"]["w"].add_(1)  # new chunks: the pack upload fails
    # else: nothing new, only the manifest is written -- and that fails
    env.blobs.failing = -1
    handle = store.commit(state, run="r", step=1, block=False)
    with pytest.raises(StorageError, match="No space left on device"):
        handle.wait(WAIT)
    assert handle.done() and "failed" in repr(handle)
    _assert_enospc(handle.exception())
    with pytest.raises(StorageError):
        handle.result()  # still the same answer
    assert env.blobs.failures > 0
    assert _steps(store) == [0] and store.ops.stats().versions == 1
    with pytest.raises(RefNotFoundError):
        store.resolve(handle.id)
    assert store.ops.check(read_data=True).ok
    assert _leases(store) == 0

    env.blobs.failing = 0  # the disk has room again: the same step commits fine
    store.wait_commits()  # the failure was seen through its handle: nothing more to raise
    again = store.commit(state, run="r", step=1, block=False).wait(WAIT)
    assert again.parent == first.id
    assert_same(store.restore("r@1"), state)
    assert store.ops.check(read_data=True).ok


@pytest.mark.parametrize("then", ["blocking-commit", "background-commit", "wait_commits", "close"])
def test_unseen_failure_is_raised_by_the_next_call(env: Env, then: str) -> None:
    store = env.open()
    state = _state()
    store.commit(state, run="r", step=0)
    state["model"]["b"].add_(1)
    env.blobs.failing = -1
    handle = store.commit(state, run="r", step=1, block=False)
    _settled(handle)
    env.blobs.failing = 0
    calls: dict[str, Callable[[], object]] = {
        "blocking-commit": lambda: store.commit(state, run="r", step=2),
        "background-commit": lambda: store.commit(state, run="r", step=2, block=False),
        "wait_commits": lambda: store.wait_commits(WAIT),
        "close": store.close,
    }
    with pytest.raises(BackgroundCommitError, match="r@1") as info:
        calls[then]()
    _assert_enospc(info.value.__cause__)
    if then == "close":
        store = env.reopen()
    else:
        calls["wait_commits"]()  # raised once: reported now
    assert _steps(store) == [0]  # neither the failed commit nor the refused one is visible
    assert store.ops.check(read_data=True).ok
    store.commit(state, run="r", step=1, block=False).wait(WAIT)
    assert_same(store.restore("r@1"), state)
    assert _steps(store) == [0, 1]


def test_exception_counts_as_seen(env: Env) -> None:
    store = env.open()
    env.blobs.failing = -1
    handle = store.commit(_state(), run="r", step=0, block=False)
    _settled(handle)
    _assert_enospc(handle.exception())
    env.blobs.failing = 0
    store.commit(_state(), run="r", step=0)  # nothing unseen: no BackgroundCommitError
    store.close()


def test_commit_queued_behind_a_failed_one_still_stores_its_own_state(env: Env) -> None:
    """The second commit deduplicated against chunks the failed first one was to write:
    it writes them itself."""
    store = env.open(max_pending_commits=3)
    state = _state()
    store.commit(state, run="r", step=0)
    env.blobs.gate.clear()
    state["model"]["w"].add_(1)
    failed = store.commit(state, run="r", step=1, block=False)
    state["model"]["b"].add_(1)  # w as in step 1: its chunks are in flight with the first commit
    after = store.commit(state, run="r", step=2, block=False)
    expected = copy.deepcopy(state)
    state["model"]["w"].zero_()  # the caller moves on before either is written
    env.blobs.failing = 2  # the first commit's writes: its manifest and its only pack, side by side
    env.blobs.gate.set()
    with pytest.raises(StorageError, match="No space left on device"):
        failed.wait(WAIT)
    version = after.wait(WAIT)
    assert version.new_bytes == 6 * CHUNK  # w and b, all of them written by this commit
    assert _steps(store) == [0, 2]
    assert_same(store.restore("r@2"), expected)
    assert store.ops.check(read_data=True).ok


def test_a_commit_queued_behind_a_failed_one_names_it_as_parent(env: Env) -> None:
    """Documented: the parent is fixed at snapshot time (it is part of the version id), so a
    commit queued behind a failed one of its run names that never-visible version; its own
    data is complete and the lineage resumes from it."""
    store = env.open(max_pending_commits=3)
    state = _state()
    first = store.commit(state, run="r", step=0)
    env.blobs.gate.clear()
    state["model"]["w"].add_(1)
    failed = store.commit(state, run="r", step=1, block=False)
    after = store.commit(state, run="r", step=2, block=False)
    env.blobs.failing = 1
    env.blobs.gate.set()
    with pytest.raises(StorageError):
        failed.wait(WAIT)
    version = after.wait(WAIT)
    assert version.parent == failed.id != first.id
    with pytest.raises(RefNotFoundError):
        store.resolve(failed.id)
    assert_same(store.restore("r@2"), state)
    assert store.ops.check().ok


def test_same_step_in_flight_twice_is_refused_at_submit(env: Env) -> None:
    """A step in flight in this process is refused by ``commit`` itself; a step the catalog
    holds already is refused by the worker (no catalog read on the caller's thread): the
    handle raises it, and nothing is written."""
    store = env.open(max_pending_commits=4)
    state = _state()
    env.blobs.gate.clear()
    handle = store.commit(state, run="r", step=1, block=False)
    with pytest.raises(VersionExistsError, match="in flight"):
        store.commit(_state(9), run="r", step=1, block=False)
    store.commit(_state(9), run="other", step=1, block=False)  # another run may use the step
    env.blobs.gate.set()
    handle.wait(WAIT)
    store.wait_commits(WAIT)
    written = store.ops.stats()
    refused = store.commit(_state(9), run="r", step=1, block=False)
    with pytest.raises(VersionExistsError, match="already has a version at step 1"):
        refused.wait(WAIT)
    store.wait_commits(WAIT)  # reported through its handle: not raised again
    assert store.ops.stats() == written
    assert _steps(store) == [1] and _steps(store, "other") == [1]
    assert_same(store.restore("r@1"), state)
    assert _leases(store) == 0


def test_a_step_the_catalog_holds_is_raised_by_the_next_commit_if_nobody_waited(env: Env) -> None:
    store = env.open()
    store.commit(_state(), run="r", step=1)
    _settled(store.commit(_state(2), run="r", step=1, block=False))  # refused by the worker
    with pytest.raises(BackgroundCommitError, match="already has a version at step 1") as info:
        store.commit(_state(3), run="r", step=2, block=False)
    assert isinstance(info.value.__cause__, VersionExistsError)
    assert _steps(store) == [1]
    assert_same(store.restore("r@1"), _state())


def test_a_trusted_commit_queued_behind_a_refused_one_stores_what_it_staged(env: Env) -> None:
    """The worker refuses a step the catalog holds before hashing it. A trusted commit queued
    behind it vouches for its tensors since the refused commit's staging, whose ``w`` is not
    the parent's: the worker must hash ``w`` (the hint is ignored), not reuse the parent's
    chunk ids for it."""
    store = env.open(max_pending_commits=4)
    state = _state()
    store.commit(state, run="r", step=0, block=False, trust_versions=True).wait(WAIT)
    env.blobs.gate.clear()  # the worker stalls on another run's write: both commits queue behind it
    other = store.commit(_state(7), run="x", step=0, block=False)
    state["model"]["w"].add_(1)
    refused = store.commit(state, run="r", step=0, block=False, trust_versions=True)
    expected = copy.deepcopy(state)
    after = store.commit(state, run="r", step=1, block=False, trust_versions=True)
    _bump_all(state)
    env.blobs.gate.set()
    other.wait(WAIT)
    with pytest.raises(VersionExistsError):
        refused.wait(WAIT)
    version = after.wait(WAIT)
    assert version.parent == store.resolve("r@0").id
    assert_same(store.restore("r@1"), expected)
    assert store.ops.check(read_data=True).ok


def test_a_step_refused_by_the_worker_leaves_the_next_staging_correct(env: Env) -> None:
    """After a refused commit the staging of the run is not trusted: the next trusted commit
    copies every tensor, and a mutation after it returns stays out of its version."""
    store = env.open()
    state = _state()
    store.commit(state, run="r", step=0, block=False, trust_versions=True).wait(WAIT)
    state["model"]["b"].add_(1)
    with pytest.raises(VersionExistsError):
        store.commit(state, run="r", step=0, block=False, trust_versions=True).wait(WAIT)
    before = internals(store).committer.copied
    expected = copy.deepcopy(state)
    handle = store.commit(state, run="r", step=1, block=False, trust_versions=True)
    assert internals(store).committer.copied - before == sum(t.nbytes for _, t in _tensors(state))
    _bump_all(state)
    handle.wait(WAIT)
    assert_same(store.restore("r@1"), expected)


def test_step_published_meanwhile_by_another_process(env: Env) -> None:
    """Catalog side: the publishing transaction finds the step taken and refuses; the
    other writer's version stays."""
    store = env.open()
    store.commit(_state(), run="r", step=0)
    env.blobs.gate.clear()
    handle = store.commit(_state(5), run="r", step=1, block=False)
    other = casckpt.open(env.root / "store", create=False, chunk_size=CHUNK, workers=2)
    env.stores.append(other)
    theirs = other.commit(_state(6), run="r", step=1)
    env.blobs.gate.set()
    with pytest.raises(VersionExistsError):
        handle.wait(WAIT)
    assert store.resolve("r@1").id == theirs.id
    assert_same(store.restore("r@1"), _state(6))
    assert store.ops.check(read_data=True).ok


def test_publish_failure_in_the_catalog(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    store = env.open()
    state = _state()
    store.commit(state, run="r", step=0)
    before = store.ops.stats()
    calls = []

    def broken(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        raise CatalogError("the catalog went away")

    monkeypatch.setattr(internals(store).catalog, "add_version", broken)
    state["optim"]["m"].add_(1)
    handle = store.commit(state, run="r", step=1, block=False)
    with pytest.raises(CatalogError, match="went away"):
        handle.wait(WAIT)
    monkeypatch.undo()
    assert calls and _steps(store) == [0]
    assert store.ops.check(read_data=True).ok
    assert store.gc(grace=0).chunks_swept == 3 + 1  # orphans: its 3 chunks and its tree's root node
    assert store.ops.stats() == before
    store.commit(state, run="r", step=1, block=False).wait(WAIT)
    assert_same(store.restore("r@1"), state)
    assert store.ops.check(read_data=True).ok


# --- 3. backpressure ------------------------------------------------------------------------


BOUNDS = [
    pytest.param({"commit_memory": 4 * CHUNK, "max_pending_commits": 8}, id="memory-bound"),
    pytest.param({"max_pending_commits": 2}, id="count-bound"),
]


def _two_chunks(state: dict[str, Any], step: int) -> None:
    """Change two chunks of the 16-chunk tensor ``w``."""
    first = (2 * step) % 16
    state["w"][first * ELEMS : (first + 2) * ELEMS] += float(step)


@pytest.mark.parametrize("bounds", BOUNDS)
def test_block_waits_for_room_and_never_exceeds_the_bounds(env: Env, bounds: dict[str, int]) -> None:
    store = env.open(**bounds)
    memory, max_pending = internals(store).committer.memory, internals(store).committer.max_pending
    state = {"w": _noise(1, 16)}
    store.commit(state, run="r", step=0)
    handles: list[CommitHandle] = []
    expected: list[dict[str, Any]] = [copy.deepcopy(state)]
    seen_pending: list[int] = []

    def loop() -> None:
        for step in range(1, 25):
            _two_chunks(state, step)
            handles.append(store.commit(state, run="r", step=step, block=False))
            expected.append(copy.deepcopy(state))
            seen_pending.append(len(store.pending_commits()))

    env.blobs.gate.clear()
    thread, errors = _commit_thread(loop)
    _until(lambda: len(handles) == 2, "two commits are in flight")
    time.sleep(0.2)
    assert thread.is_alive() and len(handles) == 2, "the third commit did not wait for room"
    assert len(store.pending_commits()) == 2
    # over the budget, only the two changed chunks of each are copied; within it, each pending
    # commit holds a staging set of the whole state (the second made while the first is held)
    held = 4 * CHUNK if "commit_memory" in bounds else 2 * 16 * CHUNK
    assert internals(store).committer.peak_staged == held
    env.blobs.gate.set()
    _join(thread, errors)
    versions = [h.wait(WAIT) for h in handles]
    assert max(seen_pending) <= max_pending
    assert 0 < internals(store).committer.peak_staged <= memory
    assert all(v.new_bytes == 2 * CHUNK for v in versions)
    assert internals(store).committer.staged == 0
    for step, want in enumerate(expected):
        assert_same(store.restore(f"r@{step}"), want)
    _assert_chain(store, [store.resolve("r@0").id] + [h.id for h in handles])
    assert store.ops.check(read_data=True).ok


@pytest.mark.parametrize("bounds", BOUNDS)
def test_raise_refuses_beyond_the_bound_and_loses_nothing(env: Env, bounds: dict[str, int]) -> None:
    store = env.open(backpressure="raise", **bounds)
    state = {"w": _noise(1, 16)}
    store.commit(state, run="r", step=0)
    env.blobs.gate.clear()
    expected, handles = [copy.deepcopy(state)], []
    for step in (1, 2):
        _two_chunks(state, step)
        handles.append(store.commit(state, run="r", step=step, block=False))
        expected.append(copy.deepcopy(state))
    _two_chunks(state, 3)
    with pytest.raises(CommitBackpressureError, match="backpressure='block'"):
        store.commit(state, run="r", step=3, block=False)
    assert store.pending_commits() == handles
    env.blobs.gate.set()
    for handle in handles:
        handle.wait(WAIT)
    handles.append(store.commit(state, run="r", step=3, block=False))  # room again
    expected.append(copy.deepcopy(state))
    handles[-1].wait(WAIT)
    for step, want in enumerate(expected):
        assert_same(store.restore(f"r@{step}"), want)
    _assert_chain(store, [store.resolve("r@0").id] + [h.id for h in handles])
    assert _leases(store) == 0  # the refused commit gave its lease back
    assert store.ops.check(read_data=True).ok


def test_commit_bigger_than_the_budget_is_written_in_the_foreground(env: Env) -> None:
    store = env.open(commit_memory=2 * CHUNK)
    state = {"w": _noise(1, 16)}
    alone = store.commit(state, run="r", step=0, block=False)
    assert alone.done()  # 16 new chunks > the budget: written before commit returned
    assert store.pending_commits() == []
    state["w"].zero_()  # safe at once
    assert_same(store.restore("r@0"), {"w": _noise(1, 16)})

    state["w"].copy_(_noise(1, 16))
    state["w"][:ELEMS] = 1.0  # one new chunk: fits the budget, queued
    env.blobs.gate.clear()
    small = store.commit(state, run="r", step=1, block=False)
    expected = [copy.deepcopy(state)]
    state["w"].copy_(_noise(2, 16))  # 16 new chunks again
    big: list[CommitHandle] = []
    done_at_return: list[bool] = []

    def commit_big() -> None:
        big.append(store.commit(state, run="r", step=2, block=False))
        done_at_return.append(big[0].done())

    thread, errors = _commit_thread(commit_big)
    time.sleep(0.2)
    assert thread.is_alive(), "the foreground commit did not wait for the one before it"
    env.blobs.gate.set()
    _join(thread, errors)
    assert done_at_return == [True]
    expected.append(copy.deepcopy(state))
    state["w"].zero_()
    assert big[0].wait().parent == small.wait().id  # still in commit order
    assert internals(store).committer.peak_staged == CHUNK  # the big one copied nothing
    assert big[0].wait().new_bytes == 16 * CHUNK
    for step, want in zip((1, 2), expected, strict=True):
        assert_same(store.restore(f"r@{step}"), want)
    assert store.ops.check(read_data=True).ok


# --- 4. close() and the context manager ----------------------------------------------------


def test_close_finishes_pending_commits(env: Env) -> None:
    store = env.open(max_pending_commits=4)
    state = _state()
    env.blobs.gate.clear()
    handles, expected = [], []
    for step in range(3):
        handles.append(store.commit(state, run="r", step=step, block=False))
        expected.append(copy.deepcopy(state))
        state["model"]["w"][step * ELEMS] = 100.0 + step
    assert len(store.pending_commits()) == 3
    timer = threading.Timer(0.2, env.blobs.gate.set)
    timer.start()
    store.close()
    timer.join()
    assert all(h.done() and h.exception() is None for h in handles)
    reopened = env.reopen()
    _assert_chain(reopened, [h.id for h in handles])
    for step, want in enumerate(expected):
        assert_same(reopened.restore(f"r@{step}"), want)
    assert reopened.ops.check(read_data=True).ok


def _casckpt_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("casckpt")]


def test_close_reports_a_failed_pending_commit_and_still_releases_everything(env: Env) -> None:
    assert _casckpt_threads() == []
    store = env.open()
    store.commit(_state(), run="r", step=0)
    env.blobs.failing = -1
    store.commit(_state(2), run="r", step=1, block=False)
    with pytest.raises(BackgroundCommitError, match="r@1") as info:
        store.close()
    _assert_enospc(info.value.__cause__)
    assert _casckpt_threads() == []  # worker, hashing, upload and I/O pools all gone
    store.close()  # idempotent: reported once
    env.blobs.failing = 0
    reopened = env.reopen()
    assert _steps(reopened) == [0]
    reopened.commit(_state(2), run="r", step=1, block=False).wait(WAIT)
    assert_same(reopened.restore("r@1"), _state(2))
    assert reopened.ops.check(read_data=True).ok


def test_context_manager_does_not_mask_the_exception(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    env.blobs.failing = -1
    with caplog.at_level(logging.ERROR, logger="casckpt.store"):
        with pytest.raises(ValueError, match="boom") as info:
            with env.open() as store:
                store.commit(_state(), run="r", step=0, block=False)
                raise ValueError("boom")
    assert info.value.__context__ is None  # nothing was chained onto it either
    assert internals(store).closed
    assert any("r@0" in r.getMessage() and "ValueError" in r.getMessage() for r in caplog.records)
    env.blobs.failing = 0
    assert _steps(env.reopen()) == []


def test_context_manager_raises_an_unseen_failure_on_a_clean_exit(env: Env) -> None:
    env.blobs.failing = -1
    with pytest.raises(BackgroundCommitError, match="r@0"):
        with env.open() as store:
            store.commit(_state(), run="r", step=0, block=False)
    assert _casckpt_threads() == []


# --- 5. SIGKILL with commits pending --------------------------------------------------------


def _load_child() -> ModuleType:
    spec = importlib.util.spec_from_file_location("casckpt_tests_bg_crash_child", CHILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child = _load_child()


def test_sigkill_with_background_commits_pending(tmp_path: Path) -> None:
    env_vars = {k: v for k, v in os.environ.items() if not k.startswith("CASCKPT_")}
    proc = subprocess.Popen([sys.executable, str(CHILD), str(tmp_path), "40"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env_vars)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("submitted 6 "):
                break
        proc.kill()
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == -9, f"exit {proc.returncode}\n{lines}\n{err}"
    assert lines[-1].startswith("submitted 6 "), f"{lines}\n{err}"
    assert int(lines[-1].split()[2]) > 0, "no commit was pending when the process was killed"

    with casckpt.open(tmp_path / "store", create=False, chunk_size=child.CHUNK_SIZE) as store:
        assert store.ops.check().ok
        steps = _steps(store)
        assert steps == list(range(len(steps))) and len(steps) < 40, steps  # in commit order
        for step in steps:
            assert_same(store.restore(f"r@{step}"), child.expected(step))
        state = child.expected(39)
        store.commit(state, run="r", step=100, block=False).wait(WAIT)
        assert_same(store.restore("r@100"), state)
        store.gc(grace=0)
        report = store.ops.check(read_data=True)
        assert report.ok, report.problems
        assert _steps(store) == steps + [100]
        for step in steps:
            assert_same(store.restore(f"r@{step}"), child.expected(step))


# --- 6. timeouts ----------------------------------------------------------------------------


def test_wait_with_a_timeout(env: Env) -> None:
    store = env.open()
    env.blobs.gate.clear()
    handle = store.commit(_state(), run="r", step=0, block=False)
    assert env.blobs.held.wait(WAIT)
    started = time.monotonic()
    with pytest.raises(CommitTimeoutError, match="r@0"):
        handle.wait(timeout=0.1)
    with pytest.raises(TimeoutError):  # a builtin TimeoutError too
        store.wait_commits(timeout=0.1)
    assert time.monotonic() - started < 5
    assert not handle.done() and handle.exception() is None and "pending" in repr(handle)
    assert store.pending_commits() == [handle]
    env.blobs.gate.set()
    version = handle.wait(timeout=WAIT)  # the commit went on
    assert version.id == handle.id and version.step == 0
    store.wait_commits(timeout=WAIT)
    assert store.pending_commits() == []
    assert_same(store.restore("r@0"), _state())


# -- regressions from review ---------------------------------------------------------------


def test_a_snapshot_failing_after_admission_gives_its_budget_back(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.engine.write import commit as commit_engine

    real = commit_engine._copy
    calls = {"n": 0}

    def flaky(chunk: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("injected while copying")
        return real(chunk)

    with casckpt.open(tmp_path / "s", chunk_size=CHUNK, commit_memory=8 * CHUNK) as store:
        big = {"w": torch.randn(12 * ELEMS)}  # over the budget: hashed in place, new chunks copied
        store.commit(big, run="r", step=0)
        big["w"][: 4 * ELEMS] += 1
        monkeypatch.setattr(commit_engine, "_copy", flaky)
        with pytest.raises(MemoryError):
            store.commit(big, run="r", step=1, block=False)
        assert internals(store).committer.staged == 0 and _leases(store) == 0
        state = {"w": torch.randn(6 * ELEMS)}
        store.commit(state, run="r", step=2, block=False).wait(WAIT)  # would block forever before
        assert torch.equal(store.restore("r@2")["w"], state["w"])


def test_a_process_ending_without_close_finishes_its_background_commits(
        tmp_path: Path, forked_python: ForkedPython) -> None:
    script = f"""
import torch, casckpt
store = casckpt.open({str(tmp_path / "s")!r}, chunk_size={CHUNK})
store.commit({{"w": torch.arange(50_000, dtype=torch.float32)}}, run="r", step=0, block=False)
"""  # no close(): the interpreter exits with the commit pending
    done = forked_python.run(["-c", script], timeout=120)
    assert done.returncode == 0, done.stderr
    with casckpt.open(tmp_path / "s") as store:
        assert torch.equal(store.restore("r@0")["w"], torch.arange(50_000, dtype=torch.float32))


def test_a_process_ending_without_close_after_its_commits_finished_exits(
        tmp_path: Path, forked_python: ForkedPython) -> None:
    """The worker waits between commits (it is kept until close); an interpreter exiting
    with it idle, the store never closed, must not wait for it forever."""
    script = f"""
import torch, casckpt
store = casckpt.open({str(tmp_path / "s")!r}, chunk_size={CHUNK})
store.commit({{"w": torch.arange(50_000, dtype=torch.float32)}}, run="r", step=0, block=False).wait()
store.commit({{"w": torch.ones(50_000)}}, run="r", step=1, block=False).wait()
"""  # no close(): the worker is idle when the interpreter exits
    done = forked_python.run(["-c", script], timeout=120)
    assert done.returncode == 0, done.stderr
    with casckpt.open(tmp_path / "s") as store:
        assert [v.step for v in store.log("r", order="asc")] == [0, 1]


def test_the_worker_is_kept_between_commits_and_gone_after_close(env: Env) -> None:
    store = env.open()
    store.commit(_state(), run="r", step=0, block=False).wait(WAIT)
    workers = [t for t in _casckpt_threads() if t.name == "casckpt-commit"]
    assert len(workers) == 1
    store.commit(_state(2), run="r", step=1, block=False).wait(WAIT)
    assert [t for t in _casckpt_threads() if t.name == "casckpt-commit"] == workers
    store.close()
    assert not workers[0].is_alive()


def _pause_before_lease(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Hold background commits between their snapshot and their lease: ``reached`` is set
    there; they go on once ``go`` is set."""
    reached, go = threading.Event(), threading.Event()
    real = background.begin_lease

    def paused(catalog: object, version_id: str | None = None) -> str:
        reached.set()
        go.wait(30)
        return real(catalog, version_id)  # type: ignore[arg-type]

    monkeypatch.setattr(background, "begin_lease", paused)
    return reached, go


def test_unchanged_hint_after_the_parent_was_deleted_stores_the_state(tmp_path: Path) -> None:
    """Change hints: another handle deletes the run's newest version; this process's next
    ``unchanged=`` commit vouched for its tensors since ITS last commit, but the hint reused
    the older surviving version's chunk ids: the version silently stored stale bytes."""
    with casckpt.open(tmp_path / "s") as mine, casckpt.open(tmp_path / "s") as other:
        frozen = torch.arange(65536.0)
        mine.commit({"frozen": frozen, "w": torch.ones(65536)}, run="r", step=1)
        w = torch.full((65536,), 2.0)
        mine.commit({"frozen": frozen, "w": w}, run="r", step=2)
        other.delete("r@2")
        version = mine.commit({"frozen": frozen, "w": w}, run="r", step=3, unchanged="w")
        assert torch.equal(other.restore(version.id)["w"], w)


@pytest.mark.parametrize("mutate", [False, True])
def test_gc_between_a_background_snapshot_and_its_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        mutate: bool) -> None:
    """The lease now begins after the snapshot: another handle deletes the only version holding
    the chunks a queued background commit deduped against, and gc(grace=0) sweeps them before
    the lease. The commit must publish a version that restores bit-exact, rewritten from its
    staged copy -- also when the caller mutated the state meanwhile."""


    torch.manual_seed(0)
    a, b = torch.randn(200_000), torch.randn(1000)
    with casckpt.open(tmp_path / "s") as mine, casckpt.open(tmp_path / "s") as other:
        mine.commit({"a": a, "b": b}, run="r", step=1)
        mine.commit({"a": torch.randn(200_000), "b": b}, run="r", step=2)
        reached, go = _pause_before_lease(monkeypatch)
        state = {"a": a.clone(), "b": b}
        handle = mine.commit(state, run="r", step=3, block=False)
        assert reached.wait(30)
        if mutate:
            state["a"].add_(1.0)  # allowed: a background commit's snapshot is taken
        other.delete("r@1")
        assert other.gc(grace=0).chunks_swept > 0
        go.set()
        restored = other.restore(handle.wait().id)
        assert torch.equal(restored["a"], a) and torch.equal(restored["b"], b)
        other.gc(grace=0)
        assert other.ops.check(read_data=True).ok


def _blob_files(root: Path, kind: str) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and kind in p.parts)


def test_worker_killed_mid_encode_publishes_nothing_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Erasure-coding workers: SIGKILL the worker as it gets its second pack. The commit fails
    typed, no shard file of the dead worker is stored or left in staging, gc(grace=0) takes the
    packs stored before, and a new commit restores bit-exact."""
    import os
    import signal

    from casckpt.errors import EncodeWorkerError
    from casckpt.storage import ecpool

    locations = [str(tmp_path / f"loc{i}") for i in range(3)]
    torch.manual_seed(0)
    state = {"a": torch.randn(1 << 19), "b": torch.randn(1 << 18)}
    real, sent = ecpool._Worker.send, [0]

    def send_then_kill(worker: ecpool._Worker, request: dict[str, object]) -> None:
        sent[0] += 1
        if sent[0] == 2:  # stopped first: however loaded the machine, it never answers this one
            os.kill(worker.pid, signal.SIGSTOP)
        real(worker, request)
        if sent[0] == 2:
            os.kill(worker.pid, signal.SIGKILL)

    with casckpt.open(tmp_path / "s", blobs=locations, redundancy="ec:2+1", pack_size=1 << 20) as store:
        monkeypatch.setattr(ecpool._Worker, "send", send_then_kill)
        with pytest.raises(EncodeWorkerError):
            store.commit(state, run="r", step=1)
        monkeypatch.setattr(ecpool._Worker, "send", real)
        assert store.runs() == []
        assert not [p for p in (tmp_path / "s").rglob("*") if p.is_file() and ".s" in p.name
                    and "packs" not in p.parts]  # no staging shard left behind
        store.gc(grace=0)
        assert _blob_files(tmp_path, "packs") == []
        version = store.commit(state, run="r", step=1)
        restored = store.restore(version.id)
        assert all(torch.equal(restored[k], state[k]) for k in state)
        assert store.ops.check(read_data=True).ok


_CRASH = """
import os, signal, sys, torch, casckpt
import casckpt.engine.write.commit as ce
where = sys.argv[2]
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
if where == "publish":
    ce._publish = die           # packs, chunk rows and manifest written; lease held
else:
    ce.begin_lease = die        # between the snapshot and the lease: nothing written yet
with casckpt.open(sys.argv[1]) as store:
    torch.manual_seed(1)
    store.commit({"a": torch.randn(100_000), "b": torch.randn(5000)}, run="r", step=2)
"""


@pytest.mark.parametrize("where", ["lease", "publish"])
def test_commit_killed_around_its_lease_leaves_nothing_gc_misses(
        tmp_path: Path, where: str, forked_python: ForkedPython) -> None:
    """kill -9 a committing process between its snapshot and its lease, or with its lease held
    after its packs and manifest are written: nothing becomes visible, gc(grace=0) reaps the
    lease and takes every object of the dead commit, and the earlier version is intact."""

    root = tmp_path / "s"
    torch.manual_seed(0)
    state = {"a": torch.randn(100_000), "b": torch.randn(5000)}
    with casckpt.open(root) as store:
        store.commit(state, run="r", step=1)
    before = (_blob_files(root, "packs"), _blob_files(root, "manifests"))
    done = forked_python.run(["-c", _CRASH, str(root), where], timeout=120)
    assert done.returncode == -9, done.stderr[-2000:]
    with casckpt.open(root) as store:
        assert [v.step for v in store.log("r")] == [1]
        if where == "publish":
            assert _blob_files(root, "packs") != before[0]
        store.gc(grace=0)
        assert (_blob_files(root, "packs"), _blob_files(root, "manifests")) == before
        restored = store.restore("r@1")
        assert all(torch.equal(restored[k], state[k]) for k in state)
        assert store.ops.check(read_data=True).ok


def test_hinted_background_commit_whose_reused_chunks_gc_swept_fails_loudly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Change hints + lease after the snapshot: a queued hinted commit reuses its parent's chunk
    ids without reading them; another handle deletes the parent and gc(grace=0) sweeps them
    before the lease. Publishing must not make a version over chunks that are gone: it rewrites
    them from the state after checking they still hash to their ids, or fails typed."""


    torch.manual_seed(0)
    frozen, w = torch.randn(100_000), torch.randn(100_000)
    with casckpt.open(tmp_path / "s") as mine, casckpt.open(tmp_path / "s") as other:
        mine.commit({"frozen": torch.zeros(100_000), "w": torch.zeros(100_000)}, run="r", step=1)
        mine.commit({"frozen": frozen, "w": w}, run="r", step=2)
        reached, go = _pause_before_lease(monkeypatch)
        handle = mine.commit({"frozen": frozen, "w": w.add(1.0)}, run="r", step=3, block=False,
                             unchanged="frozen")
        assert reached.wait(30)
        other.delete("r@2")
        assert other.gc(grace=0).chunks_swept > 0
        go.set()
        try:
            version = handle.wait()
        except CatalogError as exc:
            assert "commit again" in str(exc)
            assert [v.step for v in other.log("r")] == [1]
        else:
            restored = other.restore(version.id)
            assert torch.equal(restored["frozen"], frozen) and torch.equal(restored["w"], w + 1.0)
        assert other.ops.check(read_data=True).ok


def _a_background_commit_fails(store: casckpt.Store, monkeypatch: pytest.MonkeyPatch,
                               state: dict[str, torch.Tensor], step: int) -> None:
    """Commit ``state`` of run ``r`` at ``step`` in the background through an injected catalog
    outage: the commit fails, its handle raises, and the real ``finish`` is back after."""
    import casckpt.engine.write.commit as commit_engine
    from casckpt.errors import CatalogUnavailableError

    real = commit_engine.finish

    def outage(*args: object, **kwargs: object) -> object:
        raise CatalogUnavailableError("the catalog is down (injected)")

    monkeypatch.setattr(commit_engine, "finish", outage)
    with pytest.raises(CatalogUnavailableError):
        store.commit(state, run="r", step=step, block=False).wait(WAIT)
    monkeypatch.setattr(commit_engine, "finish", real)


def test_unchanged_hint_after_a_failed_background_commit_stores_the_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Change hints: a background commit fails (a catalog outage is not even raised by the next
    commit); the next ``unchanged=`` commit's parent is then the version before the failed one,
    whose chunk ids hold older bytes of the tensor the caller vouches for."""
    w1, w2 = torch.ones(65536), torch.full((65536,), 2.0)
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"w": w1}, run="r", step=1)
        _a_background_commit_fails(store, monkeypatch, {"w": w2}, step=2)
        version = store.commit({"w": w2}, run="r", step=3, unchanged="w")
        assert torch.equal(store.restore(version.id)["w"], w2)


# -- host staging: the caller's thread copies, the worker hashes and writes ------------------


def _bump_all(state: dict[str, Any]) -> None:
    for _, tensor in _tensors(state):
        tensor.add_(1)


@pytest.mark.parametrize("memory", [None, 4 * CHUNK], ids=["staged", "over-budget"])
def test_a_mutation_after_commit_returns_never_shows_in_the_version(env: Env, memory: int | None) -> None:
    """``add_(1)`` on every tensor right after ``commit(block=False)`` returns: each version
    holds the state as it was at its call -- also for the 2nd and 3rd commits, made while the
    1st is still writing (the gate holds it), which need a second staging set, and for the
    4th, which reuses a set its earlier commit released. Over the budget (``commit_memory``
    smaller than the state) the state is hashed in place and its new chunks, more than the
    budget here, written in the caller's thread: same result (no gate: it would wait on it)."""
    store = env.open(max_pending_commits=4, **({} if memory is None else {"commit_memory": memory}))
    state = _state()
    expected, handles = [], []
    if memory is None:
        env.blobs.gate.clear()  # the worker hashes the first commit, then waits to write it
    for step in range(3):
        handles.append(store.commit(state, run="r", step=step, block=False))
        expected.append(copy.deepcopy(state))
        _bump_all(state)
    assert memory is not None or not any(h.done() for h in handles)
    env.blobs.gate.set()
    handles[-1].wait(WAIT)
    handles.append(store.commit(state, run="r", step=3, block=False))
    expected.append(copy.deepcopy(state))
    _bump_all(state)
    versions = [h.wait(WAIT) for h in handles]
    for step, want in enumerate(expected):
        assert_same(store.restore(f"r@{step}"), want)
    _assert_chain(store, [v.id for v in versions])
    committer = internals(store).committer
    assert committer.peak_staged <= committer.memory and committer.staged == 0
    if memory is None:  # the state fits: staged whole, in sets reused across commits
        size = sum(t.nbytes for _, t in _tensors(state))
        assert committer.copied == 4 * size
        assert committer.kept <= 3 * size  # three in flight at most; the fourth reused a set
    else:
        assert committer.copied == 0 and committer.kept == 0
    assert store.ops.check(read_data=True).ok


def test_the_handle_id_waits_for_the_worker_to_hash(env: Env) -> None:
    store = env.open()
    state = _state()
    env.blobs.gate.clear()
    handle = store.commit(state, run="r", step=0, block=False)
    assert "r@0" in repr(handle)
    version_id = handle.id  # the worker hashed it; the write is still held
    assert not handle.done()
    env.blobs.gate.set()
    assert handle.wait(WAIT).id == version_id


def test_staging_keeps_every_kind_of_leaf_as_a_blocking_commit_stores_it(env: Env, tmp_path: Path) -> None:
    """Tied tensors, views of one storage (a slice beside its base, a transpose), numpy arrays,
    empty and 0-d tensors, conj and neg views, several dtypes: a background commit plans the
    same extents and chunks as a blocking one, and restores the same state."""
    base = torch.arange(6 * ELEMS, dtype=torch.float32)
    tied = torch.randn(2 * ELEMS)
    state: dict[str, Any] = {
        "tied": {"a": tied, "b": tied},
        "views": {"base": base, "slice": base[ELEMS + 3 : 3 * ELEMS], "t": base.view(8, -1).t()},
        "np": {"arr": _noise(5, 2).numpy(), "small": torch.arange(5).numpy()},
        "odd": {"empty": torch.empty(0, 3), "scalar": torch.tensor(3.5), "i64": torch.arange(7),
                "bf16": torch.randn(ELEMS).to(torch.bfloat16),
                "conj": torch.randn(ELEMS, dtype=torch.complex64).conj(),
                "neg": torch._neg_view(torch.randn(ELEMS))},
        "plain": {"lr": 0.1, "keys": {3: (1, "x", None, b"\x00")}, "flag": True},
    }
    blocking = casckpt.open(tmp_path / "blocking", chunk_size=CHUNK, pack_size=16 * CHUNK, workers=2)
    env.stores.append(blocking)
    background = env.open()
    want = blocking.commit(state, run="r", step=0)
    got = background.commit(state, run="r", step=0, block=False).wait(WAIT)
    assert blocking.show(want.id).tensors == background.show(got.id).tensors  # same rows and chunks
    assert (got.new_bytes, got.stored_bytes) == (want.new_bytes, want.stored_bytes)
    restored = background.restore(got.id)
    assert restored["tied"]["a"].data_ptr() == restored["tied"]["b"].data_ptr()
    for path in ("views.slice", "views.t", "odd.conj", "odd.neg", "odd.bf16", "odd.scalar"):
        section, key = path.split(".")
        assert torch.equal(restored[section][key], state[section][key]), path
    assert (restored["np"]["arr"] == state["np"]["arr"]).all()
    assert restored["plain"] == state["plain"]


def test_staging_sets_stay_within_commit_memory(env: Env) -> None:
    """Room for two staged copies of the state: a third commit in flight waits for a set to be
    released (block) and is refused under backpressure='raise'; nothing is lost either way."""
    state = _state()
    size = sum(t.nbytes for _, t in _tensors(state))
    store = env.open(max_pending_commits=8, commit_memory=2 * size + CHUNK, backpressure="raise")
    env.blobs.gate.clear()
    first = store.commit(state, run="r", step=0, block=False)
    second = store.commit(state, run="r", step=1, block=False)
    with pytest.raises(CommitBackpressureError):
        store.commit(state, run="r", step=2, block=False)
    committer = internals(store).committer
    assert committer.staged == committer.kept == 2 * size
    env.blobs.gate.set()
    first.wait(WAIT)
    second.wait(WAIT)
    store.commit(state, run="r", step=2, block=False).wait(WAIT)  # reuses a released set
    committer = internals(store).committer
    assert committer.kept == 2 * size and committer.peak_staged <= committer.memory
    assert _steps(store) == [0, 1, 2]


def test_a_trusted_background_commit_copies_only_what_moved(env: Env) -> None:
    """``trust_versions``: the counters are read on the caller's thread; a tensor not written
    since the run's last commit is not copied when its staged bytes are still current."""
    store = env.open()
    state = _state()
    store.commit(state, run="r", step=0, block=False, trust_versions=True).wait(WAIT)
    before = internals(store).committer.copied
    state["model"]["b"].add_(1)
    expected = copy.deepcopy(state)
    handle = store.commit(state, run="r", step=1, block=False, trust_versions=True)
    assert internals(store).committer.copied - before == state["model"]["b"].nbytes
    _bump_all(state)
    handle.wait(WAIT)
    assert_same(store.restore("r@1"), expected)
    assert store.ops.check(read_data=True).ok


def test_a_blocking_commit_between_staged_ones_makes_the_next_copy_what_it_declared(env: Env) -> None:
    """``unchanged=`` promises the parent's bytes. After a blocking commit (which read the live
    state, not the staging), the staging of a tensor changed before it is stale: the next
    background commit copies it even though it is declared unchanged. The small tensor is
    packed with others, so the commit hashes it (a hint never reuses packed tensors): a skipped
    copy would store the stale staged bytes."""
    store = env.open()
    state = {"small": torch.arange(64, dtype=torch.float32), "w": _noise(3, 4)}
    store.commit(state, run="r", step=0, block=False).wait(WAIT)
    state["small"].add_(1)
    store.commit(state, run="r", step=1)
    expected = copy.deepcopy(state)
    handle = store.commit(state, run="r", step=2, block=False, unchanged="*")
    _bump_all(state)
    handle.wait(WAIT)
    assert_same(store.restore("r@2"), expected)


def test_unchanged_hint_in_the_background_after_a_failed_commit_stores_the_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The next background commit declares ``w`` unchanged after one that failed. A promise
    spares no copy (it is about the parent version, not the staging), and the parent is the
    version before the failed one, not the run's last commit in this process, so the worker
    ignores the promise and hashes the staged bytes: ``w`` as it was at the call."""
    w1, w2 = torch.ones(65536), torch.full((65536,), 2.0)
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"w": w1}, run="r", step=1)
        state = {"w": w2}
        _a_background_commit_fails(store, monkeypatch, state, step=2)
        copied = internals(store).committer.copied
        handle = store.commit(state, run="r", step=3, block=False, unchanged="w")
        assert internals(store).committer.copied == copied + w2.nbytes  # copied all the same
        w2.add_(1)  # after the call: not in the version
        version = handle.wait(WAIT)
        assert version.parent == store.resolve("r@1").id
        assert torch.equal(store.restore(version.id)["w"], torch.full((65536,), 2.0))
        assert store.ops.check(read_data=True).ok


def test_a_wrong_shape_declared_unchanged_fails_the_background_commit(env: Env) -> None:
    from casckpt.errors import ChangeHintError

    store = env.open()
    store.commit({"w": torch.ones(64)}, run="r", step=0, block=False).wait(WAIT)
    handle = store.commit({"w": torch.ones(65)}, run="r", step=1, block=False, unchanged="w")
    with pytest.raises(ChangeHintError, match="declared unchanged"):
        handle.wait(WAIT)
    assert _steps(store) == [0] and _leases(store) == 0
    state = {"w": torch.ones(65)}
    store.commit(state, run="r", step=1, block=False).wait(WAIT)
    assert_same(store.restore("r@1"), state)


def test_a_commit_failing_before_its_hash_leaves_the_worker_running(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker hashes a staged commit; when that fails (the catalog is down as it looks up
    the parent) the handle reports it and the next commits still run."""
    import casckpt.engine.write.commit as commit_engine
    from casckpt.errors import CatalogUnavailableError

    store = env.open()
    real = commit_engine.parent_of

    def down(*args: Any, **kwargs: Any) -> Any:
        raise CatalogUnavailableError("the catalog is down (injected)")

    monkeypatch.setattr(commit_engine, "parent_of", down)
    failed = store.commit(_state(), run="r", step=0, block=False)
    with pytest.raises(CatalogUnavailableError):
        failed.wait(WAIT)
    with pytest.raises(CatalogUnavailableError):
        _ = failed.id  # never hashed: the id says why
    monkeypatch.setattr(commit_engine, "parent_of", real)
    state = _state()
    store.commit(state, run="r", step=0, block=False).wait(WAIT)
    store.commit(state, run="r", step=1)  # a blocking commit drains the queue: it must not hang
    assert _steps(store) == [0, 1]


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("n", [8, 4096], ids=["packed", "own-extent"])
@pytest.mark.parametrize("flip", ["conj-then-plain", "plain-then-conj", "neg-then-plain"])
def test_a_conjugate_or_negative_bit_that_flips_under_trusted_counters_is_stored_as_read(
        tmp_path: Path, block: bool, n: int, flip: str) -> None:
    """A view's conjugate or negative bit moves no version counter: the counters' key holds the
    bits, and reused staging views must read as the tensor does now, not as it did."""
    x = torch.complex(torch.randn(n), torch.randn(n)) if "conj" in flip else torch.randn(n)
    lazy = x.conj() if "conj" in flip else torch._neg_view(x)
    first, second = (x, lazy) if flip == "plain-then-conj" else (lazy, x)
    with casckpt.open(tmp_path / "s", cache=tmp_path / "c", chunk_size=4096, pack_size=16 * 4096) as store:
        for step, value in ((1, first), (2, second)):
            handle = store.commit({"w": value}, run="r", step=step, block=block, trust_versions=True)
            if not block:
                handle.wait(WAIT)
        got = store.restore("r@2")["w"]
        assert torch.equal(got, second.resolve_conj().resolve_neg())
        assert not got.is_conj() and not got.is_neg()


@pytest.mark.parametrize("trust", [False, True])
def test_a_taken_step_of_a_state_over_the_staging_budget_is_refused_at_submit(
        tmp_path: Path, trust: bool) -> None:
    """A state over ``commit_memory`` is snapshotted on the caller's thread and names itself the
    parent of the commits queued behind it: a taken step is refused there, before it hashes, so
    the next commit's parent is a version that exists."""
    with casckpt.open(tmp_path / "s", cache=tmp_path / "c", chunk_size=4096, pack_size=16 * 4096,
                      commit_memory=8 * 4096) as store:
        state = {"w": torch.randn(16 * 1024), "b": torch.randn(100)}
        v0 = store.commit(state, run="r", step=0, block=False, trust_versions=trust).wait(WAIT)
        state["b"].add_(1)
        with pytest.raises(VersionExistsError):
            store.commit(state, run="r", step=0, block=False, trust_versions=trust)
        expected = {k: v.clone() for k, v in state.items()}
        v1 = store.commit(state, run="r", step=1, block=False, trust_versions=trust).wait(WAIT)
        assert v1.parent == v0.id
        got = store.restore("r@1")
        assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_the_collector_runs_while_a_background_commit_waits_for_room(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caller's section pauses the cyclic collector over its own work only: a caller
    blocked on backpressure (or writing an over-budget state) leaves it running."""
    import gc

    import casckpt.engine.write.commit as commit_engine

    gate = threading.Event()
    real = commit_engine.finish

    def held(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(WAIT)
        return real(*args, **kwargs)

    monkeypatch.setattr(commit_engine, "finish", held)
    with casckpt.open(tmp_path / "s", cache=tmp_path / "c", chunk_size=4096,
                      commit_memory=1 << 20, max_pending_commits=8) as store:
        state = {"w": torch.randn(200_000)}  # 800 KB: one staging set fits, a second does not
        first = store.commit(state, run="r", step=0, block=False)
        state["w"].add_(1)
        waiting = threading.Thread(target=lambda: store.commit(state, run="r", step=1, block=False))
        waiting.start()
        try:
            time.sleep(1.0)
            assert waiting.is_alive()  # still waiting for the first commit's staging
            assert gc.isenabled()
        finally:
            gate.set()
            waiting.join(WAIT)
        first.wait(WAIT)
        store.wait_commits(WAIT)
