"""The notebook widgets, without a browser or a kernel: widget state after each event.

Clicks and zooms arrive the way the browser sends them: plotly's FigureWidget receives
``_js2py_pointsCallback`` / ``_js2py_relayout`` messages from its front end and dispatches
them to the trace's ``on_click`` and the layout's ``on_change`` callbacks. Setting those
traits here runs the same path.
"""

from __future__ import annotations

import html
import json

import numpy as np
import pytest
import torch

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError
from ckptlab.format.predict import DEFAULT_ALIGNMENTS
from ckptlab.testing.hexview import hex_bytes
from ckptlab.viz import alignment_figure, bytemap_figure, bytemap_trace, hex_html
from ckptlab.viz._style import human_nbytes
from ckptlab.widgets import AlignmentExplorer, LayoutExplorer
from ckptlab.widgets.explorer import HEX_NBYTES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def click(fig, x: float, lane: str = "data") -> None:
    """A plotly_click on the byte map at file offset ``x``, as the front end reports it."""
    fig._js2py_pointsCallback = {
        "event_type": "plotly_click",
        "points": {"xs": [x], "ys": [lane], "point_indexes": [[0, 0]], "trace_indexes": [0]},
        "device_state": {"alt": False, "ctrl": False, "meta": False, "shift": False,
                         "button": 0, "buttons": 0},
    }


def browser_zoom(fig, lo: float, hi: float) -> None:
    """A drag-zoom in the browser: plotly.js sends a relayout with the new x range."""
    fig._js2py_relayout = {"relayout_data": {"xaxis.range[0]": lo, "xaxis.range[1]": hi},
                           "source_view_id": "view-1"}


@pytest.fixture(scope="module")
def explorer(sample_file) -> LayoutExplorer:
    return LayoutExplorer(sample_file)


# ---------------------------------------------------------------------------------------------
# LayoutExplorer


def test_layout_explorer_starts_with_the_whole_file(explorer, sample_layout):
    bm = explorer.bytemap
    assert explorer.archive == sample_layout
    assert explorer.selected is None and explorer.items.value is None
    # a path opens as a Checkpoint: the map of its one file is the layout's, named by file
    assert explorer.checkpoint is not None and explorer.checkpoint.format == "torch-zip"
    assert explorer.figure.layout.meta == {**bytemap_figure(sample_layout).layout.meta,
                                           "file": "sample.pt"}
    np.testing.assert_array_equal(bm.lane_codes, cl.viz.ByteMap.from_layout(
        sample_layout).lane_codes)
    assert explorer.figure.layout.meta["mode"] == "binned"
    assert [v for _, v in explorer.items.options] == list(range(len(bm.item_names)))
    for label, i in explorer.items.options:
        lo, hi = bm.item_span(i)
        assert label == f"#{i} {bm.item_names[i]} · {human_nbytes(hi - lo)}"
    assert html.escape(sample_layout.path.rsplit("/", 1)[-1]) in explorer.summary.value
    assert f"{len(sample_layout.records)} records" in explorer.summary.value


def test_select_marks_the_item_and_shows_its_bytes(explorer, sample_layout, sample_file):
    bm = explorer.bytemap
    raw = sample_file.read_bytes()
    record = sample_layout.record("data/3")
    item = bm.item_at(record.header_offset)
    explorer.select(item)
    lo, hi = bm.item_span(item)
    assert (lo, hi) == (record.header_offset, record.end_offset)
    assert explorer.selected == explorer.items.value == item
    (shape,) = explorer.figure.layout.shapes
    assert (shape.x0, shape.x1, shape.xref, shape.yref) == (lo, hi, "x", "paper")
    details = explorer.details.value
    assert f"#{item} {record.name}" in details
    assert f"[{record.data_offset:,}, {record.data_offset + record.data_nbytes:,})" in details
    assert f"{record.crc32:#010x}" in details
    # the tensors viewing the record
    keys = {s.key for s in sample_layout.storages if s.record == record.name}
    for t in sample_layout.tensors:
        if t.storage_key in keys:
            assert html.escape(".".join(map(str, t.path))) in details
    # the hex view: the item's first bytes, read from the file
    n = min(hi - lo, HEX_NBYTES)
    assert explorer.hex.value == hex_html(raw[lo:lo + n], lo, sample_layout)
    assert hex_bytes(explorer.hex.value) == raw[lo:lo + n]


