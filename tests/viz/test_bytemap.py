"""The byte map (``ckptlab.viz.bytemap``) against the layout's segments, computed the slow way.

Every property compares the figure's data (x edges, z, customdata, text, meta) with a brute
force over ``layout.segments``: an (segments x bins) overlap matrix.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.errors import CkptlabError, InvalidArgumentError
from ckptlab.format import SegmentKind
from ckptlab.viz import ByteMap, bytemap_figure, bytemap_trace, overhead_figure
from ckptlab.viz._style import (
    KIND_ORDER,
    LANE_LABELS,
    LANE_ORDER,
    LANE_WORDS,
    METADATA_LANE,
    human_nbytes,
    plain_text,
)
from ckptlab.viz.bytemap import bytemap_boundaries, bytemap_marks

U32 = 0xFFFFFFFF
TRAILER_ITEM_NAMES = {
    SegmentKind.CENTRAL_DIRECTORY: "<central directory>",
    SegmentKind.ZIP64_EOCD: "<zip64 EOCD>",
    SegmentKind.ZIP64_LOCATOR: "<zip64 locator>",
    SegmentKind.EOCD: "<EOCD>",
    SegmentKind.HEADER_LENGTH: "<header length>",
    SegmentKind.HEADER: "<JSON header>",
    SegmentKind.HEADER_PADDING: "<header padding>",
    SegmentKind.UNKNOWN: "<unknown bytes>",
}


# ---------------------------------------------------------------------------------------------
# layouts and brute force


def save_sparse(obj: Any, path: Path, alignment: int = 64) -> Path:
    """torch.save under skip_data: multi-GiB tensors cost a few KiB of disk (see test_zip64)."""
    from torch.utils.serialization import config

    with config.patch({"save.storage_alignment": alignment}), torch.serialization.skip_data():
        torch.save(obj, path)
    return path


def big(nbytes: int) -> torch.Tensor:
    try:
        return torch.empty(nbytes, dtype=torch.uint8)  # address space only, never touched
    except RuntimeError as exc:
        pytest.skip(f"cannot reserve {nbytes} bytes of virtual memory: {exc}")


@pytest.fixture(scope="module")
def zip64_obj() -> dict[str, torch.Tensor]:
    return {"a": torch.ones(3), "big": big(U32), "b": torch.arange(4)}


@pytest.fixture(scope="module")
def zip64_layout(tmp_path_factory: pytest.TempPathFactory, zip64_obj) -> cl.format.ArchiveLayout:
    path = save_sparse(zip64_obj, tmp_path_factory.mktemp("z64") / "z64.pt")
    yield cl.inspect(path)
    path.unlink()


@pytest.fixture(scope="module")
def layouts(sample_layout, small_file, safetensors_file, small_obj, zip64_layout,
            zip64_obj) -> dict[str, cl.format.ArchiveLayout]:
    """Every kind of layout the byte map is drawn for."""
    return {
        "sample": sample_layout,
        "small": cl.inspect(small_file),
        "safetensors": cl.inspect(safetensors_file),
        "predicted": cl.predict_layout(small_obj, alignment=4096, archive_name="small"),
        "zip64": zip64_layout,
        "zip64-predicted": cl.predict_layout(zip64_obj, alignment=1000, archive_name="z"),
    }


@pytest.fixture(scope="module")
def maps(layouts) -> dict[str, ByteMap]:
    return {name: ByteMap.from_layout(layout) for name, layout in layouts.items()}


def seg_lane(layout: cl.format.ArchiveLayout, seg: cl.format.Segment) -> str:
    """The lane of a segment, the slow way: storage bytes are tensor data; the other data
    (data.pkl and small records) and a JSON header are metadata."""
    if seg.kind is SegmentKind.DATA:
        return (SegmentKind.DATA if seg.record in {s.record for s in layout.storages}
                else METADATA_LANE)
    if seg.kind is SegmentKind.HEADER:
        return METADATA_LANE
    return seg.kind


def seg_arrays(layout: cl.format.ArchiveLayout) -> tuple[np.ndarray, np.ndarray, list[SegmentKind]]:
    starts = np.array([s.offset for s in layout.segments], dtype=np.int64)
    ends = np.array([s.end_offset for s in layout.segments], dtype=np.int64)
    return starts, ends, [s.kind for s in layout.segments]


def overlap(layout: cl.format.ArchiveLayout, edges: np.ndarray) -> np.ndarray:
    """Bytes of segment i inside bin j: shape (segments, bins)."""
    starts, ends, _ = seg_arrays(layout)
    lo, hi = np.asarray(edges[:-1]), np.asarray(edges[1:])
    return np.clip(np.minimum(ends[:, None], hi[None, :])
                   - np.maximum(starts[:, None], lo[None, :]), 0, None)


def brute_coverage(layout: cl.format.ArchiveLayout, lanes: tuple[str, ...],
                   edges: np.ndarray) -> np.ndarray:
    ov = overlap(layout, edges)
    seg_lanes = np.array([str(seg_lane(layout, s)) for s in layout.segments])
    return np.stack([ov[seg_lanes == str(k)].sum(axis=0) for k in lanes])


def kind_totals(layout: cl.format.ArchiveLayout) -> dict[SegmentKind, int]:
    out: dict[SegmentKind, int] = {}
    for s in layout.segments:
        out[s.kind] = out.get(s.kind, 0) + s.nbytes
    return out


def lane_totals(layout: cl.format.ArchiveLayout) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in layout.segments:
        lane = seg_lane(layout, s)
        out[lane] = out.get(lane, 0) + s.nbytes
    return out


def item_name(seg: cl.format.Segment) -> str:
    return seg.record if seg.record is not None else TRAILER_ITEM_NAMES[seg.kind]


def visible_segments(layout: cl.format.ArchiveLayout, lo: int, hi: int) -> list[int]:
    return [i for i, s in enumerate(layout.segments) if s.offset < hi and s.end_offset > lo]


@st.composite
def windows(draw: st.DrawFn, file_nbytes: int) -> tuple[int, int]:
    """Byte ranges inside the file: tiny, small, or any size."""
    lo = draw(st.integers(0, file_nbytes - 1))
    width = draw(st.one_of(st.integers(1, 64), st.integers(1, 20_000),
                           st.integers(1, file_nbytes)))
    return lo, min(lo + width, file_nbytes)


# ---------------------------------------------------------------------------------------------
# ByteMap arrays, items


@pytest.mark.parametrize("name", ["sample", "small", "safetensors", "predicted", "zip64",
                                  "zip64-predicted"])
def test_arrays_are_the_segments(layouts, maps, name):
    layout, bm = layouts[name], maps[name]
    starts, ends, kinds = seg_arrays(layout)
    np.testing.assert_array_equal(bm.starts, starts)
    np.testing.assert_array_equal(bm.nbytes, ends - starts)
    assert [KIND_ORDER[c] for c in bm.kinds] == kinds
    seg_lanes = [seg_lane(layout, s) for s in layout.segments]
    assert [LANE_ORDER[c] for c in bm.lane_codes] == seg_lanes
    assert bm.lanes == tuple(k for k in LANE_ORDER if k in set(seg_lanes))
    assert bm.file_nbytes == layout.file_nbytes
    # items: runs of segments with one owner, in file order
    names = [item_name(s) for s in layout.segments]
    assert [bm.item_names[i] for i in bm.items] == names
    assert list(bm.item_names) == [n for n, _ in itertools.groupby(names)]
    assert np.all(np.diff(bm.items) >= 0) and bm.items[0] == 0
    # per lane: the segment indices and the running byte totals
    totals = lane_totals(layout)
    for row, lane in enumerate(bm.lanes):
        assert list(bm.lane_segments[row]) == [i for i, k in enumerate(seg_lanes) if k == lane]
        assert bm.prefix[row, -1] == totals[lane]
    assert bm.prefix[:, -1].sum() == layout.file_nbytes


@pytest.mark.parametrize("name", ["sample", "safetensors", "zip64"])
def test_item_span_and_item_at(layouts, maps, name):
    layout, bm = layouts[name], maps[name]
    spans = [bm.item_span(i) for i in range(len(bm.item_names))]
    assert spans[0][0] == 0 and spans[-1][1] == layout.file_nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # items tile the file
    for i, (lo, hi) in enumerate(spans):
        segs = [s for s in layout.segments if s.offset >= lo and s.end_offset <= hi]
        assert {item_name(s) for s in segs} == {bm.item_names[i]}
        assert sum(s.nbytes for s in segs) == hi - lo
        assert bm.item_at(lo) == bm.item_at(hi - 1) == bm.item_at((lo + hi) // 2) == i
    for r in layout.records:  # a zip record is one item, from its header to its descriptor
        i = bm.item_at(r.header_offset)
        assert bm.item_names[i] == r.name
        assert spans[i] == (r.header_offset, r.end_offset)
    # outside the file: clipped to the first and last item
    assert bm.item_at(-10) == 0
    assert bm.item_at(layout.file_nbytes + 10) == len(bm.item_names) - 1


def test_item_span_of_a_missing_item(maps):
    bm = maps["small"]
    for bad in (-1, len(bm.item_names), 10**9):
        with pytest.raises(InvalidArgumentError, match="no item"):
            bm.item_span(bad)


def test_item_label_names_the_viewing_tensors(layouts, maps):
    layout, bm = layouts["small"], maps["small"]
    wte = layout.storage(next(t.storage_key for t in layout.tensors
                              if t.path == ("transformer.wte.weight",)))
    label = bm.item_label(bm.item_at(wte.data_offset))
    # three tensors view the tied storage: the embedding, the LM head and a view at offset 24
    assert label == (f"{wte.record} · transformer.wte.weight float32[16, 8], "
                     "lm_head.weight float32[16, 8], extra.view float32[2, 8]")
    pkl = layout.record("data.pkl")
    assert bm.item_label(bm.item_at(pkl.data_offset)) == pkl.name
    assert bm.item_label(len(bm.item_names) - 1) == "<EOCD>"


def test_item_label_lists_at_most_three_tensors(tmp_path):
    base = torch.arange(10.0)
    path = tmp_path / "many.pt"
    torch.save({f"v{i}": base[i:] for i in range(5)}, path)
    bm = ByteMap.from_layout(cl.inspect(path))
    label = bm.item_label(bm.item_at(cl.inspect(path).storages[0].data_offset))
    assert label == "many/data/0 · v0 float32[10], v1 float32[9], v2 float32[8] (+2)"


# ---------------------------------------------------------------------------------------------
# coverage


@given(data=st.data())
def test_coverage_is_the_brute_force_overlap(layouts, maps, data):
    name = data.draw(st.sampled_from(sorted(layouts)), label="layout")
    layout, bm = layouts[name], maps[name]
    lo, hi = data.draw(windows(layout.file_nbytes), label="window")
    inner = data.draw(st.lists(st.integers(lo, hi), max_size=40), label="edges")
    edges = np.unique(np.array([lo, hi, *inner], dtype=np.int64))
    cover = bm.coverage(edges)
    assert cover.shape == (len(bm.lanes), len(edges) - 1)
    np.testing.assert_array_equal(cover, brute_coverage(layout, bm.lanes, edges))
    # each bin is covered exactly once by the lanes together
    np.testing.assert_array_equal(cover.sum(axis=0), np.diff(edges))


@pytest.mark.parametrize("name", ["sample", "small", "safetensors", "predicted", "zip64"])
def test_coverage_of_the_whole_file_is_the_lane_totals(layouts, maps, name):
    layout, bm = layouts[name], maps[name]
    totals = lane_totals(layout)
    whole = bm.coverage(np.array([0, layout.file_nbytes]))
    assert dict(zip(bm.lanes, whole[:, 0].tolist())) == totals
    # any binning sums to the same totals
    edges = np.unique(np.linspace(0, layout.file_nbytes, 77).round().astype(np.int64))
    assert dict(zip(bm.lanes, bm.coverage(edges).sum(axis=1).tolist())) == totals
    cumulative = bm.cumulative(np.array([-5, 0, layout.file_nbytes, layout.file_nbytes + 9]))
    assert cumulative[:, 0].tolist() == cumulative[:, 1].tolist() == [0] * len(bm.lanes)
    assert cumulative[:, 2].tolist() == cumulative[:, 3].tolist() == [totals[k] for k in bm.lanes]


# ---------------------------------------------------------------------------------------------
# the trace: exact and binned modes


def check_trace(layout: cl.format.ArchiveLayout, bm: ByteMap, lo: int, hi: int, bins: int,
                threshold: int, trace: dict[str, Any]) -> None:
    """Every array of a bytemap_trace for window [lo, hi) against the segments."""
    meta = trace["meta"]
    assert meta["x_range"] == [lo, hi]
    vis = visible_segments(layout, lo, hi)
    assert meta["visible_segments"] == len(vis)
    smallest = min(layout.segments[i].nbytes for i in vis)
    exact = len(vis) <= threshold and smallest >= (hi - lo) / bins
    assert meta["mode"] == ("exact" if exact else "binned")
    # empty cells are None, not NaN: widget messages are JSON, which has no NaN
    assert all(v is None or np.isfinite(v) for v in np.asarray(trace["z"]).ravel())
    x, z = np.asarray(trace["x"]), np.asarray(trace["z"], dtype=float)
    custom, text = np.asarray(trace["customdata"]), np.asarray(trace["text"], dtype=object)
    n_lanes, n_cols = len(bm.lanes), meta["columns"]
    assert z.shape == text.shape == (n_lanes, n_cols) and custom.shape[:2] == (n_lanes, n_cols)
    assert x.shape == (n_cols + 1,) and x[0] == lo and x[-1] == hi
    assert np.all(np.diff(x) > 0)
    lane_of = {k: row for row, k in enumerate(bm.lanes)}
    if exact:
        assert n_cols == len(vis)
        for col, i in enumerate(vis):  # one column per segment, clipped to the window
            seg = layout.segments[i]
            row = lane_of[seg_lane(layout, seg)]
            assert (x[col], x[col + 1]) == (max(seg.offset, lo), min(seg.end_offset, hi))
            filled = np.flatnonzero(~np.isnan(z[:, col]))
            assert filled.tolist() == [row]  # its lane
            assert row < z[row, col] < row + 1
            item = bm.item_at(seg.offset)
            assert custom[:, col].tolist() == [[seg.offset, seg.end_offset, seg.nbytes,
                                                item]] * n_lanes
            # plain words: the bytes, what they are, whose they are, how many
            assert text[row, col] == (
                f"bytes {seg.offset:,}–{seg.end_offset - 1:,}: "
                f"{LANE_WORDS[seg_lane(layout, seg)]} of {bm.item_description(item)} "
                f"({human_nbytes(seg.nbytes)})")
            assert set(np.delete(text[:, col], row)) <= {""}
        return
    assert n_cols == min(bins, hi - lo)
    widths = np.diff(x)
    assert widths.max() - widths.min() <= 1  # even bins
    cover = brute_coverage(layout, bm.lanes, x)
    np.testing.assert_array_equal(custom[:, :, 0], cover)
    np.testing.assert_array_equal(np.isnan(z), cover == 0)
    ov = overlap(layout, x) > 0
    seg_items = np.array([bm.item_at(s.offset) for s in layout.segments])
    seg_lanes = [seg_lane(layout, s) for s in layout.segments]
    for row, lane in enumerate(bm.lanes):
        covered = cover[row] > 0
        lane_z = z[row, covered]
        assert np.all((lane_z > row) & (lane_z < row + 1))  # the colour band of the lane
        frac = cover[row, covered] / widths[covered]
        # the shade is the share of the bin the lane covers: 1% of a bin is 1% tinted
        np.testing.assert_allclose(lane_z - row, 0.999 * frac)
        mine = np.array([k == lane for k in seg_lanes])
        for col in np.flatnonzero(covered):
            owners = np.flatnonzero(mine & ov[:, col])  # this lane's segments in this bin
            first, last = seg_items[owners[0]], seg_items[owners[-1]]
            assert (custom[row, col, 1], custom[row, col, 2]) == (first, last)
            sentence = text[row, col]
            assert sentence.startswith(f"bytes {x[col]:,}–{x[col + 1] - 1:,}: "
                                       f"{human_nbytes(cover[row, col])} of {LANE_WORDS[lane]}")
            assert f"<br>in {bm.item_description(first)}" in sentence
        assert np.all(custom[row, ~covered, 1:] == -1)
        assert set(text[row, ~covered]) <= {""}


@given(data=st.data())
def test_trace_against_the_segments(layouts, maps, data):
    name = data.draw(st.sampled_from(sorted(layouts)), label="layout")
    layout, bm = layouts[name], maps[name]
    lo, hi = data.draw(windows(layout.file_nbytes), label="window")
    bins = data.draw(st.one_of(st.integers(1, 40), st.integers(1, 2000)), label="bins")
    threshold = data.draw(st.one_of(st.just(1000), st.integers(0, 700)), label="threshold")
    trace = bytemap_trace(bm, x_range=(lo, hi), bins=bins, exact_threshold=threshold)
    event(trace["meta"]["mode"])
    check_trace(layout, bm, lo, hi, bins, threshold, trace)


@pytest.mark.parametrize("name", ["sample", "small", "safetensors", "zip64"])
def test_default_view_is_the_whole_file(layouts, maps, name):
    layout, bm = layouts[name], maps[name]
    trace = bytemap_trace(bm)
    check_trace(layout, bm, 0, layout.file_nbytes, 1000, 1000, trace)
    same = bytemap_trace(layout)  # a layout is mapped on the fly, to the same data
    for key in ("x", "z", "customdata", "text"):
        np.testing.assert_array_equal(np.asarray(same[key]), np.asarray(trace[key]))
    assert same["meta"] == trace["meta"]


def test_threshold_rule_at_its_boundaries(layouts, maps):
    layout, bm = layouts["sample"], maps["sample"]
    r = layout.record("data/0")
    lo, hi = r.header_offset, r.end_offset  # header, name, FB padding, data, descriptor
    vis = visible_segments(layout, lo, hi)
    assert [layout.segments[i].kind for i in vis] == [
        SegmentKind.LOCAL_HEADER, SegmentKind.NAME, SegmentKind.PADDING, SegmentKind.DATA,
        SegmentKind.DESCRIPTOR]
    smallest = min(layout.segments[i].nbytes for i in vis)
    assert smallest == len("sample/data/0")  # the name
    fit = -(-(hi - lo) // smallest)  # the fewest bins at which the name is a bin wide
    cases = [(fit, 5, "exact"), (fit - 1, 5, "binned"), (1, 5, "binned"),
             (10 * fit, 5, "exact"), (fit, 4, "binned"), (fit, 0, "binned")]
    for bins, threshold, mode in cases:
        trace = bytemap_trace(bm, x_range=(lo, hi), bins=bins, exact_threshold=threshold)
        assert trace["meta"]["mode"] == mode, (bins, threshold)
        check_trace(layout, bm, lo, hi, bins, threshold, trace)
    # where the window is exactly `smallest * bins` wide, the name is exactly one bin: exact
    trace = bytemap_trace(bm, x_range=(lo, lo + smallest * 40), bins=40)
    assert trace["meta"]["mode"] == "exact"
    trace = bytemap_trace(bm, x_range=(lo, lo + smallest * 40 + 1), bins=40)
    assert trace["meta"]["mode"] == "binned"


def test_a_header_never_gets_less_than_a_bin(maps, layouts):
    """Few enough segments is not enough for exact columns: each must be a bin wide.

    The sample has 609 segments (under the threshold of 1000) but 1-byte records and 30-byte
    headers in 1.4 MB, so the whole file is binned; a torch.save zip always has a 1-byte
    record (.format_version), so its whole file is never exact.
    """
    for name in ("sample", "small"):
        layout = layouts[name]
        trace = bytemap_trace(maps[name])
        assert trace["meta"]["visible_segments"] == len(layout.segments) <= 1000
        assert min(s.nbytes for s in layout.segments) == 1
        assert trace["meta"]["mode"] == "binned"
        # every header still shows: its lane is tinted in the bin holding it
        z = np.asarray(trace["z"], dtype=float)
        x = np.asarray(trace["x"])
        row = maps[name].lanes.index(SegmentKind.LOCAL_HEADER)
        for r in layout.records:
            col = np.searchsorted(x, r.header_offset, side="right") - 1
            assert not np.isnan(z[row, col]), r.name


@pytest.mark.parametrize("x_range, expected", [
    ((100, 50), (50, 100)),  # reversed
    ((10.7, 20.2), (10, 21)),  # floats: floor and ceil
    ((-100, 50), (0, 50)),  # clipped into the file
    ((7, 7), (7, 8)),  # zero width: the byte under it
    ((7.5, 7.5), (7, 8)),
    ((-30, -20), (0, 1)),
    (None, None),
])
def test_window_clipping(layouts, maps, x_range, expected):
    layout, bm = layouts["sample"], maps["sample"]
    n = layout.file_nbytes
    expected = expected or (0, n)
    assert bytemap_trace(bm, x_range=x_range)["meta"]["x_range"] == list(expected)
    assert bytemap_trace(bm, x_range=(n + 10, n + 20))["meta"]["x_range"] == [n - 1, n]
    assert bytemap_trace(bm, x_range=(n - 5, n + 20))["meta"]["x_range"] == [n - 5, n]
    # the x edges follow the window
    x = np.asarray(bytemap_trace(bm, x_range=x_range)["x"])
    assert (x[0], x[-1]) == expected


def test_one_byte_window(maps, layouts):
    layout, bm = layouts["sample"], maps["sample"]
    trace = bytemap_trace(bm, x_range=(0, 1))
    check_trace(layout, bm, 0, 1, 1000, 1000, trace)
    assert trace["meta"]["mode"] == "exact" and trace["meta"]["columns"] == 1
    trace = bytemap_trace(bm, x_range=(0, 1), bins=1, exact_threshold=0)
    check_trace(layout, bm, 0, 1, 1, 0, trace)
    assert trace["meta"]["mode"] == "binned"
    assert np.asarray(trace["customdata"])[:, 0, 0].tolist() == [
        1 if k is SegmentKind.LOCAL_HEADER else 0 for k in bm.lanes]


# ---------------------------------------------------------------------------------------------
# the figure


@pytest.mark.parametrize("name", ["sample", "small", "safetensors", "predicted", "zip64"])
def test_figure_is_the_trace(layouts, maps, name):
    layout, bm = layouts[name], maps[name]
    for x_range in (None, (0, min(5000, layout.file_nbytes))):
        fig = bytemap_figure(bm, x_range=x_range, bins=300)
        trace = bytemap_trace(bm, x_range=x_range, bins=300)
        assert len(fig.data) == 3
        heat, ticks, breaks = fig.data
        marks = bytemap_marks(trace)
        parted = bytemap_boundaries(bm, trace)
        np.testing.assert_array_equal(np.asarray(breaks.x, dtype=float), parted["x"])
        np.testing.assert_array_equal(np.asarray(ticks.x, dtype=float), marks["x"])
        assert list(ticks.y or ()) == list(marks["y"])
        assert heat.type == "heatmap" and heat.name == "bytes"
        np.testing.assert_array_equal(np.asarray(heat.x), trace["x"])
        np.testing.assert_array_equal(np.asarray(heat.z, dtype=float),
                                      np.asarray(trace["z"], dtype=float))
        np.testing.assert_array_equal(np.asarray(heat.customdata), trace["customdata"])
        assert list(heat.y) == [LANE_LABELS[k] for k in bm.lanes]
        assert (heat.zmin, heat.zmax) == (0, len(bm.lanes))
        meta = fig.layout.meta
        assert meta == {"kind": "bytemap", **trace["meta"],
                        "lanes": [str(k) for k in bm.lanes],
                        "file_nbytes": layout.file_nbytes, "tiny": len(marks["x"]),
                        "boundaries": len(parted["x"])}
        assert list(fig.layout.xaxis.range) == trace["meta"]["x_range"]
    fig = bytemap_figure(layout)  # from a layout
    assert fig.layout.meta == bytemap_figure(bm).layout.meta
    if not layout.path.startswith("<"):
        assert fig.layout.title.text.startswith(Path(layout.path).name)
    assert f"{len(layout.records)} records" in fig.layout.title.text
    assert bytemap_figure(bm, title="mine").layout.title.text == "mine"


def test_lanes_of_each_format(maps):
    # data.pkl and the small records have their own lane: the data lane is tensor bytes only
    assert maps["small"].lanes == (
        SegmentKind.LOCAL_HEADER, SegmentKind.NAME, SegmentKind.PADDING, METADATA_LANE,
        SegmentKind.DATA, SegmentKind.DESCRIPTOR, SegmentKind.CENTRAL_DIRECTORY,
        SegmentKind.ZIP64_EOCD, SegmentKind.ZIP64_LOCATOR, SegmentKind.EOCD)
    assert maps["safetensors"].lanes == (SegmentKind.HEADER_LENGTH, METADATA_LANE,
                                         SegmentKind.HEADER_PADDING, SegmentKind.DATA)
    assert SegmentKind.ZIP64_EXTRA in maps["zip64"].lanes
    assert maps["zip64"].lanes == maps["zip64-predicted"].lanes


def test_safetensors_map_is_exact_with_the_tensor_names(layouts, maps, hostile_name):
    layout, bm = layouts["safetensors"], maps["safetensors"]
    assert bm.item_names == ("<header length>", "<JSON header>", "<header padding>", "a",
                             hostile_name)
    trace = bytemap_trace(bm)
    assert trace["meta"]["mode"] == "exact"  # 5 segments, the smallest 2 bytes of 186
    assert np.asarray(trace["x"]).tolist() == [s.offset for s in layout.segments] + [
        layout.file_nbytes]
    data_row = bm.lanes.index(SegmentKind.DATA)
    a, h = layout.segments[3:]
    assert np.asarray(trace["text"])[data_row, 3:].tolist() == [  # shown as typed, not markup
        f"bytes {a.offset:,}–{a.end_offset - 1:,}: data of tensor a float32[3, 2] (24 B)",
        f"bytes {h.offset:,}–{h.end_offset - 1:,}: data of tensor "
        f"{plain_text(hostile_name)} bfloat16[5] (10 B)"]


def test_zip64_lanes(layouts, maps):
    layout, bm = layouts["zip64"], maps["zip64"]
    assert layout.zip64 and layout.file_nbytes > U32
    z64 = [r for r in layout.records if r.zip64_extra_nbytes]
    assert [r.zip64_extra_nbytes for r in z64] == [20] + [12] * (len(z64) - 1)
    row = bm.lanes.index(SegmentKind.ZIP64_EXTRA)
    trace = bytemap_trace(bm)
    check_trace(layout, bm, 0, layout.file_nbytes, 1000, 1000, trace)
    custom = np.asarray(trace["customdata"])
    covered = np.flatnonzero(custom[row, :, 0])
    # the big record's extra in the first bin; every record past 4 GiB in the last
    assert covered.tolist() == [0, 999]
    assert custom[row, :, 0].sum() == sum(r.zip64_extra_nbytes for r in z64)
    names = bm.item_names
    assert names[custom[row, 0, 1]] == layout.record("data/1").name
    assert (names[custom[row, 999, 1]], names[custom[row, 999, 2]]) == (z64[1].name, z64[-1].name)
    for kind in (SegmentKind.ZIP64_EOCD, SegmentKind.ZIP64_LOCATOR):
        assert custom[bm.lanes.index(kind), 999, 0] == (56 if kind is SegmentKind.ZIP64_EOCD
                                                        else 20)
    # zoomed past 4 GiB: exact columns, the zip64 extras among them
    lo = layout.record("data/1").data_offset + U32 - 100
    trace = bytemap_trace(bm, x_range=(lo, layout.file_nbytes))
    check_trace(layout, bm, lo, layout.file_nbytes, 1000, 1000, trace)
    assert trace["meta"]["mode"] == "exact"
    z = np.asarray(trace["z"], dtype=float)
    assert (~np.isnan(z[row])).sum() == len(z64) - 1
    # the prediction draws the same lanes with the same totals
    pred = maps["zip64-predicted"]
    assert pred.prefix[pred.lanes.index(SegmentKind.ZIP64_EXTRA), -1] == sum(
        r.zip64_extra_nbytes for r in layouts["zip64-predicted"].records)


# ---------------------------------------------------------------------------------------------
# overhead


@pytest.mark.parametrize("name", ["sample", "small", "safetensors", "zip64"])
def test_overhead_by_item_sums_each_items_bytes(layouts, maps, name):
    layout, bm = layouts[name], maps[name]
    for bins in (1000, 7):
        fig = overhead_figure(bm, bins=bins)
        n_items = len(bm.item_names)
        assert fig.layout.meta == {"kind": "overhead", "by": "item",
                                   "columns": min(bins, n_items)}
        x = np.asarray(fig.data[0].x)
        assert all(np.array_equal(np.asarray(t.x), x) for t in fig.data)
        assert x[0] == 0 and len(x) == min(bins, n_items) and np.all(np.diff(x) > 0)
        bounds = [*x.tolist(), n_items]
        item_nbytes = [hi - lo for lo, hi in map(bm.item_span, range(n_items))]
        stacked = sum(np.asarray(t.y, dtype=np.int64) for t in fig.data)
        assert stacked.tolist() == [sum(item_nbytes[a:b]) for a, b in itertools.pairwise(bounds)]
        by_name = {t.name: np.asarray(t.y, dtype=np.int64).sum() for t in fig.data}
        totals = kind_totals(layout)
        assert by_name["data"] == totals.get(SegmentKind.DATA, 0)
        assert by_name.get("FB padding", 0) == totals.get(SegmentKind.PADDING, 0) + totals.get(
            SegmentKind.HEADER_PADDING, 0)
        assert by_name.get("descriptor", 0) == totals.get(SegmentKind.DESCRIPTOR, 0)
        assert by_name.get("zip64 / other extra", 0) == totals.get(SegmentKind.ZIP64_EXTRA, 0)
        assert all(v > 0 for v in by_name.values())  # empty parts are left out
        assert fig.layout.meta["columns"] == len(x)


@pytest.mark.parametrize("name", ["sample", "safetensors", "zip64"])
def test_overhead_by_bytes_is_the_non_data_share_of_each_bin(layouts, maps, name):
    layout, bm = layouts[name], maps[name]
    fig = overhead_figure(bm, by="bytes", bins=64)
    (trace,) = fig.data
    edges = np.asarray(trace.customdata)
    lo, hi = edges[:, 0], edges[:, 1]
    assert lo[0] == 0 and hi[-1] == layout.file_nbytes and np.array_equal(lo[1:], hi[:-1])
    assert fig.layout.meta == {"kind": "overhead", "by": "bytes", "columns": len(lo)}
    np.testing.assert_array_equal(np.asarray(trace.x), lo)
    ov = overlap(layout, np.append(lo, hi[-1]))
    is_data = np.array([s.kind is SegmentKind.DATA for s in layout.segments])
    cover = ov[is_data].sum(axis=0)  # payload by segment kind: tensors and pickles alike
    np.testing.assert_allclose(np.asarray(trace.y), 100 * (1 - cover / (hi - lo)))


def test_overhead_title_states_the_overhead(layouts):
    layout = layouts["sample"]
    fig = overhead_figure(layout)
    assert "is file structure, not payload" in fig.layout.title.text


# ---------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize("call", [
    lambda bm, lay: ByteMap.from_layout("model.pt"),
    lambda bm, lay: ByteMap.from_layout(lay.to_dict()),
    lambda bm, lay: bytemap_trace(bm, bins=0),
    lambda bm, lay: bytemap_trace(bm, bins=-3),
    lambda bm, lay: bytemap_trace(bm, bins=2.5),
    lambda bm, lay: bytemap_trace(bm, bins=True),
    lambda bm, lay: bytemap_trace("model.pt"),
    lambda bm, lay: bytemap_figure(bm, bins=0),
    lambda bm, lay: bytemap_figure(None),
    lambda bm, lay: overhead_figure(bm, by="record"),
    lambda bm, lay: overhead_figure(bm, bins=0),
    lambda bm, lay: overhead_figure(bm, by="bytes", bins=-1),
    lambda bm, lay: bm.item_span(len(bm.item_names)),
])
def test_bad_arguments_raise_invalid_argument(layouts, maps, call):
    with pytest.raises(InvalidArgumentError) as info:
        call(maps["small"], layouts["small"])
    assert isinstance(info.value, CkptlabError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("kwargs", [
    {"x_range": (float("nan"), 5)},
    {"x_range": (1,)},
    {"x_range": (1, 2, 3)},
    {"x_range": ("a", "b")},
    {"exact_threshold": "x"},
], ids=["nan", "one-value", "three-values", "text", "threshold-text"])
def test_bad_windows_raise_invalid_argument(maps, kwargs):
    with pytest.raises(InvalidArgumentError):
        bytemap_trace(maps["small"], **kwargs)


def _same_map(a: ByteMap, b: ByteMap) -> None:
    for field in ("starts", "nbytes", "kinds", "items", "prefix", "item_starts", "lane_codes"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert (a.item_names, a.lanes, a.file) == (b.item_names, b.lanes, b.file)
    assert [x.tolist() for x in a.lane_segments] == [x.tolist() for x in b.lane_segments]
    assert a.item_tensors == b.item_tensors and a.item_tensor_names == b.item_tensor_names


def test_a_map_from_segment_columns_is_the_map_from_segment_objects(tmp_path: Path) -> None:
    """A large zip's segments come as columns (no object per segment) and its tensors' fields
    as columns too: the byte map read from them equals the one read from the objects, for a
    layout and for a checkpoint's file, with shared storages, a non-tensor record and the
    trailer (zip64 included)."""
    import dataclasses

    from ckptlab.format.layout import SegmentTuple

    shared = torch.arange(600.0)
    sd = {f"layer.{i}.weight": torch.full((i % 7 + 1,), float(i)) for i in range(400)}
    sd |= {"view.a": shared[:100], "view.b": shared[50:], "step": 3, "note": "x" * 300}
    path = tmp_path / "big.pt"
    torch.save(sd, path)
    layout = cl.inspect(path)
    assert isinstance(layout.segments, SegmentTuple) and hasattr(layout.logical, "columns")
    objects = dataclasses.replace(layout, segments=tuple(layout.segments),
                                  logical=tuple(layout.logical))
    assert not hasattr(objects.segments, "columns")
    _same_map(ByteMap.from_layout(layout), ByteMap.from_layout(objects))
    ck = cl.open(path)
    entry = ck.files[0]
    plain = dataclasses.replace(entry, segments=tuple(entry.segments))
    _same_map(ByteMap.from_file(entry, ck.tensors.values()),
              ByteMap.from_file(plain, ck.tensors.values()))


def test_adjacent_tensors_are_parted_in_the_data_lane(tmp_path: Path) -> None:
    """A safetensors shard's tensors lie back to back in one colour: each boundary is marked
    (the offset where the next tensor's bytes start, by safetensors' own header), also after
    update_bytemap; a zip's data records are apart already (no marks); past MAX_BOUNDARIES
    the lane is drawn plain."""
    from safetensors.torch import save_file

    from ckptlab.viz.bytemap import MAX_BOUNDARIES, update_bytemap

    tensors = {f"t{i}": torch.full((i + 3,), float(i)) for i in range(7)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    ck = cl.open(path)
    starts = sorted(ck.tensors[n].parts[0].offset for n in tensors)
    fig = bytemap_figure(ck)
    assert fig.data[2].name == "tensor boundaries" and fig.layout.meta["boundaries"] == 6
    assert list(fig.data[2].x) == starts[1:]
    assert all(t.endswith("starts") and "tensor t" in t for t in fig.data[2].text)
    lo, hi = starts[2] - 1, starts[4] + 1
    meta = update_bytemap(fig, ByteMap.from_checkpoint(ck), x_range=(lo, hi))
    assert list(fig.data[2].x) == starts[2:5] and meta["boundaries"] == 3
    torch.save(tensors, tmp_path / "m.pt")
    assert bytemap_figure(cl.inspect(tmp_path / "m.pt")).layout.meta["boundaries"] == 0
    many = {f"t{i}": torch.zeros(2) for i in range(MAX_BOUNDARIES + 2)}
    save_file(many, str(tmp_path / "many.safetensors"))
    fig = bytemap_figure(cl.open(tmp_path / "many.safetensors"))
    assert fig.layout.meta["boundaries"] == 0 and len(fig.data[2].x) == 0
