"""The served panel app (``LayoutApp``), without a browser or a server.

Browser events reach the app as ``param`` changes on its panes (``relayout_data`` and
``click_data`` of the Plotly pane, ``value`` of the widgets); the tests set those and check the
figures' data that the browser would receive next.
"""

from __future__ import annotations

import html

import numpy as np
import panel as pn
import pytest

import ckptlab as cl
from ckptlab.format.predict import DEFAULT_ALIGNMENTS
from ckptlab.testing.hexview import hex_bytes
from ckptlab.viz import bytemap_figure, bytemap_trace, hex_html
from ckptlab.viz._style import human_nbytes
from ckptlab.widgets import _plotly_page
from ckptlab.widgets import app as app_module
from ckptlab.widgets._common import HEX_NBYTES
from ckptlab.widgets.app import LayoutApp

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    # panel 1.9 deprecates Widget.name (app.py passes name=); reported, not ours to change
    pytest.mark.filterwarnings("ignore:Widget.name is deprecated:PendingDeprecationWarning"),
]

PROMPT = "<i>Click the byte map or pick an item.</i>"


def click(app: LayoutApp, x: float) -> None:
    """What panel's Plotly pane sets when the browser reports a plotly_click."""
    app.map_pane.click_data = {"points": [{"curveNumber": 0, "pointNumber": [3, 0],
                                           "x": x, "y": "data", "z": 3.8}]}


@pytest.fixture
def app(sample_file) -> LayoutApp:
    return LayoutApp(sample_file)


def test_initial_state(app, sample_layout):
    assert app.original == sample_layout and app.current is app.original
    assert app.is_zip and not app.alignment.disabled
    assert app.alignment.value == 64
    assert app.alignment.options == list(DEFAULT_ALIGNMENTS)
    fig = app.map_pane.object
    assert fig.layout.meta == bytemap_figure(sample_layout).layout.meta
    assert fig.layout.title.text == bytemap_figure(sample_layout).layout.title.text
    assert app.overhead_pane.object is None  # drawn when its tab opens
    for tab in (1, 2, 3):
        app.tabs.active = tab
    assert app.cost_pane.object.layout.meta["current"] == 64
    assert app.cost_pane.object.layout.meta["alignments"] == list(DEFAULT_ALIGNMENTS)
    assert app.tensor_pane.object.layout.meta["kind"] == "storages"
    assert app.overhead_pane.object.layout.meta["kind"] == "overhead"
    bm = app.bytemap
    assert list(app.items.options.values()) == list(range(len(bm.item_names)))
    for label, i in app.items.options.items():
        lo, hi = bm.item_span(i)
        assert label == f"#{i} {bm.item_names[i]} · {human_nbytes(hi - lo)}"
    assert app.details.object == PROMPT and app.hex.object == ""
    assert isinstance(app.view, pn.Column)


def test_zoom_events_rebin_the_map(app, sample_layout):
    n = sample_layout.file_nbytes
    r = sample_layout.record("data/2")
    app.map_pane.relayout_data = {"xaxis.range[0]": r.header_offset - 0.4,
                                  "xaxis.range[1]": r.end_offset + 0.4}
    fig = app.map_pane.object
    want = bytemap_trace(app.bytemap, x_range=(r.header_offset - 1, r.end_offset + 1))
    assert fig.layout.meta == bytemap_figure(
        app.bytemap, x_range=(r.header_offset - 1, r.end_offset + 1)).layout.meta
    assert fig.layout.meta["x_range"] == [r.header_offset - 1, r.end_offset + 1]
    np.testing.assert_array_equal(np.asarray(fig.data[0].x), want["x"])
    np.testing.assert_array_equal(np.asarray(fig.data[0].customdata), want["customdata"])
    # the title survives a zoom
    assert fig.layout.title.text == bytemap_figure(sample_layout).layout.title.text
    # plotly also reports ranges as one list
    app.map_pane.relayout_data = {"xaxis.range": [100, 200]}
    assert app.map_pane.object.layout.meta["x_range"] == [100, 200]
    assert app.map_pane.object.layout.meta["mode"] == "exact"
    # events that are not x zooms change nothing
    before = app.map_pane.object
    app.map_pane.relayout_data = {"yaxis.range[0]": 1, "yaxis.range[1]": 2}
    app.map_pane.relayout_data = {"dragmode": "pan"}
    assert app.map_pane.object is before
    # a double click: autorange, the whole file
    app.map_pane.relayout_data = {"xaxis.autorange": True}
    assert app.map_pane.object.layout.meta["x_range"] == [0, n]
    assert app.map_pane.object.layout.meta["mode"] == "binned"


