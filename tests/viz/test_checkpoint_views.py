"""Tensor-first views (ckptlab.viz.checkpoint) and byte maps of Checkpoint files, on real files
written by torch.save, safetensors, dcp.save and a Hugging Face style sharded directory."""

from __future__ import annotations

import fnmatch
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint.query import natural_key
from ckptlab.errors import InvalidArgumentError
from ckptlab.format import SegmentKind
from ckptlab.viz import (
    ByteMap,
    bytemap_figure,
    bytemap_marks,
    bytemap_trace,
    dtype_totals,
    files_figure,
    filter_tensors,
    module_tree,
    query_tensors,
    sort_tensors,
    tensor_table,
    treemap_figure,
)
from ckptlab.viz._style import LANE_ORDER, METADATA_LANE, plain_text
from ckptlab.viz.bytemap import TINY_FRACTION, highlight_shapes, union_nbytes
from ckptlab.viz.checkpoint import (
    checkpoint_summary,
    object_rows,
    tensor_parts,
    tensor_table_html,
)


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.mlp.bias": torch.randn(32, generator=g),
        "model.layers.1.mlp.weight": torch.randn(32, 16, generator=g),
        "model.layers.1.attn.q.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.embed.weight": torch.randn(100, 16, generator=g),
        "head.weight": torch.arange(12, dtype=torch.int64),
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("views")
    sd = state()
    torch.save({**sd, "step": 7}, root / "model.pt")
    save_file(sd, str(root / "model.safetensors"))
    hf = root / "hf"
    hf.mkdir()
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:3],
              "model-00002-of-00002.safetensors": names[3:]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(hf / shard))
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, ks in shards.items() for k in ks}}))
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "step": 7}, checkpoint_id=str(root / "dcp"))
    return {"zip": root / "model.pt", "safetensors": root / "model.safetensors",
            "hf": hf, "dcp": root / "dcp"}


@pytest.fixture(scope="module")
def cks(files) -> dict[str, cl.checkpoint.Checkpoint]:
    return {k: cl.open(p) for k, p in files.items()}


FORMATS = ["zip", "safetensors", "hf", "dcp"]


# -- the tensor table --------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_table_is_the_checkpoints_tensors(cks, fmt):
    ck = cks[fmt]
    table = tensor_table(ck)
    assert list(table.names) == list(ck.tensors)
    for i, t in enumerate(ck.tensors.values()):
        row = table.row(i)
        assert (row["dtype"], row["kind"], row["nbytes"], row["parameters"], row["file"],
                row["offset"]) == (t.dtype, t.kind, t.nbytes, t.parameters, t.file, t.offset)
        assert row["shape"] == ("x".join(map(str, t.shape)) or "scalar")
    assert table.total_nbytes == sum(t.nbytes for t in ck.tensors.values())
    assert table.total_parameters == ck.parameters
    # the names as users know them, whatever the format
    prefix = "model." if fmt == "dcp" else ""  # DCP flattens the nested dict's keys
    assert set(table.names) == {prefix + k for k in state()}


@pytest.mark.parametrize("pattern", ["mlp", "MLP", "layers.1", "*.mlp.*", "model.*.weight",
                                     "head*", "nothing-like-this", "", "[mh]*bias"])
def test_filter_matches_glob_or_substring(cks, pattern):
    table = tensor_table(cks["zip"])
    got = [table.names[i] for i in filter_tensors(table, pattern)]
    if any(c in pattern for c in "*?["):  # a glob, case-insensitive (as every view's search)
        want = [n for n in table.names if fnmatch.fnmatchcase(n.lower(), pattern.lower())]
    else:
        want = [n for n in table.names if pattern.lower() in n.lower()]
    assert got == want
    if pattern == "mlp":
        assert len(got) == 3


def test_sort_orders(cks):
    table = tensor_table(cks["zip"])
    by_size = sort_tensors(table, by="size")
    sizes = table.nbytes[by_size]
    assert np.all(np.diff(sizes) <= 0)  # largest first
    assert table.names[by_size[0]] == "model.embed.weight"
    assert np.all(np.diff(table.nbytes[sort_tensors(table, by="size", descending=False)]) >= 0)
    assert [table.names[i] for i in sort_tensors(table, by="name")] == sorted(
        table.names, key=natural_key)
    offs = [int(table.offsets[i]) for i in sort_tensors(table, by="offset")]
    assert offs == sorted(offs)
    assert sort_tensors(table, by="order").tolist() == list(range(len(table)))
    mixed = query_tensors(table, "mlp", "parameters")
    assert [table.names[i] for i in mixed] == sorted(
        (n for n in table.names if "mlp" in n),
        key=lambda n: -int(table.parameters[table.index(n)]))
    with pytest.raises(InvalidArgumentError):
        sort_tensors(table, by="bogus")


