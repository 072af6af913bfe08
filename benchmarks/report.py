"""Ratios against the same-run baseline, targets from BENCHMARKS.md, tables and JSON."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from benchmarks.suite import WorkloadResult

Outcome = WorkloadResult | str  # a result, or the error that stopped the workload


@dataclass(frozen=True)
class Metric:
    """One reported figure: a time ratio, or bytes as a fraction of logical bytes."""

    key: str
    label: str
    kind: Literal["ratio", "fraction"]
    compute: Callable[[WorkloadResult], float | None]


def _over(num: float, den: float) -> float | None:
    return num / den if den else None


METRICS: tuple[Metric, ...] = (
    Metric(
        "commit_first_vs_save",
        "commit, first version / torch.save",
        "ratio",
        lambda r: _over(r.first.wall_s, r.baseline.save_s),
    ),
    Metric(
        "commit_next_vs_save",
        "commit, next version / torch.save",
        "ratio",
        lambda r: _over(r.next.wall_s, r.baseline.save_s),
    ),
    Metric(
        "restore_vs_load",
        "restore, full / torch.load",
        "ratio",
        lambda r: _over(r.restore.full_s, r.baseline.load_s),
    ),
    Metric(
        "tensor_vs_restore",
        "load_tensor, largest / full restore",
        "ratio",
        lambda r: _over(r.restore.tensor_s, r.restore.full_s),
    ),
    Metric(
        "changed_of_logical",
        "bytes that changed / logical",
        "fraction",
        lambda r: _over(r.changed_bytes, r.logical_bytes),
    ),
    Metric(
        "new_first_of_logical",
        "new bytes, first / logical",
        "fraction",
        lambda r: _over(r.first.version["new_bytes"], r.logical_bytes),
    ),
    Metric(
        "new_next_of_logical",
        "new bytes, next / logical",
        "fraction",
        lambda r: _over(r.next.version["new_bytes"], r.logical_bytes),
    ),
    Metric(
        "new_next_vs_changed",
        "new bytes, next / bytes that changed",
        "ratio",
        lambda r: _over(r.next.version["new_bytes"], r.changed_bytes),
    ),
    Metric(
        "stored_first_of_logical",
        "stored bytes, first / logical",
        "fraction",
        lambda r: _over(r.first.version["stored_bytes"], r.logical_bytes),
    ),
    Metric(
        "stored_next_of_logical",
        "stored bytes, next / logical",
        "fraction",
        lambda r: _over(r.next.version["stored_bytes"], r.logical_bytes),
    ),
    Metric(
        "rss_save_of_logical",
        "peak extra RSS, torch.save / logical",
        "fraction",
        lambda r: _over(r.baseline.save_peak_extra_rss, r.logical_bytes),
    ),
    Metric(
        "rss_first_of_logical",
        "peak extra RSS, commit first / logical",
        "fraction",
        lambda r: _over(r.first.peak_extra_rss, r.logical_bytes),
    ),
    Metric(
        "rss_next_of_logical",
        "peak extra RSS, commit next / logical",
        "fraction",
        lambda r: _over(r.next.peak_extra_rss, r.logical_bytes),
    ),
)

# (workload or "*", metric key) -> upper limit, from BENCHMARKS.md "Targets".
TARGETS: Mapping[tuple[str, str], float] = {
    ("unchanged", "commit_next_vs_save"): 0.1,
    ("unchanged", "new_next_of_logical"): 0.001,
    ("frozen", "new_next_vs_changed"): 1.15,
    ("frozen", "commit_next_vs_save"): 0.3,
    ("dense", "commit_first_vs_save"): 1.0,
    ("*", "restore_vs_load"): 1.0,
    ("*", "tensor_vs_restore"): 0.05,
}


def target_for(workload: str, key: str) -> float | None:
    """The BENCHMARKS.md limit for ``key`` on ``workload``, if there is one."""
    return TARGETS.get((workload, key), TARGETS.get(("*", key)))


def evaluate(result: WorkloadResult) -> dict[str, dict[str, Any]]:
    """``{metric: {"value", "target", "met"}}``; ``met`` is None without a target or value."""
    out: dict[str, dict[str, Any]] = {}
    for metric in METRICS:
        value = metric.compute(result)
        target = target_for(result.name, metric.key)
        met = None if value is None or target is None else value <= target
        out[metric.key] = {"value": value, "target": target, "met": met}
    return out


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3g}x" if kind == "ratio" else f"{value * 100:.3g}%"


def _fmt_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.2f} GiB"


def _verdict(met: bool | None) -> str:
    return {True: "[green]pass[/]", False: "[red]miss[/]", None: ""}[met]


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s < 10 else f"{s:.1f} s"


def raw_table(outcomes: Mapping[str, Outcome]) -> Table:
    """Absolute sizes and times, for reading the ratios against."""
    table = Table(title="Raw measurements (same run, same directory)")
    for column in (
        "workload",
        "logical",
        "changed",
        "torch.save",
        "torch.load",
        "commit 1st",
        "commit next",
        "restore",
        "one tensor",
        "verified",
    ):
        table.add_column(column, justify="left" if column == "workload" else "right")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, "[red]crashed[/]")
            continue
        verified = r.restore.full_matches and r.restore.tensor_matches
        table.add_row(
            name,
            _fmt_bytes(r.logical_bytes),
            _fmt_bytes(r.changed_bytes),
            _seconds(r.baseline.save_s),
            _seconds(r.baseline.load_s),
            _seconds(r.first.wall_s),
            _seconds(r.next.wall_s),
            _seconds(r.restore.full_s),
            f"{_seconds(r.restore.tensor_s)} ({_fmt_bytes(r.restore.tensor_bytes)})",
            "[green]yes[/]" if verified else "[red]NO[/]",
        )
    return table


def ratio_table(outcomes: Mapping[str, Outcome], scale: float) -> Table:
    """Every metric of every workload, with its BENCHMARKS.md target and pass/miss."""
    table = Table(title=f"casckpt vs same-run baseline (scale {scale:g})")
    for column in ("workload", "measure", "value", "target", "result"):
        table.add_column(column, justify="right" if column in ("value", "target") else "left")
    for name, r in outcomes.items():
        if isinstance(r, str):
            table.add_row(name, f"[red]crashed: {escape(r)}[/]")
            continue
        scores = evaluate(r)
        for metric in METRICS:
            score = scores[metric.key]
            target = score["target"]
            table.add_row(
                name,
                metric.label,
                _fmt(score["value"], metric.kind),
                "" if target is None else f"<= {_fmt(target, metric.kind)}",
                _verdict(score["met"]),
            )
        table.add_section()
    return table


def print_report(console: Console, outcomes: Mapping[str, Outcome], scale: float) -> None:
    """Print the raw table, then the ratio table."""
    console.print(raw_table(outcomes))
    console.print(ratio_table(outcomes, scale))


NOTES = {
    "ratios": "every time is divided by a baseline measured in the same run, same directory; "
    "bytes are fractions of the state's logical (tensor) bytes",
    "restore_cache": "restore is warm-cache for both baseline and casckpt: torch.load reads the "
    "file just written by torch.save, Store.restore the packs just committed "
    "(dropping the page cache is not possible here)",
    "restore_ref": "restore and load_tensor read the next (second) version",
    "changed_bytes": "total size of tensors whose content (BLAKE3 of dtype, shape, data) "
    "differs between the first and next state",
    "one_tensor": "BENCHMARKS.md states the one-tensor target for a 1 GiB tensor; this uses the "
    "largest tensor of the state, which is smaller",
    "peak_extra_rss": "max RSS sampled every 2 ms from /proc/self/statm minus RSS at the start",
}


def write_json(path: Path, outcomes: Mapping[str, Outcome], header: dict[str, Any]) -> None:
    """Write header, notes, raw numbers and evaluated metrics as JSON to ``path``."""
    results: dict[str, Any] = {}
    for name, r in outcomes.items():
        if isinstance(r, str):
            results[name] = {"error": r}
        else:
            results[name] = {"raw": r.to_dict(), "metrics": evaluate(r)}
    document = {**header, "notes": NOTES, "results": results}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
