"""The byte map: every byte of a checkpoint file, one lane and one colour per kind of bytes.

A plotly bar per segment takes seconds to draw at 10k records and minutes at 50k, so the map
is one heatmap trace: lanes are kinds of bytes, columns are byte bins (1000 by default), and a
cell's shade is proportional to the share of its bin that the lane's bytes cover (a bin that
is 1% header is 1% tinted, not solid). Bytes present in a bin but under a tenth of it also get
a thin tick in a second trace ("present but tiny"), so a 30-byte header in a megabyte bin
stays visible without the lane reading as solid. Once few enough segments are in view the
columns become the exact segments.

Lanes are segment kinds, except that the bytes which describe tensors (torch's ``data.pkl``
and its small records, a safetensors JSON header, DCP's ``.metadata``) have their own
``metadata`` lane: the data lane holds tensor bytes only. Hover text is in plain words and
names the tensors whose bytes a cell holds.

A map is built from an :class:`~ckptlab.format.ArchiveLayout` (one torch.save or safetensors file,
or a predicted layout) or from one file of a :class:`~ckptlab.checkpoint.Checkpoint` of any
format (its segments and its tensors' parts). :class:`ByteMap` holds the numeric arrays once
per file, so re-binning for a zoom is a few ``searchsorted`` calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ckptlab.checkpoint.model import is_checkpoint
from ckptlab.errors import InvalidArgumentError
from ckptlab.format.layout import SegmentKind
from ckptlab.viz._bytemap_model import KIND_CODE, LANE_CODE, ByteMap, as_bytemap
from ckptlab.viz._style import (
    KIND_COLORS,
    LANE_COLORS,
    LANE_LABELS,
    LANE_ORDER,
    LANE_WORDS,
    NEUTRAL,
    SELECTION,
    human_nbytes,
    plain_text,
    style_figure,
    theme_colors,
)

__all__ = ["MAX_BOUNDARIES", "TINY_FRACTION", "ByteMap", "bytemap_boundaries", "bytemap_figure",
           "bytemap_marks", "bytemap_title", "bytemap_trace", "files_figure", "highlight_shapes",
           "overhead_figure", "update_bytemap"]

# Plotly samples a heatmap that has more columns than pixels, which drops the slivers (a
# header in a bin of megabytes) this map exists to show: keep columns at about one per pixel.
DEFAULT_BINS = 1000
EXACT_THRESHOLD = 1000  # at most this many visible segments are drawn one column each
TINY_FRACTION = 0.1  # a lane covering less than this share of a bin also gets a tick
MAX_BOUNDARIES = 300  # tensor boundaries marked in a view (more: the data lane is drawn plain)
SHADE = 0.999  # z = lane + SHADE * share: a full bin is the lane's colour, never the next's


def _window(bm: ByteMap, x_range: tuple[float, float] | None) -> tuple[int, int]:
    if x_range is None:
        return 0, bm.file_nbytes
    try:
        lo, hi = sorted(float(v) for v in x_range)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"x_range must be two byte offsets (lo, hi), got {x_range!r}") from None
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise InvalidArgumentError(f"x_range must be finite, got {x_range!r}")
    lo = int(np.clip(np.floor(lo), 0, bm.file_nbytes))
    hi = int(np.clip(np.ceil(hi), 0, bm.file_nbytes))
    if hi - lo < 1:  # a zero-width zoom: show the byte under it
        lo, hi = min(lo, bm.file_nbytes - 1), min(lo, bm.file_nbytes - 1) + 1
    return lo, hi


def _share(cover: int, width: int) -> str:
    if cover >= width:
        return "all of the bin"
    pct = 100 * cover / width
    return f"{pct:.1f}% of the bin" if pct >= 0.1 else "under 0.1% of the bin"


def bytemap_trace(source: Any, *, x_range: tuple[float, float] | None = None,
                  bins: int = DEFAULT_BINS, exact_threshold: int = EXACT_THRESHOLD,
                  file: str | None = None, theme: str | None = None) -> dict[str, Any]:
    """The heatmap trace properties of the byte map for one view (what a zoom updates).

    Parameters
    ----------
    source
        An :class:`~ckptlab.format.ArchiveLayout`, a :class:`ByteMap`, a checkpoint ``FileEntry``
        or a :class:`~ckptlab.checkpoint.Checkpoint` (then ``file`` picks its file).
    x_range, bins, exact_threshold
        As for :func:`bytemap_figure`.
    file
        For a checkpoint: the file (relative path, as in ``ck.files``).
    theme
        ``"light"``, ``"dark"`` or None (the notebook's, see :func:`~ckptlab.viz._style.resolve_theme`):
        the colour an empty share fades to.

    Returns
    -------
    dict
        Plotly heatmap properties (``x``, ``y``, ``z``, ``zmin``, ``zmax``, ``colorscale``,
        ``customdata``, ``text``, ``hovertemplate``) plus ``"meta"``: ``{"mode": "binned" |
        "exact", "x_range": [lo, hi], "columns": int, "visible_segments": int}``. ``z`` is
        ``lane + 0.999 * share`` (the share of the bin the lane's bytes cover; 1 for an exact
        column). ``customdata`` is ``[bytes, first item, last item]`` per cell when binned,
        ``[start, end, bytes, item]`` when exact; ``text`` is the hover sentence. Updating a
        figure's first trace with it redraws the map; :func:`update_bytemap` also redraws
        the ticks of tiny shares (:func:`bytemap_marks`).
    """
    for name, value, least in (("bins", bins, 1), ("exact_threshold", exact_threshold, 0)):
        if type(value) is not int or value < least:
            raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
    bm = as_bytemap(source, file)
    lo, hi = _window(bm, x_range)
    i0, i1 = (int(v) for v in bm.segment_index(np.array([lo, hi - 1])))
    visible = i1 - i0 + 1
    codes = np.array([LANE_CODE[k] for k in bm.lanes])
    lane_of = np.full(len(LANE_ORDER), -1)
    lane_of[codes] = np.arange(len(codes))
    n_lanes = len(bm.lanes)
    smallest = int(bm.nbytes[i0 : i1 + 1].min())
    lane_codes = bm._codes()
    words = [LANE_WORDS[k] for k in bm.lanes]
    # Exact columns only when every one gets at least a bin's width: narrower ones would be
    # dropped by plotly's heatmap drawing, and a byte map must not hide a header.
    if visible <= exact_threshold and smallest * bins >= hi - lo:
        seg = slice(i0, i1 + 1)
        starts = np.maximum(bm.starts[seg], lo)
        ends = np.minimum(bm.starts[seg] + bm.nbytes[seg], hi)
        edges = np.append(starts, ends[-1])
        rows = lane_of[lane_codes[seg]]
        cols = np.arange(visible)
        z = np.full((n_lanes, visible), np.nan)
        z[rows, cols] = rows + SHADE
        items = bm.items[seg]
        custom = np.zeros((n_lanes, visible, 4), dtype=np.int64)
        custom[:, :, 0] = bm.starts[seg]
        custom[:, :, 1] = bm.starts[seg] + bm.nbytes[seg]
        custom[:, :, 2] = bm.nbytes[seg]
        custom[:, :, 3] = items
        text = np.full((n_lanes, visible), "", dtype=object)
        text[rows, cols] = [
            f"bytes {a:,}–{a + n - 1:,}: {words[r]} of {bm.item_description(int(i))} "
            f"({human_nbytes(n)})"
            for a, n, r, i in zip(bm.starts[seg].tolist(), bm.nbytes[seg].tolist(),
                                  rows.tolist(), items.tolist(), strict=True)]
        mode = "exact"
    else:
        n_cols = min(bins, hi - lo)
        edges = np.unique(np.linspace(lo, hi, n_cols + 1).round().astype(np.int64))
        cover = bm.coverage(edges)  # (lanes, cols)
        widths = np.diff(edges)
        frac = cover / widths
        z = np.where(cover > 0, np.arange(n_lanes)[:, None] + SHADE * frac, np.nan)
        first = np.full(cover.shape, -1, dtype=np.int64)
        last = np.full(cover.shape, -1, dtype=np.int64)
        for row, segs in enumerate(bm.lane_segments):  # the items owning each lane's bytes
            seg_starts = bm.starts[segs]
            f = np.searchsorted(seg_starts + bm.nbytes[segs], edges[:-1], side="right")
            la = np.searchsorted(seg_starts, edges[1:], side="left") - 1
            valid = cover[row] > 0
            first[row] = np.where(valid, bm.items[segs[np.clip(f, 0, len(segs) - 1)]], -1)
            last[row] = np.where(valid, bm.items[segs[np.clip(la, 0, len(segs) - 1)]], -1)
        custom = np.empty((n_lanes, len(widths), 3), dtype=np.int64)
        custom[:, :, 0] = cover
        custom[:, :, 1] = first
        custom[:, :, 2] = last
        text = np.full(cover.shape, "", dtype=object)
        rr, cc = np.nonzero(cover > 0)
        e = edges.tolist()
        cov, fi, la_ = cover[rr, cc].tolist(), first[rr, cc].tolist(), last[rr, cc].tolist()
        sentences = []
        for r, c, n, a, b in zip(rr.tolist(), cc.tolist(), cov, fi, la_, strict=True):
            width = e[c + 1] - e[c]
            more = "" if b == a else (f"<br>… to {bm.item_description(b)} "
                                      f"({b - a} more item{'s' * (b - a > 1)})")
            sentences.append(f"bytes {e[c]:,}–{e[c + 1] - 1:,}: {human_nbytes(n)} of "
                             f"{words[r]} ({_share(n, width)})<br>in "
                             f"{bm.item_description(a)}{more}")
        text[rr, cc] = sentences
        mode = "binned"
    return {
        "x": edges,
        "y": [LANE_LABELS[k] for k in bm.lanes],
        "zmin": 0,
        "zmax": n_lanes,
        "colorscale": _colorscale(bm.lanes, theme),
        # None, not NaN, for empty cells: NaN is not JSON, and widget messages carry it raw
        "z": np.where(np.isnan(z), None, z),
        "customdata": custom,
        "text": text,
        "hovertemplate": "<b>%{y}</b> · %{text}<extra></extra>",
        "meta": {"mode": mode, "x_range": [lo, hi], "columns": int(z.shape[1]),
                 "visible_segments": int(visible)},
    }


def bytemap_marks(trace: dict[str, Any]) -> dict[str, Any]:
    """The "present but tiny" ticks of a :func:`bytemap_trace`: scatter properties.

    One tick at the middle of every binned cell whose lane covers more than nothing but
    less than :data:`TINY_FRACTION` of the bin (its shade alone would be near white). Returns
    ``x`` (bin centres), ``y`` (lane labels), ``text`` (the cell's hover sentence) and
    ``marker`` (a thin vertical tick in the lane's colour); no ticks in exact mode.
    """
    z = np.asarray(trace["z"], dtype=float)
    x = np.asarray(trace["x"], dtype=np.float64)
    labels = list(trace["y"])
    if trace["meta"]["mode"] != "binned" or z.size == 0:
        return {"x": [], "y": [], "text": [], "marker": _tick_marker(labels, np.zeros(0))}
    share = z - np.arange(z.shape[0])[:, None]
    tiny = ~np.isnan(z) & (share < SHADE * TINY_FRACTION)
    rr, cc = np.nonzero(tiny)
    centres = (x[cc] + x[cc + 1]) / 2
    return {"x": centres, "y": [labels[r] for r in rr.tolist()],
            "text": np.asarray(trace["text"], dtype=object)[rr, cc],
            "marker": _tick_marker(labels, rr)}


def bytemap_boundaries(source: Any, trace: dict[str, Any]) -> dict[str, Any]:
    """Where one item's tensor bytes end and the next one's begin, in a :func:`bytemap_trace`'s
    view: scatter properties.

    Adjacent tensors of one colour would read as one solid bar (a shard of a few tensors, a
    zoom among neighbours); a thin break in the tensor-data lane marks each boundary, at most
    :data:`MAX_BOUNDARIES` of them (past that the lane is drawn plain). Returns ``x`` (the
    offsets), ``y`` (the lane's label), ``text`` (which tensor starts there) and ``marker``.
    """
    bm = as_bytemap(source)
    lo, hi = trace["meta"]["x_range"]
    segs = (bm.lane_segments[bm.lanes.index(SegmentKind.DATA)] if SegmentKind.DATA in bm.lanes
            else np.zeros(0, dtype=np.int64))
    starts = bm.starts[segs]
    ends = starts + bm.nbytes[segs]
    items = bm.items[segs]
    joined = np.flatnonzero((starts[1:] == ends[:-1]) & (items[1:] != items[:-1])) + 1
    found = segs[joined[(starts[joined] > lo) & (starts[joined] < hi)]]  # segment indices
    if not 0 < len(found) <= MAX_BOUNDARIES:
        found = found[:0]
    at = bm.starts[found]
    text = [f"byte {a:,}: {bm.item_description(i)} starts"
            for a, i in zip(at.tolist(), bm.items[found].tolist(), strict=True)]
    label = LANE_LABELS[SegmentKind.DATA]
    color = trace["colorscale"][0][1]  # the map's empty colour: a gap in the bar
    return {"x": at, "y": [label] * len(at), "text": text,
            "marker": {"symbol": "line-ns", "size": 18, "line": {"width": 1.5, "color": color}}}


def _tick_marker(labels: Sequence[str], rows: np.ndarray) -> dict[str, Any]:
    """Tick colours as lane numbers on a stepped scale of the lanes' colours: one numeric
    array (plotly validates a list of colour names one by one, slowly)."""
    colors = _lane_colors_by_label(labels) or [NEUTRAL]
    n = len(colors)
    scale: list[list[Any]] = []
    for i, c in enumerate(colors):
        scale += [[i / n, c], [(i + 1) / n, c]]
    return {"symbol": "line-ns", "size": 7,
            "line": {"width": 1, "color": rows.astype(np.float64), "colorscale": scale,
                     "cmin": -0.5, "cmax": n - 0.5}}


def _lane_colors_by_label(labels: Sequence[str]) -> list[str]:
    by_label = {LANE_LABELS[k]: LANE_COLORS[k] for k in LANE_ORDER}
    return [by_label.get(lab, NEUTRAL) for lab in labels]


def _colorscale(lanes: Sequence[str], theme: str | None = None) -> list[list[Any]]:
    base = theme_colors(theme)["empty"]
    n = max(len(lanes), 1)
    scale: list[list[Any]] = []
    for i, kind in enumerate(lanes):
        scale.append([i / n, base])
        scale.append([(i + 1) / n, LANE_COLORS[kind]])
    if not scale:
        scale = [[0, base], [1, base]]
    return scale


def bytemap_title(source: Any) -> str:
    """The byte map's default title (escaped): file name, size, and records and alignment
    for a zip (tensor parts for other checkpoint files)."""
    return _default_title(as_bytemap(source))


def _default_title(bm: ByteMap) -> str:
    layout = bm.layout
    name = plain_text((bm.file or layout.path).rsplit("/", 1)[-1])
    if bm.file and not layout.records:  # a checkpoint file without zip records
        n = bm.owners.parts if bm.owners is not None else 0
        return (f"{name} · {human_nbytes(bm.file_nbytes)} · {n} tensor part"
                f"{'s' * (n != 1)}")
    return (f"{name} · {human_nbytes(layout.file_nbytes)} · {len(layout.records)} records · "
            f"alignment {layout.alignment}")


def bytemap_figure(source: Any, *, x_range: tuple[float, float] | None = None,
                   bins: int = DEFAULT_BINS, exact_threshold: int = EXACT_THRESHOLD,
                   title: str | None = None, file: str | None = None,
                   highlight: Sequence[tuple[int, int]] = (),
                   theme: str | None = None) -> go.Figure:
    """The byte map of a checkpoint file: one lane per kind of bytes along the file.

    Parameters
    ----------
    source
        An :class:`~ckptlab.format.ArchiveLayout`, a prepared :class:`ByteMap` (reuse one to re-bin
        quickly), a checkpoint ``FileEntry``, or a :class:`~ckptlab.checkpoint.Checkpoint`
        (``ckptlab.open``; ``file`` picks the file).
    x_range
        Byte range ``(lo, hi)`` to show; the whole file by default.
    bins
        Columns when more than ``exact_threshold`` segments are visible.
    exact_threshold
        At most this many visible segments are drawn exactly, one column each.
    title
        Figure title, drawn as plotly text (markup is read: escape names in it with
        :func:`~ckptlab.viz._style.plain_text`); by default the file name (escaped), size and
        record count.
    file
        For a checkpoint: the file to map (relative path, as in ``ck.files``); by default
        the largest file holding tensor bytes.
    highlight
        Byte ranges ``(offset, nbytes)`` to outline (a tensor's parts, see
        :func:`highlight_shapes`).
    theme
        ``"light"``, ``"dark"`` or None for the notebook's theme.

    Returns
    -------
    plotly.graph_objects.Figure
        A heatmap trace (the shares) and a scatter trace (ticks where a lane is present but
        covers under a tenth of its bin). ``fig.layout.meta`` says ``mode`` (``"binned"`` or
        ``"exact"``), the byte range, the number of columns, the lanes and the file size.
        Hover text says in words which bytes a cell holds and names their tensors.
    """
    bm = as_bytemap(source, file)
    data = bytemap_trace(bm, x_range=x_range, bins=bins, exact_threshold=exact_threshold,
                         theme=theme)
    marks = bytemap_marks(data)
    breaks = bytemap_boundaries(bm, data)
    meta = data.pop("meta")
    labels = data["y"]
    fig = go.Figure([
        go.Heatmap(showscale=False, hoverongaps=False, xgap=0, ygap=2, name="bytes", **data),
        go.Scatter(mode="markers", name="present but tiny", showlegend=False,
                   hovertemplate="<b>%{y}</b> · %{text}<extra></extra>",
                   x=marks["x"], y=marks["y"], text=marks["text"], marker=marks["marker"]),
        go.Scatter(mode="markers", name="tensor boundaries", showlegend=False,
                   hovertemplate="%{text}<extra></extra>", **breaks)])
    fig.update_layout(
        title=title if title is not None else _default_title(bm),
        height=110 + 28 * len(labels), margin={"l": 130, "r": 20, "t": 76, "b": 45},
        xaxis={"title": "file offset (bytes)", "range": meta["x_range"], "showgrid": False,
               "tickformat": ",d"},
        yaxis={"autorange": "reversed", "fixedrange": True, "type": "category",
               "categoryorder": "array", "categoryarray": labels},
        uirevision="bytemap",
        shapes=highlight_shapes(highlight),
        meta={"kind": "bytemap", **meta, "lanes": [str(k) for k in bm.lanes],
              "file_nbytes": bm.file_nbytes, **({"file": bm.file} if bm.file else {}),
              "tiny": len(marks["x"]), "boundaries": len(breaks["x"])},
    )
    return style_figure(fig, theme=theme)


def update_bytemap(figure: Any, source: Any, *, x_range: tuple[float, float] | None = None,
                   bins: int = DEFAULT_BINS, exact_threshold: int = EXACT_THRESHOLD,
                   theme: str | None = None) -> dict[str, Any]:
    """Redraw a :func:`bytemap_figure` (or its ``FigureWidget``) for another view or file.

    Updates both traces, ``layout.meta``, the lane axis and the x range in one batch (for a
    FigureWidget one message). Returns the new ``meta``.
    """
    bm = as_bytemap(source)
    data = bytemap_trace(bm, x_range=x_range, bins=bins, exact_threshold=exact_threshold,
                         theme=theme)
    marks = bytemap_marks(data)
    breaks = bytemap_boundaries(bm, data)
    meta = data.pop("meta")
    batch = getattr(figure, "batch_update", None)
    ctx = batch() if batch is not None else _null()
    with ctx:
        figure.data[0].update(**data)
        if len(figure.data) > 1:
            figure.data[1].update(x=marks["x"], y=marks["y"], text=marks["text"],
                                  marker=marks["marker"])
        if len(figure.data) > 2:
            figure.data[2].update(**breaks)
        figure.layout.meta = {**(figure.layout.meta or {}), **meta,
                              "lanes": [str(k) for k in bm.lanes],
                              "file_nbytes": bm.file_nbytes, **({"file": bm.file} if bm.file else {}),
                              "tiny": len(marks["x"]), "boundaries": len(breaks["x"])}
        figure.layout.height = 110 + 28 * len(data["y"])
        figure.layout.yaxis.categoryarray = data["y"]
        figure.layout.xaxis.range = meta["x_range"]
    return dict(figure.layout.meta)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def highlight_shapes(ranges: Iterable[tuple[int, int]], *,
                     color: str = SELECTION) -> list[dict[str, Any]]:
    """Outlines for byte ranges ``(offset, nbytes)`` on a byte map (``layout.shapes``).

    A range narrower than a pixel still gets its outline (plotly draws the border).
    """
    return [dict(type="rect", xref="x", yref="paper", x0=int(o), x1=int(o) + max(int(n), 1),
                 y0=0, y1=1, line={"color": color, "width": 2},
                 fillcolor="rgba(127,127,127,0.12)") for o, n in ranges]


def files_figure(checkpoint: Any, *, max_files: int = 60, theme: str | None = None
                 ) -> go.Figure:
    """Bytes per file of a checkpoint: tensor bytes apart from the rest, the largest first.

    Parameters
    ----------
    checkpoint
        A :class:`~ckptlab.checkpoint.Checkpoint` (``ckptlab.open``), any format.
    max_files
        At most this many bars (the largest files); ``meta["omitted"]`` counts the rest.

    Returns
    -------
    plotly.graph_objects.Figure
        Two stacked horizontal bar traces (tensor bytes, other bytes). ``fig.layout.meta``
        has ``files``, ``nbytes``, ``tensor_nbytes`` (bytes of the file under some tensor
        part, counted once where tensors share bytes) and ``omitted``.
    """
    if not is_checkpoint(checkpoint):
        raise InvalidArgumentError(
            f"expected a Checkpoint (ckptlab.open), got {type(checkpoint).__name__}")
    by_file: dict[str, list[tuple[int, int]]] = {}
    for t in checkpoint.tensors.values():
        for p in t.parts:
            by_file.setdefault(p.file, []).append((p.offset, p.nbytes))
    rows = sorted(((f.path, f.nbytes, union_nbytes(by_file.get(f.path, ())))
                   for f in checkpoint.files), key=lambda r: (-r[1], r[0]))
    shown = rows[:max(max_files, 1)]
    names = [plain_text(r[0]) for r in shown]
    fig = go.Figure([
        go.Bar(y=names, x=[r[2] for r in shown], orientation="h", name="tensor bytes",
               marker={"color": LANE_COLORS[SegmentKind.DATA]},
               hovertemplate="%{y}: %{x:,} B of tensors<extra></extra>"),
        go.Bar(y=names, x=[r[1] - r[2] for r in shown], orientation="h", name="other bytes",
               marker={"color": NEUTRAL},
               hovertemplate="%{y}: %{x:,} B besides tensors<extra></extra>")])
    fig.update_layout(
        barmode="stack", title=f"Bytes per file · {len(rows)} file{'s' * (len(rows) != 1)} · "
                               f"{human_nbytes(sum(r[1] for r in rows))}",
        xaxis={"title": "bytes", "tickformat": ",d"},
        yaxis={"autorange": "reversed", "automargin": True},
        legend={"orientation": "h", "y": -0.25, "x": 0},
        height=max(260, 130 + 22 * len(shown)), margin={"l": 20, "r": 20, "t": 76, "b": 60},
        meta={"kind": "files", "files": [r[0] for r in shown],
              "nbytes": [r[1] for r in shown], "tensor_nbytes": [r[2] for r in shown],
              "omitted": len(rows) - len(shown)})
    return style_figure(fig, theme=theme)


def union_nbytes(ranges: Iterable[tuple[int, int]]) -> int:
    """Bytes covered by ``(offset, nbytes)`` ranges (tensors that view one storage overlap)."""
    total, end = 0, -1
    for lo, n in sorted(ranges):
        hi = lo + n
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


_OVERHEAD_PARTS: tuple[tuple[str, tuple[SegmentKind, ...]], ...] = (
    ("header + name", (SegmentKind.LOCAL_HEADER, SegmentKind.NAME, SegmentKind.HEADER_LENGTH,
                       SegmentKind.HEADER)),
    ("zip64 / other extra", (SegmentKind.ZIP64_EXTRA, SegmentKind.EXTRA)),
    ("FB padding", (SegmentKind.PADDING, SegmentKind.HEADER_PADDING)),
    ("descriptor", (SegmentKind.DESCRIPTOR,)),
    ("trailer", (SegmentKind.CENTRAL_DIRECTORY, SegmentKind.ZIP64_EOCD,
                 SegmentKind.ZIP64_LOCATOR, SegmentKind.EOCD)),
    ("unknown", (SegmentKind.UNKNOWN,)),
    ("data", (SegmentKind.DATA,)),
)


def _kind_coverage(bm: ByteMap, edges: np.ndarray, kind: SegmentKind) -> np.ndarray:
    """Bytes of segment kind ``kind`` in each bin ``[edges[j], edges[j+1])``."""
    mine = bm.kinds == KIND_CODE[kind]
    prefix = np.concatenate([[0], np.cumsum(np.where(mine, bm.nbytes, 0))])
    edges = np.clip(np.asarray(edges, dtype=np.int64), 0, bm.file_nbytes)
    idx = bm.segment_index(edges)
    within = np.minimum(edges - bm.starts[idx], bm.nbytes[idx])
    return np.diff(prefix[idx] + np.where(mine[idx], within, 0))


def overhead_figure(source: Any, *, by: str = "item", bins: int = DEFAULT_BINS,
                    file: str | None = None, theme: str | None = None) -> go.Figure:
    """Where the non-data bytes are, at a scale where they are visible.

    At true byte scale a 30-byte header next to a megabyte storage is sub-pixel. This view
    normalizes: with ``by="item"`` every record (and trailer structure) gets the same width
    and its bytes are split into header + name, extras, padding, descriptor and data (percent
    stacked, items aggregated into at most ``bins`` columns); with ``by="bytes"`` it shows
    the overhead percentage of each byte bin along the file.

    Parameters
    ----------
    source
        As for :func:`bytemap_figure` (a layout, a map, a checkpoint file or a checkpoint).
    by
        ``"item"`` or ``"bytes"``.
    bins
        Columns (items are aggregated, bytes binned, into at most this many).
    file
        For a checkpoint: which file.
    theme
        ``"light"``, ``"dark"`` or None for the notebook's theme.

    Returns
    -------
    plotly.graph_objects.Figure
        ``fig.layout.meta`` holds ``kind="overhead"``, ``by`` and ``columns``.
    """
    if by not in ("item", "bytes"):
        raise InvalidArgumentError(f"by must be 'item' or 'bytes', got {by!r}")
    if type(bins) is not int or bins < 1:
        raise InvalidArgumentError(f"bins must be a positive int, got {bins!r}")
    bm = as_bytemap(source, file)
    fig = go.Figure()
    if by == "bytes":
        edges = np.unique(np.linspace(0, bm.file_nbytes, min(bins, bm.file_nbytes) + 1)
                          .round().astype(np.int64))
        data = _kind_coverage(bm, edges, SegmentKind.DATA)  # payload: tensors and pickles
        pct = 100.0 * (1.0 - data / np.diff(edges))
        fig.add_trace(go.Scatter(
            x=edges[:-1], y=pct, mode="lines", line={"shape": "hv", "color": "#e45756"},
            fill="tozeroy", name="overhead %",
            customdata=np.stack([edges[:-1], edges[1:]], axis=1),
            hovertemplate="bytes [%{customdata[0]:,}, %{customdata[1]:,}): "
                          "%{y:.3f}% overhead<extra></extra>"))
        fig.update_layout(xaxis={"title": "file offset (bytes)", "tickformat": ",d"},
                          yaxis={"title": "overhead (% of bin)", "rangemode": "tozero"})
        columns = len(edges) - 1
    else:
        n_items = len(bm.item_names)
        per_item = {}
        for label, kinds in _OVERHEAD_PARTS:
            mask = np.isin(bm.kinds, [KIND_CODE[k] for k in kinds])
            per_item[label] = np.bincount(bm.items, weights=np.where(mask, bm.nbytes, 0),
                                          minlength=n_items)
        group_starts = np.unique(np.linspace(0, n_items, min(bins, n_items) + 1)
                                 .astype(np.int64))[:-1]
        columns = len(group_starts)
        for label, kinds in _OVERHEAD_PARTS:
            if not per_item[label].any():
                continue
            summed = np.add.reduceat(per_item[label], group_starts)
            fig.add_trace(go.Scatter(
                x=group_starts, y=summed, name=label, stackgroup="one", groupnorm="percent",
                mode="lines", line={"width": 0.5, "shape": "hv", "color": KIND_COLORS[kinds[0]]},
                hovertemplate=f"{label}: " + "%{y:,.0f} B<extra></extra>"))
        fig.update_layout(
            xaxis={"title": "item (records in file order, then the trailer)"},
            yaxis={"title": "share of the item's bytes (%)", "range": [0, 100]},
            hovermode="x unified")
    fig.update_layout(
        title=f"Overhead by {'item' if by == 'item' else 'byte bin'}: "
              f"{human_nbytes(bm.layout.overhead_nbytes)} of "
              f"{human_nbytes(bm.file_nbytes)} is file structure, not payload",
        height=380, margin={"l": 70, "r": 20, "t": 76, "b": 45},
        meta={"kind": "overhead", "by": by, "columns": columns})
    return style_figure(fig, theme=theme)

