"""The ``delta`` workload: what delta coding stores, costs at commit and costs at restore.

For each of the ``dense``, ``dense-bf16``, ``embed`` and ``frozen`` workloads
(state builders and intervals from :mod:`benchmarks.workloads`), one process
holds two fresh stores side by side in one work directory: ``on``, with the
store's default delta chain length ``C`` (read with ``store.ops.delta_chain()``),
and ``off``, with delta coding off (``set_delta_chain(0)``). A delta base comes
from the committing process's memory, so the whole sequence runs here:

1. the first state, then ``C`` intervals; every state committed blocking to
   both stores (which goes first alternates, so drift on a shared machine hits
   both alike). Step ``C + 1`` of ``on`` is the end of the longest chain;
2. at step ``c + 1`` for ``c`` in (``C // 2``, ``C``): the version there and the
   same state from ``off`` (a keyframe version of the same size) are fully
   restored ``RESTORE_ROUNDS`` times in turn (median kept), each compared bit
   for bit with the live state: a mismatch fails the workload. A store whose
   chain is ``C // 2`` writes exactly what ``on`` wrote for its first ``C // 2
   + 1`` versions (no keyframe is due before), so its figures are read there;
3. one more interval, committed to ``on`` only (step ``C + 2``): the policy must
   now start chains again. After every commit the version's ``longest_chain``
   (``Store.show``) is checked against the policy: deeper fails the workload.

``torch.save`` (fsync'd) and ``torch.load`` of the first state are the usual
file baseline. Reported per workload and chain: mean stored / logical per
delta commit (steps 2 .. c + 1) with and without delta coding, and over one
keyframe cycle (steps 1 .. c + 1: what a long run pays per commit); commit time
delta on / off and against torch.save; chain-end restore / keyframe restore
and / torch.load.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from rich.table import Table

import casckpt
from benchmarks import measure
from benchmarks.suite import Baseline
from benchmarks.suite import _baseline as torch_baseline  # the same fsync'd torch.save / torch.load
from benchmarks.workloads import Workload, build
from casckpt.format.state import iter_leaves

Log = Callable[[str], None]
T = TypeVar("T")

NAME = "delta"
WORKLOADS = ("dense", "dense-bf16", "embed", "frozen")
RESTORE_ROUNDS = 3  # restore pairs repeated (median kept): single restores vary by ~20%, more when busy


@dataclass(frozen=True)
class DeltaCommit:
    """One blocking ``Store.commit``: wall time, the ``Version``, and how its chunks are stored."""

    step: int
    wall_s: float
    delta_chunks: int  # Store.show: chunks of the version stored as deltas
    longest_chain: int  # Store.show: deltas decoded to read its deepest chunk
    version: dict[str, Any]

    @property
    def stored_of_logical(self) -> float:
        """Bytes written for this commit over the state's logical bytes."""
        return int(self.version["stored_bytes"]) / int(self.version["logical_bytes"])


@dataclass(frozen=True)
class StoreRun:
    """Everything one store committed (``chain`` 0: delta coding off), and its final stats."""

    chain: int
    commits: list[DeltaCommit]
    stats: dict[str, Any]

    def span(self, first: int, last: int) -> list[DeltaCommit]:
        """The commits of steps ``first`` .. ``last``."""
        return [c for c in self.commits if first <= c.step <= last]

    def at(self, step: int) -> DeltaCommit | None:
        """The commit of ``step`` (None if this store skipped it)."""
        return next((c for c in self.commits if c.step == step), None)


@dataclass(frozen=True)
class ChainEnd:
    """Full restores of a chain's last version (step ``chain + 1`` of ``on``) and of the same
    state from ``off``; both were compared bit for bit with the committed state."""

    chain: int
    step: int
    depth: int  # longest_chain of the restored version
    end_rounds_s: list[float]
    keyframe_rounds_s: list[float]

    @property
    def end_s(self) -> float:
        """Median wall time of the chain-end restore."""
        return statistics.median(self.end_rounds_s)

    @property
    def keyframe_s(self) -> float:
        """Median wall time of the keyframe restore of the same state."""
        return statistics.median(self.keyframe_rounds_s)