def test_click_selects_the_item_and_shows_its_bytes(app, sample_layout, sample_file):
    raw = sample_file.read_bytes()
    r = sample_layout.record("data/4")
    click(app, r.data_offset + 10)
    item = app.bytemap.item_at(r.data_offset)
    assert app.items.value == item
    (shape,) = app.map_pane.object.layout.shapes
    assert (shape.x0, shape.x1) == (r.header_offset, r.end_offset)
    assert app.details.object.startswith(
        f"<b>#{item} {r.name}</b> · bytes [{r.header_offset:,}, {r.end_offset:,}) · "
        f"{r.end_offset - r.header_offset:,} B")
    keys = {s.key for s in sample_layout.storages if s.record == r.name}
    for t in sample_layout.tensors:
        if t.storage_key in keys:
            assert f"<td>{html.escape('.'.join(map(str, t.path)))}</td>" in app.details.object
    n = min(r.end_offset - r.header_offset, HEX_NBYTES)
    assert app.hex.object == hex_html(raw[r.header_offset:r.header_offset + n], r.header_offset,
                                      sample_layout)
    assert hex_bytes(app.hex.object) == raw[r.header_offset:r.header_offset + n]
    # the mark survives a zoom
    app.zoom((r.header_offset, r.end_offset))
    assert app.map_pane.object.layout.shapes[0].x0 == r.header_offset
    # clicks without a point, or without x, are ignored
    app.map_pane.click_data = {"points": []}
    app.map_pane.click_data = {"points": [{"curveNumber": 0}]}
    assert app.items.value == item


def test_picking_an_item_selects_it(app, sample_file):
    raw = sample_file.read_bytes()
    last = len(app.bytemap.item_names) - 1
    app.items.value = last
    lo, hi = app.bytemap.item_span(last)
    assert (lo, hi) == (len(raw) - 22, len(raw))
    assert app.map_pane.object.layout.shapes[0].x1 == len(raw)
    assert hex_bytes(app.hex.object) == raw[-22:]
    app.select(0)
    assert app.items.value == 0
    assert app.map_pane.object.layout.shapes[0].x0 == 0


def test_alignment_control_shows_the_what_if_layout(app, sample_layout):
    app.select(5)
    app.alignment.value = 4096
    want = cl.format.realign(sample_layout, 4096)
    assert app.current.segments == want.segments and app.current.path == want.path
    fig = app.map_pane.object
    assert fig.layout.meta == bytemap_figure(want).layout.meta
    assert fig.layout.meta["file_nbytes"] == want.file_nbytes
    np.testing.assert_array_equal(np.asarray(fig.data[0].customdata),
                                  np.asarray(bytemap_figure(want).data[0].customdata))
    delta = want.file_nbytes - sample_layout.file_nbytes
    assert fig.layout.title.text.startswith(f"what-if: {sample_layout.path.rsplit('/', 1)[-1]} "
                                            "at alignment 4096 · ")
    assert fig.layout.title.text.endswith(f"({delta:+,} B)")
    lo, hi = app.bytemap.item_span(5)  # the selection follows the item to its new place
    assert [(sh.x0, sh.x1) for sh in fig.layout.shapes] == [(lo, hi)]
    app.tabs.active = 2
    assert app.cost_pane.object.layout.meta["current"] == 4096
    assert list(app.cost_pane.object.data[0].marker.line.width) == [
        3 if a == 4096 else 0 for a in DEFAULT_ALIGNMENTS]
    app.tabs.active = 1
    assert app.overhead_pane.object.layout.meta["columns"] == len(app.bytemap.item_names)
    assert f"{len(want.records)} records" in app.summary.object
    name = sample_layout.path.rsplit("/", 1)[-1]  # the file's own name, said to be a what-if
    assert "what-if, not a file: as torch.save would lay it out at storage_alignment 4096" \
        in app.summary.object and f"<b>{name}</b>" in app.summary.object
    assert app.details.object.startswith(f"<b>#5 {app.bytemap.item_names[5]}</b> · bytes [{lo:,}")
    assert "has no bytes" in app.hex.object  # a what-if layout has no file behind it
    # item labels carry the new sizes
    for label, i in app.items.options.items():
        lo, hi = app.bytemap.item_span(i)
        assert label == f"#{i} {app.bytemap.item_names[i]} · {human_nbytes(hi - lo)}"
    padded = app.bytemap.item_at(want.record("data/0").header_offset)
    assert next(k for k, v in app.items.options.items() if v == padded).endswith(
        human_nbytes(want.record("data/0").end_offset - want.record("data/0").header_offset))
    # the what-if has no bytes to show
    app.items.value = 7
    lo, hi = app.bytemap.item_span(7)
    assert (app.map_pane.object.layout.shapes[0].x0,
            app.map_pane.object.layout.shapes[0].x1) == (lo, hi)
    assert "what-if layout has no bytes" in app.hex.object
    # zooming works on the what-if layout
    app.map_pane.relayout_data = {"xaxis.range[0]": 0, "xaxis.range[1]": 9000}
    assert app.map_pane.object.layout.meta == bytemap_figure(
        want, x_range=(0, 9000)).layout.meta
    assert app.map_pane.object.layout.title.text.startswith("what-if")
    # back to the file's own alignment: the file itself
    app.alignment.value = 64
    assert app.current is app.original
    assert app.map_pane.object.layout.title.text == bytemap_figure(
        sample_layout).layout.title.text
    app.items.value = 3
    assert app.hex.object.startswith('<pre class="ckptlab-hex"')


