"""Turning casckpt values into text: rich tables for people, JSON for scripts.

Nothing here opens a store; every function takes values and a console. Consoles
are built per call (never at import) so they write to whatever ``sys.stdout`` /
``sys.stderr`` are at that moment.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any

from rich import box
from rich.console import Console, RenderableType
from rich.table import Table
from rich.text import Text

from casckpt.types import (
    CheckReport,
    LocationInfo,
    RunInfo,
    StoreStats,
    TensorInfo,
    Version,
    VersionDetail,
)
from casckpt.types import dumps as dumps
from casckpt.types import human_bytes as human_bytes
from casckpt.types import to_json_value as to_json_value

_PIPE_WIDTH = 1000
"""Console width when stdout is not a terminal: wide enough that no cell is cut or wrapped."""

_VALUE_WIDTH = 60
"""Plain values longer than this are shortened in ``show``."""


def out(*renderables: RenderableType) -> None:
    """Print to stdout; to a pipe or file without cutting cells or trailing padding."""
    if sys.stdout.isatty():
        console = Console(highlight=False, markup=False)
        for renderable in renderables:
            console.print(renderable)
        return
    console = Console(highlight=False, markup=False, width=_PIPE_WIDTH, no_color=True)
    with console.capture() as captured:
        for renderable in renderables:
            console.print(renderable)
    lines = captured.get().splitlines()
    sys.stdout.write("".join(line.rstrip() + "\n" for line in lines))
    sys.stdout.flush()


def stderr_console() -> Console:
    """A console on stderr, for messages and progress bars."""
    return Console(stderr=True, highlight=False, markup=False)


def error(message: str) -> None:
    """Print ``message`` as one red line on stderr."""
    stderr_console().print(Text(f"casckpt: error: {message}", style="bold red"), soft_wrap=True)


def note(message: str) -> None:
    """Print an informational line on stderr (never pollutes stdout, which may be JSON)."""
    stderr_console().print(Text(message, style="yellow"), soft_wrap=True)


def emit(as_json: bool, doc: object, *view: RenderableType, empty: str | None = None) -> None:
    """A command's result: ``doc`` as JSON under ``--json``; else the note ``empty`` when it is
    given and ``doc`` is empty; else ``view`` for people. Both are built whatever is printed:
    a listing that may run long (``log``, ``audit``) branches itself instead."""
    if as_json:
        print_json(doc)
    elif empty is not None and not doc:
        note(empty)
    else:
        out(*view)


def print_json(value: object) -> None:
    """Write ``value`` as JSON to stdout, and nothing else."""
    sys.stdout.write(dumps(value, indent=2) + "\n")
    sys.stdout.flush()


def local_time(moment: datetime) -> str:
    """An aware or UTC-naive datetime as local ISO time to the second."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def short_value(value: object, width: int = _VALUE_WIDTH) -> str:
    """A plain value as one readable line (``repr``-like, so ``"1"`` and ``1`` differ)."""
    if isinstance(value, (bytes, bytearray)):
        text = f"<{len(value)} bytes> " + bytes(value[:16]).hex()
    elif isinstance(value, (Mapping, list, tuple)):
        text = dumps(value)
    else:
        text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def table_of(*columns: str, right: Iterable[str] = ()) -> Table:
    """An empty table of these columns in casckpt's style (``right``: right-aligned ones)."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    right_aligned = set(right)
    for column in columns:
        table.add_column(column, justify="right" if column in right_aligned else "left")
    return table


def _metrics(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in metrics.items())


def _first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0] if lines else ""


def runs_table(runs: Iterable[RunInfo]) -> Table:
    """One row per run: name, versions, latest step and id, logical size, creation time."""
    table = table_of("RUN", "VERSIONS", "LATEST", "LATEST ID", "SIZE", "CREATED",
                     right=("VERSIONS", "LATEST", "SIZE"))
    for run in runs:
        table.add_row(run.name, str(run.versions),
                      "-" if run.latest_step is None else str(run.latest_step),
                      (run.latest_id or "-")[:12], human_bytes(run.logical_bytes),
                      local_time(run.created_at))
    return table


_LOG_COLUMNS = ("ID", "RUN", "STEP", "CREATED", "SIZE", "NEW", "STORED", "TAGS", "METRICS", "MESSAGE")
_LOG_RIGHT = ("STEP", "SIZE", "NEW", "STORED")
LOG_TABLE_ROWS = 200
"""Longer logs are written as aligned text lines (:func:`stream_log`): rich lays a table out
whole before printing it, seconds for thousands of rows."""


_DURABILITY_AT = _LOG_COLUMNS.index("STEP") + 1
"""Where a log shows the DURABILITY column: only when some version is not durable (with a
fast tier, see ``Version.durability``), so a store without one logs as it always did."""


def _log_columns(versions: list[Version]) -> tuple[str, ...]:
    if all(v.durability == "durable" for v in versions):
        return _LOG_COLUMNS
    return (*_LOG_COLUMNS[:_DURABILITY_AT], "DURABILITY", *_LOG_COLUMNS[_DURABILITY_AT:])


def _log_row(v: Version, durability: bool = False) -> tuple[str, ...]:
    row = (v.short_id, v.run, str(v.step), local_time(v.created_at), human_bytes(v.logical_bytes),
           human_bytes(v.new_bytes), human_bytes(v.stored_bytes), ",".join(v.tags),
           _metrics(v.metrics), _first_line(v.message))
    return (*row[:_DURABILITY_AT], v.durability, *row[_DURABILITY_AT:]) if durability else row


def log_table(versions: Iterable[Version]) -> Table:
    """One row per version, in the order given (``Store.log`` gives newest first)."""
    listed = list(versions)
    columns = _log_columns(listed)
    durability = len(columns) > len(_LOG_COLUMNS)
    table = table_of(*columns, right=_LOG_RIGHT)
    for v in listed:
        cells: list[str | Text] = list(_log_row(v, durability=durability))
        if durability:
            cells[_DURABILITY_AT] = _durability_cell(v.durability)
        table.add_row(*cells)
    return table


def _durability_cell(durability: str) -> Text:
    return Text(durability, style={"lost": "bold red", "fast": "yellow"}.get(durability, ""))


def stream_log(versions: Iterable[Version], batch: int = 1000) -> None:
    """The rows of :func:`log_table` as aligned text lines on stdout, a batch at a time: the
    columns of a table (three spaces apart, a rule under the head), not wrapped to the
    terminal."""
    listed = list(versions)
    columns = _log_columns(listed)
    rows = [_log_row(v, durability=len(columns) > len(_LOG_COLUMNS)) for v in listed]
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    right = [c in _LOG_RIGHT for c in columns]

    def line(cells: Iterable[str]) -> str:
        return "   ".join(c.rjust(w) if r else c.ljust(w)
                          for c, w, r in zip(cells, widths, right, strict=True)).rstrip()

    head = [line(columns), "─" * (sum(widths) + 3 * (len(widths) - 1))]
    _write_lines(itertools.chain(head, (line(row) for row in rows)), batch)


def _write_lines(lines: Iterable[str], batch: int) -> None:
    """Write ``lines`` to stdout ``batch`` at a time, then flush."""
    it = iter(lines)
    while chunk := list(itertools.islice(it, batch)):
        sys.stdout.write("\n".join(chunk) + "\n")
    sys.stdout.flush()


def _sizes(v: Version) -> str:
    return (
        f"{human_bytes(v.logical_bytes)} logical, {human_bytes(v.new_bytes)} new, "
        f"{human_bytes(v.stored_bytes)} stored"
    )


_DURABILITY_NOTES = {
    "fast": "fast: on the fast tier of the host that committed it, not drained to the "
            "locations yet (`casckpt drain` there)",
    "lost": "lost: its fast tier was lost before it drained; it cannot be restored",
}


def version_table(v: Version) -> Table:
    """Key/value rows describing one version."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    rows: list[tuple[str, str]] = [
        ("version", v.id),
        ("run", v.run),
        ("step", str(v.step)),
        ("created", local_time(v.created_at)),
        ("parent", (v.parent or "-")[:12]),
        ("tags", ", ".join(v.tags) or "-"),
        ("size", _sizes(v)),
        ("duration", f"{v.duration_s:.2f} s"),
    ]
    if v.durability != "durable":
        rows.append(("durability", _DURABILITY_NOTES.get(v.durability, v.durability)))
    if v.metrics:
        rows.append(("metrics", _metrics(v.metrics)))
    if v.metadata:
        rows.append(("metadata", dumps(v.metadata)))
    if v.message:
        rows.append(("message", v.message))
    for key, value in rows:
        table.add_row(key, value)
    return table


