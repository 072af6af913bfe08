"""``casckpt import`` and ``casckpt export``: existing checkpoints in, directories out;
``casckpt copy``: versions into another store.

Both read or write tensors, so torch is imported inside the commands only (the
catalog-only commands stay torch-free).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import RenderableType

from casckpt.cli import render
from casckpt.cli.progress import progress_bars
from casckpt.cli.shared import FLAG, JsonOption, RefArgument, open_store
from casckpt.types import CopyReport


def import_checkpoint(
    ctx: typer.Context,
    file_or_dir: Annotated[Path, typer.Argument(
        help="A .pt/.bin/.ckpt/.pth file (loaded weights-only), a .safetensors file, a DCP "
             "checkpoint directory or a Hugging Face model directory.")],
    run: Annotated[str, typer.Option("--run", metavar="RUN", help="Run to commit to.")],
    step: Annotated[int, typer.Option("--step", metavar="N", help="Step of the new version.")],
    message: Annotated[str | None, typer.Option("--message", "-m", metavar="TEXT",
                                                help="Message of the new version.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Import an existing checkpoint as version RUN@N (tensors and plain values).

    Pickles are loaded with torch.load(weights_only=True) only: one that needs code
    execution is refused, naming the global torch refused. Safetensors headers are
    validated before any tensor is read. See docs/guides/import-export.md for the state
    each kind becomes.
    """
    with open_store(ctx, drain=True) as store, progress_bars() as progress:
        version = store.import_checkpoint(file_or_dir, run=run, step=step, message=message,
                                          progress=progress)
    render.emit(as_json, {"version": version.to_dict(), "source": str(file_or_dir)},
                f"Imported {file_or_dir} as {version.short_id} ({version.run}@{version.step}): "
                f"{render.human_bytes(version.logical_bytes)} of tensors, "
                f"{render.human_bytes(version.new_bytes)} new")


def export(
    ctx: typer.Context,
    ref: RefArgument,
    to: Annotated[Path, typer.Option("--to", metavar="DIR", help="Directory to write.", file_okay=False)],
    fmt: Annotated[str, typer.Option(
        "--format", metavar="safetensors|dcp|pt",
        help="safetensors: DIR/model.safetensors (a Hugging Face import: the model directory "
             "again); dcp: a torch.distributed.checkpoint directory; pt: DIR/checkpoint.pt.",
    )] = "safetensors",
    force: Annotated[bool, typer.Option("--force", "-f", metavar=FLAG,
                                        help="Write into a non-empty DIR.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Export a version into a directory as safetensors, DCP or torch.save."""
    with open_store(ctx) as store, progress_bars() as progress:
        version = store.resolve(ref)
        result = store.export(version, to, format=fmt, overwrite=force, progress=progress)
    kind = " (a Hugging Face model directory)" if result.huggingface else ""
    render.emit(as_json, {"version": version.to_dict(), "directory": str(result.directory),
                          "format": result.format, "files": list(result.files),
                          "huggingface": result.huggingface},
                f"Wrote {version.short_id} ({version.run}@{version.step}) to {result.directory} "
                f"as {result.format}{kind}: {', '.join(result.files)}")


def copy(
    ctx: typer.Context,
    refs: Annotated[list[str], typer.Argument(
        metavar="REF...", help="Versions to copy: run@step, run@latest, tag:NAME, an id prefix, or a "
                               "run's name for all its versions.")],
    to: Annotated[str, typer.Option(
        "--to", metavar="STORE", help="The destination store's directory (a new store is created where "
                                      "there is none; its casckpt.toml names remote locations, catalog).")],
    to_key_file: Annotated[Path | None, typer.Option(
        "--to-key-file", metavar="FILE", help="Master key file of an encrypted destination.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar=FLAG,
                                          help="Say what would be sent; write nothing.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Copy versions into another store, with their ancestors, tags and metrics.

    Only the chunks the destination lacks are sent; a copy again sends nothing. Versions
    keep their ids, except between stores keyed differently (encrypted with another key, or
    one encrypted and one not), where each is committed again and gets a new id. See
    docs/guides/copy.md.
    """
    with open_store(ctx) as source:
        runs = {r.name for r in source.runs()}
        for ref in refs:  # a bad ref fails before the destination is opened (or created)
            if ref not in runs:
                source.resolve(ref)
        with progress_bars() as progress:
            report = source.copy(refs, to=to, dry_run=dry_run, progress=progress, to_key_file=to_key_file)
    render.emit(as_json, report.to_dict() | {"nothing_sent": report.nothing_sent, "destination": to},
                *copy_view(report, to))


def copy_view(report: CopyReport, to: str) -> list[RenderableType]:
    """A copy's versions as a table, and what was sent."""
    table = render.table_of("version", "id", "status", "chunks", "bytes", right=("chunks", "bytes"))
    for v in report.versions:
        status = ("would copy" if report.dry_run else "copied") if v.sent else "present"
        if not v.asked and v.sent:
            status += " (ancestor)"
        table.add_row(f"{v.run}@{v.step}", v.id[:12], status, str(v.chunks), render.human_bytes(v.bytes))
    if report.nothing_sent:
        summary = f"Nothing to send: {to} holds every version asked for."
    elif report.dry_run:
        summary = (f"Dry run: would send {report.chunks} chunk(s), {render.human_bytes(report.bytes)}, "
                   f"to {to}.")
    else:
        summary = (f"Sent {report.chunks} chunk(s), {render.human_bytes(report.bytes)} "
                   f"({render.human_bytes(report.stored_bytes)} stored) to {to} "
                   f"in {report.seconds:.1f} s.")
    if report.tags:
        summary += f" Tags set: {', '.join(report.tags)}."
    if report.tags_kept:
        summary += (f" Tags left on the destination's own versions: {', '.join(report.tags_kept)} "
                    "(move them there with `casckpt tag` if the copies should have them).")
    if report.degraded_packs:
        summary += (f" DEGRADED: {report.degraded_packs} pack(s) stored below their redundancy at {to} "
                    "(the warning above says why; `casckpt check` there lists them). The copied versions "
                    "are readable; `casckpt repair` there restores the redundancy once its locations "
                    "are back.")
    return [table, summary]


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command (in their order in help)."""
    app.command("import")(import_checkpoint)
    app.command()(export)
    app.command()(copy)
