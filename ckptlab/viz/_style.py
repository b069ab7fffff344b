"""One fixed colour and label per segment kind, shared by every figure, the hex view and the report;
the byte map's lanes; the one categorical palette; the figure theme (light, dark, or the
notebook's); and :func:`plain_text`, which every figure passes user-provided names through."""

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
    SegmentKind.FILE_HEADER,
    SegmentKind.HEADER_LENGTH,
    SegmentKind.HEADER,
    SegmentKind.HEADER_PADDING,
    SegmentKind.TENSOR_HEADER,
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
    SegmentKind.HEADER: "#9467bd",  # the metadata lane's colour: never the data green
    SegmentKind.HEADER_PADDING: "#ffbf79",
    SegmentKind.FILE_HEADER: "#bab0ac",
    SegmentKind.TENSOR_HEADER: "#17becf",
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
    SegmentKind.FILE_HEADER: "file header",
    SegmentKind.TENSOR_HEADER: "tensor header",
    SegmentKind.DATA: "data",
    SegmentKind.DESCRIPTOR: "descriptor",
    SegmentKind.CENTRAL_DIRECTORY: "central directory",
    SegmentKind.ZIP64_EOCD: "zip64 EOCD",
    SegmentKind.ZIP64_LOCATOR: "zip64 locator",
    SegmentKind.EOCD: "EOCD",
    SegmentKind.UNKNOWN: "unknown",
}

assert set(KIND_ORDER) == set(SegmentKind) == set(KIND_COLORS) == set(KIND_LABELS)

# -- the byte map's lanes -------------------------------------------------------------------------
# A lane is a segment kind, except that the bytes which describe the tensors (torch's data.pkl
# and the small records beside it, a safetensors JSON header, DCP's .metadata) get their own
# "metadata" lane instead of sharing the data lane (DATA) or a format-specific one (HEADER).
METADATA_LANE = "metadata"
LANE_ORDER: tuple[str, ...] = tuple(  # KIND_ORDER, HEADER's place taken by the metadata lane
    METADATA_LANE if kind is SegmentKind.HEADER else kind for kind in KIND_ORDER)
LANE_COLORS: dict[str, str] = {
    **{k: c for k, c in KIND_COLORS.items() if k is not SegmentKind.HEADER},
    METADATA_LANE: KIND_COLORS[SegmentKind.HEADER],
}
LANE_LABELS: dict[str, str] = {
    **{k: v for k, v in KIND_LABELS.items() if k is not SegmentKind.HEADER},
    METADATA_LANE: "metadata",
}
# what a lane's bytes are, in words a hover can say ("<words> of tensor w")
LANE_WORDS: dict[str, str] = {
    SegmentKind.LOCAL_HEADER: "zip local header",
    SegmentKind.NAME: "record name",
    SegmentKind.ZIP64_EXTRA: "zip64 extra field",
    SegmentKind.PADDING: "alignment padding (FB field)",
    SegmentKind.EXTRA: "other extra field",
    SegmentKind.HEADER_LENGTH: "header length",
    METADATA_LANE: "metadata",
    SegmentKind.HEADER_PADDING: "header padding",
    SegmentKind.FILE_HEADER: "tensorizer file header",
    SegmentKind.TENSOR_HEADER: "tensorizer tensor header",
    SegmentKind.DATA: "data",
    SegmentKind.DESCRIPTOR: "data descriptor",
    SegmentKind.CENTRAL_DIRECTORY: "central directory",
    SegmentKind.ZIP64_EOCD: "zip64 end record",
    SegmentKind.ZIP64_LOCATOR: "zip64 locator",
    SegmentKind.EOCD: "end of central directory",
    SegmentKind.UNKNOWN: "bytes no structure accounts for",
}
assert set(LANE_ORDER) == set(LANE_COLORS) == set(LANE_LABELS) == set(LANE_WORDS)
# KIND_COLORS and KIND_LABELS also answer for the metadata lane, so code that colours or names
# a byte map's lanes with them (``KIND_COLORS[kind] for kind in bytemap.lanes``) keeps working
KIND_COLORS[METADATA_LANE] = LANE_COLORS[METADATA_LANE]  # type: ignore[index]
KIND_LABELS[METADATA_LANE] = LANE_LABELS[METADATA_LANE]  # type: ignore[index]

