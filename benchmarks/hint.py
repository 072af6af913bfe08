"""The ``hint`` workload: the floor of a verified commit, change hints, and the async stall
against ``torch.distributed.checkpoint.async_save`` (issue 17).

Everything in one process, one work directory, one run; every figure is a ratio of two
measurements taken there, each the median of ``REPEATS`` alternating repetitions:

* **unchanged** (the ``unchanged`` workload's state: the dense decoder + AdamW moments):
  BLAKE3 of every tensor byte on all cores (one ``blake3(max_threads=AUTO)`` hasher
  updated with each tensor's bytes: the floor of a verified re-commit) against a blocking
  re-commit of the same state (the default, verified path); the re-commit with the hint
  (``unchanged="*"``) against ``torch.save`` (+ fsync).
* **frozen** (the ``frozen`` workload: backbone frozen, ~15% of parameters train), one
  interval between commits: a blocking commit with ``trust_versions=True`` against
  ``torch.save``; and the training-visible stall of a background commit
  (``commit(block=False)`` until it returns), default and hinted, against
  ``async_save``'s steady-state stall (its second and later calls: the first one builds
  its plan and staging buffers) with ``FileSystemWriter`` in a one-process gloo group.
  Two stores, one committed without hints, one with ``trust_versions=True``, see the
  same states. Each background commit and async save is waited for before the next.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.peers_tools import dcp_group
from benchmarks.workloads import build

Log = Callable[[str], None]

NAME = "hint"
REPEATS = 5


@dataclass(frozen=True)
class HintResult:
    """Raw numbers (seconds: medians of ``REPEATS``) of the ``hint`` workload."""

    name: str
    unchanged_bytes: int
    unchanged_save_s: float
    blake3_s: float
    recommit_s: float
    recommit_hint_s: float
    frozen_bytes: int
    frozen_changed_bytes: int
    frozen_save_s: float
    frozen_commit_s: float
    frozen_commit_hint_s: float
    dcp_stall_s: float
    dcp_first_stall_s: float
    async_stall_s: float
    async_stall_hint_s: float
    restores_match: bool
    samples: dict[str, list[float]]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


def _views(state: Any) -> list[memoryview]:
    return [measure.raw_bytes(t) for _, t in measure.tensor_leaves(state)]


def _clock(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def _save_s(state: Any, workdir: Path) -> float:
    path = workdir / "baseline.pt"
    _, seconds = measure.timed(lambda: measure.torch_save_fsync(state, path))
    measure.remove(path)
    return seconds


def _unchanged(workdir: Path, scale: float, samples: dict[str, list[float]], log: Log) -> tuple[int, float]:
    wl = build("unchanged", scale)
    state = wl.state()
    views = _views(state)
    logical = sum(len(v) for v in views)
    log(f"{NAME}: unchanged ({measure.fmt_bytes(logical)}): torch.save + fsync")
    save_s = _save_s(state, workdir)
    with casckpt.open(workdir / "unchanged") as store:
        store.commit(state, run="r", step=0)
        store.commit(state, run="r", step=1, unchanged="*")  # the run's memos are warm from here
        log(f"{NAME}: unchanged: BLAKE3 on all cores vs re-commit, vs hinted re-commit, x{REPEATS}")
        for i in range(REPEATS):
            measure.release_memory()
            samples["blake3"].append(_clock(measure.blake3_all, views))
            samples["recommit"].append(_clock(store.commit, state, run="r", step=2 + 2 * i))
            samples["recommit_hint"].append(_clock(store.commit, state, run="r", step=3 + 2 * i,
                                                   unchanged="*"))
    return logical, save_s


def _dcp_async_stall(state: Any, directory: Path) -> tuple[float, Any]:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        future = async_save(state, storage_writer=FileSystemWriter(directory))
        stall = time.perf_counter() - start
    return stall, future


def _wait(future: Any) -> None:
    (future.upload_completion if hasattr(future, "upload_completion") else future).result()


def _frozen(workdir: Path, scale: float, samples: dict[str, list[float]], log: Log) -> tuple[Any, ...]:
    wl = build("frozen", scale)
    logical = measure.logical_bytes(wl.state())
    log(f"{NAME}: frozen ({measure.fmt_bytes(logical)}): torch.save + fsync")
    save_s = _save_s(wl.state(), workdir)
    dcp_group(workdir)  # kept for the process: later workloads may use it too
    with casckpt.open(workdir / "plain") as plain, casckpt.open(workdir / "hinted") as hinted:
        plain.commit(wl.state(), run="r", step=0)
        hinted.commit(wl.state(), run="r", step=0, trust_versions=True)
        first, future = _dcp_async_stall(wl.state(), workdir / "dcp-0")
        _wait(future)
        changed = 0
        matches = True
        log(f"{NAME}: frozen: one interval, then blocking commits, DCP async_save and background "
            f"commits, x{REPEATS}")
        for i in range(REPEATS):
            before = measure.tensor_digests(wl.state())
            wl.advance()
            changed = measure.changed_bytes(before, measure.tensor_digests(wl.state()))
            step = 1 + 2 * i
            measure.release_memory()
            samples["frozen_commit"].append(_clock(plain.commit, wl.state(), run="r", step=step))
            samples["frozen_commit_hint"].append(_clock(hinted.commit, wl.state(), run="r", step=step,
                                                        trust_versions=True))
            wl.advance()
            measure.release_memory()
            stall, future = _dcp_async_stall(wl.state(), workdir / f"dcp-{i + 1}")
            _wait(future)
            measure.remove(workdir / f"dcp-{i + 1}")
            samples["dcp_stall"].append(stall)
            for store, key, hint in ((plain, "async_stall", False), (hinted, "async_stall_hint", True)):
                measure.release_memory()
                start = time.perf_counter()
                handle = store.commit(wl.state(), run="r", step=step + 1, block=False, trust_versions=hint)
                samples[key].append(time.perf_counter() - start)
                handle.wait()
        for store in (plain, hinted):
            matches = matches and measure.trees_equal(wl.state(), store.restore("r@latest"))
    return logical, changed, save_s, first, matches


def run_hint(scale: float, workdir: Path, log: Log) -> HintResult:
    """Measure the ``hint`` workload at ``scale`` in the empty directory ``workdir``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    samples: dict[str, list[float]] = {k: [] for k in (
        "blake3", "recommit", "recommit_hint", "frozen_commit", "frozen_commit_hint", "dcp_stall",
        "async_stall", "async_stall_hint")}
    unchanged_bytes, unchanged_save_s = _unchanged(workdir, scale, samples, log)
    frozen_bytes, changed, frozen_save_s, dcp_first, matches = _frozen(workdir, scale, samples, log)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return HintResult(
        NAME, unchanged_bytes, unchanged_save_s, med["blake3"], med["recommit"], med["recommit_hint"],
        frozen_bytes, changed, frozen_save_s, med["frozen_commit"], med["frozen_commit_hint"],
        med["dcp_stall"], dcp_first, med["async_stall"], med["async_stall_hint"], matches, samples,
    )


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Literal["ratio", "fraction", "seconds", "mb_per_s"]
    compute: Callable[[HintResult], float | None]


