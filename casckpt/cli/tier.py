"""The fast tier: ``drain`` (move what this host's tier holds to the locations now),
``tier status`` (bytes per tier, versions not durable yet) and ``tier forget`` (declare
another host's tier lost by hand). See docs/guides/fast-tier.md.

The tier of this host is the one ``casckpt.toml`` records (``casckpt init --fast-tier``),
or ``casckpt --fast-tier DIR`` / ``CASCKPT_FAST_TIER``. No command but ``drain`` drains:
the others open the store without a drain worker (see :func:`casckpt.cli.shared.open_path`).

Exit codes: ``drain`` exits 1 when the drain stopped early or found versions lost; the
others are those of ``casckpt --help`` (2 no fast tier to drain, ``forget`` without
``--yes`` or of a tier that is not lost; 3 unknown tier id; 4 ``drain`` waited on a version
that was lost).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from casckpt.cli import render
from casckpt.cli.progress import progress_bars
from casckpt.cli.shared import EXIT_PROBLEMS, FLAG, JsonOption, open_store
from casckpt.types import DrainReport, TierLoss, TierStatus

tier_app = typer.Typer(
    help="The fast tier: where commits land before they drain to the locations.", no_args_is_help=True)

_NO_TIER = ("this store has no fast tier on this host: pass --fast-tier DIR before the command "
            "(or set CASCKPT_FAST_TIER), or record one with `casckpt init PATH --fast-tier DIR`")
_SHOWN = 10  # version ids listed before "N more"


def drain(
    ctx: typer.Context,
    wait: Annotated[bool, typer.Option(
        "--wait/--no-wait", metavar=FLAG,
        help="Wait for another process of this host draining the tier, then for every version "
             "waiting on it to be durable (--no-wait: return at once if another process is "
             "draining).")] = True,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", min=0, metavar="SECONDS",
        help="With --wait: give up waiting for durability after this long (exit 5).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Drain this host's fast tier now: every pack not drained yet to the store's locations
    (with the store's redundancy), then the manifests of the versions this makes durable,
    then evict drained packs beyond the tier's budget. Exit 1 if the drain stopped early
    (it resumes on the next drain) or found versions lost."""
    with open_store(ctx) as store:
        if store.tier.status().local_path is None:
            raise typer.BadParameter(_NO_TIER, param_hint="--fast-tier")
        with progress_bars() as progress:
            report = store.tier.drain(wait=wait, progress=progress)
        if wait and report.error is None and not report.lost_versions:
            store.tier.wait_durable(timeout=timeout)
    render.emit(as_json, report.to_dict(), *drain_view(report))
    if report.error is not None or report.lost_versions:
        raise typer.Exit(EXIT_PROBLEMS)


def drain_view(report: DrainReport) -> list[RenderableType]:
    """What a drain did, then what went wrong, if anything."""
    if report.busy:
        return [Text("another process of this host is draining this tier; nothing done "
                     "(`casckpt drain --wait` waits for it)", style="yellow")]
    table = _key_values([
        ("drained", f"{report.packs} pack(s), {render.human_bytes(report.bytes)}"),
        ("durable now", f"{report.versions} version(s)"),
        ("evicted", render.human_bytes(report.evicted_bytes)),
        ("took", f"{report.seconds:.2f} s" + (f" ({render.human_bytes(int(report.bytes / report.seconds))}/s)"
                                              if report.bytes and report.seconds > 0 else "")),
    ])
    parts: list[RenderableType] = [table]
    if report.lost_versions or report.lost_packs:
        parts.append(Text(
            f"LOST: {len(report.lost_packs)} pack(s) were gone from the tier before they drained; "
            f"{len(report.lost_versions)} version(s) needing them are lost: {_ids(report.lost_versions)}",
            style="bold red"))
    if report.error is not None:
        parts.append(Text(f"the drain stopped early: {report.error}; it resumes on the next drain",
                          style="bold red"))
    return parts


