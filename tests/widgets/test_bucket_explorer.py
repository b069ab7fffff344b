"""The async-writing widgets without a browser: BucketExplorer after each control change,
TimelineView over a real save, save_progress over a save held mid-way by an I/O hook, and
sized_items against DCP's own planner."""

from __future__ import annotations

import errno
import io
import re
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError, WriterError
from ckptlab.plan import state_shapes
from ckptlab.viz import bucket_figure, timeline_figure
from ckptlab.widgets import BucketExplorer, TimelineView, save_progress
from ckptlab.widgets.write import sized_items
from ckptlab.write import AsyncWriter, SizedItem, assign_buckets, item_nbytes

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


@pytest.fixture(scope="module")
def tiny() -> dict:
    return cl.samples.tiny_gpt()


def _mixed() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"model": {"w": torch.randn(6, 5, generator=g), "ids": torch.arange(9),
                      "half": torch.randn(7, generator=g).to(torch.bfloat16)},
            "optim": {"state": {"m": torch.randn(4, 4, generator=g)}, "lr": 0.5},
            "hist": [torch.ones(3), torch.zeros(2, 2)], "epoch": 3}


# ---------------------------------------------------------------------------------------------
# sized_items


def test_sized_items_match_dcp_write_items() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    state = _mixed()
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plan = planner.create_local_plan()
    dcp_items = {(i.index.fqn, item_nbytes(i), i.tensor_data is not None) for i in plan.items}
    ours = sized_items(state)
    assert {(i.key, i.nbytes, i.is_tensor) for i in ours} == dcp_items
    assert assign_buckets(ours, 3).bucket_nbytes == assign_buckets(plan.items, 3).bucket_nbytes


def test_sized_items_of_a_config() -> None:
    tensors, objects = state_shapes("tiny", optimizer=True)
    items = sized_items("tiny")
    assert [i.key for i in items] == [t.fqn for t in tensors] + objects
    size = {"bfloat16": 2, "float32": 4}
    for item, spec in zip(items, tensors):
        n = 1
        for d in spec.shape:
            n *= d
        assert item.nbytes == n * size[spec.dtype] and item.is_tensor
    assert items[-1] == SizedItem("optim.param_groups", 0, is_tensor=False)
    plain = sized_items(cl.plan.CONFIGS["tiny"], optimizer=False, dtype="float32")
    assert all(not i.key.startswith("optim.") for i in plain)
    assert plain[0].nbytes == 1000 * 64 * 4
    with pytest.raises(InvalidArgumentError, match="unknown model config"):
        sized_items("gpt-17")
    with pytest.raises(InvalidArgumentError, match="state dict"):
        sized_items(42)


# ---------------------------------------------------------------------------------------------
# BucketExplorer


def test_bucket_count_slider_updates_figure_and_summary(tiny) -> None:
    ex = BucketExplorer(tiny)
    assert ex.source.value == "state dict" and ex.optimizer.disabled
    assert ex.items == sized_items(tiny)
    assert ex.buckets.value == 8 and (ex.buckets.min, ex.buckets.max) == (1, 32)
    assert ex.figure.layout.meta == bucket_figure(assign_buckets(ex.items, 8)).layout.meta
    for n in (3, 1, 32):
        ex.buckets.value = n
        want = assign_buckets(ex.items, n)
        assert ex.assignment == want
        meta = ex.figure.layout.meta
        assert meta["n_buckets"] == n and meta["bucket_nbytes"] == list(want.bucket_nbytes)
        assert list(ex.figure.data[2].x) == list(range(n))
        ideal = [s for s in ex.figure.layout.shapes if s.name == "ideal 0"]
        assert len(ideal) == 1 and ideal[0].y0 == pytest.approx(want.nbytes / n)
        assert f"imbalance {want.imbalance:.3f}" in ex.figure.layout.title.text
        assert f"in {n} bucket" in ex.summary.value
        assert ex.summary.value.count("<tr>") == n + 1  # header + a row per bucket
    largest = max(ex.items, key=lambda i: i.nbytes)
    assert largest.key in ex.summary.value


def test_source_optimizer_and_separation(tiny) -> None:
    ex = BucketExplorer(tiny, buckets=4)
    ex.source.value = "tiny"
    assert not ex.optimizer.disabled
    assert ex.items == sized_items("tiny", optimizer=True)
    ex.optimizer.value = False
    assert ex.items == sized_items("tiny", optimizer=False)
    assert ex.figure.layout.meta["nbytes"] == sum(i.nbytes for i in ex.items)
    ex.optimizer.value = True
    assert len(ex.figure.data[1].x) == 0  # no hint: one group
    ex.separate.value = True
    meta = ex.figure.layout.meta
    assert meta["separation_hint"] == "optim." and meta["bucket_groups"] == [0, 1, 1, 1]
    assert len(ex.figure.data[1].x) > 0
    assert all(h.startswith("<b>optim.") for h in ex.figure.data[1].hovertext)
    assert ex.assignment == assign_buckets(ex.items, 4, "optim.")
    assert "group 1" in ex.summary.value
    overall = max(ex.assignment.bucket_nbytes) / (ex.assignment.nbytes / 4)
    assert f"{overall:.2f}× an even split of all bytes" in ex.summary.value
    # a hint that splits the items needs 2 buckets: the slider cannot go below
    assert ex.buckets.min == 2
    ex.buckets.value = 1
    assert ex.buckets.value == 2 and ex.figure.layout.meta["n_buckets"] == 2
    ex.hint.value = "model.layers.1."
    assert ex.assignment == assign_buckets(ex.items, 2, "model.layers.1.")
    ex.separate.value = False
    assert ex.buckets.min == 1 and ex.figure.layout.meta["separation_hint"] is None
    assert ex.buckets.value == 2


