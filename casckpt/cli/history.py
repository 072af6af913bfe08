"""History and lineage commands: ``log``, ``tags``, ``diff``, ``history``, ``fork``, ``lineage``,
``best``, and ``audit`` (who changed the store, and when).

All are answered from the catalog; none reads tensor data. Exit codes are
those of ``casckpt --help`` (2 bad input, e.g. a bad ``--where``; 3 unknown
run, ref, tag, tensor or metric).
"""

from __future__ import annotations

import re
import time
from datetime import datetime
from typing import Annotated

import typer
from rich.console import RenderableType
from rich.text import Text
from rich.tree import Tree

from casckpt.cli import render
from casckpt.cli.shared import FLAG, JsonOption, RefArgument, open_store
from casckpt.types import AuditEntry, RunNode, TensorChange, TensorHistoryEntry, VersionDiff

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGO = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_EPOCH = re.compile(r"^\s*\d+(?:\.\d+)?\s*$")
_TIME_HELP = "an ISO date or time (local unless it has an offset), epoch seconds, or an age like 90m, 6h, 7d"

RunArgument = Annotated[str, typer.Argument(help="A run name.")]


def parse_time(text: str) -> float:
    """``"2026-11-29"``, ``"2026-11-29T10:00"``, ``"1764400000"`` or ``"6h"`` (ago) -> epoch seconds."""
    ago = _AGO.match(text)
    if ago is not None:
        return time.time() - float(ago.group(1)) * _UNITS[ago.group(2)]
    if _EPOCH.match(text):
        return float(text)
    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise typer.BadParameter(f"cannot read time {text!r}: use {_TIME_HELP}") from None


def log(
    ctx: typer.Context,
    run: Annotated[str | None, typer.Argument(help="Only this run (default: all runs).")] = None,
    since: Annotated[str | None, typer.Option(metavar="TIME",
        help=f"Created at or after: {_TIME_HELP}.")] = None,
    until: Annotated[str | None, typer.Option(metavar="TIME",
        help=f"Created at or before: {_TIME_HELP}.")] = None,
    min_step: Annotated[int | None, typer.Option(min=0, metavar="STEP", help="Lowest step.")] = None,
    max_step: Annotated[int | None, typer.Option(min=0, metavar="STEP", help="Highest step.")] = None,
    tag: Annotated[str | None, typer.Option(help="Only the version this tag names.")] = None,
    where: Annotated[list[str] | None, typer.Option(
        "--where", "-w", metavar="EXPR", help="NAME OP VALUE, e.g. 'loss<2.1' or 'metadata.optimizer==adamw' "
        "(OP: < <= > >= == !=); repeat for AND.")] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", "-n", min=1, metavar="N", help="Show at most N versions.")
    ] = None,
    asc: Annotated[bool, typer.Option("--asc", metavar=FLAG, help="Oldest first.")] = False,
    as_json: JsonOption = False,
) -> None:
    """List versions, newest first, optionally filtered."""
    since_s = parse_time(since) if since is not None else None
    until_s = parse_time(until) if until is not None else None
    with open_store(ctx) as store:
        versions = store.log(run, limit=limit, since=since_s, until=until_s, min_step=min_step,
                             max_step=max_step, tag=tag, where=where,
                             order="asc" if asc else "desc")
    if as_json:
        render.print_json([v.to_dict() for v in versions])
    elif not versions:
        filtered = any(x is not None for x in (since, until, min_step, max_step, tag, where))
        render.note("no versions match" if filtered else
                    f"no versions in run {run!r}" if run else "no versions yet")
    elif len(versions) > render.LOG_TABLE_ROWS:
        render.stream_log(versions)
    else:
        render.out(render.log_table(versions))


def diff(ctx: typer.Context, a: RefArgument, b: RefArgument, as_json: JsonOption = False) -> None:
    """Show what changed from version A to version B: tensors (with changed bytes) and values."""
    with open_store(ctx) as store:
        result = store.diff(a, b)
    render.emit(as_json, result.to_dict(), *diff_view(result))


def history(
    ctx: typer.Context, run: RunArgument,
    path: Annotated[str, typer.Argument(help="Dotted tensor path, e.g. model.layers.0.weight.")],
    as_json: JsonOption = False,
) -> None:
    """List the versions of RUN in which the tensor at PATH changed, oldest first."""
    with open_store(ctx) as store:
        entries = store.history(run, path)
    render.emit(as_json, [e.to_dict() for e in entries], history_table(entries))


