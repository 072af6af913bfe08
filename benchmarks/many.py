"""The ``many-tensors`` workload: states of 10^4-10^5 small tensors (MoE experts, per-parameter
optimizer state), against torch.save / torch.load in the same run.

Two states, as in issue 15: 20,000 fp32 tensors of 256 elements (19.5 MiB) and 100,000 of 16
(6.1 MiB), a flat ``{"model": {"layers.N.expert.w": ...}}`` dict. ``--scale`` scales the tensor
counts (not their sizes), at least 1,000. For each state, on a fresh SQLite store:

* torch.save (to a file, fsync'd) and torch.load(weights_only=True) of the state;
* the first commit, an unchanged re-commit, and a commit changing 10 tensors;
* catalog + manifest bytes each commit adds (the catalog file and its WAL, checkpointed);
* a full restore (verified), ``Store.show`` (the summary, ``tensors=False``, and the full
  listing) and ``Store.diff`` of the versions 10 tensors apart, ``Store.load_tensor`` of one
  tensor, ``casckpt show`` (the CLI, default summary) in a fresh process, and the start-up
  of ``casckpt --help`` alone (what any command pays before its work).

Times are medians of ``REPEATS`` where the operation does not change the store (restore,
show, diff, load_tensor), single runs otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import casckpt

Log = Callable[[str], None]

NAME = "many-tensors"
SHAPES = ((20_000, 256), (100_000, 16))
CHANGED = 10
REPEATS = 3


@dataclass(frozen=True)
class ManyState:
    """The raw numbers of one state."""

    tensors: int
    elements: int
    logical_bytes: int
    save_s: float
    load_s: float
    commit_first_s: float
    commit_unchanged_s: float
    commit_changed_s: float
    restore_s: float
    show_s: float  # the summary (tensors=False)
    show_tensors_s: float  # every tensor listed
    diff_s: float
    load_tensor_s: float
    cli_show_s: float
    cli_start_s: float
    catalog_first_bytes: int
    catalog_unchanged_bytes: int  # catalog + manifest bytes the unchanged re-commit added
    catalog_changed_bytes: int
    store_bytes: int
    new_bytes_unchanged: int
    new_bytes_changed: int


@dataclass(frozen=True)
class ManyResult:
    """Every raw number of the ``many-tensors`` workload."""

    name: str
    states: list[ManyState]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def state(self, i: int) -> ManyState | None:
        return self.states[i] if i < len(self.states) else None


def _median(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _catalog_bytes(root: Path) -> int:
    """Bytes of the catalog, after a checkpoint folds its WAL in, plus the manifest objects."""
    with closing(sqlite3.connect(root / "catalog.db")) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = sum(p.stat().st_size for p in root.glob("catalog.db*"))
    return size + sum(p.stat().st_size for p in (root / "manifests").iterdir())


def _tree_size(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _one(count: int, elements: int, workdir: Path, log: Log) -> ManyState:
    g = torch.Generator().manual_seed(count)
    state = {"model": {f"layers.{i // 8}.experts.{i % 8}.w": torch.randn(elements, generator=g)
                       for i in range(count)}}
    logical = count * elements * 4
    path = workdir / f"save-{count}.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    save_s = _timed(save)
    load_s = _median(lambda: torch.load(path, weights_only=True))
    root = workdir / f"store-{count}"
    with casckpt.open(root) as store:
        first = _timed(lambda: store.commit(state, run="r", step=1))
        after_first = _catalog_bytes(root)
        v2: list[Any] = []
        unchanged = _timed(lambda: v2.append(store.commit(state, run="r", step=2)))
        after_unchanged = _catalog_bytes(root)
        paths = list(state["model"])
        for p in paths[:: max(1, count // CHANGED)][:CHANGED]:
            state["model"][p] = state["model"][p] + 1
        v3: list[Any] = []
        changed = _timed(lambda: v3.append(store.commit(state, run="r", step=3)))
        after_changed = _catalog_bytes(root)
        restore_s = _median(lambda: store.restore("r@3"))
        show_s = _median(lambda: store.show("r@3", tensors=False))
        show_tensors_s = _median(lambda: store.show("r@3"))
        diff = store.diff("r@2", "r@3")
        if len(diff.changed) != CHANGED:
            raise AssertionError(f"diff found {len(diff.changed)} changed tensors, not {CHANGED}")
        diff_s = _median(lambda: store.diff("r@2", "r@3"))
        load_tensor_s = _median(lambda: store.load_tensor("r@3", f"model.{paths[count // 2]}"))
    cli = [sys.executable, "-m", "casckpt.cli.main", "--store", str(root), "show", "r@3"]
    cli_s = _median(lambda: subprocess.run(cli, check=True, capture_output=True))
    start = [sys.executable, "-m", "casckpt.cli.main", "--help"]
    start_s = _median(lambda: subprocess.run(start, check=True, capture_output=True))
    log(f"{NAME} {count} x {elements}: commit {first:.2f} s (torch.save {save_s:.2f} s), unchanged "
        f"{unchanged:.2f} s, restore {restore_s:.2f} s (torch.load {load_s:.2f} s)")
    return ManyState(
        count, elements, logical, save_s, load_s, first, unchanged, changed, restore_s, show_s,
        show_tensors_s, diff_s, load_tensor_s, cli_s, start_s, after_first, after_unchanged - after_first,
        after_changed - after_unchanged, _tree_size(root), v2[0].new_bytes, v3[0].new_bytes)


def run_many(scale: float, workdir: Path, log: Log) -> ManyResult:
    """Both states (tensor counts times ``scale``, at least 1,000)."""
    states = [_one(max(1_000, int(count * scale)), elements, workdir, log) for count, elements in SHAPES]
    return ManyResult(NAME, states)
