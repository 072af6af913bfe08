"""``casckpt report``: the store as one self-contained HTML file (plots and their tables).

Reads only (a read-only store can report); probes the locations once for their health.
Needs the ``report`` extra (matplotlib): without it the command exits 5 naming the extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from casckpt.cli import render
from casckpt.cli.shared import open_store


def report(
    ctx: typer.Context,
    html: Annotated[Path, typer.Option("--html", metavar="FILE",
        help="Write the report to FILE (one HTML file, viewable offline).")],
    run: Annotated[list[str] | None, typer.Option("--run", "-r", metavar="RUN",
        help="Only this run in the per-run plots (repeat for more; default: every run).")] = None,
) -> None:
    """Write an HTML report: space saved, new bytes, metrics, lineage, storage, gc, locations, drills."""
    with open_store(ctx) as store:
        written = store.ops.report(html, runs=run or None)
    render.out(f"Wrote report {written}")


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command."""
    app.command()(report)
