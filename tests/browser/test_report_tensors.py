"""The tensor-first report (`ckptlab report`) in chromium: the search box finds tensors, the
byte maps and other figures draw with no title, toolbar or tick label overlapping another,
and the page works offline. Screenshots go under .artifacts/browser/."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

import ckptlab as cl
from ckptlab.viz import report_html
from ckptlab.viz.report import MAX_TENSOR_ROWS

pytestmark = pytest.mark.browser

FIGURE = ".ckptlab-figure .js-plotly-plot"


@pytest.fixture(scope="module")
def many_pt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch.save file of 720 tensors: more rows than the report shows at once."""
    path = tmp_path_factory.mktemp("report") / "many.pt"
    sd = {}
    for layer in range(60):
        for part in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.up", "mlp.down"):
            sd[f"model.layers.{layer}.{part}.weight"] = torch.full((4, 4), float(layer))
            sd[f"model.layers.{layer}.{part}.bias"] = torch.zeros(4)
    torch.save(sd, path)
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hf")
    sd = {f"model.layers.{i}.mlp.weight": torch.ones(64, 16 + i) for i in range(6)}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:3],
              "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(root / shard))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    return root


def _boxes(page, selector: str) -> list[dict]:
    return [b for b in (el.bounding_box() for el in page.locator(selector).element_handles())
            if b and b["width"] > 0 and b["height"] > 0]


def _overlap(a: dict, b: dict, slack: float = 0.5) -> bool:
    return (a["x"] + slack < b["x"] + b["width"] and b["x"] + slack < a["x"] + a["width"]
            and a["y"] + slack < b["y"] + b["height"] and b["y"] + slack < a["y"] + a["height"])


def _check_layout_of_figures(page) -> int:
    """No title overlaps its toolbar or a tick label; no two tick labels of one axis overlap;
    titles and figures stay inside the page's width. Returns the number of figures checked."""
    plots = page.locator(FIGURE)
    n = plots.count()
    width = page.viewport_size["width"]
    for i in range(n):
        plot = plots.nth(i)
        plot.scroll_into_view_if_needed()
        plot.hover()  # the toolbar shows on hover
        frame = plot.bounding_box()
        assert frame["x"] >= 0 and frame["x"] + frame["width"] <= width + 1, (i, frame)
        title = plot.locator(".gtitle")
        if title.count() == 0:
            continue
        tbox = title.first.bounding_box()
        # the title is drawn whole, inside the figure (not clipped at either side)
        assert tbox["x"] >= frame["x"] - 1 and \
            tbox["x"] + tbox["width"] <= frame["x"] + frame["width"] + 1, (i, tbox, frame)
        bar = plot.locator(".modebar")
        if bar.count():
            mbox = bar.first.bounding_box()
            if mbox:
                assert not _overlap(tbox, mbox), (i, "title under the toolbar", tbox, mbox)
        for axis in (".xtick text", ".ytick text"):
            ticks = [b for b in (t.bounding_box() for t in plot.locator(axis).element_handles())
                     if b]
            for a, b in itertools.pairwise(ticks):
                assert not _overlap(a, b), (i, axis, a, b)
            for t in ticks:
                assert not _overlap(tbox, t), (i, "title over a tick label", t)
    return n


