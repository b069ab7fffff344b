"""Names are shown as typed, never as markup, in every figure.

Plotly reads a subset of HTML in the text it draws: a tensor named ``<b>x</b>`` would show
bold, one named ``<a href="http://e">y</a>`` as a live link. Each figure builder (and the
widgets that set labels) passes names through :func:`ckptlab.viz._style.plain_text`. These
tests build every figure from objects named with markup and walk the figure's JSON: no text
plotly draws may hold the markup raw, and the escaped names must be there (so the check is not
vacuous). ``layout.meta`` keeps the names as they are: it is data, never drawn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import ckptlab as cl
from ckptlab.plan import Chunk, WriteItem, global_plan, local_plan
from ckptlab.plan.cache import CacheEvent
from ckptlab.viz import (
    ByteMap,
    alignment_figure,
    blockmap_figure,
    bucket_figure,
    bytemap_figure,
    cache_timeline_figure,
    overhead_figure,
    rank_bytes_figure,
    report_html,
    reshard_figure,
    shard_map_figure,
    storage_figure,
    timeline_figure,
    transfer_figure,
)
from ckptlab.viz._style import plain_text
from ckptlab.write import SizedItem, Timeline, TimelineEvent, assign_buckets

BOLD = "<b>x</b>"
LINK = '<a href="http://e">y</a>'
NAMES = (BOLD, LINK)
ARCHIVE = '<b>x<a href="e">'  # markup a file name (so an archive name) can hold: no "/"
# the names' own tags, which must never reach plotly raw (the builders' markup, such as
# "<b>%{y}</b>" in a hover template, is theirs and stays)
RAW = re.compile(r"<b>x|<a\s|</a>|<i>m", re.IGNORECASE)
NOT_DRAWN = {"meta", "customdata", "uid"}  # data plotly keeps but never draws as text


def drawn_strings(node: Any, where: str = "") -> Iterator[tuple[str, str]]:
    """(where, text) for every string in a figure's JSON that plotly may draw."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in NOT_DRAWN:
                yield from drawn_strings(value, f"{where}.{key}")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from drawn_strings(value, f"{where}[{i}]")
    elif isinstance(node, np.ndarray):
        if node.dtype.kind in "OUS":
            for i, value in enumerate(node.ravel().tolist()):
                yield from drawn_strings(value, f"{where}[{i}]")
    elif isinstance(node, str):
        yield where, node


def check_figure(fig: go.Figure, shown: tuple[str, ...] = NAMES) -> list[str]:
    """Assert no drawn text holds raw markup and each name in ``shown`` is drawn escaped;
    return the drawn strings."""
    texts = list(drawn_strings(fig.to_plotly_json()))
    raw = [(where, text) for where, text in texts if RAW.search(text)]
    assert not raw, raw[:5]
    for name in shown:
        assert any(plain_text(name) in text for _, text in texts), (name, texts[:20])
    return [text for _, text in texts]


def test_the_checker_sees_raw_markup() -> None:
    fig = go.Figure(go.Bar(x=[BOLD], y=[1], hovertext=[LINK]))
    with pytest.raises(AssertionError):
        check_figure(fig)
    assert plain_text(BOLD) == "&lt;b&gt;x&lt;/b&gt;"
    assert plain_text(LINK) == '&lt;a href="http://e"&gt;y&lt;/a&gt;'  # plotly has no &quot;
    assert plain_text("a & b") == "a &amp; b"


# ---------------------------------------------------------------------------------------------
# checkpoint files whose names are markup


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    w = torch.arange(12, dtype=torch.float32)
    return {BOLD: w, LINK: w[4:].view(2, 4), "plain": torch.ones(3, dtype=torch.bfloat16)}


@pytest.fixture(scope="module")
def torch_file(tmp_path_factory, state):
    path = tmp_path_factory.mktemp("markup") / "<i>m.pt"  # the archive name: "<i>m"
    torch.save(state, path)
    return path