MEASURES: tuple[Measure, ...] = (
    Measure("recommit_vs_blake3", "unchanged re-commit (verified) / BLAKE3 of the state, all cores", "ratio",
            lambda r: r.recommit_s / r.blake3_s),
    Measure("recommit_vs_save", "unchanged re-commit (verified) / torch.save", "ratio",
            lambda r: r.recommit_s / r.unchanged_save_s),
    Measure("recommit_hint_vs_save", "unchanged re-commit, unchanged='*' / torch.save", "ratio",
            lambda r: r.recommit_hint_s / r.unchanged_save_s),
    Measure("frozen_commit_vs_save", "frozen commit (verified) / torch.save", "ratio",
            lambda r: r.frozen_commit_s / r.frozen_save_s),
    Measure("frozen_commit_hint_vs_save", "frozen commit, trust_versions / torch.save", "ratio",
            lambda r: r.frozen_commit_hint_s / r.frozen_save_s),
    Measure("async_stall_vs_dcp", "frozen: commit(block=False) stall / DCP async_save stall (steady)",
            "ratio", lambda r: r.async_stall_s / r.dcp_stall_s),
    Measure("async_stall_hint_vs_dcp", "frozen: stall, trust_versions / DCP async_save stall (steady)",
            "ratio", lambda r: r.async_stall_hint_s / r.dcp_stall_s),
    Measure("dcp_first_vs_steady", "DCP async_save: first call's stall / steady stall", "ratio",
            lambda r: r.dcp_first_stall_s / r.dcp_stall_s),
    Measure("frozen_changed_of_logical", "frozen: bytes that changed per interval / logical", "fraction",
            lambda r: r.frozen_changed_bytes / r.frozen_bytes),
)

TARGETS: dict[str, float] = {  # issue 17; the stall target as issue 32 restates it (<= 1.0x DCP's)
    "recommit_vs_blake3": 1.3,
    "recommit_hint_vs_save": 0.05,
    "frozen_commit_hint_vs_save": 0.2,
    "async_stall_vs_dcp": 1.0,
    "async_stall_hint_vs_dcp": 0.25,
}

NOTES = (f"see benchmarks/hint.py; each time the median of {REPEATS} alternating repetitions; "
         "'unchanged' is the dense state, 'frozen' the frozen-backbone one, both at --scale")


def raw_table(outcomes: Mapping[str, HintResult]) -> Table:
    """The hint workload's raw medians."""
    table = Table(title=f"hint: commit floor, change hints, async stall vs DCP async_save "
                        f"(medians of {REPEATS})")
    for column in ("state", "logical", "torch.save", "BLAKE3 all cores", "commit", "commit, hinted",
                   "DCP async stall (1st)", "stall", "stall, hinted", "ok"):
        table.add_column(column, justify="left" if column == "state" else "right")

    def ms(s: float) -> str:
        return f"{s * 1000:.1f} ms"

    for r in outcomes.values():
        table.add_row("unchanged", measure.fmt_bytes(r.unchanged_bytes), ms(r.unchanged_save_s),
                      ms(r.blake3_s), ms(r.recommit_s), ms(r.recommit_hint_s), "", "", "", "")
        table.add_row("frozen", measure.fmt_bytes(r.frozen_bytes), ms(r.frozen_save_s), "",
                      ms(r.frozen_commit_s), ms(r.frozen_commit_hint_s),
                      f"{ms(r.dcp_stall_s)} ({ms(r.dcp_first_stall_s)})", ms(r.async_stall_s),
                      ms(r.async_stall_hint_s), "yes" if r.restores_match else "[red]NO[/]")
    return table