def test_picking_in_the_list_selects(explorer, sample_file):
    bm = explorer.bytemap
    last = len(bm.item_names) - 1  # the EOCD
    explorer.items.value = last
    assert explorer.selected == last
    (shape,) = explorer.figure.layout.shapes
    assert (shape.x0, shape.x1) == bm.item_span(last) == (bm.file_nbytes - 22, bm.file_nbytes)
    raw = sample_file.read_bytes()
    assert hex_bytes(explorer.hex.value) == raw[-22:]
    assert raw[-22:].startswith(b"PK\x05\x06")
    explorer.items.value = 2
    assert explorer.selected == 2
    assert (explorer.figure.layout.shapes[0].x0, explorer.figure.layout.shapes[0].x1) == \
        bm.item_span(2)


def test_clicking_the_map_selects_the_item_under_the_pointer(explorer, sample_layout):
    bm = explorer.bytemap
    for name in ("data/7", "data.pkl", "version"):
        r = sample_layout.record(name)
        for x in (r.header_offset, r.data_offset + r.data_nbytes / 2, r.end_offset - 1):
            click(explorer.figure, x)
            item = bm.item_at(int(x))
            assert bm.item_names[item] == r.name
            assert explorer.selected == explorer.items.value == item
            assert (explorer.figure.layout.shapes[0].x0,
                    explorer.figure.layout.shapes[0].x1) == (r.header_offset, r.end_offset)
    # a click in the trailer selects the central directory
    click(explorer.figure, sample_layout.central_directory_offset + 3, "central directory")
    assert bm.item_names[explorer.selected] == "<central directory>"


def test_zoom_rebins(explorer, sample_layout):
    bm = explorer.bytemap
    r = sample_layout.record("data/5")
    explorer.select(bm.item_at(r.header_offset))
    # from Python: set the axis range
    explorer.figure.layout.xaxis.range = [r.header_offset, r.end_offset]
    meta = explorer.figure.layout.meta
    want = bytemap_trace(bm, x_range=(r.header_offset, r.end_offset))
    assert meta == bytemap_figure(bm, x_range=(r.header_offset, r.end_offset)).layout.meta
    assert meta["x_range"] == [r.header_offset, r.end_offset]
    assert meta["visible_segments"] == 5  # header, name, FB padding, data, descriptor
    np.testing.assert_array_equal(np.asarray(explorer.figure.data[0].x), want["x"])
    np.testing.assert_array_equal(np.asarray(explorer.figure.data[0].customdata),
                                  want["customdata"])
    assert list(explorer.figure.layout.xaxis.range) == [r.header_offset, r.end_offset]
    assert explorer.figure.layout.shapes[0].x0 == r.header_offset  # the mark stays
    # from the browser: a drag-zoom over the first 200 KB
    browser_zoom(explorer.figure, 10.5, 200_000.2)
    meta = explorer.figure.layout.meta
    assert meta["x_range"] == [10, 200_001] and meta["mode"] == "binned"
    want = bytemap_trace(bm, x_range=(10, 200_001))
    np.testing.assert_array_equal(np.asarray(explorer.figure.data[0].z, dtype=float),
                                  np.asarray(want["z"], dtype=float))
    np.testing.assert_array_equal(np.asarray(explorer.figure.data[0].customdata),
                                  want["customdata"])
    # a click in a zoomed view still names the item under the pointer
    click(explorer.figure, r.data_offset)
    assert bm.item_names[explorer.selected] == r.name
    # zoom() without a range: the whole file again
    explorer.zoom()
    assert explorer.figure.layout.meta == bytemap_figure(bm).layout.meta
    assert list(explorer.figure.layout.xaxis.range) == [0, sample_layout.file_nbytes]


@pytest.mark.parametrize("bad", [-1, 10**6, "3", 2.0, None, np.int64(1)])
def test_select_rejects_bad_items(explorer, bad):
    with pytest.raises(InvalidArgumentError, match="item must be an int"):
        explorer.select(bad)


