"""``casckpt retention set|show|clear|plan`` and ``casckpt delete|undelete``.

``retention plan`` is the dry run: every version of the run(s), whether
``casckpt gc`` would keep or delete it, and the rules that keep it. It writes
nothing; ``casckpt gc --dry-run`` adds the bytes that would be freed (that needs
a mark over the whole store). ``delete`` is soft: ``undelete`` brings the
version back until GC sweeps its data.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from casckpt.cli import render
from casckpt.cli.rules import parse_rules, with_rule_options
from casckpt.cli.shared import JsonOption, RefArgument, open_store
from casckpt.errors import InvalidArgumentError
from casckpt.retention_rules import RULES, describe
from casckpt.types import RetentionPlan, RetentionPolicy

retention_app = typer.Typer(
    help="Retention policies: which versions `casckpt gc` keeps (combinable, as in restic forget).",
    no_args_is_help=True,
)

RunArgument = Annotated[str, typer.Argument(help="Run name.")]
OptionalRun = Annotated[str | None, typer.Argument(help="Only this run (default: every run with a policy).")]


def _policy_line(policy: RetentionPolicy | None) -> str:
    return "no policy (keeps every version)" if policy is None else describe(policy)


def _policy_json(run: str, policy: RetentionPolicy | None) -> dict[str, Any]:
    return {"run": run, "policy": None if policy is None else policy.to_dict()}


@retention_app.command("set")
@with_rule_options()
def set_policy(ctx: typer.Context, run: RunArgument, as_json: JsonOption = False, **rules: Any) -> None:
    """Set the retention policy of RUN (replacing any); `casckpt gc` applies it.

    A version is kept if any rule keeps it; tagged versions (unless
    --no-keep-tagged) and fork points of live runs are always kept. Give at
    least one keep rule.
    """
    given = parse_rules(rules)
    if all(given[rule.name] is None for rule in RULES if rule.keeps_alone):
        raise InvalidArgumentError(
            "give at least one keep rule ("
            + ", ".join(rule.flag for rule in RULES if rule.keeps_alone)
            + "); without one every untagged version would be deleted. To keep everything, "
            f"clear the policy instead: casckpt retention clear {run}")
    with open_store(ctx) as store:
        policy = store.retention.set(run, **given)
        empty = not store.log(run, limit=1)
    if as_json:
        render.print_json(_policy_json(run, policy))
        return
    render.out(f"Retention of {run}: {describe(policy)}")
    if empty:
        render.note(f"run {run!r} has no versions yet")
    render.note(f"see what it would delete: casckpt retention plan {run}")


@retention_app.command("show")
def show_policy(ctx: typer.Context, run: OptionalRun = None, as_json: JsonOption = False) -> None:
    """Show the retention policy of RUN, or of every run that has one."""
    with open_store(ctx) as store:
        if run is not None:
            policies = [(run, store.retention.get(run))]
        else:
            policies = [(r.name, p) for r in store.runs() if (p := store.retention.get(r.name)) is not None]
    found = [_policy_json(name, policy) for name, policy in policies]
    table = render.table_of("RUN", "POLICY")
    for name, policy in policies:
        table.add_row(name, _policy_line(policy))
    render.emit(as_json, found[0] if run is not None else found, table,
                empty="no run has a retention policy (every version is kept)")


@retention_app.command("clear")
def clear_policy(ctx: typer.Context, run: RunArgument) -> None:
    """Remove the retention policy of RUN: it keeps every version again."""
    with open_store(ctx) as store:
        store.retention.clear(run)
    render.out(f"Retention of {run} cleared: every version is kept")


def _plan_table(plan: RetentionPlan) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False,
                  title=f"{plan.run}: {_policy_line(plan.policy)}", title_justify="left")
    for column in ("STEP", "ID", "CREATED", "ACTION", "KEPT BY"):
        table.add_column(column, justify="right" if column == "STEP" else "left")
    for d in plan.decisions:
        action = Text("keep", style="green") if d.keep else Text("delete", style="bold red")
        table.add_row(str(d.version.step), d.version.short_id, render.local_time(d.version.created_at),
                      action, "; ".join(d.reasons) or "-")
    return table


def _plan_dict(plan: RetentionPlan) -> dict[str, Any]:
    return {**plan.to_dict(), "keep": sum(d.keep for d in plan.decisions), "delete": len(plan.deleted)}


@retention_app.command("plan")
def plan_policy(ctx: typer.Context, run: OptionalRun = None, as_json: JsonOption = False) -> None:
    """Dry run: which versions `casckpt gc` would delete, which it keeps, and why. Writes nothing."""
    with open_store(ctx) as store:
        plans = store.retention.plan(run)
    if as_json:
        render.print_json([_plan_dict(plan) for plan in plans])
        return
    if not plans:
        render.note("no run has a retention policy (every version is kept)")
        return
    for plan in plans:
        kept = sum(d.keep for d in plan.decisions)
        render.out(_plan_table(plan), f"{plan.run}: keep {kept}, delete {len(plan.deleted)}", "")
    render.note("bytes freed: see `casckpt gc --dry-run`")


def delete(
    ctx: typer.Context,
    ref: RefArgument,
    reason: Annotated[str, typer.Option(help="Why, recorded with the version.")] = "manual",
    as_json: JsonOption = False,
) -> None:
    """Delete a version (soft: `casckpt undelete` brings it back until gc sweeps its data)."""
    with open_store(ctx) as store:
        version = store.delete(ref, reason=reason)
    render.emit(as_json, version.to_dict(), f"Deleted {version.short_id} ({version.run}@{version.step})")
    if not as_json:
        render.note(f"undo with: casckpt undelete {version.short_id}")


def undelete(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="A deleted version: its id, a unique id prefix, or run@step.")],
    as_json: JsonOption = False,
) -> None:
    """Bring back a deleted version, unless gc already swept its data."""
    with open_store(ctx) as store:
        version = store.undelete(ref)
    render.emit(as_json, version.to_dict(), f"Undeleted {version.short_id} ({version.run}@{version.step})")


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command (in their order in help)."""
    app.add_typer(retention_app, name="retention")
    app.command()(delete)
    app.command()(undelete)
