"""The ``peers`` workload's figures, targets and tables (the runs: ``benchmarks/peers.py``).

Every ratio is taken per round, between two tools measured in that round (a tool's saves
summed over the checkpoints against torch.save's; restore medians against torch.load's;
steady stalls, checkpoints 2..N, against DCP ``async_save``'s), then the median over rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from rich.table import Table

from benchmarks import measure
from benchmarks.peers import (
    CHECKPOINTS,
    NAME,
    REGIME_LABELS,
    REGIMES,
    RESTORE_REPS,
    STEPS_PER_INTERVAL,
    PeersResult,
    RegimeRound,
    ToolRound,
)
from benchmarks.peers_tools import ABSENT, LABELS, TOOL_KEYS

__all__ = ["MEASURES", "NAME", "NOTES", "TARGETS", "markdown_table", "raw_table"]

# ---- figures ------------------------------------------------------------------------------------

RoundFigure = Callable[[RegimeRound], float | None]


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def over_rounds(result: PeersResult, regime: str, figure: RoundFigure) -> float | None:
    """The median over rounds of ``figure`` of the regime (None where it has no value)."""
    return _median([figure(run) for run in result.runs if run.regime == regime])


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _steady(values: list[float]) -> list[float]:
    return values[1:] if len(values) > 1 else values  # without the first call: plans, buffers


def save_ratio(tool: str, base: str = "torch", first: bool = False) -> RoundFigure:
    """Sum of the tool's saves over the baseline's in the same round (``first``: checkpoint 1 only)."""
    def figure(run: RegimeRound) -> float | None:
        a, b = run.tools.get(tool), run.tools.get(base)
        if a is None or b is None:
            return None
        return _ratio(a.saves_s[0], b.saves_s[0]) if first else _ratio(sum(a.saves_s), sum(b.saves_s))
    return figure


def stall_ratio(tool: str, base: str = "dcp-async") -> RoundFigure:
    """Steady stall (checkpoints 2..N) of the tool over the base's, in the same round."""
    def figure(run: RegimeRound) -> float | None:
        a, b = run.tools.get(tool), run.tools.get(base)
        if a is None or b is None:
            return None
        return _ratio(sum(_steady(a.stalls_s)), sum(_steady(b.stalls_s)))
    return figure


def bytes_ratio(tool: str, base: str = "torch", of: Literal["disk", "stored_sum"] = "disk") -> RoundFigure:
    """Bytes the tool keeps (or wrote, ``stored_sum``) over the base's kept bytes."""
    def figure(run: RegimeRound) -> float | None:
        a, b = run.tools.get(tool), run.tools.get(base)
        if a is None or b is None:
            return None
        return _ratio(getattr(a, of), b.disk)
    return figure


def restore_ratio(tool: str) -> RoundFigure:
    """Median restore of the tool over the median torch.load, in the same round."""
    def figure(run: RegimeRound) -> float | None:
        a, b = run.tools.get(tool), run.tools.get("torch")
        if a is None or b is None or not a.restores_s:
            return None
        return _ratio(statistics.median(a.restores_s), statistics.median(b.restores_s))
    return figure


def prune_figures(tool: str) -> tuple[RoundFigure, RoundFigure]:
    """(prune seconds, bytes reclaimed / bytes before)."""
    def seconds(run: RegimeRound) -> float | None:
        a = run.tools.get(tool)
        return None if a is None else a.prune_s

    def reclaimed(run: RegimeRound) -> float | None:
        a = run.tools.get(tool)
        return None if a is None or a.reclaimed is None else _ratio(a.reclaimed, a.disk)

    return seconds, reclaimed


Kind = Literal["ratio", "fraction", "seconds", "mb_per_s"]
Waiver = Callable[[PeersResult], str | None]


class Measure(NamedTuple):
    """A reported figure, in the fields of ``benchmarks.report.Metric``."""

    key: str
    label: str
    kind: Kind
    compute: Callable[[PeersResult], float | None]
    waive: Waiver | None = None


def _absent(*tools: str) -> Waiver:
    def waive(r: PeersResult) -> str | None:
        gone = [t for t in tools if r.tools.get(t) == ABSENT]
        return f"{', '.join(LABELS[t] for t in gone)} {ABSENT}" if gone else None
    return waive


