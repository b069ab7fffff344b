"""The served workbench (`ckptlab serve`) and the HTML report (`ckptlab report`) in chromium."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_support import ServedProcess, free_port, serve_process

from ckptlab import samples
from ckptlab.cli import main as cli_main

pytestmark = pytest.mark.browser

MAP = ".ckptlab-bytemap .js-plotly-plot"


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return samples.write_sample(tmp_path_factory.mktemp("app") / "sample.pt")


@pytest.fixture(scope="module")
def served(sample: Path) -> Iterator[ServedProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "ckptlab", "serve", str(sample), "--port", str(port)]
    with serve_process(cmd, port, timeout=120) as proc:
        yield proc


def _open_app(page, served: ServedProcess) -> None:
    page.goto(served.url + "/")
    page.locator(f"{MAP} .hm").first.wait_for(state="attached")
    page.locator(f"{MAP} .gtitle").first.wait_for()
    # the tensor table comes first: bring the torch.save section's map into the viewport
    page.locator(MAP).first.scroll_into_view_if_needed()


def test_app_renders_the_byte_map_offline(page, page_log, served, screenshot) -> None:
    _open_app(page, served)
    title = page.locator(f"{MAP} .gtitle").first.text_content()
    assert "sample.pt" in title and "alignment 64" in title
    lanes = page.locator(f"{MAP} .ytick text").all_text_contents()
    for lane in ("local header", "name", "FB padding", "data", "descriptor",
                 "central directory", "EOCD"):
        assert lane in lanes
    screenshot("app")
    page_log.assert_offline()
    page_log.assert_no_errors()


def test_moving_the_alignment_control_redraws_the_map(page, page_log, served,
                                                      screenshot) -> None:
    _open_app(page, served)
    handle = page.locator(".ckptlab-alignment .noUi-handle").first
    handle.focus()
    for _ in range(6):  # 64 -> 128 -> ... -> 4096, one option per key press
        page.keyboard.press("ArrowRight")
    title = page.locator(f"{MAP} .gtitle").first
    page.wait_for_function(
        "el => el.textContent.includes('at alignment 4096')", arg=title.element_handle())
    assert "what-if" in title.text_content()
    assert "4 KiB" not in title.text_content()  # the title states bytes, not a verdict
    screenshot("app-4096")
    page_log.assert_offline()
    page_log.assert_no_errors()


def test_hover_on_the_map_names_a_record(page, page_log, served, screenshot) -> None:
    _open_app(page, served)
    drag = page.locator(f"{MAP} .nsewdrag").first
    box = drag.bounding_box()
    data_tick = page.locator(f"{MAP} .ytick text", has_text=re.compile(r"^data$")).first
    data_tick.wait_for()  # (the axis may be drawn a moment after the map on a busy machine)
    tick = data_tick.bounding_box()
    y = tick["y"] + tick["height"] / 2  # the middle of the data lane
    hover = page.locator(f"{MAP} .hoverlayer .hovertext").first
    # plotly hovers on mousemove inside its drag layer; the pane may still be settling its
    # size right after the first draw, so sweep until a label shows (bounded)
    for attempt in range(20):
        page.mouse.move(box["x"] + 5, y)
        page.mouse.move(box["x"] + box["width"] * (0.2 + 0.03 * attempt), y, steps=5)
        try:
            hover.wait_for(timeout=1000)
            break
        except Exception:
            box = drag.bounding_box()
    hover.wait_for(timeout=1000)
    text = hover.text_content()
    # the hover names the tensor and its record (plain words since the byte map's rework)
    assert "data" in text and "in tensor model." in text, text
    assert re.search(r"(sample/)?data/\d+", text), text
    screenshot("app-hover")
    page_log.assert_no_errors()


def test_report_opens_offline_with_its_figures(page, page_log, sample: Path, tmp_path: Path,
                                               screenshot) -> None:
    out = tmp_path / "report.html"
    assert cli_main(["report", str(sample), "-o", str(out)]) == 0
    page.goto(out.as_uri())
    plots = page.locator(".ckptlab-figure .js-plotly-plot")
    plots.nth(3).locator(".main-svg").first.wait_for(state="attached")
    assert plots.count() >= 4  # byte map, overhead, alignment cost, tensors (and more)
    assert page.locator(".ckptlab-figure .js-plotly-plot .hm").count() == 1  # the byte map
    titles = page.locator(".ckptlab-figure .gtitle").all_text_contents()
    assert any("sample.pt" in t for t in titles)
    assert any(t.startswith("Alignment cost") for t in titles)
    hexview = page.locator("pre.ckptlab-hex")
    assert hexview.locator('span[title="local header of sample/data.pkl"]').count() == 2
    assert hexview.text_content().lstrip().startswith("0  50 4b 03 04")
    screenshot("report")
    page_log.assert_offline()
    page_log.assert_no_errors()


def test_zooming_the_map_rebins_it_on_the_server(page, page_log, served, screenshot) -> None:
    _open_app(page, served)
    plot = page.locator(MAP).first
    meta = plot.evaluate("gd => gd.layout.meta")
    assert meta["mode"] == "binned" and meta["x_range"][0] == 0
    # what a drag-zoom sends: plotly's relayout event, which panel forwards to the server;
    # bytes 75,000-82,000 hold the records around data/1
    plot.evaluate("gd => Plotly.relayout(gd, {'xaxis.range[0]': 75000, 'xaxis.range[1]': 82000})")
    page.wait_for_function(
        "gd => gd.layout.meta && gd.layout.meta.x_range[0] === 75000", arg=plot.element_handle())
    meta = plot.evaluate("gd => gd.layout.meta")
    assert meta["x_range"] == [75000, 82000]
    # the server re-binned: the columns now cover exactly the window, 7 bytes each
    edges = plot.evaluate("gd => Array.from(gd.data[0].x)")
    assert len(edges) == meta["columns"] + 1 == 1001
    assert edges[0] == 75000 and edges[-1] == 82000
    screenshot("app-zoomed")
    page_log.assert_no_errors()


# ``python -c`` for a server whose index is held back until a file appears: it starts as
# ``ckptlab serve`` does (ckptlab.widgets.app.serve), with ServedCheckpoint waiting for the
# gate first, so that the page is opened while the index is still being made
GATED_SERVER = """
import os, sys, time
import ckptlab.widgets.app as app
path, port, gate = sys.argv[1], int(sys.argv[2]), sys.argv[3]
made = app.ServedCheckpoint.__init__
def gated(self, *args, **kwargs):
    while not os.path.exists(gate):
        time.sleep(0.05)
    made(self, *args, **kwargs)
