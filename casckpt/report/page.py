"""One self-contained HTML page: inline CSS and SVG, no script, nothing fetched to view it.

The page follows the reader's ``prefers-color-scheme``; every plot's SVG draws its text and
axes in ``currentColor``, so the same SVG reads on both. Each plot has the same data as a
table below it (collapsed in a ``<details>``, which keyboards and screen readers open).
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path

from casckpt.errors import InvalidArgumentError
from casckpt.localfs import replace_atomically
from casckpt.report import operations, sections
from casckpt.report.data import ReportData, ReportSource, collect
from casckpt.report.sections import Section, when
from casckpt.report.svg import human_bytes

MAX_ROWS = 2000  # a table lists at most this many rows (the newest, for ordered data) and says so

_CSS = """
:root { color-scheme: light dark; --fg: #1f2328; --bg: #ffffff; --muted: #59636e; --line: #d1d9e0;
        --card: #f6f8fa; }
@media (prefers-color-scheme: dark) {
  :root { --fg: #e6edf3; --bg: #0d1117; --muted: #9198a1; --line: #3d444d; --card: #151b23; }
}
* { box-sizing: border-box; }
body { margin: 0 auto; max-width: 62rem; padding: 1.5rem; color: var(--fg); background: var(--bg);
       font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; }
h1 { font-size: 1.6rem; margin: 0 0 .25rem; } h2 { font-size: 1.25rem; margin: 2.2rem 0 .3rem; }
p.meta, p.intro, p.empty { color: var(--muted); margin: .2rem 0 .6rem; }
p.empty { font-style: italic; padding: 1rem; border: 1px dashed var(--line); border-radius: 6px; }
nav a { color: inherit; margin-right: .8rem; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(9rem, 1fr)); gap: .6rem;
         margin: 1rem 0; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 6px; padding: .5rem .7rem; }
.card b { display: block; font-size: 1.15rem; } .card span { color: var(--muted); font-size: .85rem; }
figure { margin: 0; } figure svg { display: block; max-width: 100%; height: auto; color: var(--fg); }
details { margin: .4rem 0 0; } summary { cursor: pointer; color: var(--muted); }
table { border-collapse: collapse; margin: .4rem 0; font-size: .85rem; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid var(--line); padding: .2rem .6rem; text-align: left; }
"""


def write_report(source: ReportSource, path: str | os.PathLike[str], runs: Sequence[str] | None = None,
                 *, title: str = "casckpt store") -> Path:
    """Collect the report's data from ``source`` and write it to ``path`` as one HTML file.

    The file is written beside ``path`` and renamed over it, so a reader never sees half a
    report. Returns the path written.

    Raises:
        InvalidArgumentError: a bad ``runs``; or ``path`` exists and is not a file (a folder,
            a pipe, a device: never replaced by the report).
        RefNotFoundError: a run in ``runs`` does not exist.
        OSError: ``path`` cannot be written.
    """
    target = Path(path)
    if target.exists() and not target.is_file():
        raise InvalidArgumentError(
            f"{target} exists and is not a file; the report replaces a file only: give a file path")
    page = render_page(collect(source, runs, title=title))
    # two reports to one path never write into each other's temporary; no half report is left
    replace_atomically(target, lambda tmp: tmp.write_text(page, encoding="utf-8"))
    return target


def render_page(data: ReportData) -> str:
    """The whole page for ``data``."""
    built = [build(data) for build in (*sections.BUILDERS, *operations.BUILDERS)]
    nav = " ".join(f'<a href="#{s.key}">{html.escape(s.title)}</a>' for s in built)
    body = "\n".join(_section(s) for s in built)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        "<meta name=\"color-scheme\" content=\"light dark\">\n"
        f"<title>{html.escape(data.title)}: report</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
        f"<header><h1>{html.escape(data.title)}</h1>\n"
        f"<p class=\"meta\">Report made {when(data.generated_at)} by casckpt.</p>\n{_cards(data)}\n"
        f"<nav aria-label=\"sections\">{nav}</nav></header>\n<main>\n{body}\n</main>\n</body>\n</html>\n")


def _cards(data: ReportData) -> str:
    st = data.stats
    saved = 1 - st.stored_bytes / st.logical_bytes if st.logical_bytes else 0.0
    items = ((_plural(st.runs, "run"), str(st.runs)), (_plural(st.versions, "version"), str(st.versions)),
             ("logical", human_bytes(st.logical_bytes)),
             ("stored", human_bytes(st.stored_bytes)), ("saved", f"{saved:.0%}"),
             ("on locations", human_bytes(st.location_bytes)), ("redundancy", st.redundancy))
    cards = "".join(f'<div class="card"><b>{html.escape(v)}</b><span>{html.escape(k)}</span></div>'
                    for k, v in items)
    return f'<div class="cards">{cards}</div>'


def _plural(count: int, noun: str) -> str:
    """``noun`` as it reads after ``count``: 1 run, 0 runs, 2 runs."""
    return noun if count == 1 else f"{noun}s"


def _section(s: Section) -> str:
    parts = [f'<section id="{s.key}" aria-labelledby="{s.key}-title">',
             f'<h2 id="{s.key}-title">{html.escape(s.title)}</h2>',
             f'<p class="intro">{html.escape(s.intro)}</p>']
    if s.plot is None:
        empty = s.empty or "The plot could not be drawn from these values; the table below has them."
        parts.append(f'<p class="empty">{html.escape(empty)}</p>')
    else:
        parts.append(f'<figure class="plot" data-plot="{s.key}" data-width="{s.plot.width}" '
                     f'data-height="{s.plot.height}">{s.plot.svg}</figure>')
    if s.table.rows:
        parts.append(_table(s))
    parts.append("</section>")
    return "\n".join(parts)


def _table(s: Section) -> str:
    rows = s.table.rows[-MAX_ROWS:]
    note = f" (the last {len(rows)} of {len(s.table.rows)})" if len(rows) < len(s.table.rows) else ""
    head = "".join(f'<th scope="col">{html.escape(h)}</th>' for h in s.table.headers)
    body = "\n".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    count = f"{len(s.table.rows)} {_plural(len(s.table.rows), 'row')}"
    return (f"<details><summary>Data: {html.escape(s.title)}, {count}{note}</summary>\n"
            f"<table><caption>{html.escape(s.title)}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>\n{body}\n</tbody></table></details>")
