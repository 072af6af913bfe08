"""The ``catalog`` workload: history queries on a run of 10,000 versions (SQLite catalog).

Two stores of the same run. **Tree versions** (what every commit writes today, so
what the targets are judged on): 10,000 real ``Store.commit`` calls of a flat
50-tensor state (tensors of 256 float32 elements, one chunk each: the data is not
what is measured), 40 tensors changing in every version, 10 never, with the same
metadata, metrics and tags as below; then ``log`` and ``history`` of a freshly
opened store, wall and CPU (:func:`run_trees`; ~3-8 minutes of commits on a loaded
2-core machine). **Format-1 rows** (stores written before tree manifests):

No tensor is committed: a store is created, then its catalog is filled
directly with realistic rows, as 10,000 commits of a 50-tensor state would
leave them (one ``versions`` row each with metrics, metadata and a manifest
blob of the size a real one has; 50 ``tensors`` rows per version, each with its changed
bytes against its parent (``tensors.changed_bytes``, as migration 0014 and catalog
rebuilds write it); one
``contents`` row per distinct tensor content, with its chunk-id list; a tag
every 1,000 steps). 40 of the 50 tensors change in every version (one chunk
of four), 10 never change. Then, through the public API of a freshly opened
store, each query runs once to warm up and ``REPEATS`` times measured:

* ``Store.log(run)``: the full list of 10,000 versions (target <= 100 ms);
* ``Store.history(run, path)`` of a tensor that changed in every version
  (10,000 entries, the worst case; target <= 200 ms) and of one that never
  changed (1 entry);
* ``Store.log(run, where=..., min_step=..., limit=20)``: a filtered listing.

* ``Store.best(run, "loss")`` and ``Store.lineage()``: everyday catalog queries;
* a same-run floor: the tensor's rows read with the ``sqlite3`` module alone
  (``SELECT version_id, digest FROM tensors WHERE path = ?``, 10,000 rows), the
  least any history of that tensor reads; history is reported against it.

Figures are medians. PostgreSQL is not measured here (the tests run the same
queries there for correctness). The targets are stated for 10,000 versions,
which every ``--scale`` of at least 0.25 builds; a smaller scale (the CI
smoke run) builds 2,000 so that it stays fast.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

import casckpt
from benchmarks.oldformats import encode_manifest
from casckpt.catalog import Catalog, tensorchanges
from casckpt.catalog import schema as s
from casckpt.format.chunks import chunk_id, object_id
from casckpt.format.manifest import ExtentEntry, Manifest, TensorEntry

Log = Callable[[str], None]

NAME = "catalog"
RUN = "bench-run"
VERSIONS = 10_000
SMOKE_VERSIONS = 2_000  # below FULL_SCALE (the filtered log needs loss < 1.0: past 1,500)
FULL_SCALE = 0.25
TENSORS = 50
FROZEN = 10  # tensors 0..FROZEN-1 never change; the others change one chunk per version
CHUNKS = 4
CHUNK_SIZE = 1 << 18
REPEATS = 5
TAG_EVERY = 1_000
TRAINED_PATH = f"model.layers.{TENSORS - 1}.weight"
FROZEN_PATH = "model.layers.0.weight"


@dataclass(frozen=True)
class Query:
    """One measured query: each round's seconds, their median, and the number of results."""

    rounds_s: list[float]
    median_s: float
    results: int


@dataclass(frozen=True)
class TreeStore:
    """The store every commit writes today (tree manifests), made by real commits, and its queries.

    ``history_*`` and ``log_all`` also report each round's CPU seconds (``cpu_s``)."""

    versions: int
    commits_s: float  # building it: every commit, wall
    commits_cpu_s: float
    log_all: Query
    history_trained: Query
    history_frozen: Query
    log_all_cpu_s: float
    history_trained_cpu_s: float


@dataclass(frozen=True)
class CatalogResult:
    """Every raw number of the ``catalog`` workload: ``trees`` (what users' stores hold) and,
    for stores written before tree manifests, the format-1 rows of the other fields."""

    name: str
    versions: int
    tensors_per_version: int
    tensor_rows: int
    content_rows: int
    manifest_bytes: int
    build_s: float
    log_all: Query
    log_filtered: Query
    history_trained: Query
    history_frozen: Query
    best: Query
    tree: Query
    rows_floor: Query  # sqlite3 alone: the trained tensor's rows (version id, digest)
    trees: TreeStore

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


def _path(k: int) -> str:
    return f"model.layers.{k}.weight"


def _ids(seed: str, n: int) -> list[bytes]:
    return [chunk_id(f"{seed}/{i}".encode()) for i in range(n)]


