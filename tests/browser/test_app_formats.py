"""The tensor-first served app in chromium on four formats: a torch.save file, a safetensors
file, a Hugging Face sharded directory and a DCP directory.

Each: the page paints the summary and the tensor table; typing a name in the search box
finds the tensor; clicking its row outlines its bytes on the byte map (a rectangle at the
tensor's file offset in the figure the browser drew) and shows its first bytes in hex;
the title, the plotly toolbar and the lane labels do not overlap. Screenshots go to
``.artifacts/browser/``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_support import ServedProcess, free_port, serve_process

import ckptlab as cl
from ckptlab import samples

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600)]

MAP = ".ckptlab-bytemap .js-plotly-plot"
ROW = ".ckptlab-tensors .tabulator-row"
LONG = "with_a_suffix_long_enough_to_be_cut_in_a_1280_px_wide_page"
# [field, the width its text takes, the width its box gives the text] of each element: a
# Range measures the text's whole run, also where it is cut
TEXT_FIT = """els => els.map(e => {
  const t = e.querySelector('.tabulator-col-title') || e.querySelector(':scope > div') || e
  const range = document.createRange()
  range.selectNodeContents(t)
  const cs = getComputedStyle(t)
  return [e.getAttribute('tabulator-field'), range.getBoundingClientRect().width,
          t.clientWidth - parseFloat(cs.paddingLeft) - parseFloat(cs.paddingRight),
          cs.textOverflow, cs.overflowX, t.textContent]
})"""


def _write_torch(root: Path) -> tuple[Path, str]:
    return samples.write_sample(root / "sample.pt"), "model.transformer.h.1.mlp.c_fc.weight"


def _write_safetensors(root: Path) -> tuple[Path, str]:
    import torch
    from safetensors.torch import save_file

    path = root / "model.safetensors"
    save_file({f"blocks.{i}.attn.weight": torch.full((64, 64), float(i)) for i in range(6)}
              | {"head.bias": torch.ones(16)}, str(path))
    return path, "blocks.4.attn.weight"


def _write_hf(root: Path) -> tuple[Path, str]:
    import torch
    from safetensors.torch import save_file

    out = root / "hf"
    out.mkdir()
    weight_map = {}
    for shard in (1, 2):
        name = f"model-0000{shard}-of-00002.safetensors"
        tensors = {f"model.layers.{shard * 10 + i}.mlp.weight": torch.full((32, 32), float(i))
                   for i in range(4)}
        # a name longer than its column: cut with an ellipsis, whole in the tooltip
        tensors[f"model.layers.{shard}.self_attention.query_key_value.weight_{LONG}"] = (
            torch.zeros(2))
        save_file(tensors, str(out / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    # a config whose values are long one-line JSON (a value besides the tensors)
    (out / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "suppress_tokens": list(range(400)),
         "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position": 8192}}))
    return out, "model.layers.22.mlp.weight"


def _write_dcp(root: Path) -> tuple[Path, str]:
    import torch
    import torch.distributed.checkpoint as dcp

    out = root / "dcp"
    sd = {"model": {f"layer{i}.weight": torch.full((16, 16), float(i)) for i in range(5)},
          "step": 1234, "lr": 3e-4}
    dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    return out, "model.layer3.weight"


WRITERS = {"torch": _write_torch, "safetensors": _write_safetensors, "hf": _write_hf,
           "dcp": _write_dcp}


@pytest.fixture(scope="module", params=list(WRITERS))
def served(request, tmp_path_factory) -> Iterator[tuple[ServedProcess, Path, str]]:
    root = tmp_path_factory.mktemp(f"fmt-{request.param}")
    path, name = WRITERS[request.param](root)
    port = free_port()
    if request.param == "torch":  # the CLI verb itself
        cmd = [sys.executable, "-m", "ckptlab", "serve", str(path), "--port", str(port)]
    else:  # the CLI still refuses other formats up front: the app's own entry point
        cmd = [sys.executable, "-m", "ckptlab.widgets.app", str(path), "--port", str(port)]
    env = dict(os.environ, CKPTLAB_CACHE_DIR=str(root / "cache"))
    with serve_process(cmd, port, timeout=180, env=env) as proc:
        yield proc, path, name


def _boxes_overlap(a: dict, b: dict) -> bool:
    return not (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
                or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])


def test_search_select_and_highlight(page, page_log, served, screenshot) -> None:
    proc, path, name = served
    ck = cl.open(path)
    part = ck.tensors[name].parts[0]
    page.goto(proc.url + "/")
    page.locator(ROW).first.wait_for()
    summary = page.locator(".ckptlab-summary").first.text_content()
    assert f"{len(ck.tensors):,} tensors" in summary
    assert f"{ck.parameters:,} parameters" in summary
    if ck.format != "torch-zip":
        assert "record" not in summary and "zip64" not in summary
    count = page.locator(".ckptlab-count-text").first
    assert count.text_content() == f"{len(ck.tensors):,} tensors"

    page.locator(".ckptlab-search input").first.fill(name)
    cell = page.locator(f'{ROW} .tabulator-cell[tabulator-field="name"]', has_text=name).first
    cell.wait_for()
    page.locator(".ckptlab-count-text", has_text=f" of {len(ck.tensors):,}").first.wait_for()
    cells = page.locator(f'{ROW} .tabulator-cell[tabulator-field="name"]')
    for _ in range(100):  # the count may show before the rows are redrawn
        shown = cells.all_text_contents()
        if shown and all(name in s for s in shown):
            break
        page.wait_for_timeout(100)
    assert name in shown and all(name in s for s in shown), shown

    page.locator(MAP).first.wait_for()  # the map arrives once the server opened the file
    cell.click()
    page.locator(".ckptlab-tensor-title", has_text=name).first.wait_for()
    hexview = page.locator(".ckptlab-tensor-hex pre.ckptlab-hex").first
    hexview.wait_for()
    assert hexview.text_content().lstrip().startswith(f"{part.offset:,}")
    plot = page.locator(MAP).first
    page.wait_for_function(
        "([gd, x0]) => (gd.layout.shapes || []).some(s => s.type === 'rect' && s.x0 === x0)",
        arg=[plot.element_handle(), part.offset])
    meta = plot.evaluate("gd => gd.layout.meta")
    assert meta["file_nbytes"] == ck.file(part.file).nbytes  # the map of the tensor's file
    if len(ck.files) > 1:
        picker = page.locator(".ckptlab-file-picker select").first
        assert picker.input_value().startswith(f"{part.file} · ")  # "file · format · size"
        page.locator(".ckptlab-files .js-plotly-plot .main-svg").first.wait_for(
            state="attached")

    # no overlaps: page title vs map, map title vs its toolbar, lane labels among themselves
    title = page.locator(".ckptlab-title h2").first.bounding_box()
    gtitle = plot.locator(".gtitle").first.bounding_box()
    assert not _boxes_overlap(title, gtitle)
    plot.hover()
    modebar = plot.locator(".modebar").first
    if modebar.count() and modebar.is_visible():
        assert not _boxes_overlap(modebar.bounding_box(), gtitle)
    labels = [t.bounding_box() for t in plot.locator(".ytick text").all()]
    labels = [b for b in labels if b and b["height"] > 0]
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            assert not _boxes_overlap(a, b), (a, b)
    screenshot(f"app-{ck.format}")
    page_log.assert_offline()
    page_log.assert_no_errors()


def test_table_headers_fit_and_long_values_end_in_an_ellipsis(page, page_log, served,
                                                              screenshot) -> None:
    """At 1280 px: every column's header is shown whole (its text fits its box), and a value
    wider than its column is cut with an ellipsis and shown whole in the cell's tooltip."""
    from ckptlab.widgets._tensor_table import COLUMNS

    proc, path, _ = served
    page.goto(proc.url + "/")
    page.locator(ROW).first.wait_for()
    fields = ", ".join(f'.tabulator-col[tabulator-field="{f}"]' for f in COLUMNS)
    headers = page.locator(".ckptlab-tensors").first.locator(fields).evaluate_all(TEXT_FIT)
    assert [h[0] for h in headers] == list(COLUMNS)
    for field, text_px, box_px, *_ in headers:
        assert text_px <= box_px, f"the {field!r} header is cut: {text_px:.1f} > {box_px:.1f} px"
    cells: list = []
    for _ in range(100):  # Tabulator may draw a row before it sizes its cells (0 px boxes)
        cells = page.locator(f'{ROW} .tabulator-cell[tabulator-field]').evaluate_all(TEXT_FIT)
        if cells and all(c[2] > 0 for c in cells if c[0] in COLUMNS):
            break
        page.wait_for_timeout(100)
    cut = [c for c in cells if c[0] in COLUMNS and c[1] > c[2] + 0.5]
    for field, _, _, overflow, overflow_x, text in cut:
        assert (overflow, overflow_x) == ("ellipsis", "hidden"), (field, text, overflow)
    if path.name == "hf":  # the long names are there: cut, and whole on hover
        long_cells = [c for c in cut if c[0] == "name" and LONG in c[5]]
        assert long_cells, cells
        cell = page.locator(f'{ROW} .tabulator-cell[tabulator-field="name"]',
                            has_text=LONG).first
        cell.hover()
        tip = page.locator(".tabulator-tooltip").first
        tip.wait_for()
        assert tip.text_content() == long_cells[0][5]
        screenshot("app-table-ellipsis")
    else:
        assert not [c for c in cut if c[0] != "file"], cut  # short names fit
    page_log.assert_no_errors()


