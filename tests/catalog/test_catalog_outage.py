"""A PostgreSQL catalog that crashes and comes back while a training loop commits.

A dedicated server (its own data directory and socket, so tests sharing the
session's server never see it go down) is crashed with an immediate shutdown
and restarted on the same socket three times while a thread commits every
~50 ms, alternating blocking and background commits. Defended:

- every acknowledged version is visible and restores bit-exact; no failed
  version is visible unless its error is ``in_doubt`` (the connection was lost
  as the database committed it), and then it restores bit-exact too; the store
  checks clean;
- every failure is a ``CatalogUnavailableError`` (never a raw SQLAlchemy or
  psycopg error, never a BackgroundCommitError re-raising an outage);
- the first commit started 1 s or more after the database is back succeeds.

Also: a background commit in flight rides out a restart shorter than the
retry budget, and one lost to a longer outage does not fail the next commit;
an unreachable server (no socket, refused, silent) fails fast with
``CatalogUnavailableError``; a publishing transaction retried after its
COMMIT's answer was lost is recognised, and only a publish lost while committing
is flagged ``in_doubt``; SQLite's errors keep their type.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from doubles import WriteHookStore
from sqlalchemy import event

import casckpt
from casckpt import CommitHandle
from casckpt.catalog import Catalog
from casckpt.catalog.database import CONNECT_TIMEOUT_S
from casckpt.catalog.gc import visible_ids
from casckpt.errors import CatalogError, CatalogUnavailableError, VersionExistsError
from casckpt.testing.postgres import CrashablePostgres

CHUNK = 4096
RETRY_S = "0.3"  # the catalog's retry budget in this test: shorter than each outage
UP_S, DOWN_S = 3.0, 0.8  # up 3 s between outages (a loaded machine commits in it), down >= 0.8 s
OUTAGES = 2  # the second proves recovery is not a one-off; a third asserted the same again


@pytest.fixture(scope="module")
def crashable_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CrashablePostgres]:
    pytest.importorskip("pgserver")
    server = CrashablePostgres(tmp_path_factory.mktemp("pgcrash") / "pg")
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Attempt:
    """One commit of the loop: when it started, how, and how it ended."""

    step: int
    block: bool
    started: float
    weights: torch.Tensor
    version_id: str | None = None
    error: BaseException | None = None
    handle: CommitHandle | None = None


@dataclass
class Loop:
    """A training loop committing every ~50 ms until stopped."""

    store: Any
    attempts: list[Attempt] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        weights = torch.randn(16 * 1024, generator=torch.Generator().manual_seed(0))
        step = 0
        while not self.stop.is_set():
            step += 1
            weights[(step * 1024) % weights.numel():][:1024] += 1.0  # one chunk changes
            attempt = Attempt(step, block=step % 2 == 1, started=time.monotonic(),
                              weights=weights.clone())
            try:
                if attempt.block:
                    attempt.version_id = self.store.commit(
                        {"w": weights, "step": step}, run="train", step=step).id
                else:
                    attempt.handle = self.store.commit(
                        {"w": weights, "step": step}, run="train", step=step, block=False)
            except Exception as exc:  # noqa: BLE001 - judged by the test
                attempt.error = exc
            self.attempts.append(attempt)
            time.sleep(0.05)

    def settle(self) -> None:
        """Wait for every background commit and record how it ended."""
        for attempt in self.attempts:
            if attempt.handle is not None:
                try:
                    attempt.version_id = attempt.handle.wait(timeout=60).id
                except Exception as exc:  # noqa: BLE001 - judged by the test
                    attempt.error = exc


def test_commits_survive_catalog_crashes(crashable_pg: CrashablePostgres, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASCKPT_CATALOG_RETRY_S", RETRY_S)
    store = casckpt.open(tmp_path / "store", catalog=crashable_pg.new_database(), chunk_size=CHUNK)
    loop = Loop(store)
    committer = threading.Thread(target=loop.run, name="training-loop")
    outages: list[tuple[float, float]] = []  # (went down, back up)
    committer.start()
    try:
        for _ in range(OUTAGES):
            time.sleep(UP_S)
            down = time.monotonic()
            crashable_pg.crash()
            time.sleep(DOWN_S)
            crashable_pg.start()
            outages.append((down, time.monotonic()))
        time.sleep(UP_S)
    finally:
        loop.stop.set()
        committer.join()
    loop.settle()

    failed = [a for a in loop.attempts if a.error is not None]
    acked = [a for a in loop.attempts if a.error is None]
    assert failed, "the outages made no commit fail: the test would prove nothing"
    for attempt in failed:
        assert isinstance(attempt.error, CatalogUnavailableError), (
            f"step {attempt.step} ({'blocking' if attempt.block else 'background'}) failed with "
            f"{type(attempt.error).__name__}: {attempt.error}")
    next_down = [down for down, _up in outages[1:]] + [float("inf")]
    for (_down, up), until in zip(outages, next_down, strict=True):
        after = [a for a in loop.attempts if up + 1.0 <= a.started < until]
        assert after, "the loop stopped committing"
        first = after[0]
        assert first.error is None, (
            f"the first commit 1 s after the catalog came back (step {first.step}, "
            f"{'blocking' if first.block else 'background'}) failed: {first.error!r}")

    visible = {v.step: v.id for v in store.log("train")}
    assert {a.step: a.version_id for a in acked} == {s: visible[s] for s in (a.step for a in acked)}
    # only a commit whose connection was lost while the database committed it may be visible
    # although it raised; its error says so, and the version is whole
    in_doubt = [a for a in failed if a.step in visible]
    assert all(a.error.in_doubt for a in in_doubt), "a failed commit became visible"
    for attempt in acked + in_doubt:
        restored = store.restore(f"train@{attempt.step}")
        assert restored["step"] == attempt.step
        assert torch.equal(restored["w"].view(torch.uint8), attempt.weights.view(torch.uint8))
    assert store.ops.check().ok
    store.close()


class HeldWrites(WriteHookStore):
    """A local blob store whose writes wait while ``gate`` is clear (``held`` says one waits)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()

    def before_write(self, key: str) -> None:
        self.held.set()
        assert self.gate.wait(30)