def test_dtype_totals_and_module_tree_sum_the_table(cks):
    ck = cks["zip"]
    table = tensor_table(ck)
    totals = dtype_totals(ck)
    assert sum(t.nbytes for t in totals) == table.total_nbytes
    assert sum(t.parameters for t in totals) == ck.parameters
    assert {t.dtype: t.tensors for t in totals} == {"float32": 4, "bfloat16": 1, "int64": 1}
    tree = module_tree(ck)
    assert tree[0].prefix == "" and tree[0].nbytes == table.total_nbytes
    for node in tree:  # every prefix's totals are the sums over the names under it
        under = [t for t in ck.tensors.values()
                 if not node.prefix or t.name == node.prefix
                 or t.name.startswith(node.prefix + ".")]
        assert (node.tensors, node.nbytes, node.parameters) == (
            len(under), sum(t.nbytes for t in under), sum(t.parameters for t in under))
    mlp = next(n for n in tree if n.prefix == "model.layers.0.mlp")
    assert mlp.parent == "model.layers.0" and mlp.depth == 4 and not mlp.leaf
    shallow = module_tree(ck, max_depth=2)
    assert max(n.depth for n in shallow) == 2 and shallow[0].nbytes == tree[0].nbytes


def test_treemap_values_and_folding(cks):
    ck = cks["zip"]
    fig = treemap_figure(ck)
    tm = fig.data[0]
    values = dict(zip(tm.ids, tm.values))
    assert values["ckptlab:all"] == tensor_table(ck).total_nbytes == fig.layout.meta["nbytes"]
    parent_of = dict(zip(tm.ids, tm.parents))
    for parent in set(tm.parents) - {""}:  # branchvalues "total": a parent >= its children
        assert sum(v for i, v in values.items() if parent_of[i] == parent) <= values[parent]
    # every level down to the tensors is drawn, and a box's colour grows with its bytes
    depth = max(n.count(".") + 1 for n in tm.ids if n != "ckptlab:all") + 1
    assert tm.maxdepth == min(depth, 7)
    shade = dict(zip(tm.ids, tm.marker.colors))
    by_bytes = sorted(values, key=values.get)
    assert [shade[i] for i in by_bytes] == sorted(shade[i] for i in by_bytes)
    assert tm.marker.showscale and tm.marker.colorbar.title.text == "bytes"
    small = treemap_figure(ck, max_nodes=5)
    assert len(small.data[0].ids) <= 5 and small.layout.meta["folded"] > 0
    assert dict(zip(small.data[0].ids, small.data[0].values))["ckptlab:all"] == values[
        "ckptlab:all"]


def test_summary_objects_and_table_html(cks, hostile_name, tmp_path):
    ck = cks["zip"]
    s = checkpoint_summary(ck)
    assert (s["format"], s["tensors"], s["parameters"]) == ("torch-zip", 6, ck.parameters)
    assert ("step", "7") in object_rows(ck)
    torch.save({hostile_name: torch.ones(2)}, tmp_path / "h.pt")
    table = tensor_table(cl.open(tmp_path / "h.pt"))
    doc = tensor_table_html(table)
    assert hostile_name not in doc and plain_text(hostile_name).replace('"', "&quot;") in doc
    big = tensor_table(ck)
    capped = tensor_table_html(big, limit=2)
    assert capped.count("<tr>") == 3 and "4 hidden" in capped


# -- byte maps of checkpoint files -------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_file_maps_and_lanes_tile_it(cks, fmt):
    ck = cks[fmt]
    for entry in ck.files:
        bm = ByteMap.from_file(entry, ck.tensors.values())
        assert bm.file == entry.path and bm.file_nbytes == entry.nbytes
        assert bm.prefix[:, -1].sum() == entry.nbytes  # the lanes cover every byte once
        trace = bytemap_trace(bm)
        cover = np.asarray(trace["customdata"])[:, :, 0]
        if trace["meta"]["mode"] == "binned":
            assert cover.sum() == entry.nbytes
        data = bm.lanes.index(SegmentKind.DATA) if SegmentKind.DATA in bm.lanes else None
        parts = [p for t in ck.tensors.values() for p in t.parts if p.file == entry.path]
        # the data lane is the tensors' bytes, nothing else
        got = 0 if data is None else int(bm.prefix[data, -1])
        assert got == union_nbytes((p.offset, p.nbytes) for p in parts)


def test_a_map_from_the_checkpoint_is_the_map_from_its_file(cks):
    """Every file's map from the checkpoint (for one torch.save file: from its layout's
    columns, no entry objects made) is the map from its entry and tensors, hover names too."""
    for fmt, ck in cks.items():
        for entry in ck.files:
            got = bytemap_figure(ByteMap.from_checkpoint(ck, entry.path)).to_json()
            want = bytemap_figure(ByteMap.from_file(entry, ck.tensors.values())).to_json()
            assert got == want, (fmt, entry.path)


