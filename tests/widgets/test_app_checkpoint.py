"""The tensor-first served app (``CheckpointApp``) on every format, without a browser.

Browser events reach the app as ``param`` changes (the search box's ``value_input``, the
table's ``selection``, the map's ``click_data``/``relayout_data``, the file picker's
``value``); the tests set those and check what the browser would receive next.
"""

from __future__ import annotations

import html
import json
import re
import time

import panel as pn
import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint._cache import CheckpointIndex, InspectionCache
from ckptlab.testing.hexview import hex_bytes
from ckptlab.widgets._checkpoint_app import TENSOR_HEX_NBYTES, neighbourhood
from ckptlab.widgets._tensor_table import tensor_frame
from ckptlab.widgets.app import CheckpointApp, LayoutApp, ServedCheckpoint

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Widget.name is deprecated:PendingDeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A Hugging Face sharded directory: two safetensors shards and their index."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("hf")
    shards = {"model-00001-of-00002.safetensors": {
                  "model.embed.weight": torch.arange(32.0).reshape(8, 4),
                  "model.layers.0.mlp.weight": torch.ones(4, 4)},
              "model-00002-of-00002.safetensors": {
                  "model.layers.1.mlp.weight": torch.full((4, 4), 2.0),
                  "lm_head.weight": torch.full((8, 4), 3.0, dtype=torch.float16)}}
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(root / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return root


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory):
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp") / "ckpt"
    sd = {"model": {"w": torch.arange(10.0), "b": torch.ones(3)}, "step": 5, "lr": 0.25}
    dcp.save(sd, checkpoint_id=str(root), no_dist=True)
    return root


def _file_bytes(served: ServedCheckpoint, rel: str) -> bytes:
    with open(served.full_path(rel), "rb") as f:
        return f.read()


def _check_selected(app: CheckpointApp, name: str) -> None:
    """Details, hex and map outline all show tensor ``name``."""
    row = app.index.row_of(name)
    ck = app.served.checkpoint
    part = ck.tensors[name].parts[0]
    assert app.selected == row
    assert f"<b>{html.escape(name)}</b>" in app.details.object
    raw = _file_bytes(app.served, part.file)
    n = min(part.nbytes, TENSOR_HEX_NBYTES)
    assert hex_bytes(app.hex.object) == raw[part.offset:part.offset + n]
    pane = app.layout_app.map_pane if app.layout_app is not None else app.map_pane
    # the map shows the tensor among its neighbours, and is scrolled into view
    assert tuple(pane.object.layout.meta["x_range"]) == neighbourhood(
        part.offset, part.nbytes, len(raw))
    assert app.follow.ticket > 0
    rects = [s for s in pane.object.layout.shapes if s.type == "rect"]
    assert [(r.x0, r.x1) for r in rects] == [
        (p.offset, p.offset + max(p.nbytes, 1)) for p in ck.tensors[name].parts
        if p.file == part.file]
    if app.layout_app is None:
        assert app.file == part.file and pane.object.layout.meta["file"] == part.file


def test_torch_zip_app(sample_file):
    app = CheckpointApp(sample_file)
    ck = cl.open(sample_file)
    assert app.served.is_zip and isinstance(app.layout_app, LayoutApp)
    assert len(app.served.frame) == len(ck.tensors)
    summary = app.summary.object
    assert f"{len(ck.tensors):,} tensors" in summary and f"{ck.parameters:,} parameters" in summary
    assert "float32" in summary
    # the zip's own section: records, alignment slider, its byte map
    assert app.layout_app.alignment in app.map_section.objects
    names = app.find("ATTN.C_PROJ.weight")  # case-insensitive substring
    assert names and all("attn.c_proj.weight" in n for n in names)
    assert app.tensors.count.object.endswith(f"{len(names)} of {len(ck.tensors):,} tensors</span>")
    name = names[0]
    app.tensors.table.selection = [app.index.row_of(name)]  # what a click on the row sets
    _check_selected(app, name)
    # the records list follows to the record that holds the tensor's bytes (not data.pkl)
    offset = ck.tensors[name].parts[0].offset
    item = app.layout_app.items.value
    assert item == app.layout_app.bytemap.item_at(offset) and item != 0
    lo, hi = app.layout_app.bytemap.item_span(item)
    assert lo <= offset < hi
    # the outline follows a what-if alignment out and comes back with the file's own map
    app.layout_app.alignment.value = 4096
    app.layout_app.alignment.value = 64
    app.select(name)
    _check_selected(app, name)


