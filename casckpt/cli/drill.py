"""``casckpt drill`` (restore drills, made for cron) and ``casckpt advise`` (the checkpoint
interval).

``casckpt drill`` exits 0 when every version drilled restored, 4 (integrity) when any did
not -- naming each on stderr -- and the usual codes for other errors (see ``casckpt
--help``). ``--json`` prints one JSON document on stdout either way: the drill id, whether
it was recorded, ``ok``, and every result. ``casckpt drill --history`` lists past results,
newest first. ``casckpt advise RUN --mtbf 8h`` prints the advised interval in seconds and
in steps, and what the current and advised intervals cost (docs/guides/drills-and-intervals.md).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from casckpt.cli import render
from casckpt.cli.progress import progress_bars
from casckpt.cli.shared import EXIT_INTEGRITY, FLAG, JsonOption, open_store
from casckpt.types import Advice, DrillResult


def _seconds(value: float) -> str:
    """Seconds, readably: ``0.042 s``, ``12.3 s``, ``1.5 h`` (with the seconds)."""
    if value < 10:
        return f"{value:.3g} s"
    if value < 600:
        return f"{value:.1f} s"
    unit, size = ("h", 3600.0) if value >= 5400 else ("min", 60.0)
    return f"{value:.0f} s ({value / size:.1f} {unit})"


def _results_table(results: tuple[DrillResult, ...] | list[DrillResult], *, when: bool) -> Table:
    table = Table(box=None)
    for column in (("when",) if when else ()) + ("version", "id", "bytes", "seconds", "result"):
        table.add_column(column, justify="right" if column in ("bytes", "seconds") else "left")
    for r in results:
        verdict = Text("ok") if r.ok else Text(f"FAILED: {r.error}", style="bold red")
        cells = [f"{r.run}@{r.step}", r.version_id[:12], render.human_bytes(r.bytes), f"{r.seconds:.3f}"]
        if when:
            cells.insert(0, render.local_time(datetime.fromtimestamp(r.at, timezone.utc)))
        table.add_row(*cells, verdict)
    return table


def drill(
    ctx: typer.Context,
    runs: Annotated[list[str] | None, typer.Option(
        "--run", "-r", metavar="RUN",
        help="Drill this run (repeat for more); default: every run.")] = None,
    count: Annotated[int, typer.Option(
        metavar="N", min=1,
        help="Versions to drill in all: the latest of each run, then random older ones.")] = 3,
    seed: Annotated[int | None, typer.Option(
        metavar="S", help="Seed the random choice of older versions (a repeatable drill).")] = None,
    history: Annotated[bool, typer.Option(
        "--history", metavar=FLAG, help="List past drill results instead, newest first.")] = False,
    limit: Annotated[int, typer.Option(
        metavar="N", min=1, help="With --history: at most this many results.")] = 100,
    as_json: JsonOption = False,
) -> None:
    """Restore versions into memory, every byte verified, and record how it went.

    Exits 4 when a version does not restore (each named on stderr), so cron and alerting
    can rely on it. Nothing is written to disk and nothing in the store is repaired; a
    read-only store drills without recording.
    """
    if history:
        with open_store(ctx) as store:
            past = store.ops.drill_history(None if runs else limit)
        if runs:
            past = [r for r in past if r.run in runs][:limit]
        render.emit(as_json, [r.to_dict() for r in past], _results_table(past, when=True),
                    empty="no drills recorded yet: run `casckpt drill`")
        return
    with open_store(ctx) as store, progress_bars() as progress:
        report = store.ops.drill(runs or None, count=count, seed=seed, progress=progress)
    if as_json:
        render.print_json({"ok": report.ok, **report.to_dict()})
    elif not report.results:
        render.note("the store has no versions to drill")
    else:
        render.out(_results_table(report.results, when=False))
    if not report.recorded:
        render.note("casckpt: the store is read-only: this drill was not recorded")
    if not report.ok:
        for r in report.failed:
            render.error(f"drill: {r.run}@{r.step} ({r.version_id[:12]}) did not restore: {r.error}")
        raise typer.Exit(EXIT_INTEGRITY)


def _percent(value: float) -> str:
    return f"{value * 100:.2f} %"


def _advice_table(advice: Advice) -> Table:
    table = Table(title=f"checkpoint interval for {advice.run}", box=None)
    table.add_column("")
    table.add_column("current", justify="right")
    table.add_column("advised", justify="right")
    source = "median of drills" if advice.restore_source == "drills" else "measured now"
    table.add_row("interval",
                  f"{_seconds(advice.current_interval_s)}, {advice.current_interval_steps:g} steps",
                  f"{_seconds(advice.advised_interval_s)}, {advice.advised_interval_steps} steps")
    table.add_row("expected overhead", _percent(advice.expected_overhead["current"]),
                  _percent(advice.expected_overhead["advised"]))
    table.add_row("lost work per failure", _seconds(advice.expected_lost_work_s["current"]),
                  _seconds(advice.expected_lost_work_s["advised"]))
    table.add_section()
    table.add_row(f"checkpoint cost (median stall, {advice.commits} commits)",
                  _seconds(advice.checkpoint_cost_s), "")
    table.add_row(f"restore ({source})", _seconds(advice.restore_s), "")
    table.add_row("restart", _seconds(advice.restart_s), "")
    table.add_row("MTBF", _seconds(advice.mtbf_s), "")
    table.add_row("Young's interval sqrt(2CM)", "", _seconds(advice.young_interval_s))
    table.add_row("step rate", f"{advice.step_rate:.3g} steps/s", "")
    return table


def advise(
    ctx: typer.Context,
    run: Annotated[str, typer.Argument(help="The run to advise on.")],
    mtbf: Annotated[str, typer.Option(
        metavar="AGE", help="Mean time between failures of the job (e.g. 8h, 3d).")],
    restart: Annotated[str, typer.Option(
        metavar="AGE", help="Time to get the job running again, before the restore (e.g. 5m).")] = "0s",
    as_json: JsonOption = False,
) -> None:
    """Advise how often to checkpoint RUN (Young/Daly), from its measured stall and restore time."""
    with open_store(ctx) as store:
        advice = store.ops.advise(run, mtbf=mtbf, restart=restart)
    render.emit(as_json, advice.to_dict(), _advice_table(advice), Text(
        f"Checkpoint every {advice.advised_interval_steps} steps "
        f"(about {_seconds(advice.advised_interval_s)}); Daly's formula, see "
        "docs/guides/drills-and-intervals.md for its assumptions."))


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command (in their order in help)."""
    app.command()(drill)
    app.command()(advise)