def test_the_verdict_of_scan_is_shown_up_front(page, page_log, served, screenshot) -> None:
    """Is it safe to load? The badge of ckptlab.scan, above the table (issue 29)."""
    proc, path, _ = served
    expected = cl.scan(path).verdict
    page.goto(proc.url + "/")
    badge = page.locator(".ckptlab-verdict").first
    badge.wait_for(timeout=120_000)
    assert badge.text_content() == expected.upper()
    table = page.locator(ROW).first
    table.wait_for()
    assert badge.bounding_box()["y"] < table.bounding_box()["y"]
    screenshot("verdict")
    page_log.assert_no_errors()


def test_the_page_is_no_wider_than_the_window(page, page_log, served) -> None:
    """A long value besides the tensors (a config's JSON) wraps in its cell: the page never
    scrolls sideways (a Hugging Face page was 2,638 px wide in a 1,440 px window)."""
    proc, _, _ = served
    page.goto(proc.url + "/")
    page.locator(ROW).first.wait_for()
    page.locator(".ckptlab-values").first.wait_for()
    page.wait_for_timeout(500)
    wide, window = page.evaluate(
        "[document.documentElement.scrollWidth, window.innerWidth]")
    assert wide <= window, f"the page is {wide} px wide in a {window} px window"
    headers = page.locator(".ckptlab-values th").all_text_contents()
    assert headers in ([], ["name", "value (inert JSON)"])
    page_log.assert_no_errors()