def test_report_search_finds_a_tensor_and_figures_do_not_overlap(page, page_log, many_pt,
                                                                  tmp_path, screenshot) -> None:
    out = tmp_path / "many.html"
    out.write_text(report_html(cl.inspect(many_pt),
                               hex_bytes=many_pt.read_bytes()[:512]), encoding="utf-8")
    page.goto(out.as_uri())
    page.locator(f"{FIGURE} .main-svg").first.wait_for(state="attached")
    rows = page.locator("#ckptlab-tensors tbody tr")
    assert rows.count() == MAX_TENSOR_ROWS  # capped, and the page says how many are hidden
    count = page.locator("#ckptlab-filter-count")
    assert "720 tensors" in count.text_content()
    assert f"{720 - MAX_TENSOR_ROWS} hidden" in count.text_content()
    box = page.locator("#ckptlab-filter")
    box.fill("layers.37.mlp")
    page.wait_for_function("() => document.querySelectorAll("
                           "'#ckptlab-tensors tbody tr').length === 4")
    names = page.locator("#ckptlab-tensors tbody tr td:first-child").all_text_contents()
    assert names == [f"model.layers.37.mlp.{p}.{w}" for p in ("up", "down")
                     for w in ("weight", "bias")]
    assert count.text_content().startswith("4 of 720 tensors match")
    box.fill("*.layers.5?.attn.q.weight")  # a glob
    page.wait_for_function("() => document.querySelectorAll("
                           "'#ckptlab-tensors tbody tr').length === 10")
    box.fill("")
    page.wait_for_function(f"() => document.querySelectorAll("
                           f"'#ckptlab-tensors tbody tr').length === {MAX_TENSOR_ROWS}")
    box.fill("layers.37.mlp")
    screenshot("report-search", full_page=False)
    assert _check_layout_of_figures(page) >= 5  # treemap, byte map, overhead, what-if, storages
    _check_sections(page, multi=False)
    kinds = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                          ".map(d => d.layout.meta && d.layout.meta.kind)")
    assert kinds[:2] == ["treemap", "bytemap"]
    screenshot("report")
    page_log.assert_offline()
    page_log.assert_no_errors()


def _check_sections(page, *, multi: bool) -> None:
    """Every heading names one section (for several files: "Files" the table, "Bytes per
    file" the chart), and the byte maps' lane key is drawn under the first byte map's
    heading, above that map."""
    heads = page.locator("h2").all_inner_texts()
    assert len(heads) == len(set(heads)), f"repeated headings: {heads}"
    if multi:
        assert heads.index("Files") < heads.index("Bytes per file"), heads
    else:
        assert "Files" not in heads and "Bytes per file" not in heads, heads
    legend = page.locator("div.legend")
    assert legend.count() == 1, legend.count()
    first_map = next(h for h in heads if h.startswith("Byte map"))
    heading = page.get_by_role("heading", name=first_map, exact=True)
    figure = heading.locator("xpath=following-sibling::div[contains(@class, 'ckptlab-figure')]"
                             ).first
    h, key, fig = heading.bounding_box(), legend.bounding_box(), figure.bounding_box()
    assert h["y"] + h["height"] <= key["y"] + 0.5, (h, key)
    assert key["y"] + key["height"] <= fig["y"] + 0.5, (key, fig)
    chips = legend.locator("span:not(.note)").all_inner_texts()
    assert "data" in chips, chips


def test_report_of_a_sharded_directory_maps_each_file(page, page_log, hf_dir, tmp_path,
                                                      screenshot) -> None:
    ck = cl.open(hf_dir)
    out = tmp_path / "hf.html"
    out.write_text(report_html(ck), encoding="utf-8")
    page.goto(out.as_uri())
    page.locator(f"{FIGURE} .main-svg").first.wait_for(state="attached")
    kinds = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                          ".map(d => d.layout.meta && d.layout.meta.kind)")
    holding = {t.file for t in ck.tensors.values()}
    assert kinds.count("bytemap") == len(holding) and "files" in kinds
    page.locator("#ckptlab-filter").fill("layers.4")
    page.wait_for_function("() => document.querySelectorAll("
                           "'#ckptlab-tensors tbody tr').length === 1")
    row = page.locator("#ckptlab-tensors tbody tr td").all_text_contents()
    t = ck.tensors["model.layers.4.mlp.weight"]
    assert row[0] == t.name and t.file in row and f"{t.offset:,}" in row
    # the byte map of the tensor's file names it in its hover text
    maps = page.evaluate("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                         ".filter(d => d.layout.meta && d.layout.meta.kind === 'bytemap')"
                         ".map(d => [d.layout.meta.file, JSON.stringify(d.data[0].text)])")
    text = dict(maps)[t.file]
    assert "model.layers.4.mlp.weight" in text
    assert _check_layout_of_figures(page) >= 3
    _check_sections(page, multi=True)
    screenshot("report-hf")
    page_log.assert_offline()
    page_log.assert_no_errors()