def test_predicted_layout_has_no_hex(small_obj):
    predicted = cl.predict_layout(small_obj, alignment=4096)
    ex = LayoutExplorer(predicted)
    ex.select(3)
    assert ex.hex.value == "<i>A predicted layout has no bytes to show.</i>"
    lo, hi = ex.bytemap.item_span(3)
    assert f"<td>bytes</td><td>[{lo:,}, {hi:,}) · {hi - lo:,} B</td>" in ex.details.value


def test_layout_with_explicit_data_shows_hex(small_file):
    raw = small_file.read_bytes()
    layout = cl.inspect(raw)  # path "<bytes>": no file to read from
    ex = LayoutExplorer(layout, data=raw)
    ex.select(4)
    lo, hi = ex.bytemap.item_span(4)
    assert hex_bytes(ex.hex.value) == raw[lo:lo + min(hi - lo, HEX_NBYTES)]


def test_layout_explorer_from_bytes_shows_hex(small_file):
    raw = small_file.read_bytes()
    ex = LayoutExplorer(raw)
    ex.select(4)
    lo, hi = ex.bytemap.item_span(4)
    assert hex_bytes(ex.hex.value) == raw[lo:lo + min(hi - lo, HEX_NBYTES)]


def test_safetensors_explorer(safetensors_file, hostile_name):
    ex = LayoutExplorer(str(safetensors_file))
    raw = safetensors_file.read_bytes()
    assert ex.bytemap.item_names[-1] == hostile_name
    ex.items.value = 4
    assert ex.selected == 4
    assert (f"<td>{html.escape(hostile_name)}</td><td>bfloat16</td><td>[5]</td><td>[1]</td>"
            in ex.details.value)  # the tensor table
    assert "<td>[176, 186) · 10 B</td>" in ex.details.value
    assert hex_bytes(ex.hex.value) == raw[176:186]
    click(ex.figure, 3, "header length")
    assert ex.selected == 0 and hex_bytes(ex.hex.value) == raw[:8]


def test_layout_explorer_escapes_the_item_name(safetensors_file, hostile_name):
    ex = LayoutExplorer(safetensors_file)
    ex.select(4)
    assert hostile_name not in ex.details.value
    assert f"<b>#4 {html.escape(hostile_name)}</b>" in ex.details.value


def test_layout_explorer_rejects_other_objects():
    with pytest.raises(InvalidArgumentError, match="ArchiveLayout"):
        LayoutExplorer({"w": 1})


# ---------------------------------------------------------------------------------------------
# AlignmentExplorer


# Each AlignmentExplorer view update costs about a second on two cores (plotly's update() walks
# every customdata cell), so these tests use a checkpoint of three tensors and few moves.
TINY = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.bfloat16),
        "v": None}


@pytest.fixture(scope="module")
def tiny_obj() -> dict:
    obj = dict(TINY)
    obj["v"] = obj["w"][1]  # a view at an offset, sharing w's storage
    return obj


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory, tiny_obj):
    path = tmp_path_factory.mktemp("tiny") / "tiny.pt"
    torch.save(tiny_obj, path)
    return path


@pytest.fixture(scope="module")
def aligner(tiny_file) -> AlignmentExplorer:
    return AlignmentExplorer(tiny_file)


def test_alignment_explorer_starts_at_the_files_alignment(aligner, tiny_file):
    layout = cl.inspect(tiny_file)
    assert aligner.base == layout
    assert aligner.control.value == 64 and list(aligner.control.options) == list(
        DEFAULT_ALIGNMENTS)
    assert aligner.costs == cl.format.alignment_costs(layout)
    assert aligner.predicted.file_nbytes == layout.file_nbytes
    assert aligner.predicted.segments == layout.segments
    assert aligner.figure.layout.meta == bytemap_figure(layout).layout.meta
    assert aligner.cost_figure.layout.meta == alignment_figure(aligner.costs,
                                                               current=64).layout.meta


