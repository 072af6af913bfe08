"""The report's sections: for each, a plot (or why there is none) and the same data as a table.

Each builder takes the :class:`~casckpt.report.data.ReportData` and returns a
:class:`Section`; the page (:mod:`casckpt.report.page`) only lays them out.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from casckpt.report.data import ReportData, RunData
from casckpt.report.svg import (
    BAD_COLOUR,
    FOREGROUND,
    OK_COLOUR,
    PALETTE,
    WARN_COLOUR,
    Axes,
    MaxNLocator,
    Patch,
    Plot,
    bytes_axis,
    figure,
    human_bytes,
    legend,
    render,
)
from casckpt.types import Version

MAX_METRICS = 6  # metric plots per report; the table lists every metric


@dataclass(frozen=True, slots=True)
class Table:
    """A plot's data: column headers and rows of display text."""

    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class Section:
    """One titled part of the report: ``plot`` is None when there is no data (``empty`` says so)."""

    key: str
    title: str
    intro: str
    plot: Plot | None
    table: Table
    empty: str = ""


def run_colours(data: ReportData) -> dict[str, str]:
    return {r.name: PALETTE[i % len(PALETTE)] for i, r in enumerate(data.runs)}


def _in_commit_order(data: ReportData) -> list[Version]:
    return sorted((v for r in data.runs for v in r.versions), key=lambda v: (v.created_at, v.run, v.step))


def when(at: datetime | float) -> str:
    moment = at if isinstance(at, datetime) else datetime.fromtimestamp(at, timezone.utc)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def space(data: ReportData) -> Section:
    """Cumulative logical, new and stored bytes over the versions, in commit order."""
    versions = _in_commit_order(data)
    logical = new = stored = 0
    rows, series = [], []
    for v in versions:
        logical, new, stored = logical + v.logical_bytes, new + v.new_bytes, stored + v.stored_bytes
        series.append((logical, new, stored))
        rows.append((f"{v.run}@{v.step}", human_bytes(logical), human_bytes(new), human_bytes(stored)))
    table = Table(("version", "logical (cumulative)", "new after dedup", "stored"), tuple(rows))
    intro = ("What N full copies would take (logical) against the bytes the store wrote: "
             "new after dedup, then stored after compression and delta coding.")
    if not versions:
        return Section("space", "Space saved", intro, None, table, "No versions yet.")
    with figure("space") as (fig, (ax,)):
        xs = range(1, len(series) + 1)
        for i, label in enumerate(("logical", "new after dedup", "stored")):
            ax.plot(xs, [s[i] for s in series], label=label, color=PALETTE[i],
                    marker="." if len(xs) < 60 else None)
        ax.fill_between(xs, [s[2] for s in series], [s[0] for s in series], color=PALETTE[0], alpha=0.15)
        ax.set_xlabel("versions committed")
        ax.set_ylabel("cumulative bytes")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        bytes_axis(ax.yaxis)
        legend(fig, ax)
        plot = render(fig, "space")
    return Section("space", "Space saved", intro, plot, table)


def new_bytes(data: ReportData) -> Section:
    """New (raw) and stored bytes of each commit, coloured by run."""
    versions = _in_commit_order(data)
    colours = run_colours(data)
    table = Table(("version", "created", "logical", "new", "stored", "commit s"), tuple(
        (f"{v.run}@{v.step}", when(v.created_at), human_bytes(v.logical_bytes), human_bytes(v.new_bytes),
         human_bytes(v.stored_bytes), f"{v.duration_s:.2f}") for v in versions))
    intro = "Bytes each commit added: the first commit of a run writes most; later ones only what changed."
    if not versions:
        return Section("new-bytes", "New bytes per commit", intro, None, table, "No versions yet.")
    with figure("new-bytes") as (fig, (ax,)):
        xs = list(range(1, len(versions) + 1))
        ax.bar(xs, [v.stored_bytes for v in versions], color=[colours[v.run] for v in versions])
        ax.plot(xs, [v.new_bytes for v in versions], "_", color=FOREGROUND, markersize=8, label="new (raw)")
        handles = [*ax.get_legend_handles_labels()[0],
                   *(Patch(color=colour, label=name) for name, colour in colours.items())]
        ax.set_xlabel("versions committed")
        ax.set_ylabel("stored bytes")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        bytes_axis(ax.yaxis)
        legend(fig, ax, handles)
        plot = render(fig, "new-bytes")
    return Section("new-bytes", "New bytes per commit", intro, plot, table)


