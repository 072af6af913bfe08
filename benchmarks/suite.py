"""Run one workload: the three file baselines, then casckpt, in the same directory.

Per workload, in this order (all in one fresh work directory):

1. baselines on the first state: ``torch.save`` + fsync / ``torch.load``;
   safetensors ``save_file`` + fsync / ``load_file`` (tensors only);
   ``torch.distributed.checkpoint`` save / load (FileSystemWriter/Reader, one
   process, files fsync'd); BLAKE3 of every tensor byte on all cores (the floor
   of a verified re-commit);
2. a new store: blocking commit of the first state (step 1);
3. one interval (``advance``), blocking commit (step 2). For ``branch``: the
   base is step 1 of run ``branch``; each of the ``BRANCHES`` branches is
   forked from it (``Store.fork``), reset to the base, advanced with its own
   hyper-parameters and committed as step 2 of its run;
4. one more interval, then a background commit (``block=False``, step 3):
   the time until ``commit`` returns (the stall training sees) and until
   ``handle.wait()`` returns;
5. full ``Store.restore`` of step 3 and ``Store.load_tensor`` of its largest
   tensor, both checked against the live state.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import casckpt
from benchmarks import measure
from benchmarks.workloads import BRANCHES, Workload, build
from casckpt.testing.internals import internals

Log = Callable[[str], None]


@dataclass(frozen=True)
class Baseline:
    """One file baseline's save (fsync'd) and load of the first state."""

    save_s: float
    save_peak_extra_rss: int
    file_bytes: int
    load_s: float


@dataclass(frozen=True)
class Commit:
    """One blocking ``Store.commit``: wall time around the call, peak extra RSS, the Version."""

    wall_s: float
    peak_extra_rss: int
    version: dict[str, Any]


@dataclass(frozen=True)
class AsyncCommit:
    """One ``Store.commit(block=False)`` followed at once by ``handle.wait()``.

    ``stall_s``: until ``commit`` returned (what training waits for);
    ``total_s``: until ``wait`` returned. ``peak_extra_rss`` is sampled over
    both; ``peak_staged`` is the committer's high-water mark of bytes copied
    out of the state (``internals(store).committer.peak_staged``).
    ``changed_bytes``: tensors that changed since the previous commit;
    ``touched_bytes``: the same with sparse tensors counted by the rows that
    changed (``embed``; None elsewhere).
    """

    stall_s: float
    total_s: float
    peak_extra_rss: int
    peak_staged: int | None
    changed_bytes: int
    touched_bytes: int | None
    version: dict[str, Any]


@dataclass(frozen=True)
class BranchCommit:
    """One branch of the ``branch`` workload: forked from the base, one interval, committed."""

    run: str
    changed_bytes: int
    commit: Commit


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
    """Every raw number measured for one workload.

    ``changed_bytes``: total size of the tensors that differ between the first
    and the next state (for ``branch``: base and first branch). ``touched_bytes``
    counts sparse tensors by the rows that changed instead (``embed``; None
    elsewhere). ``baseline`` is torch.save / torch.load.
    """

    name: str
    model: dict[str, int | float]
    trainable_fraction: float
    tensors: int
    logical_bytes: int
    changed_bytes: int
    touched_bytes: int | None
    baseline: Baseline
    safetensors: Baseline
    dcp: Baseline
    blake3_s: float  # BLAKE3 of every tensor byte of the first state, on all cores
    first: Commit
    next: Commit
    async_commit: AsyncCommit
    restore: Restore
    branches: list[BranchCommit] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


def _file_baseline(save: Callable[[], None], load: Callable[[], Any], path: Path) -> Baseline:
    _, save_s, save_rss = measure.timed_with_rss(save)
    loaded, load_s = measure.timed(load)
    del loaded
    file_bytes = measure.path_bytes(path)
    measure.remove(path)
    return Baseline(save_s, save_rss, file_bytes, load_s)


def _baseline(state: Any, workdir: Path) -> Baseline:
    """torch.save (fsync'd) and torch.load(weights_only=True)."""
    path = workdir / "baseline.pt"
    return _file_baseline(lambda: measure.torch_save_fsync(state, path),
                          lambda: measure.torch_load(path), path)


def _safetensors_baseline(state: Any, workdir: Path) -> Baseline:
    """safetensors save_file (fsync'd) and load_file of the state's tensors only."""
    path = workdir / "baseline.safetensors"
    return _file_baseline(lambda: measure.safetensors_save_fsync(state, path),
                          lambda: measure.safetensors_load(path), path)


def _dcp_baseline(state: Any, workdir: Path) -> Baseline:
    """torch.distributed.checkpoint save / load in this one process."""
    path = workdir / "baseline.dcp"
    return _file_baseline(lambda: measure.dcp_save(state, path),
                          lambda: measure.dcp_load(state, path), path)


def _blake3_baseline(state: Any) -> float:
    """BLAKE3 of every tensor byte of the state on all cores (the floor of a verified re-commit)."""
    views = [measure.raw_bytes(t) for _, t in measure.tensor_leaves(state)]
    return measure.timed(lambda: measure.blake3_all(views))[1]


def _commit(store: casckpt.Store, state: Any, run: str, step: int) -> Commit:
    version, wall_s, rss = measure.timed_with_rss(lambda: store.commit(state, run=run, step=step))
    return Commit(wall_s, rss, version.to_dict())


def _async_commit(store: casckpt.Store, state: Any, run: str, step: int,
                  changed: tuple[int, int | None]) -> AsyncCommit:
    measure.release_memory()
    with measure.RssSampler() as rss:
        start = time.perf_counter()
        handle = store.commit(state, run=run, step=step, block=False)
        stall_s = time.perf_counter() - start
        version = handle.wait()
        total_s = time.perf_counter() - start
    staged = internals(store).committer.peak_staged
    return AsyncCommit(stall_s, total_s, rss.peak_extra, staged, *changed, version.to_dict())


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
        "info": wl.info,
    }