@pytest.mark.parametrize("alignment", [4096, 65504, 1])
def test_moving_the_control_updates_every_view(aligner, tiny_file, alignment):
    layout = cl.inspect(tiny_file)
    aligner.control.value = alignment
    want = cl.format.realign(layout, alignment)
    assert aligner.predicted.segments == want.segments
    assert aligner.predicted.file_nbytes == want.file_nbytes
    ref = bytemap_figure(want)
    assert aligner.figure.layout.meta == ref.layout.meta
    assert aligner.figure.layout.meta["file_nbytes"] == want.file_nbytes
    for key in ("x", "customdata"):
        np.testing.assert_array_equal(np.asarray(getattr(aligner.figure.data[0], key)),
                                      np.asarray(getattr(ref.data[0], key)))
    np.testing.assert_array_equal(np.asarray(aligner.figure.data[0].z, dtype=float),
                                  np.asarray(ref.data[0].z, dtype=float))
    np.testing.assert_array_equal(np.asarray(aligner.figure.data[0].text, dtype=object),
                                  np.asarray(ref.data[0].text, dtype=object))
    assert list(aligner.figure.data[0].y) == list(ref.data[0].y)
    assert aligner.figure.data[0].hovertemplate == ref.data[0].hovertemplate
    assert aligner.figure.layout.title.text.startswith(f"what-if layout at alignment {alignment} · ")
    assert list(aligner.figure.layout.xaxis.range) == [0, want.file_nbytes]
    # the cost chart highlights the row
    assert list(aligner.cost_figure.data[0].marker.line.width) == [
        3 if a == alignment else 0 for a in DEFAULT_ALIGNMENTS]
    assert aligner.cost_figure.layout.meta["current"] == alignment
    # the summary: size, delta vs 64, padding, verdict
    row = next(c for c in aligner.costs if c.alignment == alignment)
    at64 = next(c for c in aligner.costs if c.alignment == 64)
    assert row.file_nbytes == want.file_nbytes
    summary = aligner.summary.value
    assert f"alignment <b>{alignment}</b>: file {want.file_nbytes:,} B" in summary
    assert f"({want.file_nbytes - at64.file_nbytes:+,} B vs alignment 64)" in summary
    assert f"FB padding {want.padding_nbytes:,} B" in summary
    ready = all(s.data_offset % 4096 == 0 for s in want.storages if s.nbytes)
    assert ("not 4 KiB ready" not in summary) == ready
    if not ready:
        aligned = sum(1 for s in want.storages if s.nbytes and s.data_offset % 4096 == 0)
        assert f"{aligned} of {row.storages} storages" in summary


def test_show_moves_the_control(aligner):
    aligner.show(8192)
    assert aligner.control.value == 8192
    assert aligner.predicted.storage_alignment == 8192
    assert aligner.predicted.alignment == 4096  # the layout's alignment is capped at 4096
    assert aligner.predicted.record(".storage_alignment").data_nbytes == 4
    assert aligner.cost_figure.layout.meta["current"] == 8192
    assert "alignment <b>8192</b>" in aligner.summary.value


def test_state_dict_layout_and_path_give_the_same_costs(tiny_obj, tiny_file):
    layout = cl.inspect(tiny_file)
    from_obj = AlignmentExplorer(tiny_obj, archive_name="tiny")
    from_layout = AlignmentExplorer(layout, alignments=(64, 4096))
    from_path = AlignmentExplorer(str(tiny_file), alignments=(64, 4096))
    assert from_obj.costs == cl.format.alignment_costs(layout)
    assert from_layout.costs == from_path.costs == cl.format.alignment_costs(layout, (64, 4096))
    assert from_obj.predicted.segments == from_layout.predicted.segments == layout.segments
    assert from_obj.figure.layout.meta == from_path.figure.layout.meta


def test_alignment_explorer_options_and_start(tiny_file):
    ex = AlignmentExplorer(tiny_file, alignments=(1, 7, 4096), value=7)
    assert ex.control.value == 7 and ex.predicted.storage_alignment == 7
    assert [c.alignment for c in ex.costs] == [1, 7, 4096]
    assert ex.cost_figure.layout.meta["alignments"] == [1, 7, 4096]
    assert list(ex.cost_figure.data[0].marker.line.width) == [0, 3, 0]
    assert "vs alignment 64" not in ex.summary.value  # no 64 row to compare with
    ex = AlignmentExplorer(tiny_file, alignments=(1, 7))  # the file's 64 is not a choice
    assert ex.control.value == 1