_VALUES_SHOWN = 50  # plain values listed by `show` before "N more"


def detail_view(detail: VersionDetail, *, tensors: bool = False) -> list[RenderableType]:
    """The version, a summary of its tensors (by group), then its plain values; with
    ``tensors`` the tensor table is left to :func:`stream_tensors`."""
    parts: list[RenderableType] = [version_table(detail.version), ""]
    if detail.degraded:
        parts[-1:] = [Text(f"DEGRADED: {detail.degraded_packs} pack(s) holding this version are below "
                           f"their redundancy ({detail.degraded_detail}); `casckpt check` lists them, "
                           "`casckpt repair` restores them", style="bold red"), ""]
    if detail.delta_chunks:
        parts[-1:] = [Text(f"delta coding: {detail.delta_chunks} chunk(s) stored as deltas, chains up to "
                           f"{detail.longest_chain} deep"), ""]
    if detail.world_size is not None:
        how = ("torch.distributed.checkpoint: tensors sharded across ranks" if detail.saved_with == "dcp"
               else "Store.commit(group=): one state per rank (paths rankN/...)")
        parts[-1:] = [Text(f"saved by {detail.world_size} rank(s) with {how}"), ""]
    snapshot = detail.version.metadata.get("casckpt.dir")
    if isinstance(snapshot, dict):  # Store.add_dir: its tensors and values are the file listing
        counts = {k: int(v) if isinstance(v, int) else 0 for k, v in snapshot.items()}
        parts.append(Text(
            f"directory snapshot: {counts.get('files', 0)} file(s), {counts.get('dirs', 0)} dir(s), "
            f"{counts.get('links', 0)} link(s), {human_bytes(counts.get('bytes', 0))}; "
            "`casckpt checkout REF DIR` writes it back"))
        return parts
    count = detail.tensor_count
    parts.append(Text(f"{count} tensor(s), {human_bytes(detail.tensor_bytes)}" if count
                      else "no tensors", style="" if count else "dim"))
    if count and not tensors:
        groups = table_of("GROUP", "TENSORS", "SIZE", right=("TENSORS", "SIZE"))
        for g in detail.tensor_groups:
            groups.add_row(g.name, str(g.tensors), human_bytes(g.nbytes))
        parts += [groups, Text("`casckpt show REF --tensors` lists every tensor", style="dim")]
    if detail.values:
        values = table_of("VALUE", "TYPE", "CONTENT")
        for path, value in list(detail.values.items())[:_VALUES_SHOWN]:
            values.add_row(path, type(value).__name__, short_value(value))
        parts += ["", values]
        if len(detail.values) > _VALUES_SHOWN:
            parts.append(Text(f"... {len(detail.values) - _VALUES_SHOWN} more value(s): --json lists "
                              "them all", style="dim"))
    return parts