@pytest.mark.parametrize("width", [1024, 1440, 1920])
def test_the_name_column_keeps_its_width(page, page_log, served, screenshot, width) -> None:
    """Measured at three window widths: the page never scrolls sideways, the tensor name
    column is never narrower than NAME_MIN_WIDTH (at 1024 px it was a 60 px stub), and the
    columns a narrow window hides are the least needed ones, in HIDE_FIRST's order."""
    from ckptlab.widgets._tensor_table import COLUMNS, HIDE_FIRST, NAME_MIN_WIDTH

    proc, _, _ = served
    page.set_viewport_size({"width": width, "height": 900})
    page.goto(proc.url + "/")
    page.locator(ROW).first.wait_for()
    page.wait_for_timeout(300)  # Tabulator hides columns once it has measured the table
    shown = dict(page.locator(".ckptlab-tensors .tabulator-col[tabulator-field]").evaluate_all(
        "els => els.filter(e => getComputedStyle(e).display !== 'none')"
        "          .map(e => [e.getAttribute('tabulator-field'), e.getBoundingClientRect().width])"))
    assert shown["name"] >= NAME_MIN_WIDTH - 1, shown
    hidden = [c for c in COLUMNS if c not in shown]
    assert set(hidden) == set(HIDE_FIRST[:len(hidden)]), hidden
    if width >= 1440:
        assert not hidden
    wide, window = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert wide <= window, f"the page is {wide} px wide in a {window} px window"
    screenshot(f"app-{width}", full_page=False)
    page_log.assert_no_errors()