def _advance(wl: Workload) -> tuple[int, int | None]:
    """One interval; the bytes of tensors that changed, and the row-level count for sparse ones."""
    before = measure.tensor_digests(wl.state())
    wl.advance()
    after = measure.tensor_digests(wl.state())
    changed = measure.changed_bytes(before, after)
    if wl.rows_changed is None:
        return changed, None
    rows = wl.rows_changed()
    touched = sum(
        rows[path][0] * rows[path][1] if path in rows else nbytes
        for path, (nbytes, digest) in after.items() if before.get(path) != (nbytes, digest)
    )
    return changed, touched


def _branches(store: casckpt.Store, wl: Workload, base_ref: str, log: Log) -> list[BranchCommit]:
    assert wl.branch is not None
    base = measure.tensor_digests(wl.state())
    out = []
    for i in range(BRANCHES):
        run = f"{wl.name}-{i}"
        log(f"{wl.name}: fork {run} from the base, one interval, commit")
        store.fork(base_ref, run)
        wl.branch(i)
        wl.advance()
        changed = measure.changed_bytes(base, measure.tensor_digests(wl.state()))
        out.append(BranchCommit(run, changed, _commit(store, wl.state(), run, 2)))
    return out


def run_workload(name: str, scale: float, workdir: Path, log: Log) -> WorkloadResult:
    """Measure workload ``name`` at ``scale``; ``workdir`` must be an empty directory."""
    log(f"{name}: building model and optimizer state")
    wl = build(name, scale)
    state = wl.state()
    log(f"{name}: baselines: torch.save + fsync / torch.load")
    baseline = _baseline(state, workdir)
    log(f"{name}: baselines: safetensors save_file + fsync / load_file")
    safetensors = _safetensors_baseline(state, workdir)
    log(f"{name}: baselines: torch.distributed.checkpoint save / load")
    dcp = _dcp_baseline(state, workdir)
    log(f"{name}: baselines: BLAKE3 of the state on all cores")
    blake3_s = _blake3_baseline(state)
    del state
    branches: list[BranchCommit] = []
    touched: int | None = None
    with casckpt.open(workdir / "store") as store:
        log(f"{name}: commit first version")
        first = _commit(store, wl.state(), name, 1)
        if wl.branch is not None:
            branches = _branches(store, wl, first.version["id"], log)
            second, changed, run = branches[0].commit, branches[0].changed_bytes, branches[-1].run
        else:
            changed, touched = _advance(wl)
            log(f"{name}: commit next version")
            second, run = _commit(store, wl.state(), name, 2), name
        async_changed = _advance(wl)
        log(f"{name}: background commit (block=False), then wait")
        background = _async_commit(store, wl.state(), run, 3, async_changed)
        log(f"{name}: restore full and one tensor")
        restore = _restore(store, background.version["id"], wl.state())
    return WorkloadResult(
        **_describe(wl),
        changed_bytes=changed,
        touched_bytes=touched,
        baseline=baseline,
        safetensors=safetensors,
        dcp=dcp,
        blake3_s=blake3_s,
        first=first,
        next=second,
        async_commit=background,
        restore=restore,
        branches=branches,
    )
