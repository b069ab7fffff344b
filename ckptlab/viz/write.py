"""Async writing views: a save's timeline as a Gantt chart, and a bucket assignment as bars."""

from __future__ import annotations

import zlib
from typing import Any

import plotly.graph_objects as go

from ckptlab.errors import InvalidArgumentError
from ckptlab.viz._style import PALETTE, human_nbytes, plain_text, style_figure
from ckptlab.write.buckets import (
    BucketAssignment,
    item_is_tensor,
    item_key,
    item_nbytes,
)
from ckptlab.write.timeline import PHASES, Timeline

__all__ = ["ITEM_COLORS", "PHASE_COLORS", "bucket_figure", "timeline_figure"]

# one colour per save phase: copies orange, disk writes blue, fsync red, the commit green
PHASE_COLORS: dict[str, str] = {
    "reserve": "#79706e",
    "plan": "#bab0ac",
    "stage": "#f58518",
    "open": "#72b7b2",
    "write": "#4c78a8",
    "fsync": "#e45756",
    "close": "#9d755d",
    "metadata": "#b279a2",
    "wait_ranks": "#eeca3b",
    "commit": "#54a24b",
}
_OTHER_PHASE_COLOR = "#ff00ff"
assert set(PHASE_COLORS) == set(PHASES)

# items are coloured by a hash of their key: the same item keeps its colour when the buckets
# change, and neighbours in a stack rarely share one
ITEM_COLORS: tuple[str, ...] = PALETTE  # the one palette of ckptlab.viz._style
MAX_BUCKET_LABELS = 12  # buckets whose totals are written above their bars
SAVE_ROW = "save"  # the timeline row of save-wide events (bucket None)
_GROUP_PATTERNS = ("", "/")  # group 1 (the separation hint's buckets) is hatched


def _row(bucket: int | None) -> str:
    return SAVE_ROW if bucket is None else f"bucket {bucket}"


def _gbps(nbytes: int, seconds: float) -> float | None:
    """Decimal GB per second (as disks and ``transfer_figure`` count), None for no time."""
    return nbytes / seconds / 1e9 if seconds > 0 else None


