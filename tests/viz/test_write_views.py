"""timeline_figure and bucket_figure, checked on their data: every bar is an event or an item,
the markers sit at returned_s / finished_s, the ideal line is total / n, the imbalance is right.

Nothing here asserts on how long anything took: the timelines are built by hand, or come from
a real save and are compared with its own events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlab.errors import InvalidArgumentError
from ckptlab.viz import bucket_figure, timeline_figure
from ckptlab.viz.write import ITEM_COLORS, PHASE_COLORS, SAVE_ROW
from ckptlab.write import (
    PHASES,
    AsyncWriter,
    SizedItem,
    Timeline,
    TimelineEvent,
    assign_buckets,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _hand_timeline(**changes) -> Timeline:
    """Two buckets, save-wide plan / metadata / commit; times chosen to be exact in binary."""
    assignment = assign_buckets([SizedItem("a", 8192), SizedItem("b", 4096)], 2)
    ev = TimelineEvent
    events = (
        ev(None, "plan", 0.0, 0.25, 0, ""),
        ev(0, "open", 0.25, 0.375, 0, "__0_0.distcp"),
        ev(0, "stage", 0.25, 0.5, 8192, "__0_0.distcp"),
        ev(1, "stage", 0.5, 0.625, 4096, "__0_1.distcp"),
        ev(0, "write", 0.5, 0.75, 12288, "__0_0.distcp"),
        ev(1, "write", 0.625, 0.875, 8192, "__0_1.distcp"),
        ev(None, "metadata", 0.625, 0.6875, 900, ""),
        ev(0, "fsync", 0.75, 1.0, 0, "__0_0.distcp"),
        ev(1, "fsync", 0.875, 1.0, 0, "__0_1.distcp"),
        ev(None, "commit", 1.0, 1.25, 900, ".metadata"),
    )
    fields = dict(path="/ckpt/step_1", rank=0, started_at=1.0e9, assignment=assignment,
                  files=((0, "__0_0.distcp", 12000, "O_DIRECT"), (1, "__0_1.distcp", 8000, "POSIX")),
                  events=events, returned_s=0.625, finished_s=1.25, committed=True, error=None)
    fields.update(changes)
    return Timeline(**fields)


def _bars(fig) -> list[tuple[str, str, float, float]]:
    """(phase, row, start ms, duration ms) of every bar."""
    return [(t.name, y, b, x) for t in fig.data for y, b, x in zip(t.y, t.base, t.x)]


def _shape(fig, name: str):
    (shape,) = [s for s in fig.layout.shapes if s.name == name]
    return shape


# ---------------------------------------------------------------------------------------------
# timeline_figure


def test_timeline_bars_are_the_events() -> None:
    tl = _hand_timeline()
    fig = timeline_figure(tl)
    assert [t.name for t in fig.data] == [p for p in PHASES if any(e.phase == p for e in tl.events)]
    want = sorted((e.phase, SAVE_ROW if e.bucket is None else f"bucket {e.bucket}",
                   1e3 * e.start_s, 1e3 * e.duration_s) for e in tl.events)
    assert sorted(_bars(fig)) == want
    for trace in fig.data:
        assert trace.orientation == "h"
        assert trace.marker.color == PHASE_COLORS[trace.name]
    meta = fig.layout.meta
    assert meta["kind"] == "timeline" and meta["unit"] == "ms"
    assert meta["rows"] == ["save", "bucket 0", "bucket 1"]
    assert list(fig.layout.yaxis.categoryarray) == meta["rows"]
    assert meta["phases"]["write"] == {"events": 2, "seconds": 0.5, "nbytes": 20480}
    assert meta["phases"]["stage"] == {"events": 2, "seconds": 0.375, "nbytes": 12288}
    assert meta["phases"]["commit"] == {"events": 1, "seconds": 0.25, "nbytes": 900}
    assert set(meta["phases"]) == {e.phase for e in tl.events}
    assert meta["nbytes"] == tl.nbytes == 20480
    assert meta["outcome"] == "committed" and meta["committed"] and meta["error"] is None
    # writes span 0.5 .. 1.0 (the last fsync), the whole save 1.25 s
    assert meta["write_span_s"] == 0.5 and meta["write_gbps"] == pytest.approx(20480 / 0.5 / 1e9)
    assert meta["gbps"] == pytest.approx(20480 / 1.25 / 1e9)
    by_bucket = {b["bucket"]: b for b in meta["buckets"]}
    assert by_bucket[0] == {"bucket": 0, "file": "__0_0.distcp", "nbytes": 12288, "write_s": 0.25,
                            "gbps": pytest.approx(12288 / 0.25 / 1e9), "io_path": "O_DIRECT"}
    assert by_bucket[1]["io_path"] == "POSIX"
    json.dumps(meta)
    fig.to_json()


def test_timeline_hover_has_bytes_rate_and_file() -> None:
    fig = timeline_figure(_hand_timeline())
    (write,) = [t for t in fig.data if t.name == "write"]
    first = write.hovertext[0]
    assert "bucket 0" in first and "12.0 KiB (12,288 B)" in first
    assert f"{12288 / 0.25 / 1e9:.2f} GB/s" in first
    assert "__0_0.distcp (O_DIRECT)" in first
    assert "__0_1.distcp (POSIX)" in write.hovertext[1]
    (plan,) = [t for t in fig.data if t.name == "plan"]
    assert "GB/s" not in plan.hovertext[0] and "B)" not in plan.hovertext[0]
    assert [list(c) for c in write.customdata] == [[0, 12288, "__0_0.distcp"],
                                                  [1, 8192, "__0_1.distcp"]]


def test_timeline_marks_return_and_finish() -> None:
    fig = timeline_figure(_hand_timeline())
    returned, finished = _shape(fig, "returned"), _shape(fig, "finished")
    assert (returned.x0, returned.x1, returned.yref) == (625.0, 625.0, "paper")
    assert (finished.x0, finished.x1) == (1250.0, 1250.0)
    texts = [a.text for a in fig.layout.annotations]
    assert "returned to caller 625.0 ms" in texts and "finished 1250.0 ms" in texts
    assert "returned after 625.0 ms" in fig.layout.title.text
    assert "finished after 1250.0 ms" in fig.layout.title.text
    assert fig.layout.meta["returned_s"] == 0.625 and fig.layout.meta["finished_s"] == 1.25


def test_timeline_in_flight_and_failed() -> None:
    tl = _hand_timeline(finished_s=None, committed=False,
                        events=_hand_timeline().events[:4])
    fig = timeline_figure(tl)
    assert [s.name for s in fig.layout.shapes] == ["returned"]
    assert fig.layout.meta["outcome"] == "in flight" and fig.layout.meta["write_gbps"] is None
    failed = timeline_figure(_hand_timeline(committed=False, error="WriterError: disk full"))
    assert failed.layout.meta["outcome"] == "failed"
    assert failed.layout.meta["error"] == "WriterError: disk full"
    assert failed.layout.title.text.endswith("failed")
    empty = timeline_figure(_hand_timeline(events=(), files=(), returned_s=None,
                                           finished_s=None, committed=False))
    assert len(empty.data) == 0 and len(empty.layout.shapes) == 0
    assert empty.layout.meta["rows"] == ["save", "bucket 0", "bucket 1"]


def test_timeline_of_a_real_save(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(300, 500, generator=g), "b": torch.randn(70, generator=g),
             "optim": {"m": torch.randn(200, 100, generator=g)}, "step": 4}
    with AsyncWriter(tmp_path / "c", workers=2, buckets=3) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        tl = writer.wait()
    fig = timeline_figure(tl)
    want = sorted((e.phase, SAVE_ROW if e.bucket is None else f"bucket {e.bucket}",
                   1e3 * e.start_s, 1e3 * e.duration_s) for e in tl.events)
    assert sorted(_bars(fig)) == want
    meta = fig.layout.meta
    assert meta["rows"] == ["save", "bucket 0", "bucket 1", "bucket 2"]
    assert meta["nbytes"] == tl.nbytes == meta["phases"]["write"]["nbytes"]
    assert sum(b["nbytes"] for b in meta["buckets"]) == tl.nbytes
    assert {b["io_path"] for b in meta["buckets"]} <= {"O_DIRECT", "POSIX"}
    assert _shape(fig, "returned").x0 == 1e3 * tl.returned_s
    assert _shape(fig, "finished").x0 == 1e3 * tl.finished_s
    assert meta["outcome"] == "committed"
    fig.to_json()


def test_timeline_figure_rejects_other_objects() -> None:
    with pytest.raises(InvalidArgumentError, match="Timeline"):
        timeline_figure({"events": []})


# ---------------------------------------------------------------------------------------------
# bucket_figure


def _segments(trace) -> list[tuple[int, int, int, str]]:
    """(bucket, base, bytes, key) of every bar segment of a bucket_figure trace."""
    keys = [h.split("</b>")[0].removeprefix("<b>") for h in trace.hovertext]
    return list(zip(trace.x, trace.base, trace.y, keys))


def test_bucket_figure_hand_checked() -> None:
    # LPT: a (6) -> bucket 0; b (4) -> bucket 1; c (3) -> bucket 1 (4 < 6): loads (6, 7)
    a = assign_buckets([SizedItem("a", 6), SizedItem("b", 4), SizedItem("c", 3)], 2)
    fig = bucket_figure(a)
    assert _segments(fig.data[0]) == [(0, 0, 6, "a"), (1, 0, 4, "b"), (1, 4, 3, "c")]
    assert len(fig.data[1].x) == 0 and not fig.data[1].showlegend
    assert list(fig.data[2].x) == [0, 1] and list(fig.data[2].y) == [6, 7]
    meta = fig.layout.meta
    assert meta["bucket_nbytes"] == [6, 7] and meta["nbytes"] == 13
    assert meta["imbalance"] == pytest.approx(7 / 6.5) == pytest.approx(1.0769, abs=1e-4)
    assert "imbalance 1.077" in fig.layout.title.text
    ideal = _shape(fig, "ideal 0")
    assert ideal.y0 == ideal.y1 == 13 / 2
    assert (ideal.x0, ideal.x1) == (-0.45, 1.45)
    assert meta["groups"] == [{"group": 0, "buckets": [0, 1], "nbytes": 13, "ideal_nbytes": 6.5,
                               "fullest_nbytes": 7, "imbalance": pytest.approx(7 / 6.5)}]
    assert meta["largest"] == {"key": "a", "nbytes": 6}
    assert meta["overall_imbalance"] == meta["imbalance"] and meta["even_nbytes"] == 6.5
    assert [s.name for s in fig.layout.shapes] == ["ideal 0"]  # one group: no "even" line
    assert "6 B (6 B)" in fig.data[0].hovertext[0]
    colors = list(fig.data[0].marker.color)
    assert all(c in ITEM_COLORS for c in colors)
    # an item keeps its colour whatever bucket count
    again = bucket_figure(assign_buckets([SizedItem("a", 6), SizedItem("b", 4),
                                          SizedItem("c", 3)], 3))
    assert dict(zip([s[3] for s in _segments(again.data[0])], again.data[0].marker.color)) == \
        dict(zip("abc", colors))


def test_ideal_line_is_total_over_n() -> None:
    items = [SizedItem(f"t{i}", (i * 7919) % 1000 + 1) for i in range(40)]
    total = sum(i.nbytes for i in items)
    for n in (1, 3, 8):
        fig = bucket_figure(assign_buckets(items, n))
        assert _shape(fig, "ideal 0").y0 == pytest.approx(total / n)
        assert fig.layout.meta["n_buckets"] == n == len(fig.data[2].x)
        assert fig.layout.meta["imbalance"] == pytest.approx(
            max(fig.layout.meta["bucket_nbytes"]) / (total / n))


def test_separation_hint_group_is_hatched_with_its_own_ideal() -> None:
    items = [SizedItem("model.w", 300), SizedItem("model.b", 60), SizedItem("model.e", 180),
             SizedItem("optim.w.m", 200), SizedItem("optim.w.v", 200), SizedItem("optim.e.m", 120),
             SizedItem("optim.param_groups", 0, is_tensor=False)]
    a = assign_buckets(items, 4, separation_hint="optim.")
    fig = bucket_figure(a)
    meta = fig.layout.meta
    assert meta["bucket_groups"] == [0, 0, 1, 1]
    # 540 vs 520 bytes: 2 + 2 buckets. group 0: model.w | model.e + model.b;
    # group 1: optim.w.m + optim.e.m | optim.w.v
    assert meta["bucket_nbytes"] == [300, 240, 320, 200]
    assert [s[3] for s in _segments(fig.data[0])] == ["model.w", "model.e", "model.b"]
    assert sorted(s[3] for s in _segments(fig.data[1])) == ["optim.e.m", "optim.w.m",
                                                            "optim.w.v"]
    assert {s[0] for s in _segments(fig.data[1])} == {2, 3}
    assert fig.data[1].marker.pattern.shape == "/" and fig.data[0].marker.pattern.shape == ""
    assert fig.data[1].showlegend and "'optim.'" in fig.data[1].name
    assert _shape(fig, "ideal 0").y0 == 270 and (_shape(fig, "ideal 0").x0,
                                                _shape(fig, "ideal 0").x1) == (-0.45, 1.45)
    assert _shape(fig, "ideal 1").y0 == 260 and (_shape(fig, "ideal 1").x0,
                                                 _shape(fig, "ideal 1").x1) == (1.55, 3.45)
    # the worse group: 300 / 270 vs 320 / 260
    assert meta["imbalance"] == pytest.approx(320 / 260) == pytest.approx(a.imbalance)
    assert [g["imbalance"] for g in meta["groups"]] == [pytest.approx(300 / 270),
                                                        pytest.approx(320 / 260)]
    # the save waits for the fullest bucket of all: 320 against 1060 / 4 spread evenly
    assert _shape(fig, "even").y0 == 265 and meta["even_nbytes"] == 265
    assert meta["overall_imbalance"] == pytest.approx(320 / 265)
    assert "fullest 1.21× all bytes / 4" in fig.layout.title.text
    assert list(fig.layout.xaxis.ticktext) == ["0", "1", "2*", "3*"]
    assert meta["separation_hint"] == "optim." and meta["byte_items"] == 1
    assert meta["items"] == 7  # the bytes item has no segment, but is counted
    assert "1 bytes items" in " ".join(fig.data[2].hovertext)


def test_bucket_figure_with_dcp_write_items() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = {"w": torch.zeros(10, 4), "b": torch.zeros(3, dtype=torch.bfloat16), "note": "x"}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plan = planner.create_local_plan()
    fig = bucket_figure(assign_buckets(plan.items, 2))
    assert sorted(s[3] for s in _segments(fig.data[0])) == ["b", "w"]
    assert sorted(fig.layout.meta["bucket_nbytes"]) == [6, 160]
    assert fig.layout.meta["byte_items"] == 1


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=30), n=st.integers(1, 12))
def test_stacks_add_up_to_the_buckets(sizes, n) -> None:
    items = [SizedItem(f"k{i}", s) for i, s in enumerate(sizes)]
    a = assign_buckets(items, n)
    fig = bucket_figure(a)
    tops = dict.fromkeys(range(n), 0)
    for bucket, base, nbytes, _ in _segments(fig.data[0]):
        assert base == tops[bucket]  # segments stack without gaps
        tops[bucket] += nbytes
    assert [tops[b] for b in range(n)] == list(a.bucket_nbytes) == list(fig.data[2].y)
    assert len(fig.data[0].x) == sum(1 for s in sizes if s)


def test_bucket_figure_rejects_other_objects() -> None:
    with pytest.raises(InvalidArgumentError, match="BucketAssignment"):
        bucket_figure([SizedItem("a", 1)])
