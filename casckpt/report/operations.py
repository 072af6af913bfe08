"""The report's operational sections: commit stalls, gc history, location health, restore drills,
mirrors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timezone

from casckpt.report.data import ReportData
from casckpt.report.sections import Section, Table, run_colours, when
from casckpt.report.svg import (
    BAD_COLOUR,
    OK_COLOUR,
    PALETTE,
    WARN_COLOUR,
    bytes_axis,
    figure,
    human_bytes,
    legend,
    render,
)
from casckpt.reports import LocationInfo


def stalls(data: ReportData) -> Section:
    """Each commit's training-visible stall against its whole commit time, per run."""
    points = [(r.name, v.step, v.stall_s, v.duration_s) for r in data.runs for v in r.versions]
    table = Table(("run", "step", "stall s", "commit s"), tuple(
        (name, str(step), "" if stall is None else f"{stall:.3f}", f"{took:.3f}")
        for name, step, stall, took in points))
    intro = ("How long training waited for each commit (a background commit returns early), against "
             "the commit's whole wall time. Versions from before stalls were recorded have none.")
    measured = [p for p in points if p[2] is not None]
    if not measured:
        return Section("stalls", "Commit stalls", intro, None, table, "No commit recorded its stall yet.")
    colours = run_colours(data)
    with figure("stalls") as (fig, (ax,)):
        for r in data.runs:
            mine = [p for p in measured if p[0] == r.name]
            if mine:
                ax.plot([p[1] for p in mine], [p[2] or 0.0 for p in mine], color=colours[r.name], marker=".",
                        label=f"{r.name} stall")
                ax.plot([p[1] for p in mine], [p[3] for p in mine], color=colours[r.name], linestyle=":",
                        label=f"{r.name} commit")
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        legend(fig, ax)
        plot = render(fig, "stalls")
    return Section("stalls", "Commit stalls", intro, plot, table)


