"""The other figure builders: alignment cost, tensors -> storages, the coloured hex view, the report.

Each is checked on its data: bar heights, customdata, spans, every byte's colour and title.
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError
from ckptlab.format import SegmentKind, read_range
from ckptlab.format.predict import DEFAULT_ALIGNMENTS
from ckptlab.testing import strategies as cst
from ckptlab.viz import (
    KIND_COLORS,
    KIND_LABELS,
    alignment_figure,
    bytemap_figure,
    hex_html,
    overhead_figure,
    report_html,
    storage_figure,
    tensor_span,
    treemap_figure,
)
from ckptlab.viz._style import plain_text, tint
from ckptlab.viz.hexview import MAX_HEX_NBYTES
from ckptlab.viz.report import MAX_TENSOR_ROWS
from ckptlab.viz.tensors import SINGLE_VIEW

pytestmark = pytest.mark.filterwarnings(
    "ignore:ComplexHalf support is experimental:UserWarning")

ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8, "bool": 1}


def get_path(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


# ---------------------------------------------------------------------------------------------
# alignment cost


def test_alignment_figure_data(sample_layout):
    costs = cl.format.alignment_costs(sample_layout)
    fig = alignment_figure(costs, current=4096)
    bars, line = fig.data
    assert list(bars.x) == list(line.x) == [str(a) for a in DEFAULT_ALIGNMENTS]
    assert list(bars.y) == [c.padding_nbytes for c in costs]
    assert [list(c) for c in bars.customdata] == [
        [c.file_nbytes, c.storages_4k_aligned, c.storages] for c in costs]
    np.testing.assert_allclose(list(line.y), [100 * c.overhead_fraction for c in costs])
    ready = [c.storages_4k_aligned == c.storages > 0 for c in costs]
    # alignments that are multiples of 4096 put every storage on a 4 KiB boundary; 65504 not
    assert ready == [a % 4096 == 0 for a in DEFAULT_ALIGNMENTS]
    assert list(bars.marker.color) == [
        KIND_COLORS[SegmentKind.DATA] if ok else KIND_COLORS[SegmentKind.PADDING] for ok in ready]
    assert list(bars.marker.line.width) == [3 if a == 4096 else 0 for a in DEFAULT_ALIGNMENTS]
    assert fig.layout.meta == {"kind": "alignment", "alignments": list(DEFAULT_ALIGNMENTS),
                               "ready_4k": ready, "current": 4096}
    assert f"{costs[0].storages} storages" in fig.layout.title.text
    # the percentage axis ticks at round steps from 0 (1, 2 or 5 times a power of ten)
    step = fig.layout.yaxis2.dtick
    assert fig.layout.yaxis2.tick0 == 0 and fig.layout.yaxis2.range[0] == 0
    assert f"{step:g}".lstrip("0.").rstrip("0") in ("1", "2", "5")
    assert fig.layout.yaxis2.range[1] >= max(line.y)
    # no highlight without a current alignment, or with one that is not a row
    for current in (None, 3):
        fig = alignment_figure(costs, current=current)
        assert set(fig.data[0].marker.line.width) == {0}
        assert fig.layout.meta["current"] == current


def test_alignment_figure_of_an_object_without_storages():
    costs = cl.format.alignment_costs({"step": 1}, (1, 4096))
    fig = alignment_figure(costs)
    assert [c.storages for c in costs] == [0, 0]
    assert fig.layout.meta["ready_4k"] == [False, False]  # nothing to read is not "ready"


@pytest.mark.parametrize("bad", [[], [1, 2], ["64"], None])
def test_alignment_figure_needs_cost_rows(bad):
    with pytest.raises((InvalidArgumentError, TypeError)) as info:
        alignment_figure(bad)
    if bad is not None:
        assert info.type is InvalidArgumentError


# ---------------------------------------------------------------------------------------------
# tensors -> storages


def brute_span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes a tensor touches in its storage, by enumerating its elements' positions."""
    size = t.element_size()
    if t.numel() == 0:
        return t.storage_offset() * size, t.storage_offset() * size
    n = t.untyped_storage().nbytes() // size
    pos = torch.arange(n, dtype=torch.int64).as_strided(t.shape, t.stride(), t.storage_offset())
    return int(pos.min()) * size, (int(pos.max()) + 1) * size


