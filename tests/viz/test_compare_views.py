"""The comparing and measuring views: ``ckptlab.viz.compare``'s figures and tables checked by
their data (``layout.meta``), ``DiffExplorer`` / ``StatsExplorer`` driven as a user would, and
``ckptlab report --compare --stats``: on a pair the libraries wrote (safetensors by
``save_file``, a torch.save file), every figure held to torch's own numbers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.compare import difference, stats
from ckptlab.compare._stats import side_by_side
from ckptlab.viz.compare import (
    diff_figure,
    diff_table_html,
    health_html,
    hist_figure,
    stats_table_html,
    steps_figure,
)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A (safetensors) and B (torch.save): block.1 moved, block.2's bias from zero, a NaN,
    a dtype change, a tensor dropped."""
    base = tmp_path_factory.mktemp("tuned")
    torch.manual_seed(7)
    a = {f"block.{i}.{k}": torch.randn(16, 16) if k == "w" else torch.zeros(16)
         for i in range(3) for k in ("w", "b")}
    a["head.w"] = torch.randn(4, 16)
    b = {k: v.clone() for k, v in a.items()}
    b["block.1.w"] += 0.05 * torch.randn(16, 16)
    b["block.2.b"] += 0.2
    b["head.w"][0, 0] = float("nan")
    b["block.0.b"] = b["block.0.b"].to(torch.bfloat16)
    del b["block.0.w"]
    save_file(a, str(base / "a.safetensors"))
    torch.save(b, base / "b.pt")
    return base / "a.safetensors", base / "b.pt"


def test_diff_figure_and_table(tuned: tuple[Path, Path]) -> None:
    d = cl.diff(*tuned)
    fig = diff_figure(d)
    meta = fig.layout.meta
    assert meta["kind"] == "diff" and meta["modules"] == ["block.0", "block.1", "block.2", "head"]
    rel = dict(zip(meta["modules"], meta["rel_l2"], strict=True))
    # block.0.b became bfloat16 with the same values: within tolerance, no change in value
    assert rel["block.0"] == 0.0 and meta["changed"][0] == 0
    assert fig.data[0].marker.color[0] == "#b8b8b8"
    a, b = load_file(str(tuned[0])), torch.load(tuned[1], weights_only=True)
    want = ((a["block.1.w"] - b["block.1.w"]).double().norm()
            / a["block.1.w"].double().norm()).item()
    assert rel["block.1"] == pytest.approx(want, rel=1e-9)
    assert "1 only in A" in fig.layout.title.text
    table = diff_table_html(d)
    assert table.index("block.1.w") < table.index("block.0.b")  # changed, then within
    assert "bfloat16" in table and "only in A" in table and "block.0.w" in table
    assert re.search(r"NaN A / B.*1 / 1|0 / 1", table, re.S)


