"""A self-contained offline HTML report of one checkpoint (``ckptlab report``)."""

from __future__ import annotations

import html
from datetime import UTC, datetime

import plotly.graph_objects as go
import plotly.io as pio

from ckptlab.format import ArchiveLayout, alignment_costs
from ckptlab.viz._style import KIND_COLORS, KIND_LABELS, html_table, human_nbytes
from ckptlab.viz.alignment import alignment_figure
from ckptlab.viz.bytemap import ByteMap, bytemap_figure, overhead_figure
from ckptlab.viz.hexview import hex_html
from ckptlab.viz.tensors import storage_figure

__all__ = ["report_html"]

MAX_TABLE_ROWS = 500

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1280px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; }
th, td { padding: 2px 8px; border-bottom: 1px solid #eee; }
.legend span { display: inline-block; padding: 1px 6px; margin: 2px; border-radius: 3px;
               font-size: 12px; color: #fff; }
.note { color: #666; font-size: 12px; }
"""


def _more(total: int) -> str:
    return (f'<p class="note">First {MAX_TABLE_ROWS} of {total:,} rows; '
            "<code>ckptlab inspect --json</code> has them all.</p>"
            if total > MAX_TABLE_ROWS else "")


def report_html(layout: ArchiveLayout, *, hex_bytes: bytes | None = None) -> str:
    """One HTML document with the figures, tables and plotly.js inline (works offline).

    Parameters
    ----------
    layout
        The checkpoint's layout.
    hex_bytes
        The file's first bytes, for a coloured hex view of the first record (optional).

    Returns
    -------
    str
        The document. Its figures are the same builders the widgets use; plotly.js is
        embedded once, so the file opens with no network access.
    """
    bm = ByteMap.from_layout(layout)
    figures: list[tuple[str, go.Figure]] = [("Byte map", bytemap_figure(bm)),
                                            ("Overhead", overhead_figure(bm))]
    if layout.format == "torch-zip":
        figures.append(("Alignment cost", alignment_figure(alignment_costs(layout),
                                                           current=layout.storage_alignment)))
    if layout.tensors:
        figures.append(("Tensors → storages → bytes", storage_figure(layout)))
    parts = []
    for i, (title, fig) in enumerate(figures):
        div = pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False,
                          div_id=f"ckptlab-fig-{i}", config={"displaylogo": False})
        parts.append(f'<h2>{html.escape(title)}</h2><div class="ckptlab-figure">{div}</div>')
    legend = "".join(f'<span style="background:{KIND_COLORS[k]}">{KIND_LABELS[k]}</span>'
                     for k in bm.lanes)
    records = [[r.short_name, r.header_offset, r.data_offset, r.data_nbytes, r.padding_nbytes,
                r.zip64_extra_nbytes, r.descriptor_nbytes, f"{r.crc32:#010x}"]
               for r in layout.records]
    tensors = [[".".join(map(str, t.path)), t.dtype, str(list(t.shape)), t.storage_key,
                t.storage_offset] for t in layout.tensors]
    name = html.escape(layout.path.rsplit("/", 1)[-1])
    pct = 100 * layout.overhead_nbytes / max(layout.file_nbytes, 1)
    facts = [["format", layout.format], ["file", layout.path], ["size", layout.file_nbytes],
             ["records", len(layout.records)], ["storages", len(layout.storages)],
             ["tensors", len(layout.tensors)], ["alignment (largest dividing every storage)",
                                                layout.alignment],
             ["storage_alignment record", layout.storage_alignment or "—"],
             ["zip64", layout.zip64], ["overhead", f"{layout.overhead_nbytes:,} B ({pct:.3f}%)"],
             ["FB padding", layout.padding_nbytes]]
    hexview = ""
    if hex_bytes:
        hexview = ("<h2>First bytes</h2>" + hex_html(hex_bytes[:1024], 0, layout))
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>ckptlab report · {name}</title>
<style>{_CSS}</style></head>
<body class="ckptlab-report">
<h1>ckptlab report · {name}</h1>
<p class="note">{human_nbytes(layout.file_nbytes)} · generated {stamp} · self-contained: no
network access needed.</p>
{html_table(["", ""], facts)}
<div class="legend">{legend}</div>
{"".join(parts)}
<h2>Records</h2>
{html_table(["record", "header", "data offset", "data bytes", "FB padding", "zip64 extra",
         "descriptor", "crc32"], records[:MAX_TABLE_ROWS])}{_more(len(records))}
<h2>Tensors</h2>
{html_table(["tensor", "dtype", "shape", "storage", "storage_offset"],
        tensors[:MAX_TABLE_ROWS])}{_more(len(tensors))}
{hexview}
</body></html>
"""
