"""What a report shows, read from a store through its public queries only.

:func:`collect` asks the store (anything with the :class:`ReportSource` methods: a
:class:`casckpt.Store`) for its runs, their versions, the lineage, space accounting,
gc history (the audit trail's ``gc`` rows), location health, restore drills and mirrors, and returns
one frozen :class:`ReportData`. Nothing here writes, and nothing here knows about HTML.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from casckpt.errors import InvalidArgumentError
from casckpt.mirror_rules import MirrorInfo
from casckpt.reports import DrillResult, LocationInfo, StoreStats
from casckpt.types import AuditEntry, RetentionPolicy, RunInfo, RunNode, Version

DRILL_LIMIT = 200  # the newest drill results a report shows
# metric names that say which way is better (a run's keep_best retention says it for its metric)
_LOWER = frozenset({"loss", "error", "err", "perplexity", "ppl", "wer", "cer", "mse", "mae", "rmse", "nll"})
_HIGHER = frozenset({"acc", "accuracy", "f1", "score", "reward", "auc", "bleu", "rouge", "precision",
                     "recall", "map", "iou", "top1", "top5"})


class OpsSource(Protocol):
    """The operator queries a report reads (``store.ops``)."""

    def stats(self) -> StoreStats: ...
    def audit(self, *, action: str | None = None) -> list[AuditEntry]: ...
    def drill_history(self, limit: int = 100, run: str | None = None) -> Sequence[DrillResult]: ...


class LocationsSource(Protocol):
    """The location health a report shows (``store.locations``)."""

    def list(self) -> list[LocationInfo]: ...


class RetentionSource(Protocol):
    """The retention policies a report reads (``store.retention``)."""

    def get(self, run: str) -> RetentionPolicy | None: ...


class MirrorsSource(Protocol):
    """The mirrors a report shows (``store.mirrors``)."""

    def list(self) -> list[MirrorInfo]: ...


class ReportSource(Protocol):
    """The read-only queries a report needs; :class:`casckpt.Store` has them all."""

    def runs(self) -> list[RunInfo]: ...
    def lineage(self) -> list[RunNode]: ...
    def log(self, run: str | None = None, *, order: str = "desc") -> list[Version]: ...
    @property
    def ops(self) -> OpsSource: ...
    @property
    def locations(self) -> LocationsSource: ...
    @property
    def retention(self) -> RetentionSource: ...
    @property
    def mirrors(self) -> MirrorsSource: ...


@dataclass(frozen=True, slots=True)
class RunData:
    """One run's visible versions (ascending step) and, per metric, its best version.

    ``best`` maps a metric to ``(mode, version id)``: the mode is the run's retention
    ``keep_best`` mode for that metric, else what the metric's name says (``val_loss``: min,
    ``accuracy``: max; a name that says neither gets no best); ties go to the latest step,
    as :meth:`casckpt.Store.best` breaks them.
    """

    name: str
    versions: tuple[Version, ...]
    best: Mapping[str, tuple[str, str]]


@dataclass(frozen=True, slots=True)
class ReportData:
    """Everything a report shows, read at ``generated_at``."""

    title: str
    generated_at: datetime
    stats: StoreStats
    runs: tuple[RunData, ...]
    lineage: tuple[RunNode, ...]  # the runs shown, depth first
    gc_runs: tuple[AuditEntry, ...]  # oldest first
    locations: tuple[LocationInfo, ...]
    drills: tuple[DrillResult, ...]  # newest first
    mirrors: tuple[MirrorInfo, ...] = ()  # by name


def collect(source: ReportSource, runs: Sequence[str] | None = None, *,
            title: str = "casckpt store") -> ReportData:
    """Read what a report shows from ``source``: every run, or only ``runs`` (in lineage order).

    Store-wide sections (space, gc history, locations) cover the whole store either way.

    Raises:
        InvalidArgumentError: ``runs`` is a str or holds something other than run names.
        RefNotFoundError: a run in ``runs`` does not exist (near names suggested).
    """
    wanted = _wanted(runs)
    lineage = tuple(n for n in source.lineage() if wanted is None or n.name in wanted)
    if wanted is not None:
        missing = sorted(wanted - {n.name for n in lineage})
        for name in missing:
            source.log(name)  # raises RefNotFoundError with its suggestions
    run_data = tuple(_run_data(source, node.name) for node in lineage)
    drills = tuple(d for d in source.ops.drill_history(limit=DRILL_LIMIT)
                   if wanted is None or d.run in wanted)
    return ReportData(
        title=title, generated_at=datetime.now(timezone.utc), stats=source.ops.stats(), runs=run_data,
        lineage=lineage, gc_runs=tuple(source.ops.audit(action="gc")),
        locations=tuple(source.locations.list()), drills=drills, mirrors=tuple(source.mirrors.list()))


def _mode(metric: str) -> str | None:
    """Whether lower or higher ``metric`` is better, from its name; None when the name does not say."""
    words = set(re.split(r"[^a-z0-9]+", metric.lower()))
    if words & _HIGHER:
        return "max"
    return "min" if words & _LOWER else None


def _wanted(runs: Sequence[str] | None) -> frozenset[str] | None:
    if runs is None:
        return None
    if isinstance(runs, str) or not all(isinstance(r, str) and r for r in runs):
        raise InvalidArgumentError(f"runs must be a list of run names, got {runs!r}")
    return frozenset(runs) or None


def _run_data(source: ReportSource, name: str) -> RunData:
    versions = tuple(source.log(name, order="asc"))
    policy = source.retention.get(name)
    kept = policy.keep_best if policy is not None else None
    metrics = sorted({m for v in versions for m in v.metrics})
    best: dict[str, tuple[str, str]] = {}
    for metric in metrics:
        mode = kept[2] if kept is not None and kept[0] == metric else _mode(metric)
        if mode is None:
            continue
        scored = [v for v in versions if isinstance(v.metrics.get(metric), (int, float))
                  and math.isfinite(v.metrics[metric])]
        if not scored:
            continue
        sign = 1.0 if mode == "min" else -1.0
        # lowest (or highest) value; ties go to the latest step
        winner = min(scored, key=lambda v: (sign * float(v.metrics[metric]), -v.step))
        best[metric] = (mode, winner.id)
    return RunData(name=name, versions=versions, best=best)
