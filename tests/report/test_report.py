"""The HTML report's content, without a browser: self-contained, every section, tables, filters, errors.

(tests/report/test_report_browser.py loads it in Chromium.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from report_store import RUNS, build
from typer.testing import CliRunner

import casckpt
from casckpt.cli.main import app
from casckpt.errors import InvalidArgumentError, RefNotFoundError

ROOT = Path(__file__).resolve().parents[2]


class _Page(HTMLParser):
    """Every tag with its attributes; text of each section's tables."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.cells: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_cell = tag == "td"

    def handle_endtag(self, tag: str) -> None:
        self._in_cell = False if tag == "td" else self._in_cell

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.cells.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[casckpt.Store]:
    with build(tmp_path_factory.mktemp("report") / "store") as store:
        yield store


def test_report_is_self_contained(demo: casckpt.Store, tmp_path: Path) -> None:
    out = demo.ops.report(tmp_path / "r.html")
    text = out.read_text(encoding="utf-8")
    page = _parse(out)
    links = [v for _, attrs in page.tags for k, v in attrs.items()
             if k in ("src", "href", "xlink:href") and v]
    assert links and all(v.startswith("#") for v in links), links  # only in-page anchors and SVG ids
    assert not [v for v in links if re.match(r"(?i)https?://", v)]
    assert not {t for t, _ in page.tags} & {"script", "link", "img", "iframe", "object", "embed"}
    assert "@import" not in text and "@font-face" not in text
    assert re.findall(r"url\((?!#)", text) == []  # only the SVGs' own clip paths
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed


def test_report_has_every_section_with_its_table(demo: casckpt.Store, tmp_path: Path) -> None:
    page = _parse(demo.ops.report(tmp_path / "r.html"))
    figures = {a["data-plot"] for t, a in page.tags if t == "figure"}
    assert figures == {"space", "new-bytes", "metrics", "lineage", "storage", "durability", "stalls", "gc",
                       "locations", "drills", "mirrors"}
    svgs = [a for t, a in page.tags if t == "svg"]
    assert len(svgs) == len(figures) and all(a.get("width", "").endswith("pt") for a in svgs)
    assert len([t for t, _ in page.tags if t == "table"]) == len(figures)
    cells = set(page.cells)
    for version in demo.log():  # every visible version has a row
        assert f"{version.run}@{version.step}" in cells
    assert {"warmup-done", "release"} <= cells  # tags in the metrics table
    assert "best (min)" in cells
    assert "ok" in cells  # drill results
    assert {"archive", str(demo.mirrors.get("archive").destination)} <= cells  # the mirror, which sent one
    assert demo.mirrors.get("archive").versions_sent == 1


def test_report_of_some_runs_and_of_an_empty_store(demo: casckpt.Store, tmp_path: Path) -> None:
    page = _parse(demo.ops.report(tmp_path / "one.html", runs=["ft-wd"]))
    with casckpt.open(tmp_path / "empty") as empty:
        blank = empty.ops.report(tmp_path / "empty.html")
    assert "ft-wd@900" in page.cells and not [c for c in page.cells if c.startswith(("base@", "ft-lr@"))]
    text = blank.read_text(encoding="utf-8")
    for empty_state in ("No versions yet.", "No restore drills recorded yet", "No gc has run yet",
                        "No mirrors"):
        assert empty_state in text
    assert [a["data-plot"] for t, a in _parse(blank).tags if t == "figure"] == ["locations"]


def test_report_refuses_bad_runs(demo: casckpt.Store, tmp_path: Path) -> None:
    with pytest.raises(RefNotFoundError, match="nope"):
        demo.ops.report(tmp_path / "r.html", runs=["nope"])
    with pytest.raises(InvalidArgumentError):
        demo.ops.report(tmp_path / "r.html", runs=[""])
    assert not (tmp_path / "r.html").exists()


