"""Distributed checkpoint plans: who writes which chunk, what a resharded load reads, how the
bytes spread over ranks, and what the plan cache did.

A tensor's chunks are drawn on its 2-D grid (rows x columns): a 1-D tensor is a 1 x n strip,
a tensor of more dimensions keeps its first dimension as rows and flattens the others into
columns (a chunk that does not span the flattened dimensions whole becomes several column
runs). The grid is one heatmap whose cells are cut at every chunk boundary, so a checkpoint
of 2048 ranks is a few thousand cells, not 2048 shapes; a thin outline marks each chunk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from ckptlab.dcp import DcpLayout
from ckptlab.errors import InvalidArgumentError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.plan.cache import CacheEvent
from ckptlab.plan.planning import GlobalPlan, PlannedTensor
from ckptlab.plan.reshard import Chunk, ReadItem, read_items
from ckptlab.viz._style import ACCENT, PALETTE, human_nbytes, plain_text, style_figure

__all__ = ["STATUS_COLORS", "cache_timeline_figure", "chunk_boxes", "rank_bytes_figure",
           "rank_colors", "reshard_figure", "shard_map_figure", "tensor_chunks"]

# one colour per rank for small worlds (the palette every other figure uses)
_PALETTE = PALETTE
_STEPPED_MAX = 64  # up to this many ranks the colour scale has one flat step per rank
MAX_RUNS = 256  # column runs drawn per chunk of a >2-D tensor before its bounding box is
MAX_OUTLINED = 4096  # chunks outlined one by one (beyond: the cells' colours only)
STATUS_COLORS: dict[str, str] = {"miss": "#e45756", "delta": "#f58518", "hit": "#54a24b"}
_STATUS_SYMBOLS = {"miss": "square", "delta": "diamond", "hit": "circle"}
_DISTCP = re.compile(r"__(\d+)_\d+\.distcp$")

Box = tuple[int, int, int, int]  # rows [r0, r1) x columns [c0, c1) of the 2-D grid


def rank_colors(n: int) -> list[str]:
    """The colour of each of ``n`` ranks, as every plan view draws them.

    Parameters
    ----------
    n
        Number of ranks (colours), at least 1.

    Returns
    -------
    list of str
        ``n`` colours, rank 0 first: the house palette up to 10 ranks, a sampled Turbo scale
        beyond (neighbouring ranks get neighbouring hues).
    """
    if type(n) is not int or n < 1:
        raise InvalidArgumentError(f"n must be a positive int, got {n!r}")
    if n <= len(_PALETTE):
        return list(_PALETTE[:n])
    return sample_colorscale("Turbo", [r / (n - 1) for r in range(n)])


def _colorscale(n: int) -> tuple[Any, float, float]:
    """A heatmap colour scale over rank values 0..n-1 that gives rank r ``rank_colors(n)[r]``."""
    colors = rank_colors(n)
    if n == 1:
        return [[0.0, colors[0]], [1.0, colors[0]]], -0.5, 0.5
    if n <= _STEPPED_MAX:
        scale = []
        for r, c in enumerate(colors):
            scale += [[r / n, c], [(r + 1) / n, c]]
        return scale, -0.5, n - 0.5
    return "Turbo", 0.0, float(n - 1)


def _grid_shape(size: Sequence[int]) -> tuple[int, int]:
    if len(size) == 0:
        return 1, 1
    if len(size) == 1:
        return 1, int(size[0])
    return int(size[0]), math.prod(int(n) for n in size[1:])


def chunk_boxes(size: Sequence[int], chunk: Chunk) -> tuple[list[Box], bool]:
    """Where ``chunk`` lies on the 2-D grid of a tensor of shape ``size``.

    Returns
    -------
    (boxes, exact)
        Rectangles ``(r0, r1, c0, c1)`` (rows and columns, ends excluded) covering exactly the
        chunk's elements, and True; or, for a chunk of a >2-D tensor that would need more than
        :data:`MAX_RUNS` column runs, its bounding rectangle and False. An empty chunk has no
        boxes.
    """
    size = tuple(int(n) for n in size)
    o, s = tuple(chunk.offsets), tuple(chunk.sizes)
    if len(o) != len(size) or len(s) != len(size):
        raise InvalidArgumentError(f"a chunk of {len(o)} dims on a tensor of {len(size)} dims")
    if not size:
        return [(0, 1, 0, 1)], True
    if any(n == 0 for n in s):
        return [], True
    if len(size) == 1:
        return [(0, 1, o[0], o[0] + s[0])], True
    if len(size) == 2:
        return [(o[0], o[0] + s[0], o[1], o[1] + s[1])], True
    r0, r1 = o[0], o[0] + s[0]
    strides = [math.prod(size[d + 1:]) for d in range(len(size))]
    partial = [d for d in range(1, len(size)) if s[d] != size[d]]
    if not partial:
        return [(r0, r1, 0, strides[0])], True
    k = partial[-1]  # dims after k are whole: a run spans s[k] * stride[k] columns
    run = s[k] * strides[k]
    outer = list(range(1, k))
    n_runs = math.prod(s[d] for d in outer)
    if n_runs > MAX_RUNS:
        first = sum(o[d] * strides[d] for d in range(1, len(size)))
        last = sum((o[d] + s[d] - 1) * strides[d] for d in range(1, len(size)))
        return [(r0, r1, first, last + 1)], False
    boxes = []
    for idx in np.ndindex(*(s[d] for d in outer)):
        start = sum((o[d] + i) * strides[d] for d, i in zip(outer, idx)) + o[k] * strides[k]
        boxes.append((r0, r1, start, start + run))
    return boxes, True


def tensor_chunks(source: GlobalPlan | DcpLayout | PlannedTensor, fqn: str | None = None
                  ) -> tuple[PlannedTensor, list[str]]:
    """One tensor's shape, dtype, chunks and writer ranks, from a plan or a checkpoint.

    Parameters
    ----------
    source
        A :class:`~ckptlab.plan.GlobalPlan` (chunks and writers after dedup), a
        :class:`~ckptlab.plan.DcpLayout` (chunks as saved; the rank is read from the data
        file's name, ``__{rank}_0.distcp``), or a :class:`~ckptlab.plan.PlannedTensor`.
    fqn
        The tensor (not needed for a PlannedTensor).

    Returns
    -------
    (PlannedTensor, where)
        The entry, and per chunk where it lives (``"rank 3"``, or the data file and offset).
    """
    if isinstance(source, PlannedTensor):
        return source, [f"rank {r}" for r in source.writers]
    if not isinstance(fqn, str):
        raise InvalidArgumentError(f"fqn must be a tensor name, got {fqn!r}")
    if isinstance(source, GlobalPlan):
        entry = source.tensors.get(fqn)
        if entry is None:
            raise InvalidArgumentError(_unknown(fqn, source.tensors))
        return entry, [f"rank {r}" for r in entry.writers]
    if isinstance(source, DcpLayout):
        md = source.metadata.state_dict_metadata.get(fqn)
        if md is None or not hasattr(md, "chunks"):
            raise InvalidArgumentError(_unknown(fqn, source.tensors))
        items = [i for i in source.items if i.fqn == fqn and i.kind == "tensor"]
        files = sorted({i.file for i in source.items})
        ranks = []
        for i in items:
            m = _DISTCP.search(i.file)
            ranks.append(int(m.group(1)) if m else files.index(i.file))
        order = sorted(range(len(items)), key=lambda k: (ranks[k], items[k].chunk_offsets))
        entry = PlannedTensor(fqn, tuple(md.size), str(md.properties.dtype).removeprefix("torch."),
                            tuple(Chunk(items[k].chunk_offsets, items[k].chunk_sizes)
                                  for k in order), tuple(ranks[k] for k in order))
        return entry, [f"rank {ranks[k]} · {items[k].file} @ {items[k].offset:,}"
                       for k in order]
    raise InvalidArgumentError("expected a GlobalPlan, a DcpLayout or a PlannedTensor, got "
                               f"{type(source).__name__}")


def _unknown(fqn: str, names: Any) -> str:
    shown = ", ".join(list(names)[:5])
    return f"no tensor {fqn!r} here (tensors: {shown}{', ...' if len(names) > 5 else ''})"


def _itemsize(dtype: str) -> int:
    return DTYPE_ITEMSIZE.get(dtype, 1)


def _edges(boxes: Sequence[Box], rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    ys = sorted({0, rows, *(b[0] for b in boxes), *(b[1] for b in boxes)})
    xs = sorted({0, cols, *(b[2] for b in boxes), *(b[3] for b in boxes)})
    return np.array(ys, dtype=np.int64), np.array(xs, dtype=np.int64)


def _owners(boxes: Sequence[tuple[int, Box]], ys: np.ndarray, xs: np.ndarray
            ) -> tuple[np.ndarray, int]:
    """Per cell of the grid cut at ``ys`` x ``xs``: the index of the last box covering it (-1
    for none), and how many cells more than one box covers."""
    owner = np.full((len(ys) - 1, len(xs) - 1), -1, dtype=np.int64)
    count = np.zeros(owner.shape, dtype=np.int32)
    for k, (r0, r1, c0, c1) in boxes:
        i0, i1 = np.searchsorted(ys, r0), np.searchsorted(ys, r1)
        j0, j1 = np.searchsorted(xs, c0), np.searchsorted(xs, c1)
        owner[i0:i1, j0:j1] = k
        count[i0:i1, j0:j1] += 1
    return owner, int((count > 1).sum())


def _chunk_traces(size: Sequence[int], chunks: Sequence[Chunk], ranks: Sequence[int],
                  labels: Sequence[str], n_colors: int, *, showscale: bool = True
                  ) -> tuple[list[Any], dict[str, Any]]:
    """A heatmap of chunk owners (z = rank) and an outline per chunk, with the grid's facts."""
    rows, cols = _grid_shape(size)
    boxes: list[tuple[int, Box]] = []
    exact = True
    empty = 0
    per_chunk: list[list[Box]] = []
    for k, c in enumerate(chunks):
        bs, ok = chunk_boxes(size, c)
        exact &= ok
        empty += not bs
        per_chunk.append(bs)
        boxes += [(k, b) for b in bs]
    ys, xs = _edges([b for _, b in boxes], rows, cols)
    owner, overlap = _owners(boxes, ys, xs)
    rank_of = np.append(np.asarray(ranks, dtype=float), np.nan)  # index -1: no chunk
    z = rank_of[owner]
    text = np.array([*labels, "no chunk"], dtype=object)[owner]
    scale, zmin, zmax = _colorscale(n_colors)
    colorbar: dict[str, Any] = {"title": {"text": "rank"}, "thickness": 12}
    # rank ticks on the bar: each rank up to 16, then every 2nd, 4th, 8th..., so a stepped
    # bar of many ranks still reads as ranks, not as a continuous scale
    every = 1 << max(0, math.ceil(math.log2(n_colors / 16))) if n_colors > 16 else 1
    ticks = list(range(0, n_colors, every))
    colorbar.update(tickvals=ticks, ticktext=[str(r) for r in ticks])
    heat = go.Heatmap(
        z=np.where(np.isnan(z), None, z), x=xs, y=ys, zmin=zmin, zmax=zmax, colorscale=scale,
        showscale=showscale, colorbar=colorbar, text=text, hoverongaps=False,
        hovertemplate="%{text}<extra></extra>")
    traces: list[Any] = [heat]
    if len(boxes) <= MAX_OUTLINED:
        ox: list[float | None] = []
        oy: list[float | None] = []
        for _, (r0, r1, c0, c1) in boxes:
            ox += [c0, c1, c1, c0, c0, None]
            oy += [r0, r0, r1, r1, r0, None]
        traces.append(go.Scatter(x=ox, y=oy, mode="lines", hoverinfo="skip", showlegend=False,
                                 line={"color": "rgba(255,255,255,0.9)", "width": 1}))
    facts = {"grid": [rows, cols], "exact": exact, "empty_chunks": empty,
             "overlap_cells": overlap, "cells": [len(ys) - 1, len(xs) - 1],
             "boxes": [[list(b) for b in bs] for bs in per_chunk]}
    return traces, facts


def _axis_titles(size: Sequence[int]) -> tuple[str, str]:
    if len(size) <= 1:
        return "elements (dim 0)" if size else "scalar", ""
    if len(size) == 2:
        return "dim 1 (columns)", "dim 0 (rows)"
    return f"dims 1..{len(size) - 1} flattened", "dim 0 (rows)"


def shard_map_figure(source: GlobalPlan | DcpLayout | PlannedTensor,
                     fqn: str | None = None) -> go.Figure:
    """Which rank owns which chunk of one tensor, drawn on the tensor's 2-D grid.

    Parameters
    ----------
    source
        A :class:`~ckptlab.plan.GlobalPlan` (the writer of each chunk after dedup), a
        :class:`~ckptlab.plan.DcpLayout` from :func:`ckptlab.inspect` of a DCP directory (the
        rank whose ``__{rank}_0.distcp`` file holds the chunk), or a
        :class:`~ckptlab.plan.PlannedTensor`.
    fqn
        The tensor's name in the state dict.

    Returns
    -------
    plotly.graph_objects.Figure
        A heatmap whose cells are cut at the chunk boundaries, coloured by writer rank
        (:func:`rank_colors`), with a hover per chunk (rank, offsets, sizes, bytes) and an
        outline per chunk. ``fig.layout.meta`` holds ``fqn``, ``size``, ``dtype``, ``grid``
        (rows, columns), ``chunks`` (offsets, sizes, rank, nbytes, colour and grid boxes of
        each), ``ranks``, ``exact`` (False if a >2-D chunk is drawn as its bounding box),
        ``empty_chunks`` and ``overlap_cells``.
    """
    entry, where = tensor_chunks(source, fqn)
    itemsize = _itemsize(entry.dtype)
    n_colors = max(entry.writers, default=0) + 1
    if isinstance(source, GlobalPlan):
        n_colors = max(n_colors, source.world_size)
    colors = rank_colors(n_colors)
    name = plain_text(entry.fqn)
    labels = [f"<b>{name}</b><br>{plain_text(w)}<br>offsets {list(c.offsets)}<br>"
              f"sizes {list(c.sizes)}<br>{human_nbytes(c.numel * itemsize)} "
              f"({c.numel * itemsize:,} B)" for c, w in zip(entry.chunks, where)]
    traces, facts = _chunk_traces(entry.size, entry.chunks, entry.writers, labels, n_colors)
    boxes = facts.pop("boxes")
    chunks = [{"offsets": list(c.offsets), "sizes": list(c.sizes), "rank": r,
               "nbytes": c.numel * itemsize, "color": colors[r], "where": w, "boxes": b}
              for c, r, w, b in zip(entry.chunks, entry.writers, where, boxes)]
    ranks = sorted(set(entry.writers))
    nbytes = math.prod(entry.size) * itemsize
    fig = go.Figure(traces)
    xt, yt = _axis_titles(entry.size)
    rows = facts["grid"][0]
    fig.update_layout(
        title=(f"{name}<br><sup>{list(entry.size)} {entry.dtype} · "
               f"{human_nbytes(nbytes)} · {len(entry.chunks)} chunks on {len(ranks)} ranks"
               f"</sup>"),
        xaxis={"title": xt, "showgrid": False, "zeroline": False},
        yaxis={"title": yt, "autorange": "reversed", "showgrid": False, "zeroline": False,
               "showticklabels": len(entry.size) >= 2},
        height=280 if rows == 1 else 440, margin={"l": 70, "r": 20, "t": 70, "b": 50},
        meta={"kind": "shard_map", "fqn": entry.fqn, "size": list(entry.size),
              "dtype": entry.dtype, "nbytes": nbytes, "chunks": chunks, "ranks": ranks,
              "source": type(source).__name__, **facts})
    return style_figure(fig)


def _read_nbytes(saved: Sequence[Chunk], items: Sequence[ReadItem], itemsize: int) -> int:
    return sum(saved[it.storage_index].numel for it in items) * itemsize


def reshard_figure(fqn: str, size: Sequence[int], saved_chunks: Sequence[Chunk],
                   wanted_chunks: Sequence[Chunk], items: Sequence[ReadItem] | None = None, *,
                   dtype: str = "float32", saved_ranks: Sequence[int] | None = None,
                   wanted_ranks: Sequence[int] | None = None) -> go.Figure:
    """A resharded load of one tensor: the chunks saved, the chunks wanted, and the read items
    between them, with the read amplification.

    DCP's file system reader loads a saved item whole for every read item that touches it
    (``torch.load`` of the item, then a narrow), so a load reads

        ``sum(saved[item.storage_index].nbytes for item in items)``

    bytes for ``sum(wanted.nbytes)`` bytes wanted; their ratio is the read amplification
    (1.0 when every wanted chunk is exactly a saved one).

    Parameters
    ----------
    fqn, size, dtype
        The tensor's name, global shape and dtype (torch's name without the prefix).
    saved_chunks, wanted_chunks
        The chunks in the checkpoint and the chunks the load fills (one per loading rank and
        shard; replicas listed once per rank that loads them).
    items
        The read items (default: :func:`ckptlab.plan.read_items` of the two lists).
    saved_ranks, wanted_ranks
        The rank of each chunk, for colours and hovers (default: its index).

    Returns
    -------
    plotly.graph_objects.Figure
        Three panels on the tensor's grid: saved chunks, wanted chunks (both coloured by
        rank), and the read items (coloured by the loading rank). ``fig.layout.meta`` holds
        ``read_items`` (count), ``read_nbytes``, ``wanted_nbytes``, ``moved_nbytes`` (bytes
        the read items copy), ``amplification`` and ``read_nbytes_by_wanted`` (bytes read
        for each wanted chunk).
    """
    size = tuple(int(n) for n in size)
    saved, wanted = list(saved_chunks), list(wanted_chunks)
    if items is None:
        items = read_items(fqn, saved, wanted)
    items = list(items)
    s_ranks = list(range(len(saved))) if saved_ranks is None else [int(r) for r in saved_ranks]
    w_ranks = list(range(len(wanted))) if wanted_ranks is None else [int(r)
                                                                      for r in wanted_ranks]
    if len(s_ranks) != len(saved) or len(w_ranks) != len(wanted):
        raise InvalidArgumentError(
            f"{len(saved)} saved chunks with {len(s_ranks)} ranks, {len(wanted)} wanted chunks "
            f"with {len(w_ranks)} ranks")
    for it in items:
        if not (0 <= it.storage_index < len(saved) and 0 <= it.dest_index < len(wanted)):
            raise InvalidArgumentError(f"read item {it} refers to a chunk that is not listed")
    itemsize = _itemsize(dtype)
    read_nbytes = _read_nbytes(saved, items, itemsize)
    wanted_nbytes = sum(c.numel for c in wanted) * itemsize
    moved_nbytes = sum(it.numel for it in items) * itemsize
    amplification = read_nbytes / wanted_nbytes if wanted_nbytes else 0.0
    by_wanted = [0] * len(wanted)
    for it in items:
        by_wanted[it.dest_index] += saved[it.storage_index].numel * itemsize
    n_colors = max([*s_ranks, *w_ranks, 0]) + 1

    def label(what: str, k: int, c: Chunk, r: int) -> str:
        return (f"<b>{what} #{k}</b> · rank {r}<br>offsets {list(c.offsets)}<br>sizes "
                f"{list(c.sizes)}<br>{human_nbytes(c.numel * itemsize)}")

    saved_traces, saved_facts = _chunk_traces(
        size, saved, s_ranks, [label("saved", k, c, r) for k, (c, r) in
                               enumerate(zip(saved, s_ranks))], n_colors)
    wanted_traces, wanted_facts = _chunk_traces(
        size, wanted, w_ranks, [label("wanted", k, c, r) for k, (c, r) in
                                enumerate(zip(wanted, w_ranks))], n_colors, showscale=False)
    boxes = [Chunk(tuple(a + b for a, b in zip(saved[it.storage_index].offsets,
                                               it.storage_offsets)), it.lengths)
             for it in items]
    item_labels = [
        f"<b>read item #{k}</b><br>rank {w_ranks[it.dest_index]} (wanted #{it.dest_index}) "
        f"reads saved #{it.storage_index} (rank {s_ranks[it.storage_index]})<br>box offsets "
        f"{list(b.offsets)}, lengths {list(it.lengths)}<br>copies "
        f"{human_nbytes(it.numel * itemsize)}, loads the whole saved item: "
        f"{human_nbytes(saved[it.storage_index].numel * itemsize)}"
        for k, (it, b) in enumerate(zip(items, boxes))]
    item_traces, item_facts = _chunk_traces(size, boxes, [w_ranks[it.dest_index] for it in items],
                                            item_labels, n_colors, showscale=False)
    titles = (f"saved: {len(saved)} chunks", f"wanted: {len(wanted)} chunks",
              f"read items: {len(items)} (coloured by the loading rank)")
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=titles)
    for row, traces in enumerate((saved_traces, wanted_traces, item_traces), start=1):
        for t in traces:
            fig.add_trace(t, row=row, col=1)
        fig.update_yaxes(autorange="reversed", showgrid=False, zeroline=False,
                         showticklabels=len(size) >= 2, row=row, col=1)
    fig.update_xaxes(showgrid=False, zeroline=False)
    xt, yt = _axis_titles(size)
    fig.update_xaxes(title_text=xt, row=3, col=1)
    rows = saved_facts["grid"][0]
    for facts in (saved_facts, wanted_facts, item_facts):
        facts.pop("boxes")
    fig.update_layout(
        title=(f"{plain_text(fqn)}: read amplification {amplification:.2f}x<br><sup>"
               f"{len(saved)} saved → {len(wanted)} wanted chunks · {len(items)} read items · "
               f"{human_nbytes(read_nbytes)} read for {human_nbytes(wanted_nbytes)} wanted"
               "</sup>"),
        height=(520 if rows == 1 else 760), margin={"l": 70, "r": 20, "t": 100, "b": 50},
        meta={"kind": "reshard", "fqn": fqn, "size": list(size), "dtype": dtype,
              "saved": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "rank": r}
                        for c, r in zip(saved, s_ranks)],
              "wanted": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "rank": r}
                         for c, r in zip(wanted, w_ranks)],
              "read_items": len(items), "read_nbytes": read_nbytes,
              "wanted_nbytes": wanted_nbytes, "moved_nbytes": moved_nbytes,
              "amplification": amplification, "read_nbytes_by_wanted": by_wanted,
              "grid": saved_facts["grid"], "exact": saved_facts["exact"]
              and wanted_facts["exact"] and item_facts["exact"]})
    if yt:
        fig.update_yaxes(title_text=yt, row=2, col=1)
    return style_figure(fig)


