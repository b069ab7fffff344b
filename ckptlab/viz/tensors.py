"""Tensor -> storage -> bytes: which tensors share a storage, and which bytes each one views."""

from __future__ import annotations

import plotly.graph_objects as go

from ckptlab._words import plural
from ckptlab.errors import InvalidArgumentError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.format.layout import ArchiveLayout, TensorInfo
from ckptlab.viz._style import PALETTE, plain_text, style_figure

__all__ = ["storage_figure", "tensor_span"]

_STORAGE_COLORS = PALETTE
SINGLE_VIEW = "#8c8c8c"  # a storage that one tensor views


def tensor_span(tensor: TensorInfo) -> tuple[int, int]:
    """Byte range ``[start, end)`` a tensor can touch inside its storage.

    From ``storage_offset``, ``shape`` and ``stride`` (negative strides do not exist in torch);
    an empty tensor spans nothing.
    """
    size = DTYPE_ITEMSIZE.get(tensor.dtype, 1)
    start = tensor.storage_offset * size
    if tensor.numel == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride))
    return start, start + (last + 1) * size


def storage_figure(layout: ArchiveLayout, *, max_rows: int = 60,
                   shared_first: bool = True) -> go.Figure:
    """One row per tensor, grouped by the storage it views, on the storage's byte axis.

    A light bar is the whole storage, a dark bar the bytes the tensor views (its span from
    ``storage_offset``, shape and stride). Tied weights show as two rows over one storage;
    views with offsets show where they start.

    Parameters
    ----------
    layout
        An :class:`~ckptlab.format.ArchiveLayout` with tensors (torch.save zip or safetensors).
    max_rows
        At most this many tensor rows; storages viewed by several tensors come first when
        ``shared_first``, then the largest.

    Returns
    -------
    plotly.graph_objects.Figure
        ``fig.layout.meta`` holds ``rows`` (tensor paths shown), ``shared`` (storage keys
        viewed by more than one tensor) and ``omitted`` (tensors not shown).
    """
    if not isinstance(layout, ArchiveLayout):
        raise InvalidArgumentError(f"expected an ArchiveLayout, got {type(layout).__name__}")
    storages = {s.key: s for s in layout.storages}
    by_storage: dict[str, list[TensorInfo]] = {}
    for t in layout.tensors:
        if t.storage_key in storages:
            by_storage.setdefault(t.storage_key, []).append(t)
    shared = sorted(k for k, ts in by_storage.items() if len(ts) > 1)
    order = sorted(by_storage, key=lambda k: (
        -(len(by_storage[k]) > 1) if shared_first else 0, -storages[k].nbytes, k))
    rows: list[tuple[TensorInfo, str]] = []
    for key in order:
        for t in sorted(by_storage[key], key=lambda t: t.storage_offset):
            rows.append((t, key))
    total = len(rows)
    rows = rows[:max_rows]
    labels = [plain_text(f"{'.'.join(map(str, t.path))} [storage {k}]") for t, k in rows]
    spans = [tensor_span(t) for t, _ in rows]
    # colour says "these views share a storage": each shared storage its own palette colour
    # (in order), every storage viewed by one tensor the same plain one, so two unrelated
    # storages never look shared by a colour the palette happened to repeat
    shared_order = [k for k in order if len(by_storage[k]) > 1]
    color_of = {k: SINGLE_VIEW for k in order}
    color_of.update({k: _STORAGE_COLORS[i % len(_STORAGE_COLORS)]
                     for i, k in enumerate(shared_order)})
    fig = go.Figure()
    fig.add_trace(go.Bar(
        y=labels, x=[storages[k].nbytes for _, k in rows], base=[0] * len(rows),
        orientation="h", name="storage", marker={"color": "#dddddd"},
        customdata=[[storages[k].nbytes, storages[k].data_offset] for _, k in rows],
        hovertemplate=("storage of %{customdata[0]:,} B at file offset %{customdata[1]:,}"
                       "<extra></extra>")))
    fig.add_trace(go.Bar(
        y=labels, x=[hi - lo for lo, hi in spans], base=[lo for lo, _ in spans],
        orientation="h", name="tensor view",
        marker={"color": [color_of[k] for _, k in rows]},
        customdata=[[lo, hi, storages[k].data_offset + lo, storages[k].data_offset + hi,
                     t.storage_offset] for (t, k), (lo, hi) in zip(rows, spans)],
        text=[plain_text(f"{t.dtype}{list(t.shape)}") for t, _ in rows], textposition="none",
        hovertemplate=("%{y}<br>%{text}, storage_offset %{customdata[4]}<br>"
                       "storage bytes [%{customdata[0]:,}, %{customdata[1]:,})<br>"
                       "file bytes [%{customdata[2]:,}, %{customdata[3]:,})<extra></extra>")))
    fig.update_layout(
        barmode="overlay", title=(f"Tensors → storages → bytes · {plural(len(layout.tensors), 'tensor')} "
                                  f"over {len(layout.storages)} storages, "
                                  f"{len(shared)} shared"),
        xaxis={"title": "byte offset inside the storage", "tickformat": ",d"},
        yaxis={"autorange": "reversed", "automargin": True},
        height=max(260, 80 + 18 * len(rows)), showlegend=False,
        margin={"l": 20, "r": 20, "t": 76, "b": 45},
        meta={"kind": "storages", "rows": [list(map(str, t.path)) for t, _ in rows],
              "shared": shared, "omitted": total - len(rows)},
    )
    return style_figure(fig)