def test_cli_report(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        for step in (1, 2):
            store.commit({"w": torch.full((64,), float(step))}, run=RUNS[0], step=step,
                         metrics={"loss": 1 / step, "<i>$x$": float(step)})
    ok = CliRunner().invoke(app, ["--store", str(tmp_path / "s"), "report", "--html",
                                  str(tmp_path / "r.html"), "--run", RUNS[0]])
    missing = CliRunner().invoke(app, ["--store", str(tmp_path / "s"), "report", "--html",
                                       str(tmp_path / "x.html"), "--run", "nope"])
    assert ok.exit_code == 0, ok.output
    assert "Wrote report" in ok.output and (tmp_path / "r.html").is_file()
    text = (tmp_path / "r.html").read_text(encoding="utf-8")  # a metric's name is text, escaped
    assert "<i>" not in text and text.count("&lt;i&gt;$x$") >= 2  # the plot's label, the table
    assert missing.exit_code == 3 and not (tmp_path / "x.html").exists()


def _words(path: Path) -> str:
    """The page's text as a reader sees it: tags gone, whitespace collapsed."""
    return " ".join(re.sub(r"<[^>]+>", " ", path.read_text(encoding="utf-8")).split())


def test_counts_read_as_english(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "s") as store:
        store.commit({"w": torch.ones(64)}, run="only", step=1, metrics={"loss": 1.0})
        one = _words(store.ops.report(tmp_path / "one.html"))
        store.commit({"w": torch.zeros(64)}, run="second", step=1, metrics={"loss": 0.5})
        two = _words(store.ops.report(tmp_path / "two.html"))
    assert "1 run 1 version" in one and "1 runs" not in one and "1 versions" not in one
    assert re.search(r"\b1 rows\b", one) is None and ", 1 row" in one
    assert "2 runs 2 versions" in two and ", 2 rows" in two


def test_no_legend_covers_a_plot(demo: casckpt.Store, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from casckpt.report import operations, sections, svg

    drawn: dict[str, Any] = {}

    def keep(fig: Any, key: str) -> Any:
        drawn[key] = fig
        return svg.render(fig, key)

    monkeypatch.setattr(sections, "render", keep)
    monkeypatch.setattr(operations, "render", keep)
    demo.ops.report(tmp_path / "r.html")
    with_legends = set()
    for key, fig in drawn.items():
        fig.draw_without_rendering()
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend() is not None)]
        with_legends |= {key} if legends else set()
        for found in legends:
            box = found.get_window_extent()
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent()), f"the legend of {key} covers its plot"
    assert with_legends == {"space", "new-bytes", "metrics", "storage", "durability", "stalls", "drills",
                            "mirrors"}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_matplotlib_is_optional() -> None:
    """``import casckpt`` never imports matplotlib; without it, a report names the extra to install."""
    plain = _python("import sys, casckpt; print('matplotlib' in sys.modules)")
    assert plain.returncode == 0 and plain.stdout.strip() == "False", plain.stderr
    blocked = _python("import sys; sys.modules['matplotlib'] = None\n"
                      "from casckpt.errors import OptionalDependencyError\n"
                      "try:\n    import casckpt.report\nexcept OptionalDependencyError as e:\n    print(e)\n")
    assert blocked.returncode == 0 and "pip install 'casckpt[report]'" in blocked.stdout, blocked.stderr


_EVIL = '<script>alert(1)</script><img src=x onerror=alert(2)>"\'&'


def test_the_report_escapes_what_users_typed(tmp_path: Path) -> None:
    with casckpt.open(tmp_path / "store") as store:
        for step in (1, 2):
            store.commit({"w": torch.full((64,), float(step))}, run="r", step=step,
                         metrics={_EVIL: 1.0 / step}, message=_EVIL, metadata={_EVIL: _EVIL})
        store.ops.drill(count=2)
        out = store.ops.report(tmp_path / "r.html")
    page = out.read_text(encoding="utf-8")
    assert "<script" not in page and "<img" not in page


def test_the_report_refuses_to_replace_what_is_not_a_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    with casckpt.open(tmp_path / "store") as store:
        store.commit({"w": torch.zeros(8)}, run="r", step=1)
        for target in (fifo, folder):
            with pytest.raises((InvalidArgumentError, OSError)):
                store.ops.report(target)
    assert fifo.exists() and not fifo.is_file() and folder.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "pipe", "store"]  # no temporary left


def test_metrics_matplotlib_cannot_plot_still_get_a_report_with_their_table(tmp_path: Path) -> None:
    # finite, so commit accepts them; matplotlib's tick locator raised ValueError and no report was written
    with casckpt.open(tmp_path / "store") as store:
        store.commit({"w": torch.zeros(4)}, run="x", step=0, metrics={"loss": 1e308, "acc": -1e308})
        store.commit({"w": torch.zeros(4)}, run="x", step=1, metrics={"loss": 5e-324, "acc": 1e308})
        page = store.ops.report(tmp_path / "r.html").read_text(encoding="utf-8")
    assert "The plot could not be drawn" in page and "<td>1e+308</td>" in page
    assert page.count("<svg") >= 3  # the other sections still have their plots


def test_the_report_never_writes_through_a_link_at_a_temporary_name(tmp_path: Path) -> None:
    # the temporary was always ".NAME.tmp": a symlink planted there was followed, writing the report
    # over whatever it pointed at (and two reports to one path wrote into one temporary)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / ".r.html.tmp").symlink_to(victim)
    with casckpt.open(tmp_path / "store") as store:
        store.commit({"w": torch.zeros(8)}, run="r", step=1)
        out = store.ops.report(tmp_path / "r.html")
    assert victim.read_text() == "precious" and out.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".r.html.tmp", "r.html", "store", "victim"]