def test_safetensors_app_speaks_safetensors(safetensors_file, hostile_name):
    app = CheckpointApp(safetensors_file)
    assert not app.served.is_zip and app.layout_app is None and app.file_picker is None
    text = app.summary.object + "".join(
        getattr(o, "object", "") or "" for o in app.map_section.objects
        if isinstance(getattr(o, "object", None), str))
    for word in ("record", "zip64", "alignment"):
        assert word not in text.lower()
    assert not any(isinstance(o, pn.widgets.DiscreteSlider) for o in app.map_section.objects)
    assert app.map_pane.object.layout.meta["kind"] == "bytemap"
    app.select(hostile_name)
    _check_selected(app, hostile_name)
    assert html.escape(hostile_name) in app.details.object and hostile_name not in (
        app.details.object)
    # a click on the map names the tensor whose bytes are there
    part = app.served.checkpoint.tensors["a"].parts[0]
    app.map_pane.click_data = {"points": [{"x": part.offset + 3}]}
    assert app.selected == app.index.row_of("a")
    # a zoom re-bins and keeps the outline
    app.map_pane.relayout_data = {"xaxis.range[0]": 0, "xaxis.range[1]": part.offset + 30}
    assert app.map_pane.object.layout.meta["x_range"] == [0, part.offset + 30]
    assert any(s.type == "rect" and s.x0 == part.offset for s in app.map_pane.object.layout.shapes)


def test_hf_sharded_directory(hf_dir):
    app = CheckpointApp(hf_dir)
    assert app.index.format == "hf" and len(app.index) == 4
    picker = app.file_picker
    assert picker is not None
    shards = sorted(p for p in picker.options.values() if p.endswith(".safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "model.safetensors.index.json" in picker.options.values()
    overview = [o for o in app.map_section.objects if isinstance(o, pn.pane.Plotly)
                and o.object is not None and o.object.layout.meta["kind"] == "files"]
    assert len(overview) == 1
    assert sorted(overview[0].object.layout.meta["files"]) == sorted(
        f[0] for f in app.index.files)
    # picking a tensor in the other shard switches the map to that shard
    first = app.file
    other = next(s for s in shards if s != first)
    name = next(n for n, t in app.served.checkpoint.tensors.items() if t.file == other)
    app.select(name)
    _check_selected(app, name)
    assert picker.value == other
    # picking a file by hand draws it, and keeps the selection's outline where it is
    picker.value = first
    assert app.map_pane.object.layout.meta["file"] == first
    assert not [s for s in app.map_pane.object.layout.shapes if s.type == "rect"]
    assert app.find("*.mlp.weight") == ["model.layers.0.mlp.weight", "model.layers.1.mlp.weight"]
    assert "total_size" in app.values.object  # the index's metadata is a value


def test_dcp_directory(dcp_dir):
    app = CheckpointApp(dcp_dir)
    assert app.index.format == "dcp"
    assert set(app.index.names) == {"model.w", "model.b"}
    assert "<td>step</td><td>5</td>" in app.values.object
    assert "<td>lr</td><td>0.25</td>" in app.values.object
    app.select("model.b")
    _check_selected(app, "model.b")
    assert app.file.endswith(".distcp")
    ck = app.served.checkpoint
    assert torch.equal(ck.read("model.b"), torch.ones(3))


def test_a_cached_index_paints_first_and_the_map_follows(sample_file, tmp_path):
    cache = InspectionCache(tmp_path / "cache")
    ServedCheckpoint(sample_file, inspection_cache=cache)  # the first look stores the index
    served = ServedCheckpoint(sample_file, inspection_cache=cache)
    assert served.from_cache and served.checkpoint is None and not served.ready.is_set()
    app = CheckpointApp(served)
    assert len(app.tensors.frame) == len(served.index)  # the table is there already
    assert app.map_pane is None and "Reading the byte layout" in (
        app.map_section.objects[0].object)
    assert not app.refresh()
    served.load()
    assert app.refresh() and app.layout_app is not None and app.refresh()
    name = served.index.names[5]
    app.select(name)
    _check_selected(app, name)


def test_a_selection_made_before_the_map_is_outlined_when_it_comes(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(3), "b": torch.ones(7)}, str(path))
    cache = InspectionCache(tmp_path / "cache")
    ServedCheckpoint(path, inspection_cache=cache)
    served = ServedCheckpoint(path, inspection_cache=cache)
    app = CheckpointApp(served)
    app.select("b")
    assert hex_bytes(app.hex.object) == torch.ones(7).numpy().tobytes()  # read from the index
    served.load()
    app.refresh()
    _check_selected(app, "b")


def test_a_checkpoint_that_cannot_be_opened_says_so(tmp_path):
    path = tmp_path / "x.safetensors"
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3)}, str(path))
    cache = InspectionCache(tmp_path / "cache")
    ServedCheckpoint(path, inspection_cache=cache)
    served = ServedCheckpoint(path, inspection_cache=cache)
    app = CheckpointApp(served)
    served.checkpoint = None

    def broken(_path):
        raise cl.CorruptArchiveError("header length past the end", path=str(path), offset=0)

    import ckptlab.checkpoint.open as open_module

    real = open_module.open_checkpoint
    open_module.open_checkpoint = broken
    try:
        served.load()
    finally:
        open_module.open_checkpoint = real
    assert app.refresh()
    assert "not available" in app.map_section.objects[0].object
    assert "header length past the end" in app.map_section.objects[0].object