app.ServedCheckpoint.__init__ = gated
app.serve(path, port=port)
"""


def test_the_port_opens_before_the_index_and_pages_show_its_progress(
        page, page_log, sample: Path, tmp_path: Path, screenshot) -> None:
    """A page opened while the index is being made shows the checkpoint's name and a progress
    line; once the index is there the same page gets the summary, the table and (the page
    went out without plotly.js) the byte map."""
    import os

    gate = tmp_path / "gate"
    port = free_port()
    env = dict(os.environ, CKPTLAB_CACHE_DIR=str(tmp_path / "cache"))
    cmd = [sys.executable, "-c", GATED_SERVER, str(sample), str(port), str(gate)]
    with serve_process(cmd, port, timeout=120, env=env) as proc:
        page.goto(proc.url + "/")
        progress = page.locator(".ckptlab-progress-text").first
        progress.wait_for()
        assert "Reading the tensors of sample.pt" in progress.text_content()
        assert "sample.pt" in page.locator(".ckptlab-title h2").first.text_content()
        page.wait_for_timeout(1500)  # polled a few times: still no table, no map
        assert page.locator(".ckptlab-tensors .tabulator-row").count() == 0
        assert page.evaluate("() => window.Plotly === undefined")
        screenshot("app-index-progress")
        gate.write_text("go")
        page.locator(".ckptlab-tensors .tabulator-row").first.wait_for()
        assert "tensors" in page.locator(".ckptlab-summary").first.text_content()
        assert page.locator(".ckptlab-progress-text").count() == 0
        page.locator(f"{MAP} .hm").first.wait_for(state="attached")  # plotly.js came after
        page_log.assert_offline()
        page_log.assert_no_errors()