def test_show_alignment_called_directly(app, sample_layout):
    app.show_alignment(1)
    assert app.current.storage_alignment == 1
    assert app.current.padding_nbytes == 0
    app.tabs.active = 2
    assert app.cost_pane.object.layout.meta["current"] == 1
    assert app.alignment.value == 64  # the control is not moved by the method


def test_selection_survives_an_alignment_change(app):
    app.items.value = 5
    app.alignment.value = 4096
    # either the selection is cleared or it is shown again for the new layout
    if app.items.value is not None:
        assert app.map_pane.object.layout.shapes
        assert app.details.object != PROMPT


def test_safetensors_app(safetensors_file, hostile_name):
    app = LayoutApp(safetensors_file)
    raw = safetensors_file.read_bytes()
    assert not app.is_zip and app.alignment.disabled
    assert app.cost_pane.object is None
    assert app.map_pane.object.layout.meta["mode"] == "exact"
    click(app, 160)
    assert app.bytemap.item_names[app.items.value] == "a"
    assert hex_bytes(app.hex.object) == raw[152:176]
    app.items.value = 4
    assert hostile_name not in app.details.object  # escaped
    assert html.escape(hostile_name) in app.details.object
    assert hex_bytes(app.hex.object) == raw[176:186]


def test_app_from_a_predicted_layout(small_obj):
    predicted = cl.predict_layout(small_obj, alignment=128)
    app = LayoutApp(predicted)
    assert app.alignment.value == 128 and 128 in app.alignment.options
    app.select(4)
    assert "what-if layout has no bytes" in app.hex.object
    app.alignment.value = 64
    assert app.current.segments == cl.predict_layout(small_obj, alignment=64).segments


def test_serve_wires_the_app(monkeypatch, sample_file, sample_layout, tmp_path):
    monkeypatch.setenv("CKPTLAB_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(pn, "serve", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(pn, "extension", lambda *args, **kwargs: calls.append((args, kwargs)))
    app_module.serve(sample_file, port=5123)
    (ext_args, ext_kwargs), ((routes,), kwargs) = calls
    # a checkpoint's page comes without plotly.js (loaded after the table), from no CDN
    assert ext_args == ("tabulator",) and ext_kwargs == {"inline": True}
    assert kwargs["port"] == 5123 and kwargs["address"] == "127.0.0.1"
    assert kwargs["show"] is False
    assert set(kwargs["websocket_origin"]) == {"127.0.0.1:5123", "localhost:5123"}
    # each session builds its own app over the checkpoint indexed once (and cached on disk)
    assert len(list((tmp_path / "cache").glob("v*/*.ckix"))) == 1
    view = routes["/"]()
    assert isinstance(view, pn.Column)
    assert view is not routes["/"]()


def test_the_served_app_imports_no_notebook_widgets():
    """``ckptlab serve`` imports the app module only: ipywidgets, IPython and the notebook
    explorers come when one is used, and every public name of ``ckptlab.widgets`` still does."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import ckptlab.widgets.app\n"
        "late = [m for m in ('ipywidgets', 'IPython', 'ckptlab.widgets.explorer', "
        "'ckptlab.widgets.plan', 'ckptlab.widgets.write') if m in sys.modules]\n"
        "assert not late, late\n"
        "import ckptlab.widgets as w\n"
        "assert set(w.__all__) <= set(dir(w))\n"
        "for name in w.__all__:\n"
        "    assert getattr(w, name).__name__ == name, name\n"
        "from ckptlab.widgets import LayoutExplorer, app\n"
        "assert 'ipywidgets' in sys.modules and app.serve\n"
        "try:\n"
        "    w.NoSuchView\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an unknown name resolved')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_served_page_comes_without_plotly_until_it_asks():
    """A session's document gets its own extension list without plotly (panel then leaves
    plotly.js off the page even after another session imported plotly's model), and plotly
    is added once the page has loaded it."""
    # plotly's model imported, as in a server that drew a byte map; tabulator's, the table's
    import panel.models.plotly
    import panel.models.tabulator
    from bokeh.document import Document
    from panel.io.resources import Resources
    from panel.io.state import set_curdoc

    doc = Document()
    assert _plotly_page.page_without_plotly(doc)
    assert pn.state._extensions_[doc] == ["tabulator"]
    with set_curdoc(doc):
        page = Resources(mode="server").js_files
    assert not any("plotly" in url for url in page)
    assert any("tabulator" in url for url in page)
    other = Document()  # a document panel has no list for gets every imported model's JS
    with set_curdoc(other):
        assert any("plotly" in url for url in Resources(mode="server").js_files)
    _plotly_page.plotly_now_loaded(doc)
    assert pn.state._extensions_[doc] == ["tabulator", "plotly"]
    assert _plotly_page.plotly_src().endswith(".js")
    assert _plotly_page.plotly_src() in panel.models.plotly.PlotlyPlot.__javascript__
