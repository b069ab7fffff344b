"""A hex dump whose bytes are coloured by what they are (the byte map's colours)."""

from __future__ import annotations

import bisect
import html
from itertools import groupby

from ckptlab.errors import InvalidArgumentError
from ckptlab.format.layout import ArchiveLayout, Segment
from ckptlab.viz._style import KIND_COLORS, KIND_LABELS, tint

INK = "#1a1a1a"  # the text colour of bytes drawn on their segment's tint, in any theme

__all__ = ["MAX_HEX_NBYTES", "hex_html"]

MAX_HEX_NBYTES = 64 * 1024  # a hex view is for reading, not for dumping a storage


def _segments_in(layout: ArchiveLayout, lo: int, hi: int) -> list[Segment]:
    starts = [s.offset for s in layout.segments]
    i = max(bisect.bisect_right(starts, lo) - 1, 0)
    out = []
    while i < len(layout.segments) and layout.segments[i].offset < hi:
        out.append(layout.segments[i])
        i += 1
    return out


def hex_html(data: bytes, offset: int, layout: ArchiveLayout | None = None, *,
             width: int = 16) -> str:
    """HTML for a hex dump of ``data`` (the file's bytes starting at ``offset``).

    Parameters
    ----------
    data
        The bytes to show (at most 64 KiB), e.g. from :func:`ckptlab.format.read_range`.
    offset
        File offset of ``data[0]``; shown in the left column.
    layout
        When given, each byte's background is its segment kind's colour and its tooltip names
        the kind and record.
    width
        Bytes per line.

    Returns
    -------
    str
        A ``<pre class="ckptlab-hex">`` block: offset, hex bytes, printable ASCII.
    """
    if len(data) > MAX_HEX_NBYTES:
        raise InvalidArgumentError(
            f"hex view of {len(data)} bytes asked; at most {MAX_HEX_NBYTES} are shown")
    if type(offset) is not int or offset < 0 or type(width) is not int or width < 1:
        raise InvalidArgumentError(
            f"offset must be a non-negative int and width positive, got {offset!r}, {width!r}")
    segs = _segments_in(layout, offset, offset + len(data)) if layout is not None else []

    seg_starts = [s.offset for s in segs]
    seg_styles = [(tint(KIND_COLORS[s.kind], 0.35),
                   KIND_LABELS[s.kind] + (f" of {s.record}" if s.record else "")) for s in segs]

    def style_at(pos: int) -> tuple[str, str]:
        i = bisect.bisect_right(seg_starts, pos) - 1
        return seg_styles[i] if i >= 0 and pos < segs[i].end_offset else ("", "")

    lines = []
    for line_start in range(0, len(data), width):
        chunk = data[line_start : line_start + width]
        cells = []
        runs = groupby(range(len(chunk)), key=lambda j: style_at(offset + line_start + j))
        for (bg, title), js in runs:
            run = " ".join(f"{chunk[j]:02x}" for j in js)
            # the digits keep dark ink on their pastel: a dark theme's light text would vanish
            cells.append(f'<span style="background:{bg};color:{INK}" '
                         f'title="{html.escape(title)}">{run}</span>' if bg else run)
        pad = "   " * (width - len(chunk))
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f'<span class="off">{offset + line_start:>12,}</span>  '
                     f"{' '.join(cells)}{pad}  {html.escape(text)}")
    # a line never wraps (a narrow pane, JupyterLab's pre-wrap outputs): the block scrolls
    return ('<pre class="ckptlab-hex" style="font-family:monospace;font-size:12px;'
            'line-height:1.35;margin:0;white-space:pre;overflow-x:auto;max-width:100%">'
            + "\n".join(lines) + "</pre>")