def metrics(data: ReportData) -> Section:
    """Each metric over the steps of every run, tagged and best versions marked."""
    names = sorted({m for r in data.runs for v in r.versions for m in v.metrics})
    rows = []
    for r in data.runs:
        for v in r.versions:
            for m in sorted(v.metrics):
                best = r.best.get(m)
                mark = f"best ({best[0]})" if best is not None and best[1] == v.id else ""
                rows.append((r.name, str(v.step), m, f"{v.metrics[m]:.6g}", ", ".join(v.tags), mark))
    table = Table(("run", "step", "metric", "value", "tags", "best"), tuple(rows))
    intro = ("Metrics recorded with each commit. Triangles mark tagged versions, stars the best version "
             "of each run (by the run's keep_best retention, else by the metric's name: loss lowest, "
             "accuracy highest).")
    if not names:
        return Section("metrics", "Metrics", intro, None, table, "No version records metrics.")
    shown = names[:MAX_METRICS]
    colours = run_colours(data)
    with figure("metrics", 2.2 * len(shown) + 0.4, rows=len(shown)) as (fig, axes):
        for ax, metric in zip(axes, shown, strict=True):
            for r in data.runs:
                _metric_line(ax, r, metric, colours[r.name])
            ax.set_ylabel(metric)
        axes[-1].set_xlabel("step")
        legend(fig, axes[0])
        plot = render(fig, "metrics")
    return Section("metrics", "Metrics", intro, plot, table)


def _metric_line(ax: Axes, run: RunData, metric: str, colour: str) -> None:
    points = [(v, float(v.metrics[metric])) for v in run.versions
              if isinstance(v.metrics.get(metric), (int, float)) and math.isfinite(v.metrics[metric])]
    if not points:
        return
    ax.plot([v.step for v, _ in points], [y for _, y in points], color=colour, label=run.name)
    tagged = [(v, y) for v, y in points if v.tags]
    ax.scatter([v.step for v, _ in tagged], [y for _, y in tagged], marker="^", s=40,
               color=colour, edgecolors=FOREGROUND, zorder=3)
    for v, y in tagged:
        ax.annotate(", ".join(v.tags), (v.step, y), textcoords="offset points", xytext=(4, 6),
                    fontsize=7)
    best = run.best.get(metric)
    for v, y in points:
        if best is not None and v.id == best[1]:
            ax.scatter([v.step], [y], marker="*", s=140, color=colour, edgecolors=FOREGROUND,
                       zorder=4)