def rank_bytes_figure(plan: GlobalPlan) -> go.Figure:
    """Payload bytes each rank writes after dedup, with the mean and the imbalance.

    Parameters
    ----------
    plan
        A :class:`~ckptlab.plan.GlobalPlan` (from :func:`~ckptlab.plan.global_plan` or a
        :class:`~ckptlab.plan.PlanCache`); 8 to a few thousand ranks.

    Returns
    -------
    plotly.graph_objects.Figure
        One bar per rank (the heaviest in red), a dashed line at the mean.
        ``fig.layout.meta`` holds ``world_size``, ``rank_nbytes``, ``nbytes`` (their sum),
        ``mean_nbytes``, ``max_nbytes``, ``max_rank``, ``imbalance`` (max / mean) and
        ``objects`` (pickled entries: their bytes are not known before pickling, and count 0).
    """
    if not isinstance(plan, GlobalPlan):
        raise InvalidArgumentError(f"expected a GlobalPlan, got {type(plan).__name__}")
    nbytes = [int(n) for n in plan.rank_nbytes]
    n = len(nbytes)
    total = sum(nbytes)
    mean = total / n if n else 0.0
    top = max(range(n), key=lambda r: (nbytes[r], -r)) if n else 0
    colors = [ACCENT] * n
    if n:
        colors[top] = "#e45756"
    many = n > 256
    fig = go.Figure(go.Bar(
        x=list(range(n)), y=nbytes, marker={"color": colors, "line": {"width": 0}},
        customdata=[human_nbytes(b) for b in nbytes],
        hovertemplate="rank %{x}<br>%{y:,} B (%{customdata})<extra></extra>"))
    fig.add_hline(y=mean, line={"dash": "dash", "color": "#3b3b3b", "width": 1},
                  annotation_text=f"mean {human_nbytes(mean)}", annotation_position="top left")
    fig.update_layout(
        title=(f"Bytes per rank after dedup · imbalance {plan.imbalance:.3f} (max / mean)<br>"
               f"<sup>{n} ranks · total {human_nbytes(total)} · max "
               f"{human_nbytes(nbytes[top] if n else 0)} (rank {top})</sup>"),
        xaxis={"title": "rank", "showgrid": False},
        yaxis={"title": "bytes", "rangemode": "tozero", "tickformat": "~s", "ticksuffix": "B"},
        bargap=0 if many else 0.15, height=360, margin={"l": 70, "r": 20, "t": 70, "b": 50},
        meta={"kind": "rank_bytes", "world_size": plan.world_size, "rank_nbytes": nbytes,
              "nbytes": total, "mean_nbytes": mean, "max_nbytes": nbytes[top] if n else 0,
              "max_rank": top, "imbalance": plan.imbalance, "objects": len(plan.objects)})
    return style_figure(fig)