def _background_commit_across_a_crash(crashable_pg: CrashablePostgres, tmp_path: Path,
                                      down_s: float) -> tuple[Any, CommitHandle, dict[str, Any]]:
    """Open a store, commit step 1, then commit step 2 in the background with its pack write
    held while the database crashes; the write goes on after ``down_s``, then the database
    comes back."""
    blobs = HeldWrites(tmp_path / "blobs")
    store = casckpt.open(tmp_path / "store", blobs=blobs, catalog=crashable_pg.new_database(),
                         chunk_size=CHUNK)
    state = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(1))}
    store.commit(state, run="train", step=1)
    state["w"] += 1
    blobs.gate.clear()
    blobs.held.clear()
    handle = store.commit(state, run="train", step=2, block=False)
    assert blobs.held.wait(30)
    crashable_pg.crash()
    try:
        blobs.gate.set()
        time.sleep(down_s)
    finally:
        crashable_pg.start()
    return store, handle, state


def test_a_background_commit_rides_out_a_short_restart(
        crashable_pg: CrashablePostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASCKPT_CATALOG_RETRY_S", "20")
    store, handle, state = _background_commit_across_a_crash(crashable_pg, tmp_path, down_s=0.5)
    version = handle.wait(timeout=60)
    restored = store.restore("train@2")
    assert version.id == store.resolve("train@latest").id
    assert torch.equal(restored["w"], state["w"])
    assert store.ops.check().ok
    store.close()


def test_an_outage_fails_a_background_commit_but_not_the_next(
        crashable_pg: CrashablePostgres, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CASCKPT_CATALOG_RETRY_S", "0.2")
    store, handle, state = _background_commit_across_a_crash(crashable_pg, tmp_path, down_s=1.0)
    time.sleep(1.0)
    third = store.commit(state, run="train", step=3)  # not poisoned by the failure of step 2
    with pytest.raises(CatalogUnavailableError):
        handle.wait(timeout=60)
    assert [v.step for v in store.log("train")] == [3, 1]
    assert third.parent == store.resolve("train@1").id
    store.commit(state, run="train", step=4, block=False).wait(timeout=60)
    store.close()  # nothing left to report


def test_an_unreachable_catalog_fails_fast(tmp_path: Path) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # completes the handshake, never answers
    refused = socket.create_server(("127.0.0.1", 0))
    refused_port = refused.getsockname()[1]
    refused.close()
    try:
        for url, bound in (
            (f"postgresql+psycopg://postgres@/casckpt?host={tmp_path / 'no-server'}", 3.0),
            (f"postgresql+psycopg://postgres@127.0.0.1:{refused_port}/casckpt", 3.0),
            (f"postgresql+psycopg://postgres@127.0.0.1:{silent.getsockname()[1]}/casckpt",
             CONNECT_TIMEOUT_S + 3.0),
        ):
            started = time.monotonic()
            with pytest.raises(CatalogUnavailableError, match="unreachable"):
                Catalog(url, where="test", retry_s=0.5)
            assert time.monotonic() - started < bound, url
    finally:
        silent.close()


def test_a_publish_retried_after_its_commit_is_recognised(pg_url: str, tmp_path: Path) -> None:
    for url in (pg_url, f"sqlite:///{tmp_path / 'catalog.db'}"):
        catalog = Catalog(url, where="test")
        row = {"id": "a" * 64, "step": 7, "parent_id": None, "state": "visible", "created_at": 1.0,
               "committed_at": 1.0, "logical_bytes": 0, "new_bytes": 0, "stored_bytes": 0,
               "duration_s": 0.0, "meta": {}, "metrics": {}, "message": None, "manifest": b""}
        catalog.add_version(row, "train", [], [], ["best"], [])
        catalog.add_version(row, "train", [], [], ["best"], [])  # as a retry after a lost answer
        assert visible_ids(catalog) == {row["id"]}
        with pytest.raises(VersionExistsError):
            catalog.add_version({**row, "id": "b" * 64}, "train", [], [], [], [])
        catalog.close()


def _row(step: int) -> dict[str, Any]:
    return {"id": f"{step:064x}", "step": step, "parent_id": None, "state": "visible",
            "created_at": 1.0, "committed_at": 1.0, "logical_bytes": 0, "new_bytes": 0,
            "stored_bytes": 0, "duration_s": 0.0, "meta": {}, "metrics": {}, "message": None,
            "manifest": b""}


def test_only_a_publish_lost_while_committing_is_in_doubt(crashable_pg: CrashablePostgres) -> None:
    catalog = Catalog(crashable_pg.new_database(), where="test", retry_s=0.2)
    try:
        crashable_pg.crash()  # down before the publish starts: certainly not visible
        try:
            with pytest.raises(CatalogUnavailableError, match="is not visible") as down:
                catalog.add_version(_row(1), "train", [], [], [], [])
        finally:
            crashable_pg.start()
        assert not down.value.in_doubt
        # the server dies as the COMMIT is sent: the client cannot know whether it landed
        event.listen(catalog.engine, "commit", lambda _conn: crashable_pg.crash(), once=True)
        try:
            with pytest.raises(CatalogUnavailableError, match="may be visible") as lost:
                catalog.add_version(_row(2), "train", [], [], [], [])
        finally:
            crashable_pg.start()
        assert lost.value.in_doubt
        assert visible_ids(catalog) == set()  # here it had not landed; nothing half-made
        catalog.add_version(_row(2), "train", [], [], [], [])  # the next try publishes it
        assert visible_ids(catalog) == {_row(2)["id"]}
    finally:
        catalog.close()


def test_sqlite_errors_are_not_outages(tmp_path: Path) -> None:
    catalog = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}", where="test")
    with pytest.raises(CatalogError) as caught, catalog.read() as conn:
        conn.exec_driver_sql("SELECT * FROM no_such_table")
    assert not isinstance(caught.value, CatalogUnavailableError)
    catalog.close()