def timeline_figure(timeline: Timeline) -> go.Figure:
    """One save as a Gantt chart: a row per bucket (one data file each) and a ``save`` row.

    Parameters
    ----------
    timeline
        What :meth:`ckptlab.write.AsyncWriter.wait` (or ``SaveHandle.timeline``) returned.

    Returns
    -------
    plotly.graph_objects.Figure
        One horizontal bar trace per phase (in :data:`~ckptlab.write.PHASES` order, only the
        phases that occur), one bar per event: ``base`` is its start and ``x`` its duration,
        both in **milliseconds** since the save started; the ``save`` row (top) holds the
        save-wide events (plan, metadata, commit, ...). Hovering a bar shows its bytes, its
        file and, for writes, its GB/s. Dashed vertical lines (shapes named ``returned`` and
        ``finished``) mark when ``dcp.save`` handed control back to the caller and when the
        last event ended. ``fig.layout.meta`` holds the rows, per-phase totals (events,
        seconds summed over buckets, bytes), the two marks in seconds, the bytes written,
        ``gbps`` (bytes written over the whole save, planning and copies included),
        ``write_gbps`` (over ``write_span_s``: the first write's start to the last write's
        or fsync's end) and, per bucket, its bytes, write seconds, GB/s and I/O path.

    Raises
    ------
    InvalidArgumentError
        If ``timeline`` is not a :class:`~ckptlab.write.Timeline`.

    Examples
    --------
    >>> fig = timeline_figure(writer.wait())                            # doctest: +SKIP
    >>> fig.layout.meta["phases"]["write"]["nbytes"] == writer.last.timeline.nbytes  # doctest: +SKIP
    True
    """
    if not isinstance(timeline, Timeline):
        raise InvalidArgumentError(
            f"timeline_figure needs a ckptlab.write.Timeline, got {type(timeline).__name__}")
    buckets = [b.index for b in timeline.assignment.buckets]
    seen = {e.bucket for e in timeline.events if e.bucket is not None}
    buckets += sorted(seen - set(buckets))
    rows = [SAVE_ROW] + [_row(b) for b in buckets]
    io_paths = {b: p for b, _, _, p in timeline.files}
    order = list(PHASES) + sorted({e.phase for e in timeline.events} - set(PHASES))

    fig = go.Figure()
    phases: dict[str, dict[str, Any]] = {}
    for phase in order:
        events = [e for e in timeline.events if e.phase == phase]
        if not events:
            continue
        phases[phase] = {"events": len(events), "seconds": sum(e.duration_s for e in events),
                         "nbytes": sum(e.nbytes for e in events)}
        hover = []
        for e in events:
            lines = [f"<b>{plain_text(phase)}</b> · {_row(e.bucket)}",
                     f"{1e3 * e.start_s:.3f} → {1e3 * e.end_s:.3f} ms "
                     f"({1e3 * e.duration_s:.3f} ms)"]
            if e.nbytes:
                lines.append(f"{human_nbytes(e.nbytes)} ({e.nbytes:,} B)")
            rate = _gbps(e.nbytes, e.duration_s)
            if phase in ("write", "stage") and rate is not None:
                lines.append(f"{rate:.2f} GB/s")
            if e.file:
                path = io_paths.get(e.bucket) if e.bucket is not None else None
                lines.append(plain_text(e.file) + (f" ({plain_text(path)})" if path else ""))
            hover.append("<br>".join(lines))
        fig.add_trace(go.Bar(
            name=plain_text(phase), orientation="h", y=[_row(e.bucket) for e in events],
            base=[1e3 * e.start_s for e in events], x=[1e3 * e.duration_s for e in events],
            marker={"color": PHASE_COLORS.get(phase, _OTHER_PHASE_COLOR), "line": {"width": 0}},
            customdata=[[e.bucket, e.nbytes, e.file] for e in events],
            hovertext=hover, hovertemplate="%{hovertext}<extra></extra>"))

    shapes: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for name, label, at, color in (("returned", "returned to caller", timeline.returned_s,
                                    "#000000"),
                                   ("finished", "finished", timeline.finished_s, "#54a24b")):
        if at is None:
            continue
        shapes.append({"type": "line", "name": name, "xref": "x", "yref": "paper",
                       "x0": 1e3 * at, "x1": 1e3 * at, "y0": 0, "y1": 1,
                       "line": {"color": color, "dash": "dash", "width": 2}})
        annotations.append({"x": 1e3 * at, "y": 1, "xref": "x", "yref": "paper",
                            "text": f"{label} {1e3 * at:.1f} ms", "showarrow": False,
                            "xanchor": "right", "yanchor": "bottom",
                            "yshift": 0 if name == "returned" else 14,  # never on top of each other
                            "font": {"size": 11, "color": color}})

    nbytes = timeline.nbytes
    per_bucket = []
    for b in buckets:
        writes = [e for e in timeline.bucket_events(b) if e.phase == "write"]
        written = sum(e.nbytes for e in writes)
        files = {e.file for e in timeline.bucket_events(b) if e.file}
        per_bucket.append({"bucket": b, "file": next(iter(files), ""), "nbytes": written,
                           "write_s": sum(e.duration_s for e in writes),
                           "gbps": _gbps(written, sum(e.duration_s for e in writes)),
                           "io_path": io_paths.get(b)})
    save_gbps = _gbps(nbytes, timeline.finished_s or 0.0)
    # the disk's share: from the first write to the last write or fsync (durable), all buckets
    disk = [e for e in timeline.events if e.phase in ("write", "fsync") and e.bucket is not None]
    first_write = min((e.start_s for e in disk if e.phase == "write"), default=None)
    write_span_s = (max(e.end_s for e in disk) - first_write) if first_write is not None else 0.0
    write_gbps = _gbps(nbytes, write_span_s)
    if timeline.error is not None:
        outcome = "failed"
    elif timeline.committed:
        outcome = "committed"
    elif timeline.finished_s is None:
        outcome = "in flight"
    else:
        outcome = "written"
    n_files = len(timeline.files)
    title = (f"Save timeline · {human_nbytes(nbytes)} written to {n_files} "
             f"file{'s' if n_files != 1 else ''}<br>")  # two lines: never clipped
    if timeline.returned_s is not None:
        title += f"returned after {1e3 * timeline.returned_s:.1f} ms"
    if timeline.finished_s is not None:
        title += f" · finished after {1e3 * timeline.finished_s:.1f} ms"
    if write_gbps is not None:
        title += f" · written at {write_gbps:.2f} GB/s"
    title += f" · {outcome}"
    title = title.replace("<br> · ", "<br>")
    fig.update_layout(
        title={"text": title, "font": {"size": 14}}, barmode="overlay",
        xaxis={"title": "milliseconds since the save started", "rangemode": "tozero",
               "showgrid": True, "gridcolor": "#eeeeee"},
        yaxis={"type": "category", "categoryorder": "array", "categoryarray": rows,
               "range": [len(rows) - 0.5, -0.5]},  # the save row on top, then bucket 0, 1, ...
        shapes=shapes, annotations=annotations, bargap=0.3,
        legend={"title": {"text": "phase"}, "traceorder": "normal"},
        height=max(380, 160 + 34 * len(rows)), margin={"l": 80, "r": 20, "t": 118, "b": 50},
        meta={"kind": "timeline", "unit": "ms", "rows": rows, "phases": phases,
              "returned_s": timeline.returned_s, "finished_s": timeline.finished_s,
              "nbytes": nbytes, "gbps": save_gbps, "write_span_s": write_span_s,
              "write_gbps": write_gbps, "buckets": per_bucket,
              "committed": timeline.committed, "error": timeline.error, "outcome": outcome},
    )
    return style_figure(fig)