def test_alignment_explorer_from_a_bytearray(tiny_file):
    ex = AlignmentExplorer(bytearray(tiny_file.read_bytes()), alignments=(64, 4096))
    assert ex.costs == cl.format.alignment_costs(cl.inspect(tiny_file), (64, 4096))


def test_alignment_explorer_start_value_must_be_a_choice(tiny_file):
    with pytest.raises(InvalidArgumentError):
        AlignmentExplorer(tiny_file, alignments=(64, 4096), value=128)


def test_alignment_explorer_needs_a_torch_zip(safetensors_file):
    with pytest.raises(InvalidArgumentError, match="safetensors"):
        AlignmentExplorer(safetensors_file)


# -- the explorers' FigureWidget (ckptlab.widgets._figure) ------------------------------------
def _opened_states(monkeypatch) -> list[dict]:
    """Record the state each widget comm opens with (what the front end builds a model from)."""
    import ipywidgets.widgets.widget as widget_module

    opened: list[dict] = []
    create = widget_module.comm.create_comm

    def recording(*args, **kwargs):
        opened.append(kwargs.get("data", {}).get("state", {}))
        return create(*args, **kwargs)

    monkeypatch.setattr(widget_module.comm, "create_comm", recording)
    return opened


def test_figure_widget_opens_its_comm_once_with_the_whole_figure(monkeypatch) -> None:
    import plotly.graph_objects as go

    from ckptlab.widgets._figure import FigureWidget

    opened = _opened_states(monkeypatch)
    fig = FigureWidget(go.Bar(x=["a", "b"], y=[3, 4]), layout={"title": {"text": "t"}})
    figures = [s for s in opened if "_widget_data" in s]
    assert len(figures) == 1, [sorted(s) for s in opened]
    state = figures[0]
    assert [t["type"] for t in state["_widget_data"]] == ["bar"]
    assert list(state["_widget_data"][0]["y"]) == [3, 4]
    assert state["_widget_layout"]["title"]["text"] == "t"
    # the module the front end imports is the small loader; plotly's bundle travels apart
    assert len(state["_esm"]) < 10_000 and state["_plotly_bundle"] == ""
    assert fig.comm is not None and state["_ckptlab_model_id"] == fig.model_id


def test_figure_widget_sends_plotly_bundle_when_asked(monkeypatch) -> None:
    """The loader's request for plotly's bundle is answered with one binary buffer; other
    custom messages, or a request for another bundle, are not."""
    import plotly.graph_objects as go

    from ckptlab.widgets._figure import _BUNDLE_MSG, FigureWidget, _loader_key

    fig = FigureWidget(go.Bar(y=[1]))
    sent: list[tuple[dict, list]] = []
    monkeypatch.setattr(fig, "send", lambda content, buffers=None: sent.append(
        (content, buffers)))
    fig._handle_custom_msg({"type": "something else"}, [])
    fig._handle_custom_msg({"type": _BUNDLE_MSG, "key": "plotly 0.0 other"}, [])
    assert sent == []
    fig._handle_custom_msg({"type": _BUNDLE_MSG, "key": _loader_key()}, [])
    assert len(sent) == 1
    content, buffers = sent[0]
    assert content == {"type": _BUNDLE_MSG, "key": _loader_key()}
    assert [bytes(b) for b in buffers] == [str(go.FigureWidget._esm).encode()]
    assert json.dumps(_loader_key()) in fig._esm


def test_figure_widget_queues_every_message_plotly_sends() -> None:
    """The loader holds and replays exactly plotly's _py2js_* messages: a new message type in
    plotly would otherwise slip past the queue."""
    import plotly.graph_objects as go

    from ckptlab.widgets._figure import _PY2JS, _loader

    sent = {n for n in go.FigureWidget.class_trait_names() if n.startswith("_py2js_")}
    assert set(_PY2JS) == sent
    assert json.dumps(list(_PY2JS)) in _loader()


