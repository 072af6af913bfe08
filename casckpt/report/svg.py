"""Matplotlib figures as inline SVG that reads in light and dark mode.

Needs the ``report`` extra (``pip install 'casckpt[report]'``): importing this module
without matplotlib raises :class:`~casckpt.errors.OptionalDependencyError` naming it.
Figures are built on :class:`matplotlib.figure.Figure` (no pyplot, so no global figure
state); settings apply through ``rc_context`` around each figure only.

Light and dark: backgrounds are transparent, text, axes and ticks are drawn in
``currentColor`` (the page's CSS sets it per ``prefers-color-scheme``), and data colours
are mid-tones that stand out on white and on near-black alike.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from casckpt.errors import OptionalDependencyError
from casckpt.types import human_bytes

try:
    import matplotlib
    from cycler import cycler
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator
except ImportError as exc:  # pragma: no cover - the test extra installs it
    raise OptionalDependencyError(
        f"casckpt.report needs matplotlib ({exc}): pip install 'casckpt[report]'") from exc

__all__ = ["BAD_COLOUR", "FOREGROUND", "OK_COLOUR", "PALETTE", "WARN_COLOUR", "Axes", "MaxNLocator", "Patch",
           "Plot", "bytes_axis", "figure", "human_bytes", "legend", "render"]

FOREGROUND = "#010203"  # drawn as currentColor: nothing else uses this exact colour
PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")  # Tableau 10: mid-tones
OK_COLOUR, WARN_COLOUR, BAD_COLOUR = "#59a14f", "#f28e2b", "#e15759"
WIDTH_IN = 8.0
_RC: dict[Any, Any] = {
    "date.epoch": "1970-01-01T00:00:00",  # so a date is unix seconds / 86400
    "text.parse_math": False,  # a metric named "cost $x$" is text, not TeX
    "svg.fonttype": "none",  # text stays text: searchable, and no glyph paths to bloat the file
    "font.family": "sans-serif",
    "font.size": 9.0,
    "text.color": FOREGROUND,
    "axes.labelcolor": FOREGROUND,
    "axes.edgecolor": FOREGROUND,
    "xtick.color": FOREGROUND,
    "ytick.color": FOREGROUND,
    "axes.facecolor": "none",
    "figure.facecolor": "none",
    "savefig.facecolor": "none",
    "savefig.transparent": True,
    "legend.frameon": False,
    "axes.grid": True,
    "grid.color": "#808080",
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.prop_cycle": cycler(color=list(PALETTE)),
}
_HEAD = re.compile(r"\A.*?(?=<svg\b)", re.S)


@dataclass(frozen=True, slots=True)
class Plot:
    """One figure as SVG text (no XML prolog), and its size as its ``<svg>`` states it."""

    svg: str
    width: str  # e.g. "576pt"
    height: str


@contextmanager
def figure(key: str, height_in: float = 3.2, *, rows: int = 1) -> Iterator[tuple[Figure, list[Axes]]]:
    """A figure of ``rows`` stacked axes, inside the report's matplotlib settings.

    ``key`` salts the SVG's element ids, so two figures inlined in one page never share an
    id (and the same data gives the same bytes).
    """
    with matplotlib.rc_context({**_RC, "svg.hashsalt": f"casckpt-report-{key}"}):
        fig = Figure(figsize=(WIDTH_IN, height_in), layout="constrained")
        axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
        yield fig, axes


def legend(fig: Figure, ax: Axes, handles: Sequence[Artist] | None = None) -> None:
    """The figure's legend, in a row above its axes (constrained layout makes room for it), so
    it never covers data, whatever the data and the page width: inside the axes, any corner
    sits on some plot's bars or lines. ``handles``: what to list (default: ``ax``'s labelled
    artists)."""
    shown = list(handles) if handles is not None else ax.get_legend_handles_labels()[0]
    if shown:
        fig.legend(handles=shown, loc="outside upper center", ncols=min(len(shown), 6), fontsize=8)


def render(fig: Figure, key: str) -> Plot | None:
    """``fig`` as inline SVG, foreground in ``currentColor``; None when matplotlib cannot draw
    it (values it cannot lay ticks out for, such as metrics spanning -1e308..1e308: finite, so
    a commit accepts them): the section keeps its table and says the plot is missing."""
    buffer = io.StringIO()
    with matplotlib.rc_context({**_RC, "svg.hashsalt": f"casckpt-report-{key}"}):
        try:
            fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": "casckpt"})
        except (ValueError, OverflowError, FloatingPointError):
            return None
    svg = _HEAD.sub("", buffer.getvalue(), count=1).replace(FOREGROUND, "currentColor")
    width = re.search(r'<svg[^>]*\bwidth="([^"]+)"', svg)
    height = re.search(r'<svg[^>]*\bheight="([^"]+)"', svg)
    if width is None or height is None:  # pragma: no cover - matplotlib always writes both
        raise ValueError("matplotlib wrote an SVG without width and height")
    svg = svg.replace("<svg ", f'<svg role="img" aria-label="plot {key}" ', 1)
    return Plot(svg=svg, width=width.group(1), height=height.group(1))


def bytes_axis(axis: Axis) -> None:
    """Label an axis (``ax.yaxis``, ``ax.xaxis``) in KiB/MiB/GiB."""
    axis.set_major_formatter(FuncFormatter(lambda value, _pos: human_bytes(value)))