def _item_color(key: str) -> str:
    return ITEM_COLORS[zlib.crc32(key.encode()) % len(ITEM_COLORS)]


def bucket_figure(assignment: BucketAssignment) -> go.Figure:
    """Bytes per bucket, each bar stacked by the tensor items in it, against the ideal share.

    Parameters
    ----------
    assignment
        What :func:`ckptlab.write.assign_buckets` returned.

    Returns
    -------
    plotly.graph_objects.Figure
        Always three traces, so a widget can update them in place: ``data[0]`` and
        ``data[1]`` are the tensor items of group 0 and of group 1 (the buckets of the
        separation hint: hatched; empty without one), one bar segment per item with
        ``x`` its bucket, ``base`` the bytes below it and ``y`` its chunk bytes, coloured by
        a hash of the item's key (hover: key and bytes); ``data[2]`` labels each bucket's
        total. Bytes items (pickled objects, size unknown before they are resolved) have no
        segment; they are counted in the bucket's hover and in the meta. A dashed line per
        group (shapes named ``ideal 0`` / ``ideal 1``) marks the ideal (even) share:
        the group's bytes divided by its buckets. The title and ``fig.layout.meta`` give
        the imbalance (fullest bucket over its group's ideal), the bytes per bucket, the
        groups and the largest item. With two groups, a dotted line (shape ``even``) marks
        all bytes over all buckets, and ``overall_imbalance`` (the fullest bucket over that)
        says what the split into groups costs: the save waits for the fullest bucket.

    Raises
    ------
    InvalidArgumentError
        If ``assignment`` is not a :class:`~ckptlab.write.BucketAssignment`.

    Examples
    --------
    >>> from ckptlab.write import SizedItem, assign_buckets
    >>> a = assign_buckets([SizedItem("a", 6), SizedItem("b", 4), SizedItem("c", 3)], 2)
    >>> fig = bucket_figure(a)
    >>> fig.layout.meta["bucket_nbytes"], round(fig.layout.meta["imbalance"], 3)
    ([6, 7], 1.077)
    """
    if not isinstance(assignment, BucketAssignment):
        raise InvalidArgumentError(
            "bucket_figure needs a ckptlab.write.BucketAssignment (from assign_buckets), "
            f"got {type(assignment).__name__}")
    hint = assignment.separation_hint
    fig = go.Figure()
    largest: dict[str, Any] = {"key": None, "nbytes": 0}
    n_items = n_byte_items = 0
    for group in (0, 1):
        x, y, base, colors, hover = [], [], [], [], []
        for b in assignment.group_buckets(group):
            below = 0
            for item in b.items:
                n_items += 1
                nbytes = item_nbytes(item)
                key = item_key(item)
                if not item_is_tensor(item):
                    n_byte_items += 1
                if nbytes == 0:
                    continue
                if nbytes > largest["nbytes"]:
                    largest = {"key": key, "nbytes": nbytes}
                x.append(b.index)
                y.append(nbytes)
                base.append(below)
                colors.append(_item_color(key))
                hover.append(f"<b>{plain_text(key)}</b><br>{human_nbytes(nbytes)} "
                             f"({nbytes:,} B)<br>bucket {b.index}, group {group}")
                below += nbytes
        label = "items" if group == 0 else f"items matching {plain_text(repr(hint))} (group 1)"
        fig.add_trace(go.Bar(
            name=label, x=x, y=y, base=base, hovertext=hover,
            hovertemplate="%{hovertext}<extra></extra>", showlegend=group == 1 and bool(x),
            marker={"color": colors, "line": {"width": 0.5, "color": "#ffffff"},
                    "pattern": {"shape": _GROUP_PATTERNS[group], "fillmode": "overlay",
                                "fgcolor": "#ffffff", "size": 6}},
            width=0.8))

    groups = []
    for group in sorted({b.group for b in assignment.buckets}):
        members = assignment.group_buckets(group)
        ideal = assignment.ideal_nbytes(group)
        fullest = max(b.nbytes for b in members)
        groups.append({"group": group, "buckets": [b.index for b in members],
                       "nbytes": sum(b.nbytes for b in members), "ideal_nbytes": ideal,
                       "fullest_nbytes": fullest,
                       "imbalance": fullest / ideal if ideal > 0 else 1.0})
    ideal_of = {g["group"]: g["ideal_nbytes"] for g in groups}
    totals_hover = []
    for b in assignment.buckets:
        objects = sum(1 for i in b.items if not item_is_tensor(i))
        empty = sum(1 for i in b.items if item_is_tensor(i) and item_nbytes(i) == 0)
        share = b.nbytes / ideal_of[b.group] if ideal_of[b.group] > 0 else 1.0
        totals_hover.append(
            f"<b>bucket {b.index}</b> (group {b.group})<br>{human_nbytes(b.nbytes)} "
            f"({b.nbytes:,} B), {share:.3f} × ideal<br>{len(b.items) - objects} tensor items"
            + (f" ({empty} empty)" if empty else "") + f", {objects} bytes items")
    # a total above each bar, while they fit side by side (about 60 px a label on a plot of
    # 700 px or more); with more buckets the labels would run together ("5.0 GiB5.0 GiB"),
    # so the totals stay in the hover text only
    labelled = len(assignment.buckets) <= MAX_BUCKET_LABELS
    # a label never on its group's dashed ideal line: above a bar that reaches the line,
    # just inside the top of one below it
    below = [b.nbytes < ideal_of[b.group] for b in assignment.buckets]
    fig.add_trace(go.Scatter(
        name="bucket total", x=[b.index for b in assignment.buckets],
        y=[b.nbytes for b in assignment.buckets], mode="text" if labelled else "markers",
        text=[human_nbytes(b.nbytes) for b in assignment.buckets] if labelled else None,
        textposition=["bottom center" if low else "top center" for low in below],
        cliponaxis=False,
        marker={"size": 1, "opacity": 0}, textfont={"size": 10}, hovertext=totals_hover,
        hovertemplate="%{hovertext}<extra></extra>", showlegend=False))

    shapes: list[dict[str, Any]] = []
    for g in groups:
        lo, hi = min(g["buckets"]) - 0.45, max(g["buckets"]) + 0.45
        shapes.append({"type": "line", "name": f"ideal {g['group']}", "xref": "x", "yref": "y",
                       "x0": lo, "x1": hi, "y0": g["ideal_nbytes"], "y1": g["ideal_nbytes"],
                       "line": {"color": "#000000", "dash": "dash", "width": 2}})
        # the line's words go in the legend: on the plot they ran into the bars' labels
        words = f"ideal {human_nbytes(g['ideal_nbytes'])}" + (
            f" (buckets {min(g['buckets'])}..{max(g['buckets'])})" if len(groups) > 1 else "")
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", hoverinfo="skip",
                                 name=words, showlegend=True,
                                 line={"color": "#000000", "dash": "dash", "width": 2}))
    n = len(assignment.buckets)
    imbalance = assignment.imbalance
    even = assignment.nbytes / n
    fullest = max(assignment.bucket_nbytes)
    overall = fullest / even if even > 0 else 1.0
    title = (f"{n} bucket{'s' if n != 1 else ''} · {human_nbytes(assignment.nbytes)} of tensors "
             f"· imbalance {imbalance:.3f} (fullest / ideal)")
    if len(groups) > 1:
        # each group is judged against its own ideal; the save waits for the fullest bucket
        # of all, so also show an even split of all bytes over all buckets
        shapes.append({"type": "line", "name": "even", "xref": "x", "yref": "y",
                       "x0": -0.45, "x1": n - 0.55, "y0": even, "y1": even,
                       "line": {"color": "#79706e", "dash": "dot", "width": 1.5}})
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", hoverinfo="skip",
                                 name=f"all bytes / {n}: {human_nbytes(even)}",
                                 showlegend=True,
                                 line={"color": "#79706e", "dash": "dot", "width": 1.5}))
        title += (f" · {plain_text(repr(hint))} items in buckets "
                  f"{min(groups[1]['buckets'])}..{n - 1} (hatched) · fullest {overall:.2f}× "
                  f"all bytes / {n}")
    ticktext = [f"{b.index}" + ("*" if b.group == 1 else "") for b in assignment.buckets]
    fig.update_layout(
        title={"text": title, "font": {"size": 14}}, barmode="overlay",
        xaxis={"title": "bucket (one data file, one worker job; * = separation hint's group)",
               "tickmode": "array", "tickvals": [b.index for b in assignment.buckets],
               "ticktext": ticktext, "range": [-0.6, max(n, 1) - 0.4]},
        yaxis={"title": "bytes", "rangemode": "tozero", "gridcolor": "#eeeeee",
               "exponentformat": "SI"},  # k, M, G (plotly's default "B" reads as bytes)
        shapes=shapes, height=380,
        legend={"orientation": "h", "y": -0.25}, margin={"l": 70, "r": 20, "t": 80, "b": 80},
        meta={"kind": "buckets", "n_buckets": n, "separation_hint": hint,
              "bucket_nbytes": list(assignment.bucket_nbytes),
              "bucket_groups": [b.group for b in assignment.buckets],
              "nbytes": assignment.nbytes, "imbalance": imbalance, "even_nbytes": even,
              "overall_imbalance": overall, "groups": groups,
              "items": n_items, "byte_items": n_byte_items, "largest": largest},
    )
    return style_figure(fig)