def test_a_picked_row_brings_its_parts_into_view(page, page_log, served, screenshot) -> None:
    """Click a row low on the table's first page (1280x900): its outline on the byte map
    and its first bytes in hex are then in the window (the map sat ~1,900 px below)."""
    proc, path, _ = served
    ck = cl.open(path)
    page.goto(proc.url + "/")
    page.locator(ROW).first.wait_for()
    page.locator(MAP).first.wait_for()  # the map arrives once the server opened the file
    rows = page.locator(ROW)
    row = rows.nth(min(rows.count(), 20) - 1)
    name = row.locator('.tabulator-cell[tabulator-field="name"]').text_content()
    part = next(p for p in ck.tensors[name].parts if p.file)
    row.click()
    page.locator(".ckptlab-tensor-title", has_text=name).first.wait_for()
    plot = page.locator(MAP).first
    page.wait_for_function(
        "([gd, x0]) => (gd.layout.shapes || []).some(s => s.type === 'rect' && s.x0 === x0)",
        arg=[plot.element_handle(), part.offset])
    page.wait_for_timeout(500)
    height = page.evaluate("window.innerHeight")
    outline = plot.locator(".shapelayer path").first.bounding_box()
    hexview = page.locator(".ckptlab-tensor-hex pre.ckptlab-hex").first.bounding_box()
    assert 0 <= outline["y"] and outline["y"] + outline["height"] <= height, outline
    assert 0 <= hexview["y"] < height, hexview  # its first lines at least
    # the map shows the tensor among its neighbours, not a sliver of the whole file
    x0, x1 = plot.evaluate("gd => gd.layout.xaxis.range")
    assert x0 <= part.offset and part.offset + part.nbytes <= x1 + 1
    assert (x1 - x0) <= max(20 * part.nbytes, 4096) + 1 or (x1 - x0) >= ck.file(
        part.file).nbytes * 0.75 - 1
    screenshot(f"app-picked-{ck.format}", full_page=False)
    page_log.assert_no_errors()


def test_every_tensor_statistics_in_the_table(page, page_log, served, screenshot) -> None:
    """The "statistics of every tensor" button: the table gains min/max/NaN... columns (the
    values ckptlab.stats gives), the health line shows above it, the page stays in the
    window."""
    proc, path, _ = served
    found = cl.stats(path)
    page.goto(proc.url + "/")
    page.locator(ROW).first.wait_for()
    page.locator(MAP).first.wait_for()  # the statistics need the opened checkpoint
    button = page.locator(".ckptlab-measure-all button").first
    if button.is_enabled():  # (an earlier page of this server may have measured them)
        button.click()
    page.locator(".ckptlab-health").first.wait_for(timeout=120_000)
    page.locator('.tabulator-col[tabulator-field="max"]').first.wait_for()
    row = page.locator(ROW).first
    max_cell = row.locator('.tabulator-cell[tabulator-field="max"]')
    # the health line and the columns come in one update, the table's values may draw a
    # moment later on a busy machine: wait for the first row's value, not a fixed time
    for _ in range(120):
        if max_cell.text_content().strip() not in ("", "-"):
            break
        page.wait_for_timeout(500)
    name = row.locator('.tabulator-cell[tabulator-field="name"]').text_content()
    shown = max_cell.text_content()
    assert shown.strip() not in ("", "-"), ("no value drawn", row.inner_text())
    assert float(shown) == pytest.approx(found[name].max, rel=1e-3, abs=1e-12), (name, shown)
    wide, window = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert wide <= window
    screenshot(f"app-stats-{path.name}", full_page=False)
    page_log.assert_no_errors()