def _regime_measures(regime: str) -> tuple[Measure, ...]:
    def m(suffix: str, label: str, figure: RoundFigure, kind: Kind = "ratio",
          waive: Waiver | None = None) -> Measure:
        return Measure(f"{regime}_{suffix}", f"{regime}: {label}", kind,
                       lambda r: over_rounds(r, regime, figure), waive)

    return (
        m("save", "casckpt save / torch.save (10 saves)", save_ratio("casckpt")),
        m("save_vs_dcp", "casckpt save / DCP save", save_ratio("casckpt", "dcp")),
        m("first_save", "casckpt first save / torch.save", save_ratio("casckpt", first=True)),
        m("bytes", "casckpt bytes on disk / 10 torch.save files", bytes_ratio("casckpt"), "fraction"),
        m("stored_sum", "casckpt sum of Version.stored_bytes / 10 torch.save files",
          bytes_ratio("casckpt", of="stored_sum"), "fraction"),
        m("bytes_vs_borg", "casckpt bytes / borg zstd,1 bytes", bytes_ratio("casckpt", "borg-zstd"),
          waive=_absent("borg-zstd")),
        m("restore", "casckpt restore / torch.load (warm, checked)", restore_ratio("casckpt")),
        m("stall_vs_dcp", "casckpt bg stall / DCP async_save stall (steady)", stall_ratio("casckpt-bg")),
        m("hint_stall_vs_dcp", "casckpt bg stall, trust_versions / DCP async_save stall (steady)",
          stall_ratio("casckpt-hint")),
        m("stall_vs_dcp_cached", "casckpt bg stall / DCP async_save stall, cached stager",
          stall_ratio("casckpt-bg", "dcp-async-cached")),
        m("prune_s", "casckpt retention keep_last=3 + gc(grace=0)", prune_figures("casckpt")[0], "seconds"),
        m("dcp_save", "DCP save / torch.save", save_ratio("dcp")),
        m("borg_save", "borg zstd,1 save (torch.save + create) / torch.save", save_ratio("borg-zstd"),
          waive=_absent("borg-zstd")),
        m("restic_save", "restic save (torch.save + backup) / torch.save", save_ratio("restic"),
          waive=_absent("restic")),
    )


MEASURES: tuple[Measure, ...] = tuple(m for regime in REGIMES for m in _regime_measures(regime))

TARGETS: dict[str, float] = {  # issue 32
    "full_save_vs_dcp": 1.0,
    "full_bytes": 0.85,
    "frozen_bytes_vs_borg": 1.0,
    "lora_save": 0.35,
    "lora_bytes": 0.12,
    **{f"{regime}_restore": 1.2 for regime in REGIMES},
    **{f"{regime}_stall_vs_dcp": 1.0 for regime in REGIMES},
    **{f"{regime}_hint_stall_vs_dcp": 0.25 for regime in REGIMES},
}

NOTES = (f"see benchmarks/peers.py; {CHECKPOINTS} checkpoints, {STEPS_PER_INTERVAL} steps apart, per "
         f"regime and round; ratios are per round (sums of a tool's saves over torch.save's, restore "
         f"medians of {RESTORE_REPS} over torch.load's), then the median over rounds; stalls are "
         "checkpoints 2..N; borg and restic save = torch.save + the tool; restic always encrypts "
         "(repository v2, compression auto); borg repositories are unencrypted; DCP async keeps only its "
         "newest checkpoint (its files are DCP's); caches (casckpt index, borg/restic) are counted apart")


# ---- tables -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One tool's figures in one regime (medians over rounds)."""

    tool: str
    status: str
    save: float | None
    bytes: float | None
    restore: float | None
    stall: float | None
    prune_s: float | None
    reclaimed: float | None


def rows(result: PeersResult, regime: str) -> list[Row]:
    """Every tool of the regime, in ``TOOL_KEYS`` order (absent ones with their status)."""
    out = []
    for key in TOOL_KEYS:
        status = result.tools.get(key, "not run")
        prune_s, reclaimed = prune_figures(key)
        out.append(Row(key, status, *(over_rounds(result, regime, f) for f in (
            save_ratio(key), bytes_ratio(key), restore_ratio(key), stall_ratio(key), prune_s, reclaimed))))
    return [row for row in out if row.status != "not run"]


