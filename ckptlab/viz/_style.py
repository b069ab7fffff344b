"""One fixed colour and label per segment kind, shared by every figure, the hex view and the report;
and :func:`plain_text`, which every figure passes user-provided names through."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from ckptlab.format.layout import SegmentKind

# Lanes top to bottom follow the order the kinds appear in a file.
KIND_ORDER: tuple[SegmentKind, ...] = (
    SegmentKind.LOCAL_HEADER,
    SegmentKind.NAME,
    SegmentKind.ZIP64_EXTRA,
    SegmentKind.PADDING,
    SegmentKind.EXTRA,
    SegmentKind.HEADER_LENGTH,
    SegmentKind.HEADER,
    SegmentKind.HEADER_PADDING,
    SegmentKind.DATA,
    SegmentKind.DESCRIPTOR,
    SegmentKind.CENTRAL_DIRECTORY,
    SegmentKind.ZIP64_EOCD,
    SegmentKind.ZIP64_LOCATOR,
    SegmentKind.EOCD,
    SegmentKind.UNKNOWN,
)

KIND_COLORS: dict[SegmentKind, str] = {
    SegmentKind.LOCAL_HEADER: "#4c78a8",
    SegmentKind.NAME: "#72b7b2",
    SegmentKind.ZIP64_EXTRA: "#b279a2",
    SegmentKind.PADDING: "#f58518",
    SegmentKind.EXTRA: "#9d755d",
    SegmentKind.HEADER_LENGTH: "#eeca3b",
    SegmentKind.HEADER: "#8cd17d",
    SegmentKind.HEADER_PADDING: "#ffbf79",
    SegmentKind.DATA: "#54a24b",
    SegmentKind.DESCRIPTOR: "#e45756",
    SegmentKind.CENTRAL_DIRECTORY: "#79706e",
    SegmentKind.ZIP64_EOCD: "#d67195",
    SegmentKind.ZIP64_LOCATOR: "#ff9da6",
    SegmentKind.EOCD: "#3b3b3b",
    SegmentKind.UNKNOWN: "#ff00ff",
}

KIND_LABELS: dict[SegmentKind, str] = {
    SegmentKind.LOCAL_HEADER: "local header",
    SegmentKind.NAME: "name",
    SegmentKind.ZIP64_EXTRA: "zip64 extra",
    SegmentKind.PADDING: "FB padding",
    SegmentKind.EXTRA: "other extra",
    SegmentKind.HEADER_LENGTH: "header length",
    SegmentKind.HEADER: "JSON header",
    SegmentKind.HEADER_PADDING: "header padding",
    SegmentKind.DATA: "data",
    SegmentKind.DESCRIPTOR: "descriptor",
    SegmentKind.CENTRAL_DIRECTORY: "central directory",
    SegmentKind.ZIP64_EOCD: "zip64 EOCD",
    SegmentKind.ZIP64_LOCATOR: "zip64 locator",
    SegmentKind.EOCD: "EOCD",
    SegmentKind.UNKNOWN: "unknown",
}

assert set(KIND_ORDER) == set(SegmentKind) == set(KIND_COLORS) == set(KIND_LABELS)


def plain_text(name: object) -> str:
    """``name`` as text that plotly shows literally: ``&``, ``<`` and ``>`` escaped.

    Plotly reads a subset of HTML in every piece of text it draws (trace text and hover text,
    hover templates' substitutions, category and tick labels, legend entries, annotations,
    titles): a tensor named ``<b>x</b>`` would show bold and ``<a href="...">y</a>`` as a live
    link. Every name that comes from a checkpoint, a path or a caller goes through this
    function before it reaches a figure; the figures' ``layout.meta`` keeps the names as they
    are (data, not text to draw).

    Notes
    -----
    Quotes stay as they are: plotly decodes numeric entities and a few named ones (``&lt;``,
    ``&gt;``, ``&amp;``, ...) but not ``&quot;``, which would show as typed; without ``<`` no
    tag can open, so no quote can matter.
    """
    return html.escape(str(name), quote=False)


def tint(color: str, amount: float) -> str:
    """``color`` mixed with white: ``amount`` 1 is the colour, 0 is white."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    mix = [round(255 - (255 - c) * amount) for c in (r, g, b)]
    return "#{:02x}{:02x}{:02x}".format(*mix)


def human_nbytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``; exact below 1 KiB."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def html_table(header: Sequence[str], rows: Sequence[Sequence[Any]], *,
               css_class: str = "ckptlab-table") -> str:
    """A plain HTML table, every cell escaped; numbers right-aligned with thousands separators."""
    def cell(v: Any) -> str:
        if isinstance(v, int) and not isinstance(v, bool):
            return f'<td style="text-align:right">{v:,}</td>'
        return f"<td>{html.escape(str(v))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
    return (f'<table class="{css_class}" style="border-collapse:collapse;font-size:12px">'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
