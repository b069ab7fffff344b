"""What storage alignment costs: padding and 4 KiB readiness across alignments."""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go

from ckptlab.errors import InvalidArgumentError
from ckptlab.format.layout import SegmentKind
from ckptlab.format.predict import AlignmentCost
from ckptlab.viz._style import ACCENT, KIND_COLORS, human_nbytes, style_figure

__all__ = ["alignment_figure"]


def alignment_figure(costs: Sequence[AlignmentCost], *, current: int | None = None) -> go.Figure:
    """Padding bytes and overhead share for each alignment, from :func:`ckptlab.format.alignment_costs`.

    Parameters
    ----------
    costs
        Rows from :func:`ckptlab.format.alignment_costs` (one checkpoint at several alignments).
    current
        An alignment to highlight (the file's own, or the one a control selects).

    Returns
    -------
    plotly.graph_objects.Figure
        Bars: FB padding bytes per alignment (log scale). Line (right axis): overhead as a
        percentage of the file. Bars are green where every storage starts on a 4096-byte
        boundary (ready for O_DIRECT / GPUDirect Storage reads), orange elsewhere.
        ``fig.layout.meta`` holds the alignments and which are 4 KiB ready.
    """
    rows = list(costs)
    if not rows or not all(isinstance(r, AlignmentCost) for r in rows):
        raise InvalidArgumentError(
            "alignment_figure needs the rows of ckptlab.format.alignment_costs(...)")
    labels = [str(r.alignment) for r in rows]
    ready = [r.storages > 0 and r.storages_4k_aligned == r.storages for r in rows]
    colors = [KIND_COLORS[SegmentKind.DATA] if ok else KIND_COLORS[SegmentKind.PADDING]
              for ok in ready]
    line = [dict(width=3, color="#000000") if r.alignment == current else dict(width=0)
            for r in rows]
    fig = go.Figure()
    fig.add_trace(go.Bar(
        x=labels, y=[max(r.padding_nbytes, 0) for r in rows], name="FB padding (bytes)",
        marker={"color": colors, "line": {"width": [d["width"] for d in line],
                                          "color": "#000000"}},
        customdata=[[r.file_nbytes, r.storages_4k_aligned, r.storages] for r in rows],
        hovertemplate=("alignment %{x}<br>padding %{y:,} B<br>file %{customdata[0]:,} B<br>"
                       "%{customdata[1]} of %{customdata[2]} storages 4 KiB aligned"
                       "<extra></extra>")))
    fig.add_trace(go.Scatter(
        x=labels, y=[100 * r.overhead_fraction for r in rows], name="overhead (% of file)",
        yaxis="y2", mode="lines+markers", line={"color": ACCENT},
        hovertemplate="alignment %{x}<br>overhead %{y:.2f}% of the file<extra></extra>"))
    base = rows[0]
    top = max(100 * r.overhead_fraction for r in rows) * 1.1 or 1.0
    step = _nice_step(top / 5)
    fig.update_layout(
        title=(f"Alignment cost · {base.storages} storages, "
               f"{human_nbytes(base.data_nbytes)} of payload"),
        xaxis={"title": "storage alignment (bytes)", "type": "category"},
        yaxis={"title": "FB padding (bytes)", "type": "log"},
        # ticks at round percentages from 0 (plotly's own over a log primary axis read
        # 7, 24.9, 42.9)
        yaxis2={"title": "overhead (% of file)", "overlaying": "y", "side": "right",
                "range": [0, top], "tick0": 0, "dtick": step, "ticksuffix": "%",
                "showgrid": False},
        legend={"orientation": "h", "y": -0.25}, height=380, bargap=0.25,
        margin={"l": 70, "r": 70, "t": 76, "b": 90},
        meta={"kind": "alignment", "alignments": [r.alignment for r in rows],
              "ready_4k": ready, "current": current},
    )
    return style_figure(fig)


def _nice_step(raw: float) -> float:
    """The round step (1, 2 or 5 times a power of ten) at or above ``raw``."""
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
