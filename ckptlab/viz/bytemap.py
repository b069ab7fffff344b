"""The byte map: every byte of a checkpoint file, one lane and one colour per segment kind.

A plotly bar per segment takes seconds to draw at 10k records and minutes at 50k, so the map
is one heatmap trace: lanes are segment kinds, columns are byte bins (1000 by default),
and a cell's shade says how much of its bin that kind covers (any byte at all shows a tint, so
sub-pixel headers and padding stay visible). Once few enough segments are in view the columns
become the exact segments. :class:`ByteMap` holds the numeric arrays once per layout, so
re-binning for a zoom is a few ``searchsorted`` calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ckptlab.errors import InvalidArgumentError
from ckptlab.format.layout import ArchiveLayout, SegmentKind
from ckptlab.viz._style import (
    KIND_COLORS,
    KIND_LABELS,
    KIND_ORDER,
    human_nbytes,
    plain_text,
    tint,
)

__all__ = ["ByteMap", "bytemap_figure", "bytemap_trace", "overhead_figure"]

# Plotly samples a heatmap that has more columns than pixels, which drops the slivers (a
# header in a bin of megabytes) this map exists to show: keep columns at about one per pixel.
DEFAULT_BINS = 1000
EXACT_THRESHOLD = 1000  # at most this many visible segments are drawn one column each
_KIND_CODE = {k: i for i, k in enumerate(KIND_ORDER)}
_BAND_FLOOR = 0.3  # shade of a lane that covers a sliver of its bin (0..1 within the band)
_TRAILER_NAMES = {
    SegmentKind.CENTRAL_DIRECTORY: "<central directory>",
    SegmentKind.ZIP64_EOCD: "<zip64 EOCD>",
    SegmentKind.ZIP64_LOCATOR: "<zip64 locator>",
    SegmentKind.EOCD: "<EOCD>",
    SegmentKind.HEADER_LENGTH: "<header length>",
    SegmentKind.HEADER: "<JSON header>",
    SegmentKind.HEADER_PADDING: "<header padding>",
    SegmentKind.UNKNOWN: "<unknown bytes>",
}


@dataclass(frozen=True, eq=False)
class ByteMap:
    """A layout's segments as numeric arrays, ready to bin at any zoom.

    Segments are grouped into *items*: a zip record (header, name, extras, data, descriptor)
    or a trailer structure. ``item_names[i]`` names item ``i``; items are in file order.
    """

    layout: ArchiveLayout
    starts: np.ndarray  # int64 (S,): first byte of each segment, ascending, tiling the file
    nbytes: np.ndarray  # int64 (S,)
    kinds: np.ndarray  # int16 (S,): index into KIND_ORDER
    items: np.ndarray  # int32 (S,): index into item_names
    item_names: tuple[str, ...]
    lanes: tuple[SegmentKind, ...]  # kinds present in the file, in KIND_ORDER
    prefix: np.ndarray  # int64 (len(lanes), S + 1): bytes of each lane before segment i
    lane_segments: tuple[np.ndarray, ...]  # per lane: indices of its segments, ascending
    item_starts: np.ndarray  # int64 (items + 1,): first byte of each item, then the file size

    @classmethod
    def from_layout(cls, layout: ArchiveLayout) -> ByteMap:
        """Build the arrays (linear in the number of segments)."""
        if not isinstance(layout, ArchiveLayout):
            raise InvalidArgumentError(
                f"expected an ArchiveLayout (from ckptlab.inspect), got {type(layout).__name__}")
        segs = layout.segments
        n = len(segs)
        starts = np.fromiter((s.offset for s in segs), dtype=np.int64, count=n)
        nbytes = np.fromiter((s.nbytes for s in segs), dtype=np.int64, count=n)
        kinds = np.fromiter((_KIND_CODE[s.kind] for s in segs), dtype=np.int16, count=n)
        names: list[str] = []
        items = np.empty(n, dtype=np.int32)
        last: str | None = None
        for i, s in enumerate(segs):
            name = s.record if s.record is not None else _TRAILER_NAMES.get(s.kind, s.kind.value)
            if name != last:
                names.append(name)
                last = name
            items[i] = len(names) - 1
        present = np.unique(kinds)
        lanes = tuple(KIND_ORDER[c] for c in present)
        prefix = np.zeros((len(lanes), n + 1), dtype=np.int64)
        lane_segments = []
        for row, code in enumerate(present):
            mask = kinds == code
            np.cumsum(np.where(mask, nbytes, 0), out=prefix[row, 1:])
            lane_segments.append(np.flatnonzero(mask))
        first = np.flatnonzero(np.diff(items, prepend=-1))  # first segment of each item
        item_starts = np.append(starts[first], layout.file_nbytes)
        return cls(layout, starts, nbytes, kinds, items, tuple(names), lanes, prefix,
                   tuple(lane_segments), item_starts)

    @property
    def file_nbytes(self) -> int:
        return self.layout.file_nbytes

    def segment_index(self, offsets: np.ndarray) -> np.ndarray:
        """Index of the segment holding each byte offset (clipped into the file)."""
        idx = np.searchsorted(self.starts, offsets, side="right") - 1
        return np.clip(idx, 0, len(self.starts) - 1)

    def cumulative(self, edges: np.ndarray) -> np.ndarray:
        """Bytes of each lane in ``[0, edge)`` for each edge: shape ``(lanes, len(edges))``."""
        edges = np.clip(np.asarray(edges, dtype=np.int64), 0, self.file_nbytes)
        idx = self.segment_index(edges)
        within = np.minimum(edges - self.starts[idx], self.nbytes[idx])
        codes = np.array([_KIND_CODE[k] for k in self.lanes], dtype=np.int16)
        own = self.kinds[idx][None, :] == codes[:, None]
        return self.prefix[:, idx] + np.where(own, within[None, :], 0)

    def coverage(self, edges: np.ndarray) -> np.ndarray:
        """Bytes of each lane in each bin ``[edges[j], edges[j+1])``: ``(lanes, bins)``."""
        return np.diff(self.cumulative(edges), axis=1)

    def item_span(self, item: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of item ``item``."""
        if not 0 <= item < len(self.item_names):
            raise InvalidArgumentError(f"no item {item} (the map has {len(self.item_names)})")
        return int(self.item_starts[item]), int(self.item_starts[item + 1])

    def items_in(self, lo: int, hi: int) -> range:
        """The items with bytes in ``[lo, hi)``."""
        first = int(np.searchsorted(self.item_starts, lo, side="right")) - 1
        last = int(np.searchsorted(self.item_starts, hi, side="left"))
        return range(max(first, 0), min(last, len(self.item_names)))

    def item_at(self, offset: int) -> int:
        """The item holding byte ``offset``."""
        return int(self.items[self.segment_index(np.array([offset]))[0]])

    def item_label(self, item: int) -> str:
        """The item's name and, for a storage record, the tensors that view it (raw text: pass
        it through :func:`~ckptlab.viz._style.plain_text` before a figure shows it)."""
        name = self.item_names[item]
        tensors = self._tensors_by_record().get(name)
        if not tensors:
            return name
        shown = ", ".join(tensors[:3]) + (f" (+{len(tensors) - 3})" if len(tensors) > 3 else "")
        return f"{name} · {shown}"

    def _plain_names(self) -> np.ndarray:
        """``item_names`` escaped for plotly (:func:`plain_text`), then ``""``: built once."""
        cached = self.__dict__.get("_plain_item_names")
        if cached is None:
            cached = np.array([plain_text(n) for n in self.item_names] + [""], dtype=object)
            object.__setattr__(self, "_plain_item_names", cached)  # a memo of frozen data
        return cached

    def _tensors_by_record(self) -> dict[str, list[str]]:
        cached = self.__dict__.get("_tensor_index")
        if cached is None:
            by_key = {s.key: s for s in self.layout.storages}
            cached = {}
            for t in self.layout.tensors:
                storage = by_key.get(t.storage_key)
                if storage is not None:
                    cached.setdefault(storage.record, []).append(
                        f"{'.'.join(map(str, t.path))} {t.dtype}{list(t.shape)}")
            object.__setattr__(self, "_tensor_index", cached)  # a memo of frozen data
        return cached