# -- one categorical palette for files, storages, ranks, buckets ---------------------------------
PALETTE: tuple[str, ...] = ("#4c78a8", "#f58518", "#e45756", "#72b7b2", "#54a24b", "#eeca3b",
                            "#b279a2", "#ff9da6", "#9d755d", "#bab0ac")
NEUTRAL = "#bab0ac"  # "the rest": bytes besides tensors, idle time
ACCENT = "#4c78a8"  # a single series
SELECTION = "rgba(0, 0, 0, 0.9)"


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
    return (TABLE_CSS + f'<table class="{css_class}" style="border-collapse:collapse;'
            f'font-size:12px"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>')


# Cell padding and rules for every ckptlab table, wherever the HTML lands (a notebook output,
# the report, the served app): without it the columns run together. The colours come from
# JupyterLab's theme variables when there are any, so dark themes keep readable rules.
TABLE_CSS = ("<style>.ckptlab-table th,.ckptlab-table td,.ckptlab-tensors th,"
             ".ckptlab-tensors td{padding:2px 10px;border-bottom:1px solid "
             "var(--jp-border-color2,#e6e6e6);white-space:nowrap}"
             ".ckptlab-table th,.ckptlab-tensors th{text-align:left}"
             # a value (a config's JSON) wraps inside the page instead of widening it
             ".ckptlab-values td:last-child{white-space:normal;overflow-wrap:anywhere;"
             "word-break:break-word;min-width:20em}</style>")


# -- theme ----------------------------------------------------------------------------------------
# Figures draw on a transparent paper, so the notebook's own background shows through, with
# fonts, grid and "empty" cells in the colours of the theme the notebook uses.
THEMES: dict[str, dict[str, str]] = {
    "light": {"template": "plotly_white", "paper": "rgba(0,0,0,0)", "plot": "#ffffff",
              "font": "#2a2a2a", "muted": "#777777", "grid": "#e6e6e6", "empty": "#ffffff"},
    "dark": {"template": "plotly_dark", "paper": "rgba(0,0,0,0)", "plot": "#1a1a1a",
             "font": "#d8d8d8", "muted": "#9a9a9a", "grid": "#3a3a3a", "empty": "#1a1a1a"},
}
_JUPYTERLAB_THEME_SETTINGS = ("lab", "user-settings", "@jupyterlab", "apputils-extension",
                              "themes.jupyterlab-settings")


def resolve_theme(theme: str | None = None) -> str:
    """``"light"`` or ``"dark"``: ``theme`` when given, else the notebook's.

    ``None`` or ``"auto"`` looks at ``$CKPTLAB_THEME`` first, then at the theme JupyterLab
    saved in its user settings (``@jupyterlab/apputils-extension/themes.jupyterlab-settings``
    in JupyterLab's user-settings directory: ``$JUPYTERLAB_SETTINGS_DIR``, else
    ``lab/user-settings`` in Jupyter's config directory, ``$JUPYTER_CONFIG_DIR`` or
    ``~/.jupyter``, as JupyterLab itself looks it up): a theme whose name says "Dark" is
    dark. Anything else is light.

    Raises
    ------
    InvalidArgumentError
        ``theme`` is not one of ``"light"``, ``"dark"``, ``"auto"`` or None.
    """
    import os
    import re

    if theme is not None and theme not in ("light", "dark", "auto"):
        from ckptlab.errors import InvalidArgumentError

        raise InvalidArgumentError(
            f"theme must be 'light', 'dark', 'auto' or None, got {theme!r}")
    if theme in ("light", "dark"):
        return theme
    env = os.environ.get("CKPTLAB_THEME", "").strip().lower()
    if env in ("light", "dark"):
        return env
    path = os.path.join(_jupyterlab_settings_dir(), *_JUPYTERLAB_THEME_SETTINGS[2:])
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(65536)
    except OSError:
        return "light"
    # JSON with // comments (JupyterLab writes the setting's description above it): the key
    # counts where no comment starts before it on its line; `{"theme": ...}` on one line too
    match = re.search(r'^[^/\n]*"theme"\s*:\s*"([^"]*)"', text, re.MULTILINE)
    return "dark" if match and "dark" in match.group(1).lower() else "light"


