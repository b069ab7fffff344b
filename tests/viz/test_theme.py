"""Theme-aware figures: light and dark colours, JupyterLab's saved theme, responsive width and
a title that sits below the toolbar."""

from __future__ import annotations

import pytest

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError
from ckptlab.viz import (
    alignment_figure,
    bytemap_figure,
    overhead_figure,
    storage_figure,
    transfer_figure,
    treemap_figure,
)
from ckptlab.viz._style import MIN_TOP_MARGIN, THEMES, TITLE_TOP_PX, resolve_theme

SETTINGS = ("@jupyterlab", "apputils-extension", "themes.jupyterlab-settings")


def write_lab_theme(root, theme: str) -> None:
    path = root.joinpath(*SETTINGS)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{\n    // a comment, as JupyterLab writes them\n'
                    f'    "theme": "{theme}",\n    "theme-scrollbars": false\n}}\n')


def test_theme_follows_jupyterlab_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPTLAB_THEME", raising=False)
    monkeypatch.setenv("JUPYTERLAB_SETTINGS_DIR", str(tmp_path))
    assert resolve_theme() == "light"  # no settings file yet
    write_lab_theme(tmp_path, "JupyterLab Dark")
    assert resolve_theme() == resolve_theme("auto") == "dark"
    write_lab_theme(tmp_path, "JupyterLab Light")
    assert resolve_theme() == "light"
    monkeypatch.setenv("CKPTLAB_THEME", "dark")  # the environment wins over the file
    assert resolve_theme() == "dark"
    assert resolve_theme("light") == "light"  # an explicit argument wins over both
    with pytest.raises(InvalidArgumentError, match="theme"):
        resolve_theme("purple")


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_figures_take_the_themes_colours(sample_layout, theme):
    colors = THEMES[theme]
    figs = [bytemap_figure(sample_layout, theme=theme),
            overhead_figure(sample_layout, theme=theme),
            treemap_figure(sample_layout, theme=theme)]
    for fig in figs:
        assert fig.layout.plot_bgcolor == colors["plot"]
        assert fig.layout.paper_bgcolor == colors["paper"]  # transparent: the page shows
        assert fig.layout.font.color == colors["font"]
    # empty shares of the byte map fade to the theme's background, not to white on dark
    scale = figs[0].data[0].colorscale
    assert scale[0][1] == colors["empty"]


def test_every_figure_is_responsive_and_its_title_clears_the_toolbar(sample_layout):
    figs = [bytemap_figure(sample_layout), overhead_figure(sample_layout),
            alignment_figure(cl.format.alignment_costs(sample_layout), current=64),
            storage_figure(sample_layout), treemap_figure(sample_layout),
            transfer_figure({"a": 1.0, "b": 2.0}, limit=("disk", 2.5))]
    for fig in figs:
        assert fig.layout.autosize is True and fig.layout.width is None
        assert fig.layout.title.yref == "container" and fig.layout.title.pad.t == TITLE_TOP_PX
        assert fig.layout.margin.t >= MIN_TOP_MARGIN


def test_transfer_limit_is_in_the_legend_not_on_a_bar():
    fig = transfer_figure({"torch.save": 1.9, "odirect": 2.4}, limit=("raw disk", 2.5))
    assert not fig.layout.annotations  # nothing drawn over the bars
    assert fig.layout.shapes[0].y0 == 2.5
    assert fig.data[1].name == "raw disk 2.50 GB/s" and fig.layout.showlegend
    assert fig.layout.yaxis.range[1] > 2.5  # room for the bars' labels above the line


def test_bucket_totals_are_written_only_while_they_fit():
    from ckptlab.viz import bucket_figure
    from ckptlab.viz.write import MAX_BUCKET_LABELS
    from ckptlab.write import SizedItem, assign_buckets

    items = [SizedItem(f"w{i}", 5 << 30) for i in range(40)]
    few = bucket_figure(assign_buckets(items[:4], 4))
    totals = next(t for t in few.data if t.name == "bucket total")
    assert totals.mode == "text" and list(totals.text) == ["5.0 GiB"] * 4
    # never on the dashed ideal line: above a bar that reaches it, inside one below it
    uneven = bucket_figure(assign_buckets([SizedItem("a", 9 << 30), SizedItem("b", 1 << 30)],
                                          2))
    totals = next(t for t in uneven.data if t.name == "bucket total")
    ideal = next(s for s in uneven.layout.shapes if s.name == "ideal 0").y0
    assert [p for p in totals.textposition] == [
        "bottom center" if y < ideal else "top center" for y in totals.y]
    assert set(totals.textposition) == {"bottom center", "top center"}
    # the ideal's words are a legend entry, not text on the plot
    assert not uneven.layout.annotations
    assert [t.name for t in uneven.data if t.name and t.name.startswith("ideal")] == [
        "ideal 5.0 GiB"]
    many = bucket_figure(assign_buckets(items, MAX_BUCKET_LABELS + 8))
    totals = next(t for t in many.data if t.name == "bucket total")
    # "5.0 GiB5.0 GiB5.0 GiB": 20 labels run together, so the totals are in the hover only
    assert totals.text is None and totals.mode == "markers"
    assert all("10.0 GiB" in h for h in totals.hovertext)  # two 5 GiB items a bucket


def test_timeline_title_is_two_short_lines():
    from ckptlab.viz import timeline_figure
    from ckptlab.write import SizedItem, Timeline, TimelineEvent, assign_buckets

    events = (TimelineEvent(None, "plan", 0.0, 0.25, 0, ""),
              TimelineEvent(0, "write", 0.25, 0.75, 4096, "__0_0.distcp"),
              TimelineEvent(None, "commit", 0.75, 1.0, 900, ".metadata"))
    timeline = Timeline(path="/ckpt", rank=0, started_at=1.0e9,
                        assignment=assign_buckets([SizedItem("a", 4096)], 1),
                        files=((0, "__0_0.distcp", 4096, "POSIX"),), events=events,
                        returned_s=0.25, finished_s=1.0, committed=True, error=None)
    fig = timeline_figure(timeline)
    first, _, rest = fig.layout.title.text.partition("<br>")
    assert first.startswith("Save timeline") and rest.startswith("returned after 250.0 ms")
    assert fig.layout.margin.t >= MIN_TOP_MARGIN + 30  # two lines and the markers' labels