def test_without_a_state_dict_and_bad_arguments() -> None:
    ex = BucketExplorer(config="llama3-8b", optimizer=False, buckets=16, separate=True)
    assert "state dict" not in ex.source.options
    assert ex.items == sized_items("llama3-8b", optimizer=False)
    assert ex.figure.layout.meta["n_buckets"] == 16
    assert ex.figure.layout.meta["separation_hint"] == "optim."  # matches nothing: one group
    assert ex.figure.layout.meta["bucket_groups"] == [0] * 16
    with pytest.raises(InvalidArgumentError):
        BucketExplorer(config="nope")
    with pytest.raises(InvalidArgumentError):
        BucketExplorer(buckets=33)


# ---------------------------------------------------------------------------------------------
# TimelineView and save_progress


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(256, 1024, generator=g), "b": torch.randn(256, 1024, generator=g),
            "step": seed}


def test_timeline_view_shows_figure_and_summary(tmp_path: Path) -> None:
    with AsyncWriter(tmp_path / "c", workers=2) as writer:
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        tl = writer.wait()
        view = TimelineView(tl)
        assert view.figure.layout.meta == timeline_figure(tl).layout.meta
        text = view.summary.value
        assert "returned to the caller after" in text and "finished after" in text
        assert f"{1e3 * tl.returned_s:.1f} ms" in text
        assert f"{tl.nbytes:,} B" in text and "GB/s" in text and "committed" in text
        for _bucket, name, nbytes, io_path in tl.files:
            assert name in text and f"{nbytes:,}" in text and io_path in text
        dcp.save({"x": torch.ones(1000)}, checkpoint_id=str(tmp_path / "d"),
                 storage_writer=writer, no_dist=True)
        second = writer.wait()
    view.show(second)
    assert view.timeline is second
    assert view.figure.layout.meta == timeline_figure(second).layout.meta
    assert str(tmp_path / "d") in view.summary.value
    with pytest.raises(InvalidArgumentError):
        TimelineView(None)


class _Screen(io.StringIO):
    """tqdm's output; remembers every percentage it showed."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[int] = []
        self.partial = threading.Event()

    def write(self, s: str) -> int:
        for pct in re.findall(r"(\d+)%\|", s):
            self.shown.append(int(pct))
            if 0 < int(pct) < 100:
                self.partial.set()
        return super().write(s)


def test_save_progress_shows_bytes_written_so_far(tmp_path: Path) -> None:
    screen = _Screen()

    def hold_bucket_1(bucket, phase, file, offset, nbytes):
        # bucket 1 writes only once the bar has shown bucket 0's bytes (or after 20 s)
        if bucket == 1 and phase == "write":
            screen.partial.wait(20)

    with AsyncWriter(tmp_path / "c", workers=2, io_hook=hold_bucket_1) as writer:
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        tl = save_progress(writer, file=screen, mininterval=0, interval_s=0.002)
    assert screen.partial.is_set()
    assert any(0 < p < 100 for p in screen.shown) and screen.shown[-1] == 100
    assert tl.committed and tl.nbytes > 0
    out = screen.getvalue()
    assert "committed" in out and out.lstrip("\r").startswith("c:")


def test_save_progress_raises_the_writer_error(tmp_path: Path) -> None:
    def broken(bucket, phase, file, offset, nbytes):
        if bucket == 0 and phase == "write":
            raise OSError(errno.EIO, "injected")

    screen = io.StringIO()
    with AsyncWriter(tmp_path / "c", io_hook=broken) as writer:
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        with pytest.raises(WriterError, match="injected"):
            save_progress(writer.last, file=screen, desc="broken", interval_s=0.002)
    assert screen.getvalue().lstrip("\r").startswith("broken:")
    assert not (tmp_path / "c" / ".metadata").exists()


def test_save_progress_needs_a_save(tmp_path: Path) -> None:
    with AsyncWriter(tmp_path / "c") as writer:
        with pytest.raises(InvalidArgumentError, match="no save"):
            save_progress(writer)
    with pytest.raises(InvalidArgumentError):
        save_progress(object())
    with pytest.raises(InvalidArgumentError, match="interval_s"):
        save_progress(writer, interval_s=0)


def test_polling_timeline_in_flight_never_leaves_a_stale_final_timeline(tmp_path: Path) -> None:
    release = threading.Event()

    def hold(bucket, phase, file, offset, nbytes):
        if phase == "write":
            release.wait(20)

    with AsyncWriter(tmp_path / "c", workers=2, io_hook=hold) as writer:
        dcp.save(_state(), storage_writer=writer, no_dist=True)
        handle = writer.last
        recorder = handle._save.recorder  # white box: pause the poller inside freeze()
        freeze = recorder.freeze
        inside, resume = threading.Event(), threading.Event()

        def paused_freeze(*args, **kwargs):
            out = freeze(*args, **kwargs)
            if threading.current_thread().name == "poller":
                inside.set()
                resume.wait(20)
            return out

        recorder.freeze = paused_freeze
        poller = threading.Thread(target=lambda: handle.timeline, name="poller")
        poller.start()
        assert inside.wait(20)  # the poller took its snapshot of a save in flight
        release.set()  # the save runs to its commit
        assert handle._save.finished.wait(20)
        resume.set()
        poller.join(20)
        final = handle.timeline
        writer.wait()
    assert final.committed and any(e.phase == "commit" for e in final.events)
