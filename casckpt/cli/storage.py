"""Storage administration: ``location``, ``redundancy``, ``repair``, ``catalog rebuild``,
``catalog migrate-trees``, ``cache rebuild``.

A store keeps its packs on one or more blob locations, each in a failure
domain (what fails together: a disk, a host, a bucket's region). New packs
get the store's redundancy (``none``, ``replicate:N`` or ``ec:K+M``), or a
run's own. ``casckpt check --read-data[-subset]`` finds damaged shards;
``casckpt repair`` rebuilds them and moves shards off retiring or failed
locations. ``catalog rebuild`` recovers a lost catalog from the locations
alone; ``cache rebuild`` refills this host's index cache.

Exit codes: ``repair`` and ``catalog rebuild`` exit 1 when something could
not be repaired or recovered; the others are those of ``casckpt --help``
(2 bad input, e.g. a bad redundancy spec; 3 unknown location).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from casckpt.cli import render
from casckpt.cli.progress import progress_bars
from casckpt.cli.shared import EXIT_PROBLEMS, EXIT_USAGE, JsonOption, open_store
from casckpt.types import LocationInfo, RepairReport

location_app = typer.Typer(
    help="Blob locations: where packs live, their failure domains and states.", no_args_is_help=True)

redundancy_app = typer.Typer(
    help="Redundancy of new packs: none, replicate:N or ec:K+M (store-wide or per run).",
    no_args_is_help=True,
)

delta_app = typer.Typer(
    help="Delta coding: how many deltas deep a chunk may be stored before a keyframe (0: off).",
    no_args_is_help=True,
)

catalog_app = typer.Typer(help="The catalog: disaster recovery.", no_args_is_help=True)

cache_app = typer.Typer(help="This host's local index cache.", no_args_is_help=True)

NameArgument = Annotated[str, typer.Argument(help="Location name (see `casckpt location list`).")]
RunOption = Annotated[
    str | None, typer.Option("--run", help="A run's own redundancy instead of the store's.")
]


# -- locations -----------------------------------------------------------------


def _print_location(info: LocationInfo, as_json: bool, hint: str | None = None) -> None:
    render.emit(as_json, info.to_dict(), render.locations_table([info]),
                *render.unreachable_notes([info]))
    if hint and not as_json:
        render.note(hint)


@location_app.command("list")
def list_locations(
    ctx: typer.Context,
    timeout: Annotated[float | None, typer.Option(
        "--timeout", min=0, metavar="SECONDS",
        help="Seconds each location has to answer its probe (all are probed at once; "
        "default: CASCKPT_PROBE_TIMEOUT_S, else 5).")] = None,
    as_json: JsonOption = False,
) -> None:
    """List the blob locations: domain, state, URL, shards held, damaged shards, and health.

    Health is measured: every location is sent a real request (a read of its
    identity record) and is reachable only if it answers with this store's
    record in time; the ones that do not are listed with the reason.
    """
    with open_store(ctx) as store:
        found = store.locations.list(timeout=timeout)
    render.emit(as_json, [info.to_dict() for info in found], render.locations_table(found),
                *render.unreachable_notes(found))


@location_app.command("add")
def add_location(
    ctx: typer.Context,
    url: Annotated[str, typer.Argument(
        help="A directory (relative to the store directory), file:///dir or s3://bucket/prefix.")],
    domain: Annotated[str | None, typer.Option(
        help="Its failure domain, what fails with it: a disk, a host (default: its name).")] = None,
    name: Annotated[str | None, typer.Option(
        help="How commands refer to it (default: the first free locN).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Add a blob location; new packs may use it at once (recorded in the catalog and casckpt.toml).

    Packs already stored stay where they are; `casckpt repair` places the
    shards it re-creates on it when their pack lacks its failure domain.
    """
    with open_store(ctx) as store:
        info = store.locations.add(url, domain=domain, name=name)
    _print_location(info, as_json)