def test_explorers_use_the_figure_widget(sample_file, sample_layout) -> None:
    from ckptlab.widgets._figure import FigureWidget

    assert isinstance(LayoutExplorer(sample_file).figure, FigureWidget)
    aligner = AlignmentExplorer(sample_layout)
    assert isinstance(aligner.figure, FigureWidget)
    assert isinstance(aligner.cost_figure, FigureWidget)


_LOADER_CHECK_JS = r"""
import loader from "./loader.mjs";

const KEY = process.argv[2];
const log = [];
let release;
// plotly's module, as the loader's cache holds it once imported: a factory of
// {initialize, render} whose model applies each _py2js_ message it is told of
const fake = {default: () => ({
  initialize({ model }) {
    for (const name of ["_py2js_restyle", "_py2js_relayout"])
      model.on(`change:${name}`, () => {
        const v = model.get(name);
        if (v !== null) log.push([name, v.n]);
      });
    globalThis.duringInit();  // a message that arrives while plotly's model is being set up
  },
  render({ el }) { log.push(["render", el]); return () => {}; },
})};
globalThis.__ckptlabPlotly = new Map([[KEY, new Promise(r => { release = () => r(fake); })]]);

const handlers = new Map();
const values = new Map();
const model = {
  get: (name) => (values.has(name) ? values.get(name) : null),
  set: () => {}, save_changes: () => {}, send: () => {}, off: () => {},
  on: (event, cb) => { if (!handlers.has(event)) handlers.set(event, []);
                       handlers.get(event).push(cb); },
};
// ipywidgets' model classes as the loader finds them: anywidget's model holds messages back
// (its _handle_comm_msg), ipywidgets' own handler applies them
class WidgetModel { _handle_comm_msg(msg) { log.push(["applied", msg]); } }
class AnyModel extends WidgetModel { _handle_comm_msg(msg) { log.push(["held", msg]); } }
const real = new AnyModel();
real.comm = { on_msg(callback) { this.callback = callback; } };
values.set("_ckptlab_model_id", "m1");
model.widget_manager = { get_model: async (id) => (id === "m1" ? real : undefined) };
const send = (name, value) => {  // a comm message: the value, then (as plotly does) null
  for (const v of [value, null]) {
    values.set(name, v);
    for (const cb of handlers.get(`change:${name}`) ?? []) cb();
  }
};

const widget = await loader();
await widget.initialize({ model });  // returns before plotly is loaded
send("_py2js_restyle", {n: 1});
send("_py2js_relayout", {n: 2});
globalThis.duringInit = () => send("_py2js_restyle", {n: 3});
const rendering = widget.render({ el: "el" });
const before = log.length;
release();
await rendering;
send("_py2js_relayout", {n: 4});  // after loading: straight to plotly's model, once
real.comm.callback("msg");  // the comm hands a message to ipywidgets' handler directly
console.log(JSON.stringify({before, log}));
"""


def test_figure_widget_loader_replays_early_messages_in_order(tmp_path) -> None:
    """The loader, run by node: messages sent before plotly's module is loaded, or while
    plotly's model is set up, reach that model once each and in order, then the view
    renders, then later messages pass straight through (once each); and the comm hands
    messages to ipywidgets' handler, past anywidget's 2 s gate."""
    import re
    import shutil
    import subprocess

    from ckptlab.widgets._figure import _loader

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the loader's queue is checked in the browser "
                    "tests (tests/browser/test_jupyterlab.py) only")
    source = _loader()
    key = json.loads(re.search(r"^const KEY = (.*);$", source, re.M).group(1))
    (tmp_path / "loader.mjs").write_text(source)
    (tmp_path / "check.mjs").write_text(_LOADER_CHECK_JS)
    done = subprocess.run([node, str(tmp_path / "check.mjs"), key], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["before"] == 0, result  # nothing applied, nothing rendered, while loading
    assert result["log"] == [["_py2js_restyle", 1], ["_py2js_relayout", 2],
                             ["_py2js_restyle", 3], ["render", "el"],
                             ["_py2js_relayout", 4], ["applied", "msg"]], result