def _as_bytemap(source: ArchiveLayout | ByteMap) -> ByteMap:
    return source if isinstance(source, ByteMap) else ByteMap.from_layout(source)


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


def bytemap_trace(source: ArchiveLayout | ByteMap, *, x_range: tuple[float, float] | None = None,
                  bins: int = DEFAULT_BINS,
                  exact_threshold: int = EXACT_THRESHOLD) -> dict[str, Any]:
    """The heatmap trace properties of the byte map for one view (what a zoom updates).

    Returns a dict of plotly heatmap properties (``x``, ``y``, ``z``, ``zmin``, ``zmax``,
    ``colorscale``, ``customdata``, ``text``, ``hovertemplate``) plus ``"meta"``:
    ``{"mode": "binned" | "exact", "x_range": [lo, hi], "columns": int,
    "visible_segments": int}``. Updating a figure's trace with it redraws the map for another
    view or another layout.
    """
    for name, value, least in (("bins", bins, 1), ("exact_threshold", exact_threshold, 0)):
        if type(value) is not int or value < least:
            raise InvalidArgumentError(f"{name} must be an int >= {least}, got {value!r}")
    bm = _as_bytemap(source)
    lo, hi = _window(bm, x_range)
    i0, i1 = (int(v) for v in bm.segment_index(np.array([lo, hi - 1])))
    visible = i1 - i0 + 1
    codes = np.array([_KIND_CODE[k] for k in bm.lanes])
    lane_of = np.full(len(KIND_ORDER), -1)
    lane_of[codes] = np.arange(len(codes))
    n_lanes = len(bm.lanes)
    smallest = int(bm.nbytes[i0 : i1 + 1].min())
    # Exact columns only when every one gets at least a bin's width: narrower ones would be
    # dropped by plotly's heatmap drawing, and a byte map must not hide a header.
    if visible <= exact_threshold and smallest * bins >= hi - lo:
        seg = slice(i0, i1 + 1)
        starts = np.maximum(bm.starts[seg], lo)
        ends = np.minimum(bm.starts[seg] + bm.nbytes[seg], hi)
        edges = np.append(starts, ends[-1])
        rows = lane_of[bm.kinds[seg]]
        cols = np.arange(visible)
        z = np.full((n_lanes, visible), np.nan)
        z[rows, cols] = rows + _BAND_FLOOR + 0.69 * (1 - _BAND_FLOOR)
        items = bm.items[seg]
        custom = np.zeros((n_lanes, visible, 4), dtype=np.int64)
        custom[:, :, 0] = bm.starts[seg]
        custom[:, :, 1] = bm.starts[seg] + bm.nbytes[seg]
        custom[:, :, 2] = bm.nbytes[seg]
        custom[:, :, 3] = items
        text = np.full((n_lanes, visible), "", dtype=object)
        labels = {int(i): plain_text(bm.item_label(int(i))) for i in np.unique(items)}
        text[rows, cols] = [labels[int(i)] for i in items]
        hover = ("<b>%{y}</b> of %{text}<br>bytes [%{customdata[0]:,}, %{customdata[1]:,})"
                 " · %{customdata[2]:,} B<br>item #%{customdata[3]}<extra></extra>")
        mode = "exact"
    else:
        n_cols = min(bins, hi - lo)
        edges = np.unique(np.linspace(lo, hi, n_cols + 1).round().astype(np.int64))
        cover = bm.coverage(edges)  # (lanes, cols)
        widths = np.diff(edges)
        frac = cover / widths
        z = np.where(cover > 0, np.arange(n_lanes)[:, None] + _BAND_FLOOR
                     + 0.69 * (1 - _BAND_FLOOR) * frac, np.nan)
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
        text = bm._plain_names()[first]  # -1 picks the trailing "": empty cells carry no name
        hover = ("<b>%{y}</b> of %{text}: %{customdata[0]:,} B in the bin at %{x:,.0f} "
                 f"(±{int(widths.max()) // 2:,} B)<br>"
                 "items #%{customdata[1]} – #%{customdata[2]}<extra></extra>")
        mode = "binned"
    return {
        "x": edges,
        "y": [KIND_LABELS[k] for k in bm.lanes],
        "zmin": 0,
        "zmax": n_lanes,
        "colorscale": _colorscale(bm.lanes),
        # None, not NaN, for empty cells: NaN is not JSON, and widget messages carry it raw
        "z": np.where(np.isnan(z), None, z),
        "customdata": custom,
        "text": text,
        "hovertemplate": hover,
        "meta": {"mode": mode, "x_range": [lo, hi], "columns": int(z.shape[1]),
                 "visible_segments": int(visible)},
    }