def test_pickle_and_headers_have_their_own_lane(cks):
    bm = ByteMap.from_checkpoint(cks["zip"])
    pkl = [i for i, n in enumerate(bm.item_names) if n.endswith("data.pkl")]
    (item,) = pkl
    segs = np.flatnonzero(bm.items == item)
    lanes = {LANE_ORDER[c] for c in bm.lane_codes[segs]}
    assert METADATA_LANE in lanes and SegmentKind.DATA not in lanes
    st = ByteMap.from_checkpoint(cks["safetensors"])
    assert st.lanes[1] == METADATA_LANE  # the JSON header
    dcp = cks["dcp"]
    meta = ByteMap.from_checkpoint(dcp, ".metadata")
    assert meta.lanes == (METADATA_LANE,)


def test_shade_is_proportional_and_tiny_shares_get_a_tick(cks):
    bm = ByteMap.from_checkpoint(cks["zip"])
    trace = bytemap_trace(bm, bins=200)
    assert trace["meta"]["mode"] == "binned"
    z = np.asarray(trace["z"], dtype=float)
    cover = np.asarray(trace["customdata"])[:, :, 0]
    widths = np.diff(np.asarray(trace["x"]))
    head = bm.lanes.index(SegmentKind.LOCAL_HEADER)
    data = bm.lanes.index(SegmentKind.DATA)
    share = cover[head] / widths
    cols = np.flatnonzero((share > 0) & (share < 0.05))
    assert len(cols) > 0  # bins where a header is a sliver
    # a bin that is a few percent header is a few percent tinted, far from a full bin's shade
    assert np.all(z[head, cols] - head < 0.05)
    full = np.flatnonzero(cover[data] == widths)
    assert len(full) and np.allclose(z[data, full] - data, 0.999)
    marks = bytemap_marks(trace)
    centres = (np.asarray(trace["x"])[cols] + np.asarray(trace["x"])[cols + 1]) / 2
    head_label = trace["y"][head]
    ticked = {x for x, y in zip(marks["x"], marks["y"]) if y == head_label}
    assert set(centres.tolist()) <= ticked  # every sliver of a header is ticked
    tiny = (cover > 0) & (cover / widths < TINY_FRACTION)
    assert len(marks["x"]) == int(tiny.sum())


@pytest.mark.parametrize("fmt", FORMATS)
def test_hover_names_the_tensor(cks, fmt):
    ck = cks[fmt]
    name = next(n for n in ck.tensors if n.endswith("layers.1.mlp.weight"))
    part = ck.tensors[name].parts[0]
    fig = bytemap_figure(ck, file=part.file, x_range=(part.offset, part.offset + part.nbytes))
    text = [t for t in np.asarray(fig.data[0].text).ravel() if t]
    data_text = [t for t in text if f"tensor {name}" in t]
    assert data_text and data_text[0].startswith(f"bytes {part.offset:,}–")
    # the whole-file view names it too, in the bin that holds its first byte
    whole = bytemap_trace(ck, file=part.file, bins=50)
    x = np.asarray(whole["x"])
    col = int(np.searchsorted(x, part.offset, side="right") - 1)
    row = [str(k) for k in ByteMap.from_checkpoint(ck, part.file).lanes].index("data")
    assert name in whole["text"][row, col] or "more item" in whole["text"][row, col]


def test_files_figure_and_highlight(cks):
    ck = cks["hf"]
    fig = files_figure(ck)
    meta = fig.layout.meta
    assert sorted(meta["files"]) == sorted(f.path for f in ck.files)
    assert sum(meta["nbytes"]) == ck.nbytes
    for path, tensor_nbytes in zip(meta["files"], meta["tensor_nbytes"]):
        assert tensor_nbytes == sum(t.nbytes for t in ck.tensors.values() if t.file == path)
    assert np.asarray(fig.data[0].x).tolist() == meta["tensor_nbytes"]
    name = "model.layers.1.attn.q.weight"
    ranges = tensor_parts(ck, name)
    fig = bytemap_figure(ck, file=ck.tensors[name].file, highlight=ranges)
    (shape,) = fig.layout.shapes
    assert (shape.x0, shape.x1) == (ranges[0][0], ranges[0][0] + ranges[0][1])
    assert highlight_shapes([(5, 0)])[0]["x1"] == 6  # an empty part still shows


def test_bad_sources_and_files(cks):
    with pytest.raises(InvalidArgumentError, match="no file"):
        bytemap_figure(cks["hf"], file="nope.safetensors")
    with pytest.raises(InvalidArgumentError):
        tensor_table("model.pt")
    with pytest.raises(InvalidArgumentError):
        files_figure(object())
    with pytest.raises(InvalidArgumentError):
        treemap_figure(cks["zip"], max_nodes=1)