def lineage(data: ReportData) -> Section:
    """Runs as lines over their steps, forks drawn from their parent's fork step."""
    nodes = list(data.lineage)
    steps = {r.name: [v.step for v in r.versions] for r in data.runs}
    table = Table(("run", "forked from", "fork step", "versions", "steps"), tuple(
        (n.name, n.parent_run or ("a deleted version" if n.fork_version else ""),
         "" if n.fork_step is None else str(n.fork_step), str(n.versions),
         f"{min(steps[n.name])}..{max(steps[n.name])}" if steps.get(n.name) else "") for n in nodes))
    intro = "Each run is a line over its steps; a fork starts at the version of the run it branched from."
    if not nodes:
        return Section("lineage", "Lineage", intro, None, table, "No runs yet.")
    row = {n.name: i for i, n in enumerate(nodes)}
    colours = run_colours(data)
    with figure("lineage", 0.45 * len(nodes) + 1.2) as (fig, (ax,)):
        for n in nodes:
            y, xs = row[n.name], steps.get(n.name, [])
            start = n.fork_step if n.fork_step is not None else (xs[0] if xs else 0)
            if xs:
                ax.plot([start, *xs], [y] * (len(xs) + 1), color=colours[n.name], linewidth=2)
                ax.scatter(xs, [y] * len(xs), color=colours[n.name], s=14, zorder=3)
            if n.parent_run in row and n.fork_step is not None:
                ax.plot([n.fork_step, n.fork_step], [row[n.parent_run], y], color=colours[n.name],
                        linestyle=":", linewidth=1.5)
                ax.scatter([n.fork_step], [row[n.parent_run]], marker="o", s=50, facecolors="none",
                           edgecolors=colours[n.name], zorder=4)
        ax.set_yticks(range(len(nodes)), [n.name for n in nodes])
        ax.invert_yaxis()
        ax.set_xlabel("step")
        ax.grid(axis="y", visible=False)
        plot = render(fig, "lineage")
    return Section("lineage", "Lineage", intro, plot, table)


def storage_by_run(data: ReportData) -> Section:
    """Logical, new and stored bytes summed per run."""
    sums = [(r.name, sum(v.logical_bytes for v in r.versions), sum(v.new_bytes for v in r.versions),
             sum(v.stored_bytes for v in r.versions)) for r in data.runs]
    table = Table(("run", "logical", "new", "stored"), tuple(
        (name, human_bytes(a), human_bytes(b), human_bytes(c)) for name, a, b, c in sums))
    intro = ("Where the space goes: a chunk counts for the run whose commit first wrote it, "
             "so a fork costs only what it changed.")
    if not sums:
        return Section("storage", "Storage by run", intro, None, table, "No runs yet.")
    with figure("storage", 0.5 * len(sums) + 1.2) as (fig, (ax,)):
        ys = range(len(sums))
        for i, label in enumerate(("logical", "new", "stored")):
            ax.barh([y + (i - 1) * 0.27 for y in ys], [s[i + 1] for s in sums], height=0.26,
                    color=PALETTE[i], label=label)
        ax.set_yticks(list(ys), [s[0] for s in sums])
        ax.invert_yaxis()
        bytes_axis(ax.xaxis)
        legend(fig, ax)
        plot = render(fig, "storage")
    return Section("storage", "Storage by run", intro, plot, table)


def durability(data: ReportData) -> Section:
    """Versions per run by durability: durable, on a fast tier only, or lost."""
    states = ("durable", "fast", "lost")
    counts = [(r.name, Counter(v.durability for v in r.versions)) for r in data.runs]
    table = Table(("run", *states), tuple((name, *(str(c[s]) for s in states)) for name, c in counts))
    intro = ("Durable versions are on the store's locations with their redundancy; fast ones only on a "
             "host's fast tier until they drain; lost ones lost their tier first.")
    if not any(sum(c.values()) for _, c in counts):
        return Section("durability", "Versions by durability", intro, None, table, "No versions yet.")
    with figure("durability", 0.5 * len(counts) + 1.2) as (fig, (ax,)):
        left = [0] * len(counts)
        for state, colour in zip(states, (OK_COLOUR, WARN_COLOUR, BAD_COLOUR), strict=True):
            widths = [c[state] for _, c in counts]
            ax.barh(range(len(counts)), widths, left=left, color=colour, label=state)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.set_yticks(range(len(counts)), [name for name, _ in counts])
        ax.invert_yaxis()
        ax.set_xlabel("versions")
        legend(fig, ax)
        plot = render(fig, "durability")
    return Section("durability", "Versions by durability", intro, plot, table)


BUILDERS: Sequence[Callable[[ReportData], Section]] = (
    space, new_bytes, metrics, lineage, storage_by_run, durability)