def _colorscale(lanes: tuple[SegmentKind, ...]) -> list[list[Any]]:
    n = len(lanes)
    scale: list[list[Any]] = []
    for i, kind in enumerate(lanes):
        scale.append([i / n, tint(KIND_COLORS[kind], 0.3)])
        scale.append([(i + 1) / n, KIND_COLORS[kind]])
    return scale


def bytemap_figure(source: ArchiveLayout | ByteMap, *,
                   x_range: tuple[float, float] | None = None, bins: int = DEFAULT_BINS,
                   exact_threshold: int = EXACT_THRESHOLD, title: str | None = None) -> go.Figure:
    """The byte map of a checkpoint: one lane per segment kind along the file's bytes.

    Parameters
    ----------
    source
        An :class:`~ckptlab.ArchiveLayout` or a prepared :class:`ByteMap` (reuse one to
        re-bin quickly).
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

    Returns
    -------
    plotly.graph_objects.Figure
        One heatmap trace. ``fig.layout.meta`` says ``mode`` (``"binned"`` or ``"exact"``),
        the byte range and the number of columns. Hover data is numeric (offsets, bytes and
        item numbers) in binned mode; exact mode adds record and tensor names.
    """
    bm = _as_bytemap(source)
    data = bytemap_trace(bm, x_range=x_range, bins=bins, exact_threshold=exact_threshold)
    meta = data.pop("meta")
    labels = data["y"]
    fig = go.Figure(go.Heatmap(showscale=False, hoverongaps=False, xgap=0, ygap=2, name="bytes",
                               **data))
    layout = bm.layout
    fig.update_layout(
        title=title if title is not None else (
            f"{plain_text(layout.path.rsplit('/', 1)[-1])} · "
            f"{human_nbytes(layout.file_nbytes)} · "
            f"{len(layout.records)} records · alignment {layout.alignment}"),
        height=90 + 28 * len(labels), margin={"l": 130, "r": 20, "t": 50, "b": 45},
        xaxis={"title": "file offset (bytes)", "range": meta["x_range"], "showgrid": False,
               "tickformat": ",d"},
        yaxis={"autorange": "reversed", "fixedrange": True},
        uirevision="bytemap", plot_bgcolor="#ffffff",
        meta={"kind": "bytemap", **meta, "lanes": [k.value for k in bm.lanes],
              "file_nbytes": layout.file_nbytes},
    )
    return fig


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