def _manifest_size() -> int:
    """The compressed size of a real manifest of one such version."""
    extents = tuple(ExtentEntry(CHUNKS * CHUNK_SIZE, CHUNK_SIZE, tuple(_ids(f"m{k}", CHUNKS)))
                    for k in range(TENSORS))
    tensors = tuple(TensorEntry(_path(k), "torch", "float32", (1024, 256), k) for k in range(TENSORS))
    root = {"t": "dict", "k": [_path(k) for k in range(TENSORS)],
            "v": [{"t": "tensor", "i": k} for k in range(TENSORS)]}
    manifest = Manifest(RUN, 0, None, time.time(), root, tensors, extents,
                        {"optimizer": "adamw"}, {"loss": 1.0})
    return len(encode_manifest(manifest)[1])


def _version_row(run_id: int, i: int, parent: str | None, created: float,
                 manifest_size: int) -> tuple[Any, ...]:
    loss = 4.0 / (1 + i / 500)
    meta = {"optimizer": "adamw", "lr": 3e-4, "host": f"node-{i % 8}", "epoch": i // 1000}
    metrics = {"loss": loss, "val_loss": loss * 1.1, "tokens": float(i) * 4096}
    changed = (TENSORS - FROZEN) * CHUNK_SIZE
    return (object_id(f"version {i}".encode()), run_id, i * 100, parent, "visible", created,
            created + 2, TENSORS * CHUNKS * CHUNK_SIZE, changed, changed, 1.5, json.dumps(meta),
            json.dumps(metrics), None, os.urandom(manifest_size))


def _rows(run_id: int, manifest_size: int, count: int) -> dict[str, list[tuple[Any, ...]]]:
    """Rows of the whole run, per table, as tuples in the column order of ``_COLUMNS``."""
    versions, tensors, contents, tags = [], [], [], []
    chunks = {k: _ids(f"t{k}", CHUNKS) for k in range(TENSORS)}
    start, parent = time.time() - count * 60.0, None
    shape = json.dumps([1024, 256])
    for i in range(count):
        row = _version_row(run_id, i, parent, start + i * 60.0, manifest_size)
        versions.append(row)
        for k in range(TENSORS):
            if k >= FROZEN and i > 0:  # one chunk of each trained tensor changes
                chunks[k][i % CHUNKS] = chunk_id(f"t{k}@{i}".encode())
            ids = b"".join(chunks[k])
            digest = object_id(ids)
            if k >= FROZEN or i == 0:
                contents.append((digest, CHUNKS * CHUNK_SIZE, CHUNK_SIZE, ids))
            tensors.append((row[0], _path(k), "float32", shape, CHUNKS * CHUNK_SIZE, CHUNKS, digest))
        if i % TAG_EVERY == 0:
            tags.append((f"milestone-{i // TAG_EVERY}", row[0], row[5]))
        parent = row[0]
    return {"versions": versions, "tensors": tensors, "contents": contents, "tags": tags}


_COLUMNS = {
    "versions": ("id", "run_id", "step", "parent_id", "state", "created_at", "committed_at",
                 "logical_bytes", "new_bytes", "stored_bytes", "duration_s", "meta", "metrics",
                 "message", "manifest"),
    "tensors": ("version_id", "path", "dtype", "shape", "nbytes", "chunks", "digest"),
    "contents": ("digest", "nbytes", "chunk_size", "chunk_ids"),
    "tags": ("name", "version_id", "created_at"),
}


def build(url: str, count: int = VERSIONS) -> tuple[int, int, int]:
    """Fill the SQLite catalog at ``url`` with a run of ``count`` versions, in one transaction
    through ``Catalog.write()``; returns (tensor rows, content rows, manifest size)."""
    catalog = Catalog(url, where="benchmark catalog")
    try:
        manifest_size = _manifest_size()
        with catalog.write() as conn:
            conn.exec_driver_sql("PRAGMA cache_size=-1000000")  # this connection: 1 GB for the build
            conn.execute(s.runs.insert().values(name=RUN, created_at=time.time()))
            run_id = conn.execute(select(s.runs.c.id).where(s.runs.c.name == RUN)).scalar_one()
            for table, rows in _rows(run_id, manifest_size, count).items():
                columns = _COLUMNS[table]
                conn.exec_driver_sql(
                    f"INSERT INTO {table} ({', '.join(columns)}) "
                    f"VALUES ({', '.join('?' * len(columns))})", rows)
            tensorchanges.fill(conn)  # each row's changed bytes, as migration 0014 and rebuilds write them
            tensor_rows = conn.execute(select(func.count()).select_from(s.tensors)).scalar_one()
            content_rows = conn.execute(select(func.count()).select_from(s.contents)).scalar_one()
            conn.exec_driver_sql("PRAGMA cache_size=-2000")  # back to SQLite's default
    finally:
        catalog.close()
    return tensor_rows, content_rows, manifest_size


def _measure(fn: Callable[[], list[Any]], expected: int) -> Query:
    results = len(fn())  # warm up: statement cache, page cache
    if results != expected:
        raise AssertionError(f"query returned {results} results, expected {expected}")
    rounds = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        rounds.append(time.perf_counter() - start)
    return Query(rounds, statistics.median(rounds), results)


def _cpu(fn: Callable[[], list[Any]]) -> float:
    """The median CPU seconds (this process) of ``REPEATS`` calls of ``fn``."""
    rounds = []
    for _ in range(REPEATS):
        start = time.process_time()
        fn()
        rounds.append(time.process_time() - start)
    return statistics.median(rounds)


TREE_ELEMENTS = 256  # float32 elements of each committed tensor (one chunk: the data is not what is measured)


def commit_run(store: casckpt.Store, count: int) -> None:
    """``count`` real commits (``Store.commit``, tree manifests) of a 50-tensor flat state to run
    ``RUN``: the same shape of run as :func:`build`'s rows (40 tensors change in every
    version, 10 never; the same metadata and metrics; a tag every 1,000 versions)."""
    import torch  # noqa: PLC0415 (the row builder above needs no torch)

    state = {_path(k): torch.zeros(TREE_ELEMENTS) for k in range(TENSORS)}
    for i in range(count):
        if i > 0:
            for k in range(FROZEN, TENSORS):
                state[_path(k)][i % TREE_ELEMENTS] += 1.0
        loss = 4.0 / (1 + i / 500)
        store.commit(state, run=RUN, step=i * 100,
                     metadata={"optimizer": "adamw", "lr": 3e-4, "host": f"node-{i % 8}", "epoch": i // 1000},
                     metrics={"loss": loss, "val_loss": loss * 1.1, "tokens": float(i) * 4096},
                     tags=[f"milestone-{i // TAG_EVERY}"] if i % TAG_EVERY == 0 else ())


def run_trees(root: Path, count: int, log: Log) -> TreeStore:
    """Commit the run of ``count`` versions into a new store at ``root``, then time log and
    history of it in a freshly opened store."""
    log(f"{NAME}: committing {count} versions x {TENSORS} tensors (tree manifests)")
    with casckpt.open(root) as store:
        started, cpu = time.perf_counter(), time.process_time()
        commit_run(store, count)
        commits_s, commits_cpu_s = time.perf_counter() - started, time.process_time() - cpu
    log(f"{NAME}: timing log and history of the tree versions")
    with casckpt.open(root, create=False) as store:
        log_all = _measure(lambda: store.log(RUN), count)
        trained = _measure(lambda: store.history(RUN, TRAINED_PATH), count)
        frozen = _measure(lambda: store.history(RUN, FROZEN_PATH), 1)
        log_cpu = _cpu(lambda: store.log(RUN))
        trained_cpu = _cpu(lambda: store.history(RUN, TRAINED_PATH))
    return TreeStore(count, commits_s, commits_cpu_s, log_all, trained, frozen, log_cpu, trained_cpu)


def _floor(db: Path) -> list[Any]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT version_id, digest FROM tensors WHERE path = ?",
                            (TRAINED_PATH,)).fetchall()


def run_catalog(scale: float, workdir: Path, log: Log) -> CatalogResult:
    """Build the catalog in ``workdir`` (10,000 versions; 2,000 below ``--scale``
    :data:`FULL_SCALE`) and time the history queries."""
    count = VERSIONS if scale >= FULL_SCALE else SMOKE_VERSIONS
    root = workdir / "store"
    casckpt.open(root).close()
    log(f"{NAME}: inserting {count} versions x {TENSORS} tensors into the SQLite catalog")
    started = time.perf_counter()
    tensor_rows, content_rows, manifest_size = build(f"sqlite:///{root / 'catalog.db'}", count)
    build_s = time.perf_counter() - started
    log(f"{NAME}: timing log and history ({REPEATS} rounds each, after one warm-up)")
    where = ["loss<1.0", "metadata.optimizer==adamw"]
    with casckpt.open(root, create=False) as store:
        log_all = _measure(lambda: store.log(RUN), count)
        filtered = _measure(lambda: store.log(RUN, where=where, min_step=100, limit=20), 20)
        floor = _measure(lambda: _floor(root / "catalog.db"), count)
        trained = _measure(lambda: store.history(RUN, TRAINED_PATH), count)
        frozen = _measure(lambda: store.history(RUN, FROZEN_PATH), 1)
        best = _measure(lambda: [store.best(RUN, "loss")], 1)
        tree = _measure(store.lineage, 1)
    trees = run_trees(workdir / "trees", count, log)
    return CatalogResult(NAME, count, TENSORS, tensor_rows, content_rows, manifest_size,
                         build_s, log_all, filtered, trained, frozen, best, tree, floor, trees)