@tier_app.command("status")
def status(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Bytes per tier (durable on the locations; this host's fast tier: held, budget, not
    drained), versions per durability, versions not durable yet, every host's tier."""
    with open_store(ctx) as store:
        found = store.tier.status()
    render.emit(as_json, status_dict(found), *status_view(found))


def status_dict(found: TierStatus) -> dict[str, Any]:
    """``found.to_dict()`` plus the drain rate."""
    return {**found.to_dict(), "drain_rate": found.drain_rate}


def status_view(found: TierStatus) -> list[RenderableType]:
    """A summary, this host's tier, every tier the catalog knows, the versions not durable."""
    counts = ", ".join(f"{found.versions.get(k, 0)} {k}" for k in ("durable", "fast", "lost")
                       if found.versions.get(k, 0) or k == "durable")
    rows = [("durable", f"{render.human_bytes(found.durable_bytes)} on the locations"),
            ("versions", counts)]
    here = next((t for t in found.tiers if t.this_host), None)
    if found.local_path is not None:
        rows += [("this host", found.local_path),
                 ("held", f"{render.human_bytes(found.held_bytes)} in {found.held_packs} pack(s), "
                          f"budget {render.human_bytes(found.budget or 0)}"),
                 ("not drained", f"{render.human_bytes(here.undrained_bytes if here else 0)} in "
                                 f"{here.undrained_packs if here else 0} pack(s)")]
        if found.disk_bytes is not None and found.disk_free is not None:
            rows.append(("disk", f"{render.human_bytes(found.disk_free)} free of "
                                 f"{render.human_bytes(found.disk_bytes)}"))
        if found.drain_rate is not None:
            rows.append(("drain rate", f"{render.human_bytes(int(found.drain_rate))}/s"))
    else:
        rows.append(("this host", "no fast tier (casckpt --fast-tier DIR)"))
    parts: list[RenderableType] = [_key_values(rows)]
    if found.tiers:
        table = render.table_of("TIER", "HOST", "PATH", "STATE", "NOT DRAINED", "PACKS", "HERE",
                                right=("NOT DRAINED", "PACKS"))
        for t in found.tiers:
            table.add_row(t.id[:12], t.host, t.path,
                          Text(t.state, style="bold red" if t.state == "lost" else ""),
                          render.human_bytes(t.undrained_bytes), str(t.undrained_packs),
                          "yes" if t.this_host else "")
        parts += ["", table]
    if found.not_durable:
        parts += ["", Text(f"not durable yet: {_ids(found.not_durable)}", style="yellow")]
    parts += [Text(f"warning: {w}", style="yellow") for w in found.warnings]
    return parts


@tier_app.command("forget")
def forget(
    ctx: typer.Context,
    tier_id: Annotated[str, typer.Argument(
        help="The tier's id, or the start of it (`casckpt tier status`).")],
    yes: Annotated[bool, typer.Option(
        "--yes", metavar=FLAG, help="Yes: declare it lost (without it, nothing is done).")] = False,
    as_json: JsonOption = False,
) -> None:
    """Declare another host's fast tier lost, when its host or disk is gone for good: the
    packs still waiting on it to drain are lost, and every version needing one of them
    (`casckpt log` marks them lost; restore refuses them). Durable versions are unaffected.
    Final: pass --yes."""
    if not yes:
        raise typer.BadParameter(
            f"declaring fast tier {tier_id} lost is final: the versions still waiting on it to "
            "drain become lost for good (`casckpt tier status` shows what waits on it). Pass "
            "--yes to do it", param_hint="--yes")
    with open_store(ctx) as store:
        loss = store.tier.forget(tier_id)
    render.emit(as_json, loss.to_dict(), forget_line(loss))


def forget_line(loss: TierLoss) -> Text:
    """What ``tier forget`` did."""
    if not loss.packs and not loss.versions:
        return Text(f"fast tier {loss.tier[:12]} ({loss.host}:{loss.path}) is lost; no version "
                    "was waiting on it")
    return Text(f"fast tier {loss.tier[:12]} ({loss.host}:{loss.path}) is lost, with "
                f"{len(loss.packs)} pack(s) not drained: {len(loss.versions)} version(s) are lost: "
                f"{_ids(loss.versions)}", style="bold red" if loss.versions else "")


def _ids(ids: tuple[str, ...]) -> str:
    shown = " ".join(v[:12] for v in ids[:_SHOWN])
    return shown + (f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else "")


def _key_values(rows: list[tuple[str, str]]) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    return table


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command."""
    app.command()(drain)
    app.add_typer(tier_app, name="tier")
