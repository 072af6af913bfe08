"""``casckpt mirror add|run|status|remove``: keep another store up to date with selected versions.

A mirror is recorded in this (the source) store; ``mirror run`` (from cron) sends what its
selection picks now and the destination lacks, and exits 1 when a version could not be
sent (``mirror status`` says which and why). See docs/guides/mirror.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import RenderableType

from casckpt.cli import render
from casckpt.cli.progress import progress_bars
from casckpt.cli.rules import parse_rules, with_rule_options
from casckpt.cli.shared import EXIT_PROBLEMS, FLAG, JsonOption, open_store
from casckpt.errors import MirrorDestinationError, MirrorsFailedError
from casckpt.types import MirrorInfo, MirrorReport

mirror_app = typer.Typer(
    help="Mirrors: keep another store up to date with selected versions of selected runs.",
    no_args_is_help=True,
)

NameArgument = Annotated[str, typer.Argument(metavar="NAME", help="The mirror's name.")]


@mirror_app.command("add")
@with_rule_options({"keep_tagged": False})
def add(
    ctx: typer.Context,
    name: NameArgument,
    to: Annotated[str, typer.Option("--to", metavar="STORE", help=(
        "The destination store's directory (created by the first run); for one on S3 or Azure, "
        "a directory whose casckpt.toml names it (casckpt init), not a URL."))],
    runs: Annotated[list[str], typer.Option("--run", metavar="RUN", help=(
        "A run to mirror: a name or a glob ('pretrain-*'); repeat for more."))],
    tags: Annotated[list[str] | None, typer.Option("--tag", metavar="TAG", help=(
        "Send the version this tag points at (a name or a glob), and move the tag there when "
        "it moves here; repeat for more."))] = None,
    to_key_file: Annotated[Path | None, typer.Option(
        "--to-key-file", metavar="FILE", help="Master key file of an encrypted destination.")] = None,
    propagate_deletions: Annotated[bool, typer.Option(
        "--propagate-deletions", metavar=FLAG,
        help="Delete at the destination the versions this mirror sent that are deleted here "
             "(default: never delete there).")] = False,
    as_json: JsonOption = False,
    **rules: Any,
) -> None:
    """Add mirror NAME: selected versions of RUNs, sent to STORE by `casckpt mirror run`.

    A version is sent if a --tag points at it or a keep rule (the retention rules:
    --keep-last 1 is the latest, --keep-every 1000 every 1000th step) selects it.
    The destination's own retention applies there.
    """
    with open_store(ctx) as store:
        info = store.mirrors.add(name, to, runs=runs, tags=tags or (),
                                 propagate_deletions=propagate_deletions,
                                 key_file=None if to_key_file is None else str(to_key_file),
                                 **parse_rules(rules))
    render.emit(as_json, info.to_dict(),
                f"Mirror {info.name} -> {info.destination}: {info.selection.describe()}")
    if not as_json:
        render.note(f"send now with: casckpt mirror run {info.name} (or run it from cron)")


@mirror_app.command("run")
def run(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(metavar="[NAME]",
                                               help="Only this mirror (default: every one).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", metavar=FLAG,
                                          help="Say what would be sent; write nothing.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Run a mirror (or every mirror): send what it selects that the destination lacks.

    Every mirror's report is printed, then it exits with the worst code: 5 when a
    destination could not be opened (the other mirrors ran), 1 when a version could not be
    sent (the others are sent; `casckpt mirror status` says why) or a tag here could not be
    moved there (its version is gone there).
    """
    reports: list[MirrorReport] = []
    unreachable: list[tuple[str, str, MirrorDestinationError]] = []
    with open_store(ctx) as store, progress_bars() as progress:
        if name is not None:
            reports = [store.mirrors.push(name, dry_run=dry_run, progress=progress)]
        else:
            where = {m.name: m.destination for m in store.mirrors.list()}
            try:
                reports = store.mirrors.push_all(dry_run=dry_run, progress=progress)
            except MirrorsFailedError as failed:
                reports = list(failed.reports)
                unreachable = [(n, where.get(n, "?"), exc) for n, exc in failed.errors.items()]
    docs = [r.to_dict() | {"nothing_sent": r.nothing_sent, "failed": len(r.failed)} for r in reports]
    docs += [{"mirror": n, "destination": d, "error": str(exc)} for n, d, exc in unreachable]
    views = [part for r in reports for part in run_view(r)]
    views += [f"{n} -> {d}: not run: {exc}" for n, d, exc in unreachable]
    render.emit(as_json, docs[0] if name is not None else sorted(docs, key=lambda d: str(d["mirror"])),
                *views, empty="this store has no mirror")
    if unreachable:
        raise unreachable[0][2]  # exit 5, with its message
    if any(r.failed or r.stale_tags for r in reports):
        raise typer.Exit(EXIT_PROBLEMS)