@location_app.command("drain", hidden=True, add_help_option=False,  # pre-0012 spelling
                       context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
def renamed_retire() -> None:
    """The old name of `location retire`: an error that names the new one, nothing done."""
    render.error("`casckpt location drain` is now `casckpt location retire NAME`; nothing was "  # pre-0012
                 "changed (`casckpt drain` is the fast tier's, unchanged)")
    raise typer.Exit(EXIT_USAGE)


@location_app.command("retire")
def retire_location(ctx: typer.Context, name: NameArgument, as_json: JsonOption = False) -> None:
    """Stop writing to a location; `casckpt repair` then moves its shards to the others."""
    with open_store(ctx) as store:
        info = store.locations.retire(name)
    _print_location(info, as_json, f"no new shards go to {name}; " + (
        f"move its {info.shards} shard(s) off with: casckpt repair" if info.shards
        else "it holds no shards, so there is nothing to move"))


@location_app.command("fail")
def fail_location(ctx: typer.Context, name: NameArgument, as_json: JsonOption = False) -> None:
    """Declare a location lost: it is never read again; `casckpt repair` re-creates its shards elsewhere."""
    with open_store(ctx) as store:
        info = store.locations.fail(name)
    _print_location(info, as_json, f"{name} is no longer read; " + (
        f"re-create its {info.shards} shard(s) with: casckpt repair" if info.shards
        else "it holds no shards, so there is nothing to repair"))


@location_app.command("activate")
def activate_location(ctx: typer.Context, name: NameArgument, as_json: JsonOption = False) -> None:
    """Return a retiring or failed location to service: new packs may use it again."""
    with open_store(ctx) as store:
        info = store.locations.activate(name)
    _print_location(info, as_json)


# -- redundancy ----------------------------------------------------------------


@redundancy_app.command("show")
def show_redundancy(ctx: typer.Context, run: RunOption = None, as_json: JsonOption = False) -> None:
    """Show the redundancy new packs get: the store's, or RUN's (its own or the store's)."""
    with open_store(ctx) as store:
        spec = store.locations.redundancy(run)
        store_spec = spec if run is None else store.locations.redundancy()
        others = [] if run is not None else [
            (r.name, own) for r in store.runs() if (own := store.locations.redundancy(r.name)) != store_spec]
    if as_json:
        doc: dict[str, Any] = {"run": run, "redundancy": spec}
        if run is None:
            doc["runs"] = {name: own for name, own in others}
        render.print_json(doc)
        return
    if run is None:
        render.out(f"Redundancy of new packs: {spec}")
        for name, own in others:
            render.out(f"  run {name}: {own}")
    else:
        inherited = " (the store's)" if spec == store_spec else ""
        render.out(f"Redundancy of new packs of {run}: {spec}{inherited}")


@redundancy_app.command("set")
def set_redundancy(
    ctx: typer.Context,
    spec: Annotated[str, typer.Argument(
        help="none, replicate:N (N copies) or ec:K+M (K data + M parity shards); "
             "with --run also inherit (follow the store again).")],
    run: RunOption = None,
    as_json: JsonOption = False,
) -> None:
    """Set the redundancy of new packs, store-wide or for one run; stored packs keep theirs.

    Each shard or copy of a pack goes to its own failure domain, so the
    store needs at least N (replicate:N) or K+M (ec:K+M) domains with an
    active location.
    """
    with open_store(ctx) as store:
        result = store.locations.set_redundancy(spec, run=run)
    whose = "the store" if run is None else f"run {run}"
    render.emit(as_json, {"run": run, "redundancy": result}, f"Redundancy of new packs of {whose}: {result}")
    if not as_json:
        render.note("packs already stored keep their redundancy")


# -- delta coding ----------------------------------------------------------------


@delta_app.command("show")
def show_delta(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Show the delta chain policy (store and runs with their own) and what delta coding stores."""
    with open_store(ctx) as store:
        stats = store.ops.stats()
    doc = {"delta_chain": stats.delta_chain, "runs": dict(stats.run_delta_chains),
           "delta_chunks": stats.delta_chunks, "delta_raw_bytes": stats.delta_raw_bytes,
           "delta_stored_bytes": stats.delta_stored_bytes, "longest_chain": stats.longest_chain,
           "mean_chain": stats.mean_chain}
    if as_json:
        render.print_json(doc)
        return
    render.out(f"Delta chain of the store: {stats.delta_chain}" + (" (off)" if not stats.delta_chain else ""))
    for name, own in sorted(stats.run_delta_chains.items()):
        render.out(f"  run {name}: {own}")
    render.out(f"{stats.delta_chunks} delta chunks: {render.human_bytes(stats.delta_raw_bytes)} stored in "
               f"{render.human_bytes(stats.delta_stored_bytes)}; chains up to {stats.longest_chain} deep "
               f"(mean {stats.mean_chain:.1f})")


@delta_app.command("set")
def set_delta(
    ctx: typer.Context,
    chain: Annotated[int, typer.Argument(help="Deltas before a keyframe, 0 to 64 (0: off); with --run, "
                                              "-1 follows the store again.")],
    run: Annotated[str | None, typer.Option("--run", help="A run's own chain length.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Set the delta chain length of new chunks, store-wide or for one run; stored chunks keep theirs."""
    with open_store(ctx) as store:
        store.ops.set_delta_chain(chain, run=run)
        result = store.ops.delta_chain(run)
    render.emit(as_json, {"run": run, "delta_chain": result},
                f"Delta chain of {'the store' if run is None else 'run ' + run}: {result}")


# -- repair and rebuilds ---------------------------------------------------------


def _count_table(title: str, rows: list[tuple[str, int]]) -> Table:
    table = Table(title=title, box=None, title_justify="left")
    table.add_column("what")
    table.add_column("count", justify="right")
    for label, value in rows:
        table.add_row(label, str(value))
    return table


def _listing(title: str, items: tuple[str, ...]) -> list[RenderableType]:
    if not items:
        return []
    return [Text(f"{title} ({len(items)}):", style="bold red"), *(f"  {item}" for item in items)]


def _repair_view(report: RepairReport) -> list[RenderableType]:
    if report.nothing_to_do:
        return [Text("nothing to repair: every pack is at full redundancy on distinct failure domains, "
                     "and every location holds every manifest and record", style="green")]
    table = _count_table("repair", [
        ("packs needing repair", report.packs),
        ("shards rewritten", report.shards_rewritten),
        ("shards moved to another location", report.shards_moved),
        ("packs left unrepaired", len(report.unrepaired)),
        ("packs with shards sharing a failure domain", len(report.degraded)),
        ("damaged catalog manifests restored", report.catalog_manifests_restored),
        ("manifest copies written", report.manifests_written),
        ("refs records written", report.records_written),
        ("tree node rows restored from the packs", report.tree_nodes_restored),
    ])
    parts: list[RenderableType] = [table, *_listing("unrepaired packs", report.unrepaired),
                                   *_listing("degraded packs", report.degraded)]
    if report.ok:
        parts.append(Text("every pack is back at full redundancy", style="green"))
    return parts


def repair(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Rebuild damaged shards, move shards off retiring/failed locations; exit 1 if a pack stays short.

    Works through what `casckpt check` and restores found damaged and the
    shards on retiring or failed locations. Safe while other jobs commit,
    restore and collect garbage.
    """
    with open_store(ctx) as store, progress_bars() as progress:
        report = store.ops.repair(progress=progress)
    render.emit(as_json, {**report.to_dict(), "ok": report.ok}, *_repair_view(report))
    if not report.ok:
        raise typer.Exit(EXIT_PROBLEMS)


@catalog_app.command("rebuild")
def rebuild_catalog(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Recreate a lost catalog from the blob locations alone; exit 1 if any pack or version was lost.

    Needs an empty catalog: move a damaged catalog.db away first (SQLite) or
    point the store at an empty database (PostgreSQL). Recovers packs,
    versions, runs (forks, retention, redundancy) and tags; not commit
    durations and byte counts (0), soft deletions or gc history. The new
    catalog takes over the store's identity with a higher generation, so the
    old catalog, if it turns up again, is refused.
    """
    with open_store(ctx, recover=True) as store, progress_bars() as progress:
        report = store.ops.rebuild_catalog(progress=progress)
    ok = not report.lost_packs and not report.skipped
    table = _count_table("catalog rebuilt", [
        ("packs", report.packs), ("chunks", report.chunks), ("versions", report.versions),
        ("runs", report.runs), ("tags", report.tags),
        ("packs lost", len(report.lost_packs)), ("versions skipped", len(report.skipped)),
    ])
    render.emit(as_json, {**report.to_dict(), "ok": ok}, table,
                *_listing("lost packs (too few readable shards)", report.lost_packs),
                *_listing("skipped versions", report.skipped))
    if not ok:
        raise typer.Exit(EXIT_PROBLEMS)


@catalog_app.command("migrate-trees")
def migrate_trees(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Give versions written before tree manifests their trees; exit 1 if some are left.

    Version ids and restores do not change; history, diff and show then read
    those versions from their trees, and their per-tensor catalog rows go.
    Resumable (run it again after an interruption), idempotent, and safe
    while training commits and gc runs.
    """
    with open_store(ctx) as store, progress_bars() as progress:
        report = store.ops.migrate_trees(progress=progress)
    render.emit(as_json, {**report.to_dict(), "ok": not report.versions_left}, _count_table(
        "versions migrated to trees", [
            ("versions migrated", report.versions_migrated), ("versions left", report.versions_left),
            ("tree nodes written", report.nodes_written),
            ("tensor rows deleted", report.tensor_rows_deleted),
            ("versions indexed for history", report.versions_indexed),
        ]), f"took {report.seconds:.1f}s")
    if report.versions_left:
        raise typer.Exit(EXIT_PROBLEMS)


@cache_app.command("rebuild")
def rebuild_cache(ctx: typer.Context, as_json: JsonOption = False) -> None:
    """Empty this host's index cache and refill it from the catalog."""
    with open_store(ctx) as store:
        chunks = store.ops.rebuild_cache()
    render.emit(as_json, {"chunks": chunks}, f"Rebuilt the index cache: {chunks} chunks")


def register(app: typer.Typer) -> None:
    """Add this module's commands to ``app``, the root command (in their order in help)."""
    app.add_typer(location_app, name="location")
    app.add_typer(redundancy_app, name="redundancy")
    app.add_typer(delta_app, name="delta")
    app.add_typer(catalog_app, name="catalog")
    app.add_typer(cache_app, name="cache")
    app.command()(repair)