def stream_tensors(detail: VersionDetail, batch: int = 1000) -> None:
    """Every tensor of a version as aligned text lines, written a batch at a time (a rich
    table of 100,000 rows takes seconds to lay out before printing anything)."""
    sharded = any(t.shards > 1 for t in detail.tensors)
    width = min(80, max((len(t.path) for t in detail.tensors), default=6))
    head = f"{'TENSOR':<{width}}  {'DTYPE':<9}  {'SHAPE':<18}  {'SIZE':>10}  {'CHUNKS':>6}  DIGEST"

    def line(t: TensorInfo) -> str:
        text = (f"{t.path:<{width}}  {t.dtype:<9}  {str(tuple(t.shape)):<18}  {human_bytes(t.nbytes):>10}  "
                f"{t.chunks:>6}  {t.digest[:12]}")
        if sharded:
            dims = ",".join(str(d) for d in t.split_dims)
            text += f"  {t.shards} on dim {dims}" if t.split_dims else f"  {t.shards}"
        return text

    _write_lines(itertools.chain([head + ("  SHARDS" if sharded else "")], map(line, detail.tensors)), batch)


def stream_json(value: dict[str, Any], key: str, batch: int = 1000) -> None:
    """Write ``value`` as JSON to stdout, the list under ``key`` an item at a time (``--json``
    of a version with 100,000 tensors starts at once and holds no second copy as text)."""
    items = value.pop(key)
    text = dumps(value, indent=2)
    sys.stdout.write(text[:-1].rstrip() + (",\n" if value else "\n") + f'  "{key}": [')
    lines: list[str] = []
    for i, item in enumerate(items):
        lines.append(("," if i else "") + "\n    " + dumps(item, indent=None))
        if len(lines) >= batch:
            sys.stdout.write("".join(lines))
            lines = []
    sys.stdout.write("".join(lines) + ("\n  ]\n}\n" if items else "]\n}\n"))
    sys.stdout.flush()


