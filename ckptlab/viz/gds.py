"""GPUDirect Storage views: the file as 4 KiB blocks, and transfer speed per backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ckptlab.errors import InvalidArgumentError
from ckptlab.format.layout import ArchiveLayout, SegmentKind
from ckptlab.viz._style import ACCENT, KIND_COLORS, NEUTRAL, plain_text, style_figure

__all__ = ["BLOCK_KINDS", "block_classes", "blockmap_figure", "transfer_figure"]

BLOCK_KINDS = ("metadata", "payload", "shared")  # codes 0, 1, 2 of block_classes
_BLOCK_COLORS = (NEUTRAL, KIND_COLORS[SegmentKind.DATA], KIND_COLORS[SegmentKind.PADDING])
LIMIT_COLOR = KIND_COLORS[SegmentKind.DESCRIPTOR]  # the raw-disk line: red
MAX_CELLS = 250_000


def block_classes(layout: ArchiveLayout, block: int = 4096) -> np.ndarray:
    """Class of every ``block``-byte block of the file (int8, one per block).

    0 ``metadata``: no storage byte (headers, pickle, central directory).
    1 ``payload``: only bytes of one storage: GDS / O_DIRECT can move it as is.
    2 ``shared``: storage bytes and other bytes (a storage's tail block holds its data
    descriptor and the next record's header; an unaligned storage starts mid-block). Writing
    such a block whole would overwrite the other bytes.
    """
    if type(block) is not int or block < 1:
        raise InvalidArgumentError(f"block must be a positive int, got {block!r}")
    spans = sorted((s.data_offset, s.data_offset + s.nbytes) for s in layout.storages if s.nbytes)
    n_blocks = -(-layout.file_nbytes // block)
    if not spans:
        return np.zeros(n_blocks, dtype=np.int8)
    starts = np.array([a for a, _ in spans], dtype=np.int64)
    ends = np.array([b for _, b in spans], dtype=np.int64)
    prefix = np.concatenate([[0], np.cumsum(ends - starts)])

    def covered(x: np.ndarray) -> np.ndarray:  # storage bytes in [0, x)
        i = np.searchsorted(starts, x, side="right") - 1
        inside = np.where(i >= 0, np.minimum(x - starts[np.maximum(i, 0)],
                                             (ends - starts)[np.maximum(i, 0)]), 0)
        return np.where(i >= 0, prefix[np.maximum(i, 0)] + inside, 0)

    edges = np.minimum(np.arange(n_blocks + 1, dtype=np.int64) * block, layout.file_nbytes)
    cover = np.diff(covered(edges))
    width = np.diff(edges)
    out = np.where(cover == 0, 0, np.where(cover == width, 1, 2)).astype(np.int8)
    # a block covered only by storage bytes but of two storages is still "payload" for I/O
    return out


def blockmap_figure(layout: ArchiveLayout, *, block: int = 4096, columns: int = 128) -> go.Figure:
    """The file as a grid of ``block``-byte blocks coloured metadata / payload / shared.

    Rows hold ``columns`` blocks each; files with more than 250k blocks show several blocks
    per cell (the cell takes the worst class: shared > payload > metadata).

    Returns
    -------
    plotly.graph_objects.Figure
        ``fig.layout.meta`` holds the block size, blocks per cell and the count of each class.
    """
    classes = block_classes(layout, block)
    n = len(classes)
    per_cell = max(1, -(-n // MAX_CELLS))
    if per_cell > 1:
        pad = (-n) % per_cell
        cells = np.pad(classes, (0, pad)).reshape(-1, per_cell).max(axis=1)
    else:
        cells = classes
    rows = -(-len(cells) // columns)
    grid = np.full(rows * columns, np.nan)
    grid[: len(cells)] = cells
    grid = grid.reshape(rows, columns)
    first_block = (np.arange(rows * columns) * per_cell).reshape(rows, columns)
    counts = {kind: int((classes == i).sum()) for i, kind in enumerate(BLOCK_KINDS)}
    scale = [[0.0, _BLOCK_COLORS[0]], [1 / 3, _BLOCK_COLORS[0]], [1 / 3, _BLOCK_COLORS[1]],
             [2 / 3, _BLOCK_COLORS[1]], [2 / 3, _BLOCK_COLORS[2]], [1.0, _BLOCK_COLORS[2]]]
    names = np.array(BLOCK_KINDS + ("",), dtype=object)
    text = names[np.where(np.isnan(grid), 3, np.nan_to_num(grid)).astype(int)]
    fig = go.Figure(go.Heatmap(
        z=np.where(np.isnan(grid), None, grid), zmin=-0.5, zmax=2.5, colorscale=scale,
        showscale=False, xgap=1, ygap=1, text=text, customdata=first_block * block,
        hovertemplate=("%{text} block at file offset %{customdata:,}"
                       + (f" ({per_cell} blocks per cell)" if per_cell > 1 else "")
                       + "<extra></extra>")))
    for i, kind in enumerate(BLOCK_KINDS):  # the legend: what each colour is
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", hoverinfo="skip",
                                 name=f"{kind} ({counts[kind]:,})",
                                 marker={"symbol": "square", "size": 12,
                                         "color": _BLOCK_COLORS[i]}))
    pct = {k: 100 * v / max(n, 1) for k, v in counts.items()}
    fig.update_layout(showlegend=True, legend={"orientation": "h", "y": -0.12},
        title=(f"{n:,} blocks of {block} B: {counts['payload']:,} payload "
               f"({pct['payload']:.1f}%), {counts['shared']:,} shared, "
               f"{counts['metadata']:,} metadata"),
        xaxis={"title": f"block within row (×{block * per_cell:,} B)", "showgrid": False},
        yaxis={"title": "row", "autorange": "reversed", "showgrid": False},
        height=min(900, 160 + 16 * rows), margin={"l": 60, "r": 20, "t": 76, "b": 45},
        meta={"kind": "blockmap", "block": block, "blocks_per_cell": per_cell,
              "columns": columns, "counts": counts},
    )
    return style_figure(fig)


def transfer_figure(rates: Mapping[str, float] | Sequence[tuple[str, float]], *,
                    limit: tuple[str, float] | None = None,
                    title: str = "Throughput (GB/s)") -> go.Figure:
    """Bars of GB/s per method (e.g. torch.save vs each ckptlab.gds backend).

    Parameters
    ----------
    rates
        ``{label: GB/s}`` or ``[(label, GB/s), ...]``, in display order.
    limit
        ``(label, GB/s)`` drawn as a dashed line: the raw disk figure from the same run.
    title
        Drawn as plotly text (markup is read); labels are shown as typed.
    """
    items: list[tuple[str, Any]] = list(rates.items() if isinstance(rates, Mapping) else rates)
    if not items:
        raise InvalidArgumentError("transfer_figure needs at least one (label, GB/s)")
    labels = [str(k) for k, _ in items]
    values = [float(v) for _, v in items]
    fig = go.Figure(go.Bar(x=[plain_text(k) for k in labels], y=values,
                           text=[f"{v:.2f}" for v in values],
                           textposition="outside", marker={"color": ACCENT}, cliponaxis=False,
                           name="throughput", showlegend=False,  # the axis says what bars are
                           hovertemplate="%{x}: %{y:.3f} GB/s<extra></extra>"))
    if limit is not None:
        # the limit's words go in the legend, not on the plot, where they covered a bar
        fig.add_hline(y=limit[1], line={"dash": "dash", "color": LIMIT_COLOR})
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", hoverinfo="skip",
                                 name=f"{plain_text(limit[0])} {limit[1]:.2f} GB/s",
                                 line={"dash": "dash", "color": LIMIT_COLOR}))
    top = max([*values, limit[1] if limit is not None else 0.0, 0.0])
    fig.update_layout(showlegend=limit is not None, legend={"orientation": "h", "y": -0.3},
                      yaxis={"range": [0, top * 1.18 if top > 0 else 1]})
    fig.update_layout(title=title, yaxis={"title": "GB/s", "rangemode": "tozero"},
                      height=360, margin={"l": 60, "r": 20, "t": 76, "b": 60},
                      meta={"kind": "transfer", "labels": labels, "values": values})
    return style_figure(fig)