def _file_size(result: PeersResult, regime: str) -> str:
    sizes = [run.tools["torch"].disk for run in result.runs if run.regime == regime and "torch" in run.tools]
    got = [s for s in sizes if s is not None]
    return f" ({measure.fmt_bytes(statistics.median(got) / result.checkpoints)} file)" if got else ""


def _cell(value: float | None, best: float | None, unit: str = "") -> str:
    """``value`` to 2 decimals, bold where it reads the same as the best (ties all bold)."""
    if value is None:
        return ""
    text = f"{value:.2f}{unit}"
    return f"**{text}**" if best is not None and text == f"{best:.2f}{unit}" else text


def markdown_table(result: PeersResult) -> str:
    """The README table: regime | tool | save | bytes | restore | stall | prune, best per regime bold.

    save, bytes and restore are over torch.save / the torch.save files / torch.load; stall is
    over DCP ``async_save``'s steady stall (a blocking save stalls for all of it); prune is
    seconds / the fraction of bytes reclaimed keeping the newest 3.
    """
    lines = ["| regime | tool | save | bytes | restore | stall | prune s / reclaimed |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for regime in result.regimes:
        table = rows(result, regime)
        measured = [row for row in table if row.status == "measured"]

        def best(attr: str, among: list[Row] = measured) -> float | None:
            return min((v for row in among if (v := getattr(row, attr)) is not None), default=None)

        label = f"{REGIME_LABELS[regime]}{_file_size(result, regime)}"
        for row in table:
            if row.status != "measured":
                lines.append(f"| {label} | {LABELS[row.tool]} | {row.status} | | | | |")
            else:
                prune = ("" if row.prune_s is None else
                         _cell(row.prune_s, best("prune_s"), " s") +
                         ("" if row.reclaimed is None else f" / {row.reclaimed:.0%}"))
                ratios = [_cell(getattr(row, a), best(a)) for a in ("save", "bytes", "restore", "stall")]
                lines.append("| " + " | ".join([label, LABELS[row.tool], *ratios, prune]) + " |")
            label = ""
    return "\n".join(lines)


def _tool_median(r: PeersResult, regime: str, key: str
                 ) -> Callable[[Callable[[ToolRound], float | None]], float | None]:
    """``of -> median over rounds of of(tool's figures)`` for one regime and tool."""
    def med(of: Callable[[ToolRound], float | None]) -> float | None:
        return over_rounds(r, regime, lambda run: of(run.tools[key]) if key in run.tools else None)
    return med


def raw_table(outcomes: Mapping[str, PeersResult]) -> Table:
    """Per regime and tool: medians over rounds of the raw seconds and bytes."""
    table = Table(title="peers: casckpt vs torch.save, DCP, borg, restic (medians over rounds)")
    for column in ("regime", "tool", "saves (sum)", "first", "stall (steady, mean)", "bytes", "aside",
                   "restore", "prune", "reclaimed", "ok"):
        table.add_column(column, justify="left" if column in ("regime", "tool") else "right")

    def secs(v: float | None) -> str:
        return "" if v is None else f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"

    def size(v: float | None) -> str:
        return "" if v is None else measure.fmt_bytes(v)

    for r in outcomes.values():
        for regime in r.regimes:
            label = REGIME_LABELS[regime]
            for key in TOOL_KEYS:
                status = r.tools.get(key, "not run")
                if status == "not run":
                    continue
                if status != "measured":
                    table.add_row(label, LABELS[key], status)
                else:
                    med = _tool_median(r, regime, key)
                    table.add_row(
                        label, LABELS[key], secs(med(lambda t: sum(t.saves_s))),
                        secs(med(lambda t: t.saves_s[0])),
                        secs(med(lambda t: statistics.fmean(_steady(t.stalls_s)))),
                        size(med(lambda t: t.disk)), size(med(lambda t: t.aside)),
                        secs(med(lambda t: statistics.median(t.restores_s))), secs(med(lambda t: t.prune_s)),
                        size(med(lambda t: t.reclaimed)), "yes")
                label = ""
    return table