@pytest.fixture(scope="module")
def safetensors_layout(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("markup-st") / "<i>m.safetensors"
    save_file({BOLD: torch.ones(4), LINK: torch.zeros(3, dtype=torch.bfloat16)}, str(path))
    return cl.inspect(path)


@pytest.fixture(scope="module")
def torch_layout(torch_file):
    return cl.inspect(torch_file)


def test_bytemap_exact_and_binned(torch_layout, safetensors_layout) -> None:
    for layout in (torch_layout, safetensors_layout):
        exact = bytemap_figure(layout, bins=100_000)  # a column for every segment
        assert exact.layout.meta["mode"] == "exact"
        texts = check_figure(exact)
        assert any("&lt;i&gt;m." in t for t in texts)  # the file name in the title
        binned = bytemap_figure(ByteMap.from_layout(layout), bins=100, exact_threshold=0)
        assert binned.layout.meta["mode"] == "binned"  # names the records (torch: "<i>m/...")
        check_figure(binned, shown=NAMES if layout is safetensors_layout else ("<i>m/",))


def test_bytemap_of_a_predicted_layout_with_a_markup_archive_name(state) -> None:
    layout = cl.predict_layout(state, archive_name=ARCHIVE)
    assert all(r.name.startswith(f"{ARCHIVE}/") for r in layout.records)
    check_figure(bytemap_figure(layout, bins=100_000), shown=(*NAMES, ARCHIVE))
    check_figure(bytemap_figure(layout, bins=3, exact_threshold=0), shown=(ARCHIVE,))


def test_overhead_alignment_blockmap(torch_layout) -> None:
    for fig in (overhead_figure(torch_layout), overhead_figure(torch_layout, by="bytes"),
                alignment_figure(cl.format.alignment_costs(torch_layout)),
                blockmap_figure(torch_layout)):
        check_figure(fig, shown=())


def test_storage_figure(torch_layout, safetensors_layout) -> None:
    for layout in (torch_layout, safetensors_layout):
        fig = storage_figure(layout)
        check_figure(fig)
        rows = fig.layout.meta["rows"]
        assert [BOLD] in rows and [LINK] in rows  # the meta keeps the names as they are


def test_transfer_figure() -> None:
    fig = transfer_figure({BOLD: 1.5, "posix": 1.0}, limit=(LINK, 2.0))
    check_figure(fig)
    assert fig.layout.meta["labels"] == [BOLD, "posix"]


def test_report_figures(torch_layout, safetensors_layout, torch_file) -> None:
    for layout, head, n_figures in ((torch_layout, torch_file.read_bytes()[:1024], 5),
                                    (safetensors_layout, None, 4)):
        doc = report_html(layout, hex_bytes=head)
        assert BOLD not in doc and LINK not in doc and "<i>m" not in doc
        figures = re.findall(r"Plotly\.newPlot\(\s*\"[^\"]+\",\s*(\[.*?\]),\s*(\{.*?\}),\s*\{",
                             doc, flags=re.S)
        assert len(figures) == n_figures
        for data, layout_json in figures:
            fig = go.Figure(data=json.loads(data), layout=json.loads(layout_json))
            check_figure(fig, shown=())


# ---------------------------------------------------------------------------------------------
# plans


@pytest.fixture(scope="module")
def plan():
    return global_plan([
        local_plan(0, [WriteItem(BOLD, "tensor", Chunk((0,), (4,)), (8,), "float32"),
                       WriteItem(LINK, "tensor", Chunk((0, 0), (2, 2)), (2, 4), "float32")]),
        local_plan(1, [WriteItem(BOLD, "tensor", Chunk((4,), (4,)), (8,), "float32"),
                       WriteItem(LINK, "tensor", Chunk((0, 2), (2, 2)), (2, 4), "float32")]),
    ])


def test_shard_map_and_reshard(plan) -> None:
    for name in NAMES:
        fig = shard_map_figure(plan, name)
        check_figure(fig, shown=(name,))
        assert fig.layout.meta["fqn"] == name
    fig = reshard_figure(BOLD, (8,), [Chunk((0,), (4,)), Chunk((4,), (4,))],
                         [Chunk((0,), (8,))])
    check_figure(fig, shown=(BOLD,))
    check_figure(rank_bytes_figure(plan), shown=())


def test_cache_timeline() -> None:
    events = [CacheEvent(BOLD, "miss", (0, 1), 2, 0.002, 10.0),
              CacheEvent(LINK, "hit", (), 2, 0.0001, 10.01),
              CacheEvent(BOLD, "delta", (1,), 2, 0.001, 10.02)]
    fig = cache_timeline_figure(events)
    check_figure(fig)
    assert fig.layout.meta["namespaces"] == [BOLD, LINK]
    assert list(fig.layout.yaxis.categoryarray) == [plain_text(BOLD), plain_text(LINK)]


# ---------------------------------------------------------------------------------------------
# writes


def test_bucket_figure_with_a_markup_hint() -> None:
    items = [SizedItem(BOLD, 300), SizedItem(LINK, 200), SizedItem("<b>x</b>.m", 100),
             SizedItem("<b>x</b>.v", 100)]
    fig = bucket_figure(assign_buckets(items, 3, separation_hint="<b>x</b>."))
    check_figure(fig)
    assert fig.layout.meta["separation_hint"] == "<b>x</b>."
    assert fig.layout.meta["largest"]["key"] == BOLD


def test_timeline_figure_with_markup_files() -> None:
    assignment = assign_buckets([SizedItem("a", 8), SizedItem("b", 4)], 2)
    events = (TimelineEvent(None, "plan", 0.0, 0.25, 0, ""),
              TimelineEvent(0, "write", 0.25, 0.5, 8, BOLD),
              TimelineEvent(1, "write", 0.25, 0.75, 4, LINK),
              TimelineEvent(1, BOLD, 0.75, 0.8, 0, LINK),  # a phase of its own
              TimelineEvent(None, "commit", 0.75, 1.0, 9, ".metadata"))
    timeline = Timeline(path="/ckpt/<b>x", rank=0, started_at=1.0e9, assignment=assignment,
                        files=((0, BOLD, 8, "POSIX"), (1, LINK, 4, LINK)), events=events,
                        returned_s=0.25, finished_s=1.0, committed=True, error=None)
    check_figure(timeline_figure(timeline))


# ---------------------------------------------------------------------------------------------
# widgets that set labels themselves


def test_app_what_if_title(torch_layout) -> None:
    pytest.importorskip("panel")
    from ckptlab.widgets.app import LayoutApp

    app = LayoutApp(torch_layout)
    check_figure(app.map_pane.object, shown=())
    other = next(a for a in app.alignment.options if a != app.alignment.value)
    app.show_alignment(other)
    title = app.map_pane.object.layout.title.text
    assert title.startswith("what-if: &lt;i&gt;m.pt at alignment")
    check_figure(app.map_pane.object, shown=())
    app.zoom((0, 100))  # keeps the (escaped) title: not escaped twice
    assert app.map_pane.object.layout.title.text == title


def test_explorers(torch_file, state) -> None:
    pytest.importorskip("ipywidgets")
    from ckptlab.widgets import AlignmentExplorer, LayoutExplorer

    explorer = LayoutExplorer(torch_file)
    check_figure(go.Figure(explorer.figure), shown=("<i>m/",))  # binned: record names
    explorer.zoom(0, 200)
    check_figure(go.Figure(explorer.figure), shown=("<i>m/",))
    what_if = AlignmentExplorer(state, archive_name=ARCHIVE)  # records "<b>x<a ...>/data/0"
    check_figure(go.Figure(what_if.figure), shown=(ARCHIVE,))
    what_if.show(4096)
    check_figure(go.Figure(what_if.figure), shown=(ARCHIVE,))
    check_figure(go.Figure(what_if.cost_figure), shown=())