@dataclass(frozen=True)
class WorkloadDelta:
    """One workload's sequence through the ``on`` and ``off`` stores, and the restores."""

    name: str
    tensors: int
    logical_bytes: int
    baseline: Baseline  # torch.save (fsync'd) / torch.load of the first state
    on: StoreRun
    off: StoreRun
    ends: list[ChainEnd]  # the store default chain first, then the short one

    def end(self, role: int) -> ChainEnd | None:
        """The restores of the ``role``-th chain (0: the store default, 1: half of it)."""
        return self.ends[role] if role < len(self.ends) else None


@dataclass(frozen=True)
class DeltaResult:
    """Every raw number of the ``delta`` workload."""

    name: str
    chains: list[int]  # the chain lengths measured, the store default first
    workloads: list[WorkloadDelta]

    def workload(self, name: str) -> WorkloadDelta | None:
        """The figures of workload ``name`` (None if it did not run)."""
        return next((w for w in self.workloads if w.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict of all fields."""
        return dataclasses.asdict(self)


# ---- measuring ----------------------------------------------------------------------------------


def _check_chain(name: str, chain: int, commit: DeltaCommit) -> None:
    """Fail loudly when a version is deeper than its store's chain policy allows."""
    if commit.longest_chain > chain or (chain == 0 and commit.delta_chunks):
        raise RuntimeError(
            f"delta {name}: step {commit.step} of the store with delta chain {chain} has "
            f"{commit.delta_chunks} delta chunks, longest chain {commit.longest_chain}: deeper than "
            f"the policy allows (casckpt bug?); version {commit.version['id']}")


def _wall(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn``'s result and wall seconds. Unlike ``measure.timed`` no GC first: the caller collects
    once before a group of timed calls (a collection costs ~0.1 s, a small commit less)."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def _commit(store: casckpt.Store, wl: Workload, step: int) -> DeltaCommit:
    version, wall_s = _wall(lambda: store.commit(wl.state(), run=wl.name, step=step))
    detail = store.show(version.id)
    return DeltaCommit(step, wall_s, detail.delta_chunks, detail.longest_chain, version.to_dict())


def _fingerprint(state: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of a state, each tensor replaced by its BLAKE3 (of dtype, shape, bytes)."""
    digests = measure.tensor_digests(state)
    return [(path, digests[path] if isinstance(leaf, torch.Tensor) else leaf)
            for path, leaf in iter_leaves(state)]


def _verify(label: str, expected: list[tuple[str, Any]], restored: Any) -> None:
    """Fail loudly unless ``restored`` is the committed state bit for bit."""
    actual = _fingerprint(restored)
    if actual != expected:
        wrong = [p for (p, a), (_, b) in zip(expected, actual, strict=False) if a != b]
        raise RuntimeError(f"delta {label}: the restored state differs from the committed one "
                           f"({len(expected)} leaves committed, {len(actual)} restored; differing: "
                           f"{', '.join(wrong[:5]) or 'paths'})")


def _restore_pair(on: casckpt.Store, off: casckpt.Store, wl: Workload, chain: int,
                  commit: DeltaCommit) -> ChainEnd:
    """Restore ``commit``'s step from ``on`` and from ``off`` in turn, each checked."""
    ref = f"{wl.name}@{commit.step}"
    expected = _fingerprint(wl.state())
    rounds: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(RESTORE_ROUNDS):
        measure.release_memory()
        for label, store in (("on", on), ("off", off)):
            restored, seconds = _wall(functools.partial(store.restore, ref))
            _verify(f"{wl.name} {ref}, delta {label}", expected, restored)
            del restored
            rounds[label].append(seconds)
    return ChainEnd(chain, commit.step, commit.longest_chain, rounds["on"], rounds["off"])


COMMITS = 12  # issue 17: stored bytes averaged over 12 consecutive commits


def _chains(default: int) -> list[int]:
    """The sequence lengths measured: the store default chain (at most :data:`COMMITS`: by
    default keyframes are placed by cost within a deeper cap), then half of it where >= 1."""
    if default < 1:
        raise RuntimeError(f"delta: a new store's default delta chain is {default} (off): there is "
                           "no chain to measure; the workload needs delta coding on by default")
    default = min(default, COMMITS)
    short = default // 2
    return [default, short] if 1 <= short < default else [default]


def _sequence(wl: Workload, on: casckpt.Store, off: casckpt.Store, chains: Sequence[int],
              log: Log, cap: int) -> tuple[list[DeltaCommit], list[DeltaCommit], list[ChainEnd]]:
    """Steps 1-3 of the module docstring: (commits to on, commits to off, restores per chain)."""
    ons: list[DeltaCommit] = []
    offs: list[DeltaCommit] = []
    ends: dict[int, ChainEnd] = {}
    for step in range(1, chains[0] + 3):
        if step > 1:
            wl.advance()
        pairs = [(on, cap, ons)] + ([(off, 0, offs)] if step <= chains[0] + 1 else [])
        log(f"{NAME} {wl.name}: step {step}: commit to {len(pairs)} store(s)")
        measure.release_memory()
        for store, chain, into in pairs[::-1] if step % 2 else pairs:
            into.append(_commit(store, wl, step))
            _check_chain(wl.name, chain, into[-1])
        for chain in chains:
            if step == chain + 1:
                log(f"{NAME} {wl.name}: restore step {step} (chain {chain}) with delta on and off, "
                    f"{RESTORE_ROUNDS} rounds, checked")
                ends[chain] = _restore_pair(on, off, wl, chain, ons[-1])
    return ons, offs, [ends[c] for c in chains]


def _one_workload(name: str, scale: float, workdir: Path, log: Log) -> WorkloadDelta:
    log(f"{NAME} {name}: building model and optimizer state")
    wl = build(name, scale)
    state = wl.state()
    tensors, logical = sum(1 for _ in measure.tensor_leaves(state)), measure.logical_bytes(state)
    log(f"{NAME} {name}: baseline: torch.save + fsync / torch.load")
    baseline = torch_baseline(state, workdir)
    del state
    root = workdir / name
    with casckpt.open(root / "on") as on, casckpt.open(root / "off") as off:
        off.ops.set_delta_chain(0)
        chains = _chains(on.ops.delta_chain())
        ons, offs, ends = _sequence(wl, on, off, chains, log, on.ops.delta_chain())
        runs = (StoreRun(chains[0], ons, on.ops.stats().to_dict()),
                StoreRun(0, offs, off.ops.stats().to_dict()))
    measure.remove(root)
    return WorkloadDelta(name, tensors, logical, baseline, *runs, ends)


def run_delta(scale: float, workdir: Path, log: Log, workloads: Sequence[str] = WORKLOADS) -> DeltaResult:
    """Measure the ``delta`` workload at ``scale``; ``workdir`` must be an empty directory."""
    results = [_one_workload(name, scale, workdir, log) for name in workloads]
    return DeltaResult(NAME, [end.chain for end in results[0].ends], results)


# ---- figures and targets ------------------------------------------------------------------------


def _mean(values: Iterable[float]) -> float | None:
    items = list(values)
    return statistics.fmean(items) if items else None


def _over(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def stored_per_commit(run: StoreRun, chain: int) -> float | None:
    """Mean stored / logical of the commits after the first, up to the chain's end."""
    return _mean(c.stored_of_logical for c in run.span(2, chain + 1))


def stored_per_cycle(run: StoreRun, chain: int) -> float | None:
    """Mean stored / logical over one keyframe cycle of ``chain`` (steps 1 .. chain + 1)."""
    return _mean(c.stored_of_logical for c in run.span(1, chain + 1))


def commit_s(run: StoreRun, chain: int) -> float | None:
    """Mean wall time of the commits after the first, up to the chain's end."""
    return _mean(c.wall_s for c in run.span(2, chain + 1))


Kind = Literal["ratio", "fraction", "seconds", "mb_per_s"]
Figure = Callable[[WorkloadDelta, ChainEnd], float | None]


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``: key, label, kind, compute."""

    key: str
    label: str
    kind: Kind
    compute: Callable[[DeltaResult], float | None]


# (key suffix, label, kind, figure, roles it is reported for: 0 the default chain, 1 the short one)
_FIGURES: tuple[tuple[str, str, Kind, Figure, tuple[int, ...]], ...] = (
    ("stored_on_of_logical", "stored / logical per delta commit, delta on", "fraction",
     lambda w, e: stored_per_commit(w.on, e.chain), (0,)),
    ("stored_off_of_logical", "stored / logical per commit, delta off", "fraction",
     lambda w, e: stored_per_commit(w.off, e.chain), (0,)),
    ("stored_cycle_of_logical", "stored / logical per commit over a keyframe cycle, delta on",
     "fraction", lambda w, e: stored_per_cycle(w.on, e.chain), (0, 1)),
    ("commit_on_vs_off", "commit, delta on / delta off", "ratio",
     lambda w, e: _over(commit_s(w.on, e.chain), commit_s(w.off, e.chain)), (0,)),
    ("commit_on_vs_save", "commit, delta on / torch.save", "ratio",
     lambda w, e: _over(commit_s(w.on, e.chain), w.baseline.save_s), (0,)),
    ("commit_off_vs_save", "commit, delta off / torch.save", "ratio",
     lambda w, e: _over(commit_s(w.off, e.chain), w.baseline.save_s), (0,)),
    ("restore_end_vs_keyframe", "restore at the chain's end / keyframe restore", "ratio",
     lambda w, e: _over(e.end_s, e.keyframe_s), (0, 1)),
    ("restore_end_vs_load", "restore at the chain's end / torch.load", "ratio",
     lambda w, e: _over(e.end_s, w.baseline.load_s), (0,)),
)

# BENCHMARKS.md "Targets": stored bytes per commit with delta coding, restore at a chain's end.
STORED_TARGETS = {"dense": 0.7, "dense-bf16": 0.35, "embed": 0.02}
RESTORE_END_TARGET = 1.5
RESTORE_LOAD_TARGET = 1.0  # "restore, full, verified <= 1.0x torch.load" holds for every full restore
ROLES = ("", "short chain: ")  # label prefix per role; the tables show the chain lengths


def _key(workload: str, role: int, suffix: str) -> str:
    return f"{workload}/{suffix}" if role == 0 else f"{workload}/short/{suffix}"


def _compute(workload: str, role: int, figure: Figure) -> Callable[[DeltaResult], float | None]:
    def compute(result: DeltaResult) -> float | None:
        w = result.workload(workload)
        end = None if w is None else w.end(role)
        return None if w is None or end is None else figure(w, end)

    return compute


MEASURES: tuple[Measure, ...] = tuple(
    Measure(_key(w, role, suffix), f"{w}, {ROLES[role]}{label}", kind, _compute(w, role, figure))
    for w in WORKLOADS for suffix, label, kind, figure, roles in _FIGURES for role in roles
)

TARGETS: dict[str, float] = {
    **{_key(w, 0, "stored_on_of_logical"): t for w, t in STORED_TARGETS.items()},
    **{_key(w, role, "restore_end_vs_keyframe"): RESTORE_END_TARGET for w in WORKLOADS for role in (0, 1)},
    **{_key(w, 0, "restore_end_vs_load"): RESTORE_LOAD_TARGET for w in WORKLOADS},
}


# ---- tables -------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.3g}%"


def _x(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}x"


def _judged(value: float | None, target: float | None, text: str) -> str:
    """``text`` marked pass / miss against an upper limit."""
    if value is None or target is None:
        return text
    return f"{text} [green]pass[/]" if value <= target else f"{text} [red]miss[/]"


def _commit_cells(commit: DeltaCommit | None) -> list[str]:
    if commit is None:
        return ["", ""]
    stored = f"{measure.fmt_bytes(commit.version['stored_bytes'])} ({_pct(commit.stored_of_logical)})"
    return [stored, f"{commit.wall_s:.3f} s"]


def commit_table(results: Sequence[DeltaResult]) -> Table:
    """Every commit of the sequence: new bytes, and per store the stored bytes and wall time."""
    table = Table(title="Delta coding, every commit (blocking; the same states into both stores; "
                  "stored: bytes written, % of logical; depth: longest chain)")
    chain = results[0].chains[0] if results else 0
    for column in ("workload", "step", "logical", "new", "off: stored", "off: commit",
                   f"chain {chain}: stored", "commit", "deltas", "depth"):
        table.add_column(column, justify="left" if column == "workload" else "right", no_wrap=True)
    for r in results:
        for w in r.workloads:
            label = w.name
            for on in w.on.commits:
                v = on.version
                table.add_row(label, str(on.step), measure.fmt_bytes(v["logical_bytes"]),
                              measure.fmt_bytes(v["new_bytes"]),
                              *_commit_cells(w.off.at(on.step)), *_commit_cells(on),
                              str(on.delta_chunks), str(on.longest_chain))
                label = ""
            table.add_section()
    return table


def _summary_row(w: WorkloadDelta, role: int) -> list[str]:
    end = w.ends[role]
    on, off = stored_per_commit(w.on, end.chain), stored_per_commit(w.off, end.chain)
    on_s, off_s = commit_s(w.on, end.chain), commit_s(w.off, end.chain)
    restore = _over(end.end_s, end.keyframe_s)
    return [
        w.name if role == 0 else "", str(end.chain), str(end.depth),
        _judged(on, STORED_TARGETS.get(w.name) if role == 0 else None, _pct(on)), _pct(off),
        _pct(stored_per_cycle(w.on, end.chain)), _x(_over(on_s, off_s)),
        _x(_over(on_s, w.baseline.save_s)), _x(_over(off_s, w.baseline.save_s)),
        f"{end.end_s:.3f} s", f"{end.keyframe_s:.3f} s", _judged(restore, RESTORE_END_TARGET, _x(restore)),
    ]


def summary_table(results: Sequence[DeltaResult]) -> Table:
    """Per workload and chain: stored bytes, commit and restore ratios, against the targets."""
    table = Table(title="Delta coding on vs off, per workload: stored / logical and commit time, means "
                  "over steps 2 .. chain + 1 (cycle: 1 .. chain + 1; save: torch.save); full restore "
                  "of step chain + 1 (its depth) and of the same state stored off (keyframe), "
                  "verified, median; targets from BENCHMARKS.md")
    for column in ("workload", "chain", "depth", "stored on", "off", "cycle", "on/off", "on/save",
                   "off/save", "restore end", "keyframe", "end/key"):
        table.add_column(column, justify="left" if column == "workload" else "right", no_wrap=True)
    for r in results:
        for w in r.workloads:
            for role in range(len(w.ends)):
                table.add_row(*_summary_row(w, role))
    return table


def tables(outcomes: Mapping[str, DeltaResult | str]) -> Sequence[Table]:
    """The delta workload's tables, in print order (none for a crashed run: the ratio table says so)."""
    results = [r for r in outcomes.values() if not isinstance(r, str)]
    return [commit_table(results), summary_table(results)] if results else []


NOTES = {
    "sequence": "per workload (dense, dense-bf16, embed, frozen at --scale): two fresh stores in "
    "one directory, one process (delta bases live in the committing process's memory): 'on' with "
    "the store's default chain C (store.ops.delta_chain()), 'off' with set_delta_chain(0); the first "
    "state then C intervals, each state committed blocking to both (which first alternates per "
    "step); one more interval committed to 'on' only (step C + 2: chains must restart)",
    "short_chain": "chain C // 2: a store with that policy writes exactly what 'on' wrote for "
    "steps 1 .. C // 2 + 1 (no keyframe is due before), so its figures are read there",
    "stored": "stored / logical per delta commit: mean over steps 2 .. c + 1 of Version."
    "stored_bytes / logical_bytes; per cycle: over steps 1 .. c + 1 (the keyframe included)",
    "commit": "mean wall time of the commits of steps 2 .. c + 1, delta on over delta off (same "
    "states) and over torch.save + fsync of the first state",
    "restore": f"the version at step c + 1 (a chain's end) and the same state from 'off' (a "
    f"keyframe), full Store.restore, {RESTORE_ROUNDS} rounds in turn, median; every restore "
    "compared bit for bit (BLAKE3 of each tensor's dtype, shape and bytes; plain values) with "
    "the committed state",
    "chain_check": "after each commit Store.show(version).longest_chain is checked against the "
    "store's chain length; a deeper version fails the workload",
}


# ---- first commit: what delta coding's base cache costs a commit with no base yet (issue 17) ---------

FIRST_MODES = ("off", "on", "save")  # CASCKPT_DELTA_MEMORY=0, the default, torch.save + fsync
FIRST_RSS_SLACK = 256 << 20  # target: extra peak RSS <= 10% of the state + 256 MiB


@dataclass(frozen=True)
class FirstCommit:
    """Medians over rounds of one fresh process per mode: a single fp32 tensor's first commit."""

    nbytes: int
    wall_s: dict[str, float]
    peak_extra: dict[str, int]  # peak RSS over the process's RSS before the call
    held: int  # bytes the base cache holds after the commit (mode "on")

    def ratio(self, a: str, b: str) -> float:
        return self.wall_s[a] / self.wall_s[b]


def _first_child(mode: str, nbytes: int, workdir: Path) -> dict[str, Any]:
    """In a fresh process: commit (or torch.save) one new ``nbytes`` fp32 tensor."""
    from casckpt.testing.internals import internals

    tensor = torch.randn(nbytes // 4)
    path, held = workdir / mode, 0
    if mode == "save":
        _, wall, rss = measure.timed_with_rss(lambda: measure.torch_save_fsync({"t": tensor}, path))
    else:
        with casckpt.open(path) as store:
            _, wall, rss = measure.timed_with_rss(lambda: store.commit({"t": tensor}, run="r", step=0))
            held = internals(store).context.bases.held
    return {"wall_s": wall, "peak_extra": rss, "held": held}


def first_commit(nbytes: int, workdir: Path, log: Log, rounds: int = 2) -> FirstCommit:
    """Each mode in its own fresh process, ``rounds`` times in alternating order; medians."""
    import json
    import os
    import subprocess
    import sys

    walls: dict[str, list[float]] = {m: [] for m in FIRST_MODES}
    rss: dict[str, list[int]] = {m: [] for m in FIRST_MODES}
    held = 0
    for r in range(rounds):
        for mode in FIRST_MODES if r % 2 == 0 else FIRST_MODES[::-1]:
            env = dict(os.environ)
            env.pop("CASCKPT_DELTA_MEMORY", None)
            if mode == "off":
                env["CASCKPT_DELTA_MEMORY"] = "0"
            where = workdir / f"first-{r}-{mode}"
            where.mkdir(parents=True)
            log(f"{NAME} first commit: {measure.fmt_bytes(nbytes)} tensor, delta {mode}, round {r + 1}")
            out = subprocess.run([sys.executable, "-m", "benchmarks.delta", "--first-child", mode,
                                  str(nbytes), str(where)], env=env, check=True, capture_output=True,
                                 text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            walls[mode].append(got["wall_s"])
            rss[mode].append(got["peak_extra"])
            held = max(held, got["held"])
            measure.remove(where)
    return FirstCommit(nbytes, {m: statistics.median(v) for m, v in walls.items()},
                       {m: int(statistics.median(v)) for m, v in rss.items()}, held)


def first_commit_table(first: FirstCommit) -> Table:
    """The first commit with delta coding on vs off vs torch.save, against issue 17's targets."""
    table = Table(title=f"First commit of one {measure.fmt_bytes(first.nbytes)} fp32 tensor, fresh "
                  "process per mode, median (targets: on/off <= 1.1x, on/save <= 1.0x, extra RSS "
                  "<= 10% of the state + 256 MiB)")
    for column in ("mode", "wall", "/ off", "/ torch.save", "peak extra RSS", "RSS target", "cache held"):
        table.add_column(column, justify="right", no_wrap=True)
    limit = first.nbytes // 10 + FIRST_RSS_SLACK
    for mode in FIRST_MODES:
        rss, on = first.peak_extra[mode], mode == "on"
        table.add_row(mode, f"{first.wall_s[mode]:.3f} s",
                      _judged(first.ratio(mode, "off"), 1.1 if on else None, _x(first.ratio(mode, "off"))),
                      _judged(first.ratio(mode, "save"), 1.0 if on else None, _x(first.ratio(mode, "save"))),
                      _judged(rss, limit if on else None, measure.fmt_bytes(rss)),
                      measure.fmt_bytes(limit), measure.fmt_bytes(first.held) if on else "")
    return table


def _main() -> None:
    """``python -m benchmarks.delta --scale 0.25 --workloads embed,dense-bf16 --first-mib 1024``:
    issue 17's delta figures alone (the full suite runs the workload through benchmarks/run.py)."""
    import argparse
    import json
    import sys
    import tempfile

    from rich.console import Console

    parser = argparse.ArgumentParser(description=_main.__doc__)
    parser.add_argument("--scale", type=float, default=0.25)
    parser.add_argument("--workloads", default="embed,dense-bf16")
    parser.add_argument("--first-mib", type=int, default=1024, help="first-commit tensor (0: skip)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--first-child", nargs=3, metavar=("MODE", "NBYTES", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_child:
        mode, nbytes, where = args.first_child
        print(json.dumps(_first_child(mode, int(nbytes), Path(where))))
        return
    console = Console()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if args.first_mib:
            console.print(first_commit_table(first_commit(args.first_mib << 20, Path(tmp), log, args.rounds)))
        names = [w for w in args.workloads.split(",") if w]
        if names:
            result = run_delta(args.scale, Path(tmp), log, names)
            for table in tables({NAME: result}):
                console.print(table)


if __name__ == "__main__":
    _main()
