"""Run one workload: torch.save/torch.load baseline, then casckpt, in the same directory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import casckpt
from benchmarks import measure
from benchmarks.workloads import Workload, build

Log = Callable[[str], None]


@dataclass(frozen=True)
class Baseline:
    """torch.save (fsync'd) and torch.load(weights_only=True) of the first state."""

    save_s: float
    save_peak_extra_rss: int
    file_bytes: int
    load_s: float


@dataclass(frozen=True)
class Commit:
    """One ``Store.commit``: wall time around the call, peak extra RSS, the Version."""

    wall_s: float
    peak_extra_rss: int
    version: dict[str, Any]


@dataclass(frozen=True)
class Restore:
    """Full ``Store.restore`` and ``Store.load_tensor`` of the largest tensor, both checked."""

    full_s: float
    full_matches: bool
    tensor_path: str
    tensor_bytes: int
    tensor_s: float
    tensor_matches: bool


@dataclass(frozen=True)
class WorkloadResult:
    """Every raw number measured for one workload."""

    name: str
    model: dict[str, int]
    trainable_fraction: float
    tensors: int
    logical_bytes: int
    changed_bytes: int
    baseline: Baseline
    first: Commit
    next: Commit
    restore: Restore

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


def _baseline(state: Any, workdir: Path) -> Baseline:
    path = workdir / "baseline.pt"
    _, save_s, save_rss = measure.timed_with_rss(lambda: measure.torch_save_fsync(state, path))
    loaded, load_s = measure.timed(lambda: measure.torch_load(path))
    del loaded
    file_bytes = path.stat().st_size
    path.unlink()
    return Baseline(save_s, save_rss, file_bytes, load_s)


def _commit(store: casckpt.Store, state: Any, run: str, step: int) -> Commit:
    version, wall_s, rss = measure.timed_with_rss(lambda: store.commit(state, run=run, step=step))
    return Commit(wall_s, rss, version.to_dict())


def _restore(store: casckpt.Store, ref: str, state: Any) -> Restore:
    restored, full_s = measure.timed(lambda: store.restore(ref))
    full_matches = measure.trees_equal(state, restored)
    del restored
    path, expected = measure.largest_tensor(state)
    one, tensor_s = measure.timed(lambda: store.load_tensor(ref, path))
    tensor_matches = measure.leaf_equal(expected, one)
    return Restore(full_s, full_matches, path, expected.nbytes, tensor_s, tensor_matches)


def _describe(wl: Workload) -> dict[str, Any]:
    state = wl.state()
    return {
        "name": wl.name,
        "model": dataclasses.asdict(wl.cfg),
        "trainable_fraction": wl.trainable_fraction,
        "tensors": sum(1 for _ in measure.tensor_leaves(state)),
        "logical_bytes": measure.logical_bytes(state),
    }


def run_workload(name: str, scale: float, workdir: Path, log: Log) -> WorkloadResult:
    """Measure workload ``name`` at ``scale``; ``workdir`` must be an empty directory."""
    log(f"{name}: building model and optimizer state")
    wl = build(name, scale)
    log(f"{name}: torch.save + fsync, torch.load")
    baseline = _baseline(wl.state(), workdir)
    with casckpt.open(workdir / "store") as store:
        log(f"{name}: commit first version")
        first = _commit(store, wl.state(), name, 1)
        before = measure.tensor_digests(wl.state())
        wl.advance()
        changed = measure.changed_bytes(before, measure.tensor_digests(wl.state()))
        log(f"{name}: commit next version")
        second = _commit(store, wl.state(), name, 2)
        log(f"{name}: restore full and one tensor")
        restore = _restore(store, second.version["id"], wl.state())
    return WorkloadResult(
        **_describe(wl),
        changed_bytes=changed,
        baseline=baseline,
        first=first,
        next=second,
        restore=restore,
    )