def overhead_figure(source: ArchiveLayout | ByteMap, *, by: str = "item",
                    bins: int = DEFAULT_BINS) -> go.Figure:
    """Where the non-data bytes are, at a scale where they are visible.

    At true byte scale a 30-byte header next to a megabyte storage is sub-pixel. This view
    normalizes: with ``by="item"`` every record (and trailer structure) gets the same width
    and its bytes are split into header + name, extras, padding, descriptor and data (percent
    stacked, items aggregated into at most ``bins`` columns); with ``by="bytes"`` it shows
    the overhead percentage of each byte bin along the file.

    Returns
    -------
    plotly.graph_objects.Figure
        ``fig.layout.meta`` holds ``kind="overhead"``, ``by`` and ``columns``.
    """
    if by not in ("item", "bytes"):
        raise InvalidArgumentError(f"by must be 'item' or 'bytes', got {by!r}")
    if type(bins) is not int or bins < 1:
        raise InvalidArgumentError(f"bins must be a positive int, got {bins!r}")
    bm = _as_bytemap(source)
    fig = go.Figure()
    if by == "bytes":
        edges = np.unique(np.linspace(0, bm.file_nbytes, min(bins, bm.file_nbytes) + 1)
                          .round().astype(np.int64))
        cover = bm.coverage(edges)
        data_row = bm.lanes.index(SegmentKind.DATA) if SegmentKind.DATA in bm.lanes else None
        data = cover[data_row] if data_row is not None else np.zeros(len(edges) - 1)
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
            mask = np.isin(bm.kinds, [_KIND_CODE[k] for k in kinds])
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
        height=360, margin={"l": 70, "r": 20, "t": 50, "b": 45},
        meta={"kind": "overhead", "by": by, "columns": columns}, plot_bgcolor="#ffffff")
    return fig