def cache_timeline_figure(events: Sequence[CacheEvent]) -> go.Figure:
    """Every :class:`~ckptlab.plan.PlanCache` lookup on a time line, one row per namespace.

    Parameters
    ----------
    events
        ``PlanCache.events`` (any order; empty gives an empty figure).

    Returns
    -------
    plotly.graph_objects.Figure
        Per event a bar from its start (ms after the first lookup) as long as it took, and a
        marker at its start (a hit takes microseconds: the marker keeps it visible), both
        coloured by status (:data:`STATUS_COLORS`); the hover tells the ranks re-planned and
        the milliseconds. ``fig.layout.meta`` holds ``events`` (namespace, status,
        changed_ranks count, world_size, start_ms, ms; in time order), ``counts`` per status
        and ``namespaces`` (rows, in order of first appearance).
    """
    for e in events:
        if not isinstance(e, CacheEvent):
            raise InvalidArgumentError(f"expected PlanCache events, got {type(e).__name__}")
    events = sorted(events, key=lambda e: e.started_s)
    t0 = events[0].started_s if events else 0.0
    namespaces = list(dict.fromkeys(e.namespace for e in events))
    rows_shown = [plain_text(ns) for ns in namespaces]  # the y categories plotly draws
    rows = [{"namespace": e.namespace, "status": e.status, "changed_ranks": len(e.changed_ranks),
             "world_size": e.world_size, "start_ms": 1e3 * (e.started_s - t0),
             "ms": 1e3 * e.duration_s} for e in events]
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUS_COLORS}
    fig = go.Figure()
    for status, color in STATUS_COLORS.items():
        mine = [(i, r) for i, r in enumerate(rows) if r["status"] == status]
        if not mine:
            continue
        custom = [[i, r["changed_ranks"], r["world_size"], r["ms"]] for i, r in mine]
        hover = ("#%{customdata[0]} %{y} · " + status + "<br>%{customdata[1]} of "
                 "%{customdata[2]} ranks re-planned<br>%{customdata[3]:.3f} ms<extra></extra>")
        fig.add_trace(go.Bar(
            orientation="h", y=[plain_text(r["namespace"]) for _, r in mine],
            x=[r["ms"] for _, r in mine],
            base=[r["start_ms"] for _, r in mine], name=status, legendgroup=status,
            marker={"color": color, "line": {"width": 0}}, customdata=custom,
            hovertemplate=hover, width=0.5))
        fig.add_trace(go.Scatter(
            x=[r["start_ms"] for _, r in mine], y=[plain_text(r["namespace"]) for _, r in mine],
            mode="markers", name=status, legendgroup=status, showlegend=False,
            marker={"color": color, "symbol": _STATUS_SYMBOLS[status], "size": 9,
                    "line": {"color": "#ffffff", "width": 1}},
            customdata=custom, hovertemplate=hover))
    shown = " · ".join(f"{counts[s]} {s}" for s in STATUS_COLORS)
    fig.update_layout(
        title=f"PlanCache: {len(rows)} lookups · {shown}" if rows else "PlanCache: no lookups",
        xaxis={"title": "ms since the first lookup", "rangemode": "tozero"},
        yaxis={"title": "namespace", "type": "category", "categoryorder": "array",
               "categoryarray": rows_shown, "autorange": "reversed"},
        barmode="overlay", height=140 + 45 * max(len(namespaces), 1),
        margin={"l": 90, "r": 20, "t": 76, "b": 50},
        legend={"orientation": "h", "y": -0.35 if len(namespaces) < 3 else -0.2},
        meta={"kind": "cache_timeline", "events": rows, "counts": counts,
              "namespaces": namespaces})
    return style_figure(fig)