@given(obj=cst.state_dicts(plain=False))
def test_tensor_span_is_the_bytes_the_tensor_touches(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    layout = cl.inspect(buf.getvalue())
    by_key = {s.key: s for s in layout.storages}
    for info in layout.tensors:
        t = get_path(obj, info.path)
        lo, hi = tensor_span(info)
        assert (lo, hi) == brute_span(t), info
        if t.numel():
            assert 0 <= lo < hi <= by_key[info.storage_key].nbytes


def test_storage_figure_data(small_file):
    layout = cl.inspect(small_file)
    fig = storage_figure(layout)
    storages = {s.key: s for s in layout.storages}
    wte_key = next(t.storage_key for t in layout.tensors if t.path == ("transformer.wte.weight",))
    assert fig.layout.meta["shared"] == [wte_key]
    assert fig.layout.meta["omitted"] == 0
    rows = fig.layout.meta["rows"]
    # the shared storage first, its tensors by storage_offset; then the largest storages
    assert rows[:3] == [["transformer.wte.weight"], ["lm_head.weight"], ["extra.view"]] or \
        rows[:3] == [["lm_head.weight"], ["transformer.wte.weight"], ["extra.view"]]
    assert sorted(map(tuple, rows)) == sorted(t.path for t in layout.tensors)
    infos = {t.path: t for t in layout.tensors}
    whole, view = fig.data
    assert len(whole.y) == len(view.y) == len(rows)
    sizes = []
    for i, path in enumerate(rows):
        t = infos[tuple(path)]
        s = storages[t.storage_key]
        lo, hi = tensor_span(t)
        assert whole.y[i] == view.y[i] == f"{'.'.join(path)} [storage {t.storage_key}]"
        assert (whole.base[i], whole.x[i]) == (0, s.nbytes)
        assert list(whole.customdata[i]) == [s.nbytes, s.data_offset]
        assert (view.base[i], view.x[i]) == (lo, hi - lo)
        assert list(view.customdata[i]) == [lo, hi, s.data_offset + lo, s.data_offset + hi,
                                            t.storage_offset]
        assert view.text[i] == f"{t.dtype}{list(t.shape)}"
        sizes.append((t.storage_key, s.nbytes))
    # the view at offset 3 rows of 8 float32: bytes [96, 160) of the tied storage
    i = rows.index(["extra.view"])
    assert (view.base[i], view.x[i]) == (96, 64)
    unshared = [n for k, n in dict(sizes).items() if k != wte_key]
    assert unshared == sorted(unshared, reverse=True)
    # same colour for tensors over one storage; every storage one tensor views a plain grey,
    # so no palette colour repeats on unrelated storages
    colors = list(view.marker.color)
    assert colors[0] == colors[1] == colors[2] != SINGLE_VIEW
    assert set(colors[3:]) == {SINGLE_VIEW}
    # fewer rows
    fig = storage_figure(layout, max_rows=2)
    assert len(fig.layout.meta["rows"]) == 2
    assert fig.layout.meta["omitted"] == len(layout.tensors) - 2
    assert fig.layout.meta["rows"] == rows[:2]


def test_storage_figure_without_shared_first(small_file):
    layout = cl.inspect(small_file)
    rows = storage_figure(layout, shared_first=False).layout.meta["rows"]
    storages = {s.key: s for s in layout.storages}
    infos = {t.path: t for t in layout.tensors}
    nbytes = [storages[infos[tuple(p)].storage_key].nbytes for p in rows]
    assert nbytes == sorted(nbytes, reverse=True)


def test_storage_figure_of_safetensors(safetensors_file, hostile_name):
    layout = cl.inspect(safetensors_file)
    fig = storage_figure(layout)
    assert fig.layout.meta["rows"] == [["a"], [hostile_name]]
    assert fig.layout.meta["shared"] == []
    assert list(fig.data[1].customdata[0]) == [0, 24, 152, 176, 0]


def test_storage_figure_needs_a_layout(small_file):
    with pytest.raises(InvalidArgumentError):
        storage_figure(str(small_file))


# ---------------------------------------------------------------------------------------------
# hex view

_OFF = re.compile(r'<span class="off">([^<]*)</span>  ')
_SPAN = re.compile(r'<span style="background:([^;"]*);color:#1a1a1a" title="([^"]*)">'
                   r'([0-9a-f ]+)</span>')
_BYTE = re.compile(r"[0-9a-f]{2}")


def parse_hex(doc: str, width: int = 16) -> list[tuple[str, list[tuple[int, str, str]], str]]:
    """Lines of a hex_html block as (offset text, [(byte, background, title)], ascii text)."""
    head = '<pre class="ckptlab-hex" style="font-family:monospace;font-size:12px;' \
           'line-height:1.35;margin:0;white-space:pre;overflow-x:auto;max-width:100%">'
    assert doc.startswith(head) and doc.endswith("</pre>")
    body = doc[len(head):-len("</pre>")]
    out = []
    for line in body.split("\n") if body else []:
        m = _OFF.match(line)
        assert m, line
        pos, cells = m.end(), []
        while True:
            span = _SPAN.match(line, pos)
            if span:
                for b in span.group(3).split(" "):
                    cells.append((int(b, 16), span.group(1), html.unescape(span.group(2))))
                pos = span.end()
            else:
                byte = _BYTE.match(line, pos)
                if not byte:
                    break
                cells.append((int(byte.group(), 16), "", ""))
                pos = byte.end()
            if line.startswith(" ", pos) and (_SPAN.match(line, pos + 1)
                                              or _BYTE.match(line, pos + 1)):
                pos += 1
            else:
                break
        rest = line[pos:]
        pad = "   " * (width - len(cells)) + "  "
        assert rest.startswith(pad), (rest, len(cells))
        out.append((m.group(1), cells, html.unescape(rest[len(pad):])))
    return out


def segment_at(layout: cl.format.ArchiveLayout, offset: int) -> cl.format.Segment | None:
    for s in layout.segments:
        if s.offset <= offset < s.end_offset:
            return s
    return None


def check_hex(doc: str, data: bytes, offset: int, layout: cl.format.ArchiveLayout | None,
              width: int = 16) -> None:
    lines = parse_hex(doc, width)
    assert len(lines) == -(-len(data) // width)
    for k, (off, cells, text) in enumerate(lines):
        chunk = data[k * width:(k + 1) * width]
        assert off == f"{offset + k * width:>12,}"
        assert bytes(b for b, _, _ in cells) == chunk
        assert text == "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        for j, (_, bg, title) in enumerate(cells):
            seg = segment_at(layout, offset + k * width + j) if layout is not None else None
            if seg is None:
                assert (bg, title) == ("", "")
            else:
                assert bg == tint(KIND_COLORS[seg.kind], 0.35)
                assert title == KIND_LABELS[seg.kind] + (f" of {seg.record}" if seg.record
                                                         else "")


@given(data=st.data())
def test_hex_bytes_offsets_and_colours(sample_layout, sample_file, data):
    raw = sample_file.read_bytes()
    n = sample_layout.file_nbytes
    offset = data.draw(st.one_of(st.integers(0, n - 1),
                                 st.sampled_from([r.header_offset for r in
                                                  sample_layout.records])), label="offset")
    nbytes = data.draw(st.integers(0, min(700, n - offset)), label="nbytes")
    width = data.draw(st.sampled_from([16, 1, 7, 32]), label="width")
    chunk = raw[offset:offset + nbytes]
    with_layout = data.draw(st.booleans(), label="with_layout")
    layout = sample_layout if with_layout else None
    check_hex(hex_html(chunk, offset, layout, width=width), chunk, offset, layout, width)


def test_hex_of_the_first_record(sample_layout, sample_file):
    raw = sample_file.read_bytes()
    pkl = sample_layout.records[0]
    doc = hex_html(raw[:128], 0, sample_layout)
    check_hex(doc, raw[:128], 0, sample_layout)
    first = parse_hex(doc)[0]
    assert first[0] == "           0"
    assert [c[0] for c in first[1][:4]] == list(b"PK\x03\x04")
    assert {c[2] for c in first[1]} == {f"local header of {pkl.name}"}
    titles = [c[2] for line in parse_hex(doc) for c in line[1]]
    assert titles[30] == f"name of {pkl.name}"
    assert titles[30 + pkl.name_nbytes] == f"FB padding of {pkl.name}"


def test_hex_offsets_have_thousands_separators(sample_file):
    raw = sample_file.read_bytes()
    lines = parse_hex(hex_html(raw[1_234_560:1_234_592], 1_234_560))
    assert [line[0] for line in lines] == ["   1,234,560", "   1,234,576"]


def test_hex_escapes_bytes_and_names(safetensors_file, hostile_name):
    layout = cl.inspect(safetensors_file)
    raw = safetensors_file.read_bytes()
    doc = hex_html(raw, 0, layout)
    check_hex(doc, raw, 0, layout)
    assert "<script" not in doc and hostile_name not in doc  # the name is in the JSON header
    titles = {c[2] for line in parse_hex(doc) for c in line[1]}
    assert titles == {"header length", "JSON header", "header padding", "data of a",
                      f"data of {hostile_name}"}
    special = b'<b>&"x"</b>\x00\xff'
    doc = hex_html(special, 5)
    assert "<b>" not in doc and "&lt;b&gt;&amp;&quot;x&quot;&lt;/b&gt;.." in doc
    check_hex(doc, special, 5, None)


def test_hex_past_the_end_of_the_layout_is_plain(small_file):
    layout = cl.inspect(small_file)
    raw = small_file.read_bytes() + b"tail"
    offset = layout.file_nbytes - 20
    check_hex(hex_html(raw[offset:], offset, layout), raw[offset:], offset, layout)


def test_hex_limit_and_bad_arguments():
    assert parse_hex(hex_html(b"", 0)) == []
    assert len(parse_hex(hex_html(bytes(MAX_HEX_NBYTES), 0))) == MAX_HEX_NBYTES // 16
    with pytest.raises(InvalidArgumentError, match="65536"):
        hex_html(bytes(MAX_HEX_NBYTES + 1), 0)
    for offset, width in [(-1, 16), (1.0, 16), (np.int64(3), 16), (0, 0), (0, -2), (0, 2.0)]:
        with pytest.raises(InvalidArgumentError):
            hex_html(b"abc", offset, width=width)


# ---------------------------------------------------------------------------------------------
# report


def figures_in(doc: str) -> dict[str, tuple[list[dict], dict]]:
    """Each ``Plotly.newPlot(id, data, layout, ...)`` call of an HTML page, decoded."""
    out = {}
    decoder = json.JSONDecoder()
    for m in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', doc):
        data, end = decoder.raw_decode(doc, m.end())
        end = re.compile(r",\s*").match(doc, end).end()
        layout, _ = decoder.raw_decode(doc, end)
        out[m.group(1)] = (data, layout)
    return out


def decode_array(value: Any) -> np.ndarray:
    """A plotly JSON array: a list, or a typed array {"dtype", "bdata", "shape"}."""
    if isinstance(value, dict) and "bdata" in value:
        arr = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        shape = value.get("shape")
        if shape:
            arr = arr.reshape([int(s) for s in str(shape).split(",")])
        return arr
    return np.asarray(value)


def test_report_of_a_torch_zip(sample_layout, sample_file):
    raw = sample_file.read_bytes()
    doc = report_html(sample_layout, hex_bytes=raw[:1024])
    assert doc.startswith("<!DOCTYPE html>") and doc.rstrip().endswith("</html>")
    assert "<script src=\"http" not in doc and "src='http" not in doc
    assert doc.count("plotly.js v") == 1  # the library inline, once, not from a CDN
    figs = figures_in(doc)
    assert list(figs) == [f"ckptlab-fig-{i}" for i in range(5)]
    kinds = [layout["meta"]["kind"] for _, layout in figs.values()]
    assert kinds == ["treemap", "bytemap", "overhead", "alignment", "storages"]  # tensors first
    for title in ("Bytes by module", "Byte map", "Overhead", "Alignment cost",
                  "Tensors → storages → bytes"):
        assert f"<h2>{title}</h2>" in doc
    assert doc.index("<h2>Tensors</h2>") < doc.index("<h2>Byte map</h2>")
    # the embedded figures are the builders' figures
    assert figs["ckptlab-fig-0"][1]["meta"] == treemap_figure(sample_layout).layout.meta
    ref = bytemap_figure(sample_layout)
    data, layout = figs["ckptlab-fig-1"]
    assert layout["meta"] == ref.layout.meta
    np.testing.assert_array_equal(decode_array(data[0]["x"]), np.asarray(ref.data[0].x))
    np.testing.assert_array_equal(decode_array(data[0]["customdata"]),
                                  np.asarray(ref.data[0].customdata))
    assert figs["ckptlab-fig-2"][1]["meta"] == overhead_figure(sample_layout).layout.meta
    cost = figs["ckptlab-fig-3"][1]["meta"]
    assert cost["current"] == sample_layout.storage_alignment == 64
    assert cost["alignments"] == list(DEFAULT_ALIGNMENTS)
    assert figs["ckptlab-fig-4"][1]["meta"] == storage_figure(sample_layout).layout.meta
    # tables: every record and tensor, with its numbers
    for r in sample_layout.records:
        assert f"<td>{html.escape(r.short_name)}</td><td style=\"text-align:right\">{r.header_offset:,}</td>" \
               f"<td style=\"text-align:right\">{r.data_offset:,}</td>" in doc
    for t in sample_layout.tensors:
        assert f"<td>{html.escape('.'.join(map(str, t.path)))}</td>" in doc
    assert f"<td style=\"text-align:right\">{sample_layout.file_nbytes:,}</td>" in doc
    # the hex view of the first bytes
    hexdoc = doc[doc.index("<h2>First bytes</h2>") + len("<h2>First bytes</h2>"):]
    hexdoc = hexdoc[:hexdoc.index("</pre>") + len("</pre>")]
    check_hex(hexdoc, raw[:1024], 0, sample_layout)


def test_report_without_hex_bytes(small_file):
    layout = cl.inspect(small_file)
    doc = report_html(layout)
    assert "First bytes" not in doc and "ckptlab-hex" not in doc
    assert len(figures_in(doc)) == 5


def test_report_of_safetensors_escapes_names(safetensors_file, hostile_name):
    layout = cl.inspect(safetensors_file)
    doc = report_html(layout, hex_bytes=safetensors_file.read_bytes())
    figs = figures_in(doc)
    assert [lay["meta"]["kind"] for _, lay in figs.values()] == ["treemap", "bytemap",
                                                                  "overhead", "storages"]
    assert "Alignment cost" not in doc  # no alignment for safetensors
    assert hostile_name not in doc and "<script>alert" not in doc
    assert f"<td>{html.escape(hostile_name)}</td>" in doc
    # in the figures' JSON the name is plotly text shown as typed (not markup), with '<' also
    # escaped for the script tag
    data, _ = figs["ckptlab-fig-1"]
    hover = [t for t in decode_array(data[0]["text"]).ravel() if t]
    assert any(f"data of tensor {plain_text(hostile_name)} bfloat16[5]" in t for t in hover)
    assert all(hostile_name not in t for t in hover)


def test_report_truncates_long_tables(tmp_path):
    obj = {f"t{i}": torch.zeros(1) for i in range(510)}
    path = tmp_path / "many.pt"
    torch.save(obj, path)
    doc = report_html(cl.inspect(path))
    assert "First 500 of 516 rows" in doc  # records: 510 storages + 6 small ones
    # tensors: the first 500 in the page, all 510 searchable, the count says what is hidden
    assert "510 tensors; showing the first 200, 310 hidden" in doc
    assert len(re.findall(r"<td>t\d+</td>", doc)) == MAX_TENSOR_ROWS == 200  # by name
    rows = json.loads(re.search(r'id="ckptlab-tensor-rows">(.*?)</script>', doc).group(1))
    assert [r[0] for r in rows] == [f"t{i}" for i in range(510)]


def test_read_range_gives_the_reports_hex_bytes(sample_file):
    raw = sample_file.read_bytes()
    assert read_range(sample_file, 0, 1024) == raw[:1024]