def _jupyterlab_settings_dir() -> str:
    """JupyterLab's user-settings directory, found the way ``jupyterlab`` finds it."""
    import os

    explicit = os.environ.get("JUPYTERLAB_SETTINGS_DIR")
    if explicit:
        return explicit
    try:
        from jupyter_core.paths import jupyter_config_dir

        config = jupyter_config_dir()
    except ImportError:  # no Jupyter installed: its default place
        config = os.environ.get("JUPYTER_CONFIG_DIR") or os.path.join(
            os.path.expanduser("~"), ".jupyter")
    return os.path.join(config, "lab", "user-settings")


def theme_colors(theme: str | None = None) -> dict[str, str]:
    """The colours of ``theme`` (see :func:`resolve_theme`): template, paper, plot, font,
    muted, grid, empty."""
    return THEMES[resolve_theme(theme)]


TITLE_TOP_PX = 34  # the title starts below the plotly toolbar (about 30 px high)
MIN_TOP_MARGIN = 76  # room for the toolbar and one line of title above the plot area
TITLE_LINE_PX = 20  # one line of title (15 px font, plotly's line spacing)
# plotly draws a title of several lines (``<br>``) about 10 px higher than one of a single
# line at the same pad (measured in chromium: top at 20 px instead of 30.5 px for pad 34),
# which put a long two-line title under the toolbar: such a title gets this much more pad
MULTILINE_TITLE_SHIFT_PX = 12


def style_figure(fig: Any, *, theme: str | None = None) -> Any:
    """Give ``fig`` the house look, in place, and return it.

    Width follows the container (``autosize``, no fixed width); the title sits at the top
    left, below the toolbar, so the two never overlap (a title of several ``<br>`` lines a
    little lower, see ``MULTILINE_TITLE_SHIFT_PX``); the top margin leaves room for both;
    backgrounds, fonts and grid follow ``theme`` (the notebook's by default).
    """
    import re

    colors = theme_colors(theme)
    margin = fig.layout.margin
    top = margin.t if margin is not None and margin.t is not None else 0
    text = fig.layout.title.text if fig.layout.title is not None else None
    lines = len(re.split(r"<br\s*/?>", text, flags=re.IGNORECASE)) if text else 1
    pad_top = TITLE_TOP_PX + (MULTILINE_TITLE_SHIFT_PX if lines > 1 else 0)
    fig.update_layout(
        template=colors["template"], autosize=True, width=None,
        paper_bgcolor=colors["paper"], plot_bgcolor=colors["plot"],
        font={"color": colors["font"]},
        title={"x": 0, "xref": "container", "xanchor": "left", "y": 1, "yref": "container",
               "yanchor": "top", "pad": {"t": pad_top, "l": 12}, "font": {"size": 15},
               "automargin": False},
        modebar={"orientation": "h", "bgcolor": "rgba(0,0,0,0)", "color": colors["muted"],
                 "activecolor": colors["font"]},
        margin={"t": max(top, MIN_TOP_MARGIN, pad_top + lines * TITLE_LINE_PX + 6)},
    )
    fig.update_xaxes(gridcolor=colors["grid"], zerolinecolor=colors["grid"])
    fig.update_yaxes(gridcolor=colors["grid"], zerolinecolor=colors["grid"])
    return fig