def run_view(report: MirrorReport) -> list[RenderableType]:
    """A mirror run's versions as a table, and what was sent."""
    table = render.table_of("version", "id", "status", "chunks", "bytes", "why",
                            right=("chunks", "bytes"))
    for v in report.versions:
        why = v.error if v.error is not None else "; ".join(v.reasons)
        table.add_row(f"{v.run}@{v.step}", v.id[:12], v.status, str(v.chunks), render.human_bytes(v.bytes),
                      why)
    head = f"{report.mirror} -> {report.destination}"
    if report.nothing_sent:
        summary = f"{head}: nothing to send, the destination holds every selected version."
    else:
        verb = "would send" if report.dry_run else "sent"
        sent = sum(v.status in ('sent', 'would send') for v in report.versions)
        summary = (f"{head}: {verb} {sent} version(s), {report.chunks} chunk(s), "
                   f"{render.human_bytes(report.bytes)} in {report.seconds:.1f} s." if sent or report.chunks
                   else f"{head}: no version to send.")
    if report.tags:
        summary += f" Tags set: {', '.join(report.tags)}."
    if report.failed:
        summary += f" {len(report.failed)} version(s) failed (see `casckpt mirror status`)."
    if report.stale_tags:
        summary += (f" Tags not carried there (their version here is gone there, and the tag changed here "
                    f"since the mirror last carried it): {', '.join(report.stale_tags)}; undelete the "
                    "version there (the next run carries the tag), or move or remove the tag here.")
    return [table, summary]


@mirror_app.command("status")
def status(ctx: typer.Context, name: Annotated[str | None, typer.Argument(
        metavar="[NAME]", help="Only this mirror.")] = None, as_json: JsonOption = False) -> None:
    """Every mirror: its destination, last run, versions and bytes sent, and what failed and why."""
    with open_store(ctx) as store:
        mirrors = [store.mirrors.get(name)] if name is not None else store.mirrors.list()
    render.emit(as_json, mirrors[0].to_dict() if name is not None else [m.to_dict() for m in mirrors],
                *status_view(mirrors), empty="this store has no mirror (add one: casckpt mirror add)")


def status_view(mirrors: list[MirrorInfo]) -> list[RenderableType]:
    """The mirrors as a table, then each failure."""
    table = render.table_of("mirror", "destination", "last run", "versions", "bytes", "failed", "selection",
                            right=("versions", "bytes", "failed"))
    notes: list[RenderableType] = []
    for m in mirrors:
        last = "never" if m.last_run_at is None else render.local_time(m.last_run_at)
        if m.last_run_at is not None and m.last_finished_at is None:
            last += " (running)"
        table.add_row(m.name, m.destination, last, str(m.versions_sent), render.human_bytes(m.bytes_sent),
                      str(len(m.failed)), m.selection.describe())
        if m.last_error is not None:
            notes.append(f"{m.name}: the last run failed: {m.last_error}")
        notes += [f"{m.name}: {f.run}@{f.step} ({f.version_id[:12]}) not sent: {f.error}" for f in m.failed]
    return [table, *notes] if mirrors else []


@mirror_app.command("remove")
def remove(ctx: typer.Context, name: NameArgument) -> None:
    """Remove mirror NAME and what it recorded; the destination is left as it is."""
    with open_store(ctx) as store:
        store.mirrors.remove(name)
    render.out(f"Mirror {name} removed (its destination is left as it is)")


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command."""
    app.add_typer(mirror_app, name="mirror")
