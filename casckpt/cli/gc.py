"""``casckpt gc``: retention and garbage collection, made for cron.

Exit codes: 0 done (or dry run printed), 6 another gc holds the lock (try
later), 7 gc refused to delete anything because the catalog does not prove
it safe (the message says what to look at), 8 denied (the credentials may not delete:
gc needs the admin role; the message names the right), and the usual codes for other
errors (see ``casckpt --help``).

Output: one readable line on stderr saying what the run did (a dry run:
would do). ``--json`` prints exactly one line of JSON on stdout -- the
counts, bytes freed now and later, per run how many versions retention keeps
and deletes -- also when gc fails (``{"ok": false, "error": ..., "exit_code":
...}``), so ``casckpt gc --json >> gc.jsonl`` from cron is a JSON Lines log.
``--explain`` adds every version's retention decision and the rule behind it
(tables; with ``--json``, a ``"decisions"`` member).

A run killed with -9 prints no line, so summing the lines undercounts: ``--history``
(optionally ``--since 24h``) runs no gc and shows every run's counts as the catalog recorded
them, in the transactions that deleted what they count, killed runs included, and the totals.
"""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from casckpt.cli import logs, render
from casckpt.cli.progress import progress_bars
from casckpt.cli.shared import FLAG, JsonOption, exit_code_for, open_store
from casckpt.errors import CasckptError
from casckpt.retention_rules import parse_duration
from casckpt.types import GCReport, GCRun


def _summary(report: GCReport) -> Table:
    would = report.dry_run
    table = Table(title="gc (dry run: nothing was changed)" if would else "gc", box=None)
    table.add_column("what")
    table.add_column("count", justify="right")
    if not report.space_counted:  # a read-only store: retention only
        table.add_row("would be versions deleted by retention", str(report.versions_deleted))
        table.add_row("would be deleted versions purged", str(report.versions_purged))
        table.add_row("space", "not counted: a read-only store marks nothing")
        return table
    rows = [
        ("versions deleted by retention", report.versions_deleted),
        ("deleted versions purged", report.versions_purged),
        ("chunks condemned (unreferenced)", report.chunks_condemned),
        ("chunks revived", report.chunks_revived),
        ("chunks swept", report.chunks_swept),
        ("packs deleted", report.packs_deleted),
        ("packs repacked", report.packs_repacked),
        ("orphan objects deleted", report.orphans_deleted),
        ("chunks kept only as delta bases of live chunks", report.chunks_kept_as_bases),
        ("objects kept: not provably garbage", len(report.kept)),
    ]
    for label, value in rows:
        table.add_row(f"would be {label}" if would else label, str(value))
    table.add_row("bytes freed by this run" if not would else "bytes this run would free",
                  render.human_bytes(report.bytes_freed))
    table.add_row("bytes freed by a later gc (grace period)", render.human_bytes(report.bytes_pending))
    table.add_row("grace period", f"{report.grace_s:g} s")
    return table


def _per_run(report: GCReport) -> list[Text]:
    verb = "would delete" if report.dry_run else "deleted"
    return [Text(f"retention of {plan.run}: keeps {len(plan.decisions) - len(plan.deleted)}, "
                 f"{verb} {len(plan.deleted)}") for plan in report.retention]


def _decisions(report: GCReport) -> list[Table]:
    tables = []
    for plan in report.retention:
        table = Table(title=f"retention of {plan.run}", box=None)
        for column in ("step", "id", "decision", "kept by"):
            table.add_column(column)
        for d in plan.decisions:
            verdict = Text("keep") if d.keep else Text("delete", style="red")
            table.add_row(str(d.version.step), d.version.short_id, verdict,
                          ", ".join(d.reasons) or "-")
        tables.append(table)
    return tables


_TOTALS = ("versions_deleted", "versions_purged", "chunks_swept", "packs_deleted", "orphans_deleted",
           "bytes_freed")


def _history(runs: list[GCRun], as_json: bool) -> None:
    """Every run's counts and their totals (the true totals: killed runs included)."""
    total = {name: sum(getattr(r, name) for r in runs) for name in _TOTALS}
    if as_json:
        _json_line({"runs": [r.to_dict() for r in runs], "total": {"runs": len(runs), **total}})
        return
    table = Table(title="gc runs (counts as committed to the catalog)", box=None)
    for column in ("run", "started", "outcome", "versions deleted", "purged", "packs deleted",
                   "bytes freed"):
        table.add_column(column, justify="left" if column in ("started", "outcome") else "right")
    for r in runs:
        started = render.local_time(datetime.fromtimestamp(r.started_at, timezone.utc))
        table.add_row(str(r.id), started, r.outcome, str(r.versions_deleted), str(r.versions_purged),
                      str(r.packs_deleted), render.human_bytes(r.bytes_freed))
    table.add_row(f"total ({len(runs)})", "", "", str(total["versions_deleted"]),
                  str(total["versions_purged"]), str(total["packs_deleted"]),
                  render.human_bytes(total["bytes_freed"]), style="bold")
    render.out(table)


def _json_line(value: dict[str, Any]) -> None:
    sys.stdout.write(render.dumps(value) + "\n")
    sys.stdout.flush()


def gc(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar=FLAG,
        help="Show what would go; change nothing.")] = False,
    grace: Annotated[str, typer.Option(
        metavar="AGE",
        help="Keep deleted versions undeletable and unreferenced data in place this long "
             "(e.g. 6h, 0s).")] = "6h",
    force: Annotated[bool, typer.Option(
        "--force", metavar=FLAG,
        help="Delete even when the locations hold manifests the catalog does not know "
             "or many objects of unknown packs (after `casckpt check`).")] = False,
    explain: Annotated[bool, typer.Option(
        "--explain", metavar=FLAG,
        help="Show every version's retention decision and the rule that keeps it.")] = False,
    history: Annotated[bool, typer.Option(
        "--history", metavar=FLAG,
        help="Run no gc: show what every gc run deleted, killed ones included, and the totals.")] = False,
    since: Annotated[str | None, typer.Option(
        metavar="AGE", help="With --history: only runs started this long ago or later (e.g. 24h).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Apply retention policies and reclaim space; safe while other jobs commit."""
    if since is not None and not history:
        raise typer.BadParameter("--since goes with --history", param_hint="--since")
    if history:
        start = None if since is None else time.time() - parse_duration(since)
        with open_store(ctx) as store:
            _history(store.ops.gc_history(since=start), as_json)
        return
    seconds = parse_duration(grace, allow_zero=True)
    logs.show_info()  # the run's one-line summary, for cron mail and logs
    try:
        with open_store(ctx) as store, progress_bars() as progress:
            report = store.gc(dry_run=dry_run, grace=seconds, force=force, progress=progress)
    except CasckptError as exc:
        if not as_json:
            raise
        code = exit_code_for(exc)
        _json_line({"ok": False, "error": type(exc).__name__, "exit_code": code, "message": str(exc)})
        render.error(str(exc))
        raise typer.Exit(code) from None
    if as_json:
        doc = {"ok": True, **report.summary()}
        if explain:
            doc["decisions"] = [plan.to_dict() for plan in report.retention]
        _json_line(doc)
    else:
        render.out(*(_decisions(report) if explain else _per_run(report)), _summary(report))


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command (in their order in help)."""
    app.command()(gc)
