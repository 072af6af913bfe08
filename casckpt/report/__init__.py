"""A store as one self-contained HTML report (``store.ops.report``, ``casckpt report``).

:func:`write_report` reads the store through its public queries (:mod:`.data`), draws
each section with matplotlib as inline SVG (:mod:`.svg`, :mod:`.sections`,
:mod:`.operations`) and writes one HTML file that needs no network to view
(:mod:`.page`). Needs the ``report`` extra (``pip install 'casckpt[report]'``); importing
this package without matplotlib raises :class:`~casckpt.errors.OptionalDependencyError`.
``import casckpt`` never imports it.
"""

from __future__ import annotations

from casckpt.report.data import ReportData, ReportSource, collect
from casckpt.report.page import render_page, write_report

__all__ = ["ReportData", "ReportSource", "collect", "render_page", "write_report"]