def _number(detail: object, key: str) -> int:
    value = detail.get(key) if isinstance(detail, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def gc_history(data: ReportData) -> Section:
    """Bytes each gc run freed, over time (from the audit trail's ``gc`` rows)."""
    runs = data.gc_runs
    headers = ("at", "bytes freed", "versions purged", "packs deleted", "packs repacked", "failed")
    table = Table(headers, tuple(
        (when(e.at), human_bytes(_number(dict(e.detail), "bytes_freed")),
         str(_number(dict(e.detail), "versions_purged")), str(_number(dict(e.detail), "packs_deleted")),
         str(_number(dict(e.detail), "packs_repacked")), str(e.detail.get("failed") or ""))
        for e in runs))
    intro = ("Each garbage collection that ran (dry runs are not recorded): what it freed, "
             "and whether it failed.")
    if not runs:
        return Section("gc", "Garbage collection", intro, None, table, "No gc has run yet (casckpt gc).")
    with figure("gc", 2.6) as (fig, (ax,)):
        xs = list(range(1, len(runs) + 1))
        ax.bar(xs, [_number(dict(e.detail), "bytes_freed") for e in runs],
               color=[BAD_COLOUR if e.detail.get("failed") else PALETTE[0] for e in runs])
        ax.set_xticks(xs, [e.at.astimezone(timezone.utc).strftime("%m-%d %H:%M") for e in runs],
                      rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("bytes freed")
        bytes_axis(ax.yaxis)
        plot = render(fig, "gc")
    return Section("gc", "Garbage collection", intro, plot, table)


def locations(data: ReportData) -> Section:
    """Bytes each location holds, coloured by health (probed when the report was made)."""
    places = data.locations
    headers = ("location", "domain", "state", "reachable", "probe s", "shards", "bytes", "damaged", "reason")
    table = Table(headers, tuple(
        (p.name, p.domain, p.state, "yes" if p.reachable else "no", f"{p.probe_s:.3f}",
         str(p.shards), human_bytes(p.bytes), str(p.damaged), p.reason or "") for p in places))
    intro = ("Every blob location, probed with a real request when this report was made: green answers and "
             "is active, orange is retiring or holds damaged shards, red is failed or did not answer.")
    if not places:
        return Section("locations", "Location health", intro, None, table, "The store has no locations.")
    with figure("locations", 0.45 * len(places) + 1.1) as (fig, (ax,)):
        ax.barh(range(len(places)), [p.bytes for p in places], color=[_health_colour(p) for p in places])
        ax.set_yticks(range(len(places)), [f"{p.name} ({p.domain})" for p in places])
        ax.invert_yaxis()
        bytes_axis(ax.xaxis)
        ax.set_xlabel("bytes held (every copy and shard)")
        plot = render(fig, "locations")
    return Section("locations", "Location health", intro, plot, table)


def _health_colour(place: LocationInfo) -> str:
    if not place.reachable or place.state == "failed":
        return BAD_COLOUR
    return WARN_COLOUR if place.state == "retiring" or place.damaged else OK_COLOUR


def drills(data: ReportData) -> Section:
    """Restore drills over time: seconds each restore took, failures in red."""
    results = sorted(data.drills, key=lambda d: d.at)
    table = Table(("at", "drill", "version", "bytes", "seconds", "result"), tuple(
        (when(d.at), d.drill_id, f"{d.run}@{d.step} ({d.version_id[:12]})", human_bytes(d.bytes),
         f"{d.seconds:.3f}", "ok" if d.ok else f"FAILED: {d.error or ''}") for d in results))
    intro = "Restores rehearsed by casckpt drill: each version read back in full and verified."
    if not results:
        return Section("drills", "Restore drills", intro, None, table,
                       "No restore drills recorded yet: run casckpt drill (from cron, say).")
    with figure("drills", 2.6) as (fig, (ax,)):
        for ok, colour, marker, label in ((True, OK_COLOUR, "o", "ok"), (False, BAD_COLOUR, "X", "failed")):
            mine = [d for d in results if d.ok is ok]
            if mine:
                moments = [d.at / 86400 for d in mine]  # matplotlib dates: days since DATE_EPOCH
                ax.scatter(moments, [d.seconds for d in mine], color=colour, marker=marker, s=36, label=label)
        ax.xaxis_date(timezone.utc)
        ax.set_ylabel("restore seconds")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
        legend(fig, ax)
        plot = render(fig, "drills")
    return Section("drills", "Restore drills", intro, plot, table)


def mirrors(data: ReportData) -> Section:
    """Each mirror: versions its destination holds through it, and those that failed (red)."""
    headers = ("mirror", "destination", "last run", "versions sent", "bytes sent", "failed", "why")
    table = Table(headers, tuple(
        (m.name, m.destination, "never" if m.last_run_at is None else when(m.last_run_at),
         str(m.versions_sent), human_bytes(m.bytes_sent), str(len(m.failed)),
         "; ".join(([f"last run: {m.last_error}"] if m.last_error else [])
                   + [f"{f.run}@{f.step}: {f.error}" for f in m.failed])) for m in data.mirrors))
    intro = ("Mirrors of this store (casckpt mirror): selected versions kept up to date in other stores. "
             "Green: versions the destination holds through the mirror; red: versions whose last copy "
             "failed.")
    if not data.mirrors:
        return Section("mirrors", "Mirrors", intro, None, table,
                       "No mirrors: add one with casckpt mirror add.")
    names = [m.name for m in data.mirrors]
    with figure("mirrors", 0.45 * len(names) + 1.1) as (fig, (ax,)):
        sent = [m.versions_sent for m in data.mirrors]
        ax.barh(range(len(names)), sent, color=OK_COLOUR, label="sent")
        ax.barh(range(len(names)), [len(m.failed) for m in data.mirrors], left=sent, color=BAD_COLOUR,
                label="failed")
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel("versions")
        legend(fig, ax)
        plot = render(fig, "mirrors")
    return Section("mirrors", "Mirrors", intro, plot, table)


BUILDERS: Sequence[Callable[[ReportData], Section]] = (stalls, gc_history, locations, drills, mirrors)