def test_table_is_paged_sorted_and_filtered_on_the_server(tmp_path):
    path = tmp_path / "many.pt"
    torch.save({f"layers.{i}.w": torch.zeros(i % 7 + 1) for i in range(300)}, path)
    app = CheckpointApp(path)
    table = app.tensors.table
    assert table.pagination == "remote" and table.page_size == 20
    model = table.get_root()
    assert len(model.source.data["name"]) == 20  # one page, never the 300 rows
    app.find("layers.1")
    assert len(table.current_view) == 111  # 1, 10-19, 100-199
    assert len(model.source.data["name"]) == 20
    table.sorters = [{"field": "bytes", "dir": "desc"}]
    view = table.current_view
    assert list(view["bytes"]) == sorted(view["bytes"], reverse=True)
    # a selection in the sorted, filtered view names the right tensor
    name = view["name"].iloc[3]
    table.selection = [int(view.index[3])]
    assert app.selected == app.index.row_of(name)
    app.find("")
    assert len(table.current_view) == 300


def test_close_frees_the_session(sample_file):
    app = CheckpointApp(sample_file)
    app.close()
    assert app.view is None and app.layout_app is None
    app.tensors.table.selection = [3]  # nobody listens any more
    assert app.selected is None
    app.close()


def test_bad_source():
    with pytest.raises(cl.CkptlabError, match="checkpoint path"):
        CheckpointApp(42)


def test_tensor_frame_columns(sample_file):
    ck = cl.open(sample_file)
    frame = tensor_frame(CheckpointIndex.from_checkpoint(ck))
    assert list(frame.columns) == ["name", "dtype", "shape", "kind", "bytes", "parameters",
                                   "file", "offset"]
    t = next(iter(ck.tensors.values()))
    row = frame.iloc[0]
    assert (row["name"], row["dtype"], row["kind"], row["bytes"], row["parameters"],
            row["file"], row["offset"]) == (t.name, t.dtype, t.kind, t.nbytes, t.parameters,
                                            "sample.pt", t.parts[0].offset)
    assert re.fullmatch(r"\[\d+(, \d+)*\]", row["shape"])