def stats_dict(stats: StoreStats) -> dict[str, Any]:
    """``stats.to_dict()`` plus the derived ratios."""
    return {**stats.to_dict(), "dedup_ratio": stats.dedup_ratio,
            "compression_ratio": stats.compression_ratio}


def stats_table(stats: StoreStats) -> Table:
    """Counts, sizes and ratios of a whole store."""
    table = table_of("KEY", "VALUE", right=("VALUE",))
    table.show_header = False
    rows = [
        ("runs", str(stats.runs)),
        ("versions", str(stats.versions)),
        ("tags", str(stats.tags)),
        ("chunks", str(stats.chunks)),
        ("packs", str(stats.packs)),
        ("logical size", human_bytes(stats.logical_bytes)),
        ("unique size", human_bytes(stats.unique_bytes)),
        ("stored size", human_bytes(stats.stored_bytes)),
        ("pack size", human_bytes(stats.pack_bytes)),
        ("on locations", human_bytes(stats.location_bytes)),
        ("redundancy", stats.redundancy),
        ("dedup ratio", f"{stats.dedup_ratio:.2f}x"),
        ("compression ratio", f"{stats.compression_ratio:.2f}x"),
        ("delta chain policy", f"{stats.delta_chain}" + (" (off)" if not stats.delta_chain else "")),
        ("delta chunks", f"{stats.delta_chunks}: {human_bytes(stats.delta_raw_bytes)} stored in "
                         f"{human_bytes(stats.delta_stored_bytes)}"),
        ("delta chains", f"longest {stats.longest_chain}, mean {stats.mean_chain:.1f}"),
    ]
    if stats.versions_without_tree:
        rows.append(("without a tree", f"{stats.versions_without_tree} version(s) read through per-tensor "
                     "rows (saved by many ranks, or from before tree manifests: `casckpt catalog "
                     "migrate-trees` converts those)"))
    for key, value in rows:
        table.add_row(key, value)
    return table


def check_dict(report: CheckReport) -> dict[str, Any]:
    """``report.to_dict()`` plus ``ok``."""
    return {**report.to_dict(), "ok": report.ok}


def check_view(report: CheckReport) -> list[RenderableType]:
    """A one-line summary, then a table of problems if any."""
    read = (f"; read {report.packs_read} packs, {report.chunks_read} chunks "
            f"({human_bytes(report.bytes_read)})" if report.chunks_read or report.packs_read else "")
    summary = f"checked {report.versions} versions, {report.packs} packs, {report.chunks} chunks{read}"
    notes: list[RenderableType] = [Text(f"warning: {w}", style="yellow") for w in report.warnings]
    if report.ok:
        return [summary, Text("no problems found", style="green"), *notes]
    problems = table_of("KIND", "SUBJECT", "DETAIL")
    for p in report.problems:
        problems.add_row(p.kind, p.subject, p.detail)
    found = Text(f"{len(report.problems)} problem(s) found", style="bold red")
    return [summary, found, problems, *notes]


_STATE_STYLES = {"active": "green", "retiring": "yellow", "failed": "bold red"}


def locations_table(locations: Iterable[LocationInfo]) -> Table:
    """One row per blob location: name, failure domain, state, URL, what it holds, and how its
    health probe went (see :func:`unreachable_notes` for why one is not reachable)."""
    table = table_of("NAME", "DOMAIN", "STATE", "URL", "SHARDS", "SIZE", "DAMAGED", "PROBE", "REACHABLE",
                     right=("SHARDS", "SIZE", "DAMAGED", "PROBE"))
    for loc in locations:
        table.add_row(loc.name, loc.domain, Text(loc.state, style=_STATE_STYLES.get(loc.state, "")),
                      loc.url, str(loc.shards), human_bytes(loc.bytes),
                      Text(str(loc.damaged), style="bold red" if loc.damaged else ""),
                      _seconds(loc.probe_s),
                      Text("yes") if loc.reachable else Text("no", style="bold red"))
    return table


def unreachable_notes(locations: Iterable[LocationInfo]) -> list[RenderableType]:
    """One line per location that is not reachable, saying why."""
    return [Text(f"{loc.name} is not reachable (probed for {_seconds(loc.probe_s)}): {loc.reason}",
                 style="bold red") for loc in locations if not loc.reachable]


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"