def fork(
    ctx: typer.Context, ref: RefArgument,
    new_run: Annotated[str, typer.Argument(help="Name of the new run.")],
    as_json: JsonOption = False,
) -> None:
    """Start run NEW_RUN from a version; its first commit gets that version as parent."""
    with open_store(ctx) as store:
        version = store.resolve(ref)
        run = store.fork(version, new_run)
    render.emit(as_json, {**run.to_dict(), "forked_from": version.to_dict()},
                f"Forked run {run.name} from {version.short_id} ({version.run}@{version.step})")


def lineage(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Show the lineage of runs: each fork under the run it was forked from."""
    with open_store(ctx) as store:
        nodes = store.lineage()
    render.emit(as_json, [n.to_dict() for n in nodes], lineage_view(nodes), empty="no runs yet")


def best(
    ctx: typer.Context, run: RunArgument,
    metric: Annotated[str, typer.Option("--metric", "-m", metavar="METRIC",
        help="Metric name, e.g. val_loss.")],
    maximize: Annotated[bool, typer.Option("--max/--min", metavar=FLAG,
        help="Highest or lowest value wins.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Show the version of RUN with the lowest (or --max: highest) METRIC."""
    mode = "max" if maximize else "min"
    with open_store(ctx) as store:
        version = store.best(run, metric, mode)
    render.emit(as_json, version.to_dict(), f"Best {metric} ({mode}) of run {run}: "
                f"{version.metrics[metric]:.6g} at {version.run}@{version.step}", "",
                render.version_table(version))


def tags(
    ctx: typer.Context,
    run: Annotated[str | None, typer.Argument(
        help="Only the tags of this run's versions (default: every tag).")] = None,
    as_json: JsonOption = False,
) -> None:
    """List the tags, by name: the version each points at and when it was set (`casckpt tag`
    sets one; `show tag:NAME` shows its version)."""
    with open_store(ctx) as store:
        found = store.tags(run)
    table = render.table_of("TAG", "ID", "RUN", "STEP", "SET", right=("STEP",))
    for t in found:
        table.add_row(t.name, t.version.short_id, t.version.run, str(t.version.step),
                      render.local_time(t.created_at))
    render.emit(as_json, [t.to_dict() for t in found], table,
                empty="no tags yet" if run is None else f"no tags on the versions of run {run}")


# -- rendering ----------------------------------------------------------------------------


def _pair(before: object, after: object) -> str:
    if before is None or after is None or before == after:
        return str(after if after is not None else before)
    return f"{before} -> {after}"


def _shape(shape: tuple[int, ...] | None) -> str | None:
    return None if shape is None else str(tuple(shape))


def diff_view(d: VersionDiff) -> list[RenderableType]:
    """A header, a table of changed tensors, a summary line, and the values that changed."""
    header = (f"{d.a.short_id} ({d.a.run}@{d.a.step}) -> {d.b.short_id} ({d.b.run}@{d.b.step})")
    changes: list[TensorChange] = sorted((*d.changed, *d.added, *d.removed), key=lambda c: c.path)
    table = render.table_of("CHANGE", "TENSOR", "DTYPE", "SHAPE", "SIZE", "CHANGED",
                            right=("SIZE", "CHANGED"))
    for c in changes:
        table.add_row(c.change, c.path, _pair(c.dtype_before, c.dtype_after),
                      _pair(_shape(c.shape_before), _shape(c.shape_after)),
                      render.human_bytes(c.nbytes_after if c.change != "removed" else c.nbytes_before),
                      render.human_bytes(c.changed_bytes))
    summary = (f"{len(changes)} tensors differ ({len(d.changed)} changed, {len(d.added)} added, "
               f"{len(d.removed)} removed), {d.unchanged} unchanged; "
               f"{render.human_bytes(d.changed_bytes)} changed")
    parts: list[RenderableType] = [header, ""]
    parts += [table, ""] if changes else []
    parts.append(summary)
    if d.values:
        values = render.table_of("VALUE", "CHANGE", "BEFORE", "AFTER")
        for v in d.values:
            values.add_row(v.path, v.change, "-" if v.change == "added" else render.short_value(v.before),
                           "-" if v.change == "removed" else render.short_value(v.after))
        parts += ["", values]
    else:
        parts.append(Text("no plain values changed", style="dim"))
    return parts


def history_table(entries: list[TensorHistoryEntry]) -> RenderableType:
    """One row per version in which the tensor changed."""
    table = render.table_of("ID", "RUN", "STEP", "CREATED", "CHANGE", "DTYPE", "SHAPE", "SIZE",
                            "CHANGED", right=("STEP", "SIZE", "CHANGED"))
    for e in entries:
        table.add_row(e.version.short_id, e.version.run, str(e.version.step),
                      render.local_time(e.version.created_at), e.change, e.dtype or "-",
                      _shape(e.shape) or "-", render.human_bytes(e.nbytes),
                      render.human_bytes(e.changed_bytes))
    return table


def audit(
    ctx: typer.Context,
    since: Annotated[str | None, typer.Option(metavar="TIME",
        help=f"Changes at or after: {_TIME_HELP}.")] = None,
    until: Annotated[str | None, typer.Option(metavar="TIME",
        help=f"Changes at or before: {_TIME_HELP}.")] = None,
    action: Annotated[str | None, typer.Option(metavar="ACTION",
        help="Only this action (commit, delete, tag, gc, ...) or family (location: every "
             "location.*).")] = None,
    target: Annotated[str | None, typer.Option(metavar="TARGET",
        help="Only this target: a version id (or a prefix), run:NAME, tag:NAME, location:NAME.")] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", "-n", min=1, metavar="N", help="Only the newest N entries.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Show the audit trail, oldest first: who (user, host, pid; database role) committed,
    deleted, tagged, ran gc, changed policies or locations, and when."""
    since_s = parse_time(since) if since is not None else None
    until_s = parse_time(until) if until is not None else None
    with open_store(ctx) as store:
        entries = store.ops.audit(since=since_s, until=until_s, action=action, target=target, limit=limit)
    if as_json:
        render.print_json([e.to_dict() for e in entries])
    elif not entries:
        filtered = any(x is not None for x in (since, until, action, target))
        render.note("no audit entries match" if filtered else "no audit entries yet")
    else:
        render.out(audit_table(entries))


_VERSION_ID = re.compile(r"[0-9a-f]{64}")


def _audit_target(target: str | None) -> str:
    if target is None:
        return "-"
    return target[:12] if len(target) == 64 and ":" not in target else target


def _audit_detail(entry: AuditEntry) -> str:
    detail = dict(entry.detail)
    if entry.action == "commit":  # what a reader scans for: where it went and what it cost
        return (f"{detail.get('run')}@{detail.get('step')} "
                f"new {render.human_bytes(int(detail.get('new_bytes') or 0))}")
    if entry.action == "gc":
        return (f"{detail.get('versions_deleted', 0)} deleted, {detail.get('versions_purged', 0)} "
                f"purged, {render.human_bytes(int(detail.get('bytes_freed') or 0))} freed")
    shown = {k: v[:12] if isinstance(v, str) and _VERSION_ID.fullmatch(v) else v
             for k, v in detail.items()}  # version ids as everywhere else in tables
    return render.short_value(shown) if shown else ""


def audit_table(entries: list[AuditEntry]) -> RenderableType:
    """One row per audit entry, in the order given."""
    roles = any(e.db_user is not None for e in entries)
    columns = ["AT", "ACTION", "TARGET", "WHO", *(["ROLE"] if roles else []), "DETAIL"]
    table = render.table_of(*columns)
    for e in entries:
        who = f"{e.os_user}@{e.host}:{e.pid}"
        table.add_row(render.local_time(e.at), e.action, _audit_target(e.target), who,
                      *([e.db_user or "-"] if roles else []), _audit_detail(e))
    return table


def _label(node: RunNode) -> Text:
    label = Text(node.name, style="bold")
    if node.fork_version is not None:
        at = f"{node.parent_run}@{node.fork_step}" if node.parent_run else "a deleted version"
        label.append(f"  forked from {at} ({node.fork_version[:12]})", style="cyan")
    label.append(f"  {node.versions} version{'' if node.versions == 1 else 's'}", style="dim")
    return label


def lineage_view(nodes: list[RunNode]) -> Tree:
    """Root runs at the top level; each fork under the run it was forked from."""
    root = Tree("runs", hide_root=True)
    by_name = {n.name: n for n in nodes}
    placed: dict[str, Tree] = {}
    for node in nodes:  # depth first, so a parent is always placed before its forks
        parent = placed.get(node.parent_run) if node.parent_run in by_name else None
        placed[node.name] = (parent or root).add(_label(node))
    return root


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command (in their order in help)."""
    app.command()(log)
    app.command()(tags)
    app.command()(diff)
    app.command()(history)
    app.command()(fork)
    app.command()(lineage)
    app.command()(best)
    app.command()(audit)