def test_histograms_against_torch(tuned: tuple[Path, Path],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptlab.compare import _kernels

    d = cl.diff(*tuned)
    ck_a, ck_b = cl.open(tuned[0]), cl.open(tuned[1])
    series = side_by_side(d, ck_a, ck_b, "block.1.w")
    monkeypatch.setattr(_kernels, "CHUNK_NBYTES", 256)  # the same, read in pieces of 32
    pieces = side_by_side(d, ck_a, ck_b, "block.1.w")
    for label, s in series.items():
        assert pieces[label].counts == s.counts and pieces[label].min == s.min, label
        assert pieces[label].std == pytest.approx(s.std, rel=1e-12), label
    assert list(series) == ["A", "B", "B - A"]
    a, b = load_file(str(tuned[0]))["block.1.w"], torch.load(tuned[1])["block.1.w"]
    delta = (b.double() - a.double()).reshape(-1)
    s = series["B - A"]
    assert (s.min, s.max) == (delta.min().item(), delta.max().item())
    assert list(s.counts) == [int(c) for c in torch.histc(delta, 64, s.min, s.max)]
    assert difference(a, b).counts == s.counts
    fig = hist_figure(series, title="block.1.w")
    assert fig.layout.meta["series"] == ["A", "B", "B - A"] and len(fig.data) == 3
    assert list(fig.data[2].x) == list(s.edges)
    empty = cl.compare.TensorStats("float32", 3, nan=3)  # nothing finite: named, not drawn
    fig = hist_figure({"A": empty}, title="t")
    assert len(fig.data) == 0 and "A: no finite value" in fig.layout.title.text


def test_stats_table_and_health(tuned: tuple[Path, Path]) -> None:
    found = stats(tuned[1])
    table = stats_table_html(found)
    assert "head.w" in table and "bfloat16" in table
    line = health_html(cl.compare.health(found))
    assert "NaN or Inf in 1 tensor: head.w" in line and "all zero: block.0.b, block.1.b" in line
    assert "nothing looks wrong" in health_html([])


def test_steps_figure(tmp_path: Path) -> None:
    from ckptlab.compare import step_diffs

    torch.manual_seed(8)
    w = torch.randn(4, 4)
    for step in (1, 2, 3):
        d = tmp_path / f"checkpoint-{step}"
        d.mkdir()
        (d / "trainer_state.json").write_text("{}")
        w = w * (1 + 0.1 * step)
        save_file({"enc.w": w, "dec.w": torch.ones(2)}, str(d / "model.safetensors"))
    fig = steps_figure(step_diffs(tmp_path))
    meta = fig.layout.meta
    assert meta["steps"] == ["checkpoint-1 → checkpoint-2", "checkpoint-2 → checkpoint-3"]
    assert meta["modules"] == ["dec", "enc"]
    z = fig.data[0].z
    assert list(z[0]) == [None, None]  # dec never moved: blank cells
    assert z[1][0] == pytest.approx(math.log10(0.2 / 1.0), rel=1e-6)
    assert z[1][1] == pytest.approx(math.log10(0.3), rel=1e-6)


def test_explorers_as_a_user_drives_them(tuned: tuple[Path, Path]) -> None:
    from ckptlab.widgets import DiffExplorer, StatsExplorer

    x = DiffExplorer(*tuned)
    assert x.picker.value == "block.1.w" and len(x.hist.data) == 3  # opens on the largest
    # the largest finite change first, the NaN (rel_l2 0 elsewhere), the bias from zero last
    assert x.picker.options[:3] == ("block.1.w", "head.w", "block.2.b")
    x.select("block.1.w")
    assert [t.name for t in x.hist.data] == ["A", "B", "B - A"]
    x.search.value = "head"
    assert x.picker.options == ("head.w",)
    x.search.value = "block.*.w"  # a glob
    assert set(x.picker.options) == {"block.1.w", "block.2.w"}
    again = DiffExplorer(x.diff)  # from a diff computed before: its sides opened again
    again.select("block.2.b")
    assert [t.name for t in again.hist.data] == ["A", "B", "B - A"]
    s = StatsExplorer(tuned[1])
    assert "head.w" in s.health[0]
    assert s.picker.value == "head.w" and s.hist.data[0].name == "head.w"  # the NaN first
    s.select("block.1.w")
    assert len(s.hist.data) == 1 and s.hist.layout.title.text == "block.1.w"
    with pytest.raises(KeyError):
        s.select("nope")


def test_report_compare_and_stats(tuned: tuple[Path, Path], tmp_path: Path,
                                  capsys: Any) -> None:
    out = tmp_path / "r.html"
    assert main(["report", str(tuned[0]), "--compare", str(tuned[1]), "--stats",
                 "-o", str(out)]) == 0
    page = out.read_text()
    assert "Compared with" in page and "What changed" in page
    assert "Histograms · block.1.w" in page and "Tensor statistics" in page
    # the statistics are columns of the one tensor table (searchable with it), not a second one
    assert "columns of the tensor table below" in page and page.count("<th>min</th>") == 1
    rows = json.loads(page.split('id="ckptlab-tensor-rows">', 1)[1].split("</script>", 1)[0])
    found = stats(tuned[0])
    by_name = {r[0]: r for r in rows}
    for name, s in found.items():
        assert by_name[name][-6:] == [f"{s.min:.4g}", f"{s.max:.4g}", f"{s.mean:.4g}",
                                      f"{s.std:.4g}", s.nan, s.inf], name
    assert page.count("ckptlab-fig-0") >= 1 and page.count('id="ckptlab-fig-0"') == 1
    capsys.readouterr()
    assert main(["report", str(tuned[0]), "--compare", str(tmp_path / "missing.pt"),
                 "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ckptlab: error:") and "missing.pt" in err
    assert not (tmp_path / "x.html").exists()


def test_a_shape_change_is_drawn_apart(tmp_path: Path) -> None:
    save_file({"m.w": torch.ones(2, 3), "n.w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"m.w": torch.ones(3, 2), "n.w": torch.ones(2) * 2},
              str(tmp_path / "b.safetensors"))
    fig = diff_figure(cl.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors"))
    assert fig.layout.meta["rel_l2"] == [math.inf, 1.0]
    assert fig.data[0].marker.color[0] == "#d62728"


def test_report_of_a_run_with_its_steps(tmp_path: Path, capsys: Any) -> None:
    """``ckptlab report RUN --steps``: the saves compared one after another, a figure at the
    top of the report of the save the run resumes from; on a directory that is not a run,
    one error line."""
    torch.manual_seed(13)
    w = torch.randn(4, 4)
    for step in (5, 10, 15):
        d = tmp_path / "run" / f"checkpoint-{step}"
        d.mkdir(parents=True)
        (d / "trainer_state.json").write_text("{}")
        w = w + 0.1
        save_file({"enc.w": w, "dec.b": torch.ones(2)}, str(d / "model.safetensors"))
    out = tmp_path / "run.html"
    assert main(["report", str(tmp_path / "run"), "--steps", "-o", str(out)]) == 0
    page = out.read_text()
    assert "The run&#x27;s saves" in page or "The run's saves" in page
    steps = ("checkpoint-5 \\u2192 checkpoint-10", "checkpoint-10 \\u2192 checkpoint-15")
    assert all(s in page for s in steps)  # (the figure's JSON escapes the arrow)
    capsys.readouterr()
    single = tmp_path / "run" / "checkpoint-5" / "model.safetensors"
    assert main(["report", str(single), "--steps", "-o", str(tmp_path / "x.html")]) == 2
    assert "--steps is for a training run" in capsys.readouterr().err