def test_statistics_of_the_selected_tensor_on_demand(safetensors_file):
    """The button under a selected tensor measures it (``ckptlab.stats``'s figures, its
    health line when something looks wrong); a new selection clears them."""
    app = CheckpointApp(safetensors_file)
    app.served.load()
    assert app.measure.disabled
    ck = cl.open(safetensors_file)
    names = list(ck.tensors)
    app.select(names[0])
    assert not app.measure.disabled and app.statistics.object == ""
    app.measure.clicks += 1  # what a click on the button does
    want = cl.stats(safetensors_file, [names[0]])[names[0]]
    shown = app.statistics.object
    assert html.escape(names[0]) in shown and f"{want.numel:,}" in shown
    assert format(want.max, ".4g") in shown
    app.select(names[-1])
    assert app.statistics.object == ""


def test_the_neighbourhood_of_a_selected_tensor():
    """A small tensor is shown in a window 20x its size (4 KiB at least) centred on it and
    inside the file; a large one, or a one-tensor shard, with the whole file."""
    assert neighbourhood(50_000, 1_000, 1_000_000) == (40_500, 60_500)
    assert neighbourhood(10, 64, 1_000_000) == (0, 4096)  # at the start: shifted, not cut
    assert neighbourhood(999_900, 100, 1_000_000) == (1_000_000 - 4096, 1_000_000)
    assert neighbourhood(100, 400_000, 1_000_000) == (0, 1_000_000)
    assert neighbourhood(80, 65_000, 65_200) == (0, 65_200)
    assert neighbourhood(0, 0, 10) == (0, 10)


def test_every_tensor_statistics_become_table_columns_and_a_health_line(tmp_path):
    """On demand, every tensor is measured once for the server (ckptlab.stats) and the
    table gains the statistics as columns (equal to torch's on the loaded tensors, sortable
    by value), the health line naming the NaN tensor; a later page shows them at once."""
    sd = {f"layers.{i}.weight": torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
          for i in range(4)}
    sd["layers.2.weight"][1, 1] = float("nan")
    sd["zeros"] = torch.zeros(5)
    path = tmp_path / "m.pt"
    torch.save(sd, path)
    served = ServedCheckpoint(path)
    served.load()
    app = CheckpointApp(served)
    assert "min" not in app.tensors.table.value.columns and app.health.object == ""
    app.measure_every_tensor()
    for _ in range(600):
        if app._poll_stats():
            break
        time.sleep(0.05)
    frame = app.tensors.table.value
    for name, t in sd.items():
        row = frame[frame["name"] == name].iloc[0]
        finite = t[~t.isnan()].double()
        assert row["min"] == finite.min().item() and row["max"] == finite.max().item()
        assert row["nan"] == int(t.isnan().sum()) and row["zeros"] == int((t == 0).sum())
    assert "layers.2.weight" in app.health.object and "NaN" in app.health.object
    assert "all zero" in app.health.object and app.measure_all.disabled
    app.tensors.table.sorters = [{"field": "nan", "dir": "desc"}]
    assert app.tensors.table.sort_rows(app.tensors.table.current_view)["name"].iloc[0] == (
        "layers.2.weight")
    later = CheckpointApp(served)  # another page: the columns without measuring again
    assert "max" in later.tensors.table.value.columns and "NaN" in later.health.object


def test_the_safety_verdict_comes_on_its_own_thread(sample_file):
    """The open does not wait for ckptlab.scan (torch's rules take seconds to import): the
    verdict is set on a thread of its own, a page made before it shows it on its poll, and an
    app made without a page (a notebook) waits for it."""
    served = ServedCheckpoint(sample_file)
    served.load()
    assert not served.safety_done.is_set()  # the open did not scan
    served.check_safety()
    assert served.safety_done.wait(120)
    expected = cl.scan(sample_file).verdict.upper()
    assert f">{expected}<" in served.safety_html
    # a page made before it shows the verdict on its poll; without a page, it is found at once
    early = ServedCheckpoint(sample_file)
    early.load()
    app = CheckpointApp(early)
    assert f">{expected}<" in app.safety.object and "Checking" not in app.safety.object
    app.safety.object = "<i>Checking whether it is safe to load…</i>"
    app._poll_safety()
    assert f">{expected}<" in app.safety.object
