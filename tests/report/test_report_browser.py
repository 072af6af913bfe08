"""The HTML report in a real browser: headless Chromium (Debian's ``chromium``; .ci/run installs
it) loads the file from disk with the network off, in light and in dark mode.

Asserted: no console error, no request leaves the file, every plot rendered (its ``<svg>``
has the size the page says, a non-zero box, and drawn content), the text of the plots
contrasts with the page in both colour schemes, and the screenshot is not blank.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
from headless import CHROMIUM, Browser
from report_store import build

pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="chromium is not installed (CI installs it: .ci/run)")

PLOTS = {"space", "new-bytes", "metrics", "lineage", "storage", "durability", "stalls", "gc", "locations",
         "drills", "mirrors"}
PROBE = {
    "plots": """[...document.querySelectorAll('figure.plot')].map(f => {
        const svg = f.querySelector('svg'); const box = svg ? svg.getBoundingClientRect() : null;
        return {key: f.dataset.plot, want: [f.dataset.width, f.dataset.height],
                attrs: svg ? [svg.getAttribute('width'), svg.getAttribute('height')] : null,
                box: box ? [box.width, box.height] : null,
                drawn: svg ? svg.querySelectorAll('path, use, rect').length : 0,
                texts: svg ? svg.querySelectorAll('text').length : 0,
                colour: svg ? getComputedStyle(svg).color : null}; })""",
    "background": "getComputedStyle(document.body).backgroundColor",
    "external": """[...document.querySelectorAll('[src], [href]')].map(e => e.getAttribute('src') ||
        e.getAttribute('href')).filter(u => !u.startsWith('#'))""",
}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("report-browser")
    with build(root / "store") as store:
        yield store.ops.report(root / "report.html")


def _rgb(css: str) -> tuple[float, ...]:
    inside = css[css.index("(") + 1:css.index(")")]
    return tuple(float(part) for part in inside.replace("/", ",").split(",")[:3])


def _contrast(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    def luminance(rgb: tuple[float, ...]) -> float:
        linear = [c / 255 / 12.92 if c / 255 <= 0.03928 else ((c / 255 + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.mark.parametrize("dark", [False, True], ids=["light", "dark"])
def test_report_renders_offline_in_chromium(report: Path, dark: bool) -> None:
    from PIL import Image

    with Browser() as browser:
        page = browser.load(report, dark=dark, evaluate=PROBE)
    assert page.errors == []
    assert [u for u in page.requests if not u.startswith(("file:", "data:"))] == []
    assert page.values["external"] == []
    plots = page.values["plots"]
    assert {p["key"] for p in plots} == PLOTS
    for plot in plots:
        assert plot["attrs"] == plot["want"], plot["key"]
        assert plot["box"][0] > 300 and plot["box"][1] > 100, plot
        assert plot["drawn"] > 10 and plot["texts"] > 3, plot
        assert _contrast(_rgb(plot["colour"]), _rgb(page.values["background"])) >= 7, (plot, page.values)
    background = _rgb(page.values["background"])
    assert (sum(background) < 150) is dark  # the page follows prefers-color-scheme
    image = Image.open(io.BytesIO(page.screenshot)).convert("RGB")
    assert image.width >= 1000 and image.height > 3000  # the whole page, every section
    colours = image.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 200  # plots, text, anti-aliasing: far from a blank page
    assert max(count for count, _ in colours) < 0.97 * image.width * image.height


def test_the_browser_check_sees_errors_and_requests(tmp_path: Path) -> None:
    """The checks above can fail: a console error, a script exception and a fetch are all seen."""
    page_file = tmp_path / "bad.html"
    page_file.write_text('<html><body><p>x</p><img src="https://cdn.example.com/x.png">'
                         '<script>console.error("broken"); undefined_function();</script></body></html>')
    with Browser() as browser:
        page = browser.load(page_file)
    assert any("broken" in e for e in page.errors)
    assert any("undefined_function" in e for e in page.errors)
    assert "https://cdn.example.com/x.png" in page.requests


LEGENDS = """[...document.querySelectorAll('figure.plot svg')].map(svg => {
    const box = e => e.getBoundingClientRect();
    const meet = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
    const legends = [...svg.querySelectorAll('g[id^="legend_"]')].map(box);
    const areas = [...svg.querySelectorAll('g[id^="axes_"] > g[id^="patch_"]:first-child')].map(box);
    return {key: svg.closest('figure').dataset.plot, legends: legends.length, areas: areas.length,
            covered: legends.some(l => areas.some(a => meet(l, a)))}; })"""


@pytest.mark.parametrize("width", [1280, 700])
def test_no_legend_covers_a_plot_at_two_widths(report: Path, width: int) -> None:
    with Browser() as browser:
        page = browser.load(report, width=width, evaluate={
            "legends": LEGENDS, "scroll": "document.documentElement.scrollWidth",
            "cards": "[...document.querySelectorAll('.card')].map(c => c.innerText.replace(/\\s+/g, ' '))"})
    found = page.values["legends"]
    assert {f["key"] for f in found if f["legends"]} == PLOTS - {"lineage", "gc", "locations"}
    assert all(f["areas"] >= 1 for f in found)  # the probe sees every plot's drawing area
    assert [f["key"] for f in found if f["covered"]] == []  # each legend sits outside every plot area
    assert page.values["scroll"] <= width  # nothing runs off the side
    assert "3 runs" in page.values["cards"]
