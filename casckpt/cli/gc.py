"""``casckpt gc``: retention and garbage collection, made for cron.

Exit codes: 0 done (or dry run printed), 6 another gc holds the lock (try
later), 7 gc refused to delete anything because the catalog does not prove
it safe (the message says what to look at), and the usual codes for other
errors (see ``casckpt --help``). One
log line per phase goes to stderr; ``--json`` prints the report on stdout.
"""

from __future__ import annotations

import logging
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from casckpt.cli import render
from casckpt.cli.main import JsonOption, _open_store, app
from casckpt.cli.progress import progress_bars
from casckpt.engine.retention import parse_duration
from casckpt.types import GCReport


def _summary(report: GCReport) -> Table:
    table = Table(title="gc (dry run: nothing was changed)" if report.dry_run else "gc", box=None)
    table.add_column("what")
    table.add_column("count", justify="right")
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
    ]
    for label, value in rows:
        table.add_row(label, str(value))
    table.add_row("bytes freed once swept", render.human_bytes(report.bytes_freed))
    table.add_row("grace period", f"{report.grace_s:g} s")
    return table


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


def _log_to_stderr() -> None:
    """casckpt's own INFO lines (one per gc run) on stderr, for cron mail and logs."""
    logger = logging.getLogger("casckpt")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("casckpt: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@app.command()
def gc(
    ctx: typer.Context,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would go; change nothing.")] = False,
    grace: Annotated[str, typer.Option(
        help="Keep deleted versions undeletable and unreferenced data in place this long "
             "(e.g. 6h, 0s).")] = "6h",
    force: Annotated[bool, typer.Option(
        "--force", help="Delete even when the locations hold manifests the catalog does not know "
                        "or many objects of unknown packs (after `casckpt check`).")] = False,
    as_json: JsonOption = False,
) -> None:
    """Apply retention policies and reclaim space; safe while other jobs commit."""
    seconds = parse_duration(grace, allow_zero=True)
    _log_to_stderr()
    with _open_store(ctx) as store, progress_bars() as progress:
        report = store.gc(dry_run=dry_run, grace=seconds, force=force, progress=progress)
    if as_json:
        render.print_json(report.to_dict())
    else:
        render.out(*_decisions(report), _summary(report))
