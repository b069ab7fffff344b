"""AsyncWriter round trips: stock dcp.load reads its checkpoints bit-exact, tensors are
4096-aligned in the files, the state dict can change right after dcp.save returns, async_save,
reuse, a second save while one is in flight, and 2 real gloo ranks."""

from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path

import async_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckptlab.errors import WriterError
from ckptlab.plan import inspect_dcp, run_ranks
from ckptlab.write import PHASES, AsyncWriter, Timeline

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _assert_equal_state(got, want, where="") -> None:
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want.detach()), where
    elif isinstance(want, dict):
        for k, v in want.items():
            _assert_equal_state(got[k], v, f"{where}.{k}")
    else:
        assert got == want, where


def _load(path: Path, like: dict) -> dict:
    target = async_workers.zeros_like_state(like)
    dcp.load(target, checkpoint_id=str(path), no_dist=True)  # stock FileSystemReader
    return target


def _snapshot(state):
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _snapshot(v) for k, v in state.items()}
    return state


def _mutate(state) -> None:
    with torch.no_grad():
        for v in state.values():
            if isinstance(v, dict):
                _mutate(v)
            elif isinstance(v, torch.Tensor) and v.numel():
                v.fill_(True) if v.dtype == torch.bool else v.fill_(-7)


def test_round_trip_snapshot_isolation_and_alignment(tmp_path: Path) -> None:
    state = async_workers.mixed_state()
    want = _snapshot(state)
    path = tmp_path / "ckpt"
    with AsyncWriter(path) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        _mutate(state)  # right after return, before the data is on disk
        timeline = writer.wait()
    assert isinstance(timeline, Timeline) and timeline.committed and timeline.error is None
    _assert_equal_state(_load(path, want), want)
    layout = inspect_dcp(path)
    tensors = [i for i in layout.items if i.kind == "tensor"]
    assert len(tensors) == 11
    for item in tensors:
        assert item.offset % 4096 == 0, item.fqn
        assert item.data_offset is not None and item.data_offset % 4096 == 0, item.fqn
        assert item.data_alignment == 4096
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    sizes = {f: os.path.getsize(path / f) for f in ("__0_0.distcp", "__0_1.distcp")}
    assert {(f, n) for _, f, n, _ in timeline.files} == set(sizes.items())


def test_timeline_records_every_phase(tmp_path: Path) -> None:
    state = async_workers.mixed_state()
    with AsyncWriter(tmp_path / "c", workers=2) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        tl = writer.wait()
    phases = {e.phase for e in tl.events}
    assert {"plan", "stage", "open", "write", "fsync", "close", "metadata", "commit"} <= phases
    assert phases <= set(PHASES)
    for b, name, nbytes, io_path in tl.files:
        events = tl.bucket_events(b)
        assert {e.file for e in events} == {name}
        written = sum(e.nbytes for e in events if e.phase == "write")
        assert written == -(-nbytes // 4096) * 4096  # whole blocks, truncated afterwards
        assert io_path in ("O_DIRECT", "POSIX")
        first = {}
        for e in sorted(events, key=lambda e: e.start_s):
            first.setdefault(e.phase, e)
        # the worker opens its file while the caller is still copying (pipelined), but the
        # last write ends after the last copy, and fsync comes after every write
        assert first["open"].start_s < first["write"].start_s < first["fsync"].start_s
        stage = [e for e in events if e.phase == "stage"]
        assert len(stage) == 1
        assert stage[0].end_s <= max(e.end_s for e in events if e.phase == "write")
    commit = [e for e in tl.events if e.phase == "commit"]
    assert len(commit) == 1 and commit[0].bucket is None and commit[0].file == ".metadata"
    assert commit[0].start_s >= max(e.end_s for e in tl.events if e.phase == "fsync")
    assert tl.returned_s is not None and tl.returned_s <= commit[0].start_s
    staged = sum(e.nbytes for e in tl.events if e.phase == "stage")
    assert staged == sum(v.nbytes for v in [state["model"]["big"], state["optim"]["m"]]) + sum(
        t.numel() * t.element_size() for k, t in state["model"].items() if k != "big")
    d = tl.to_dict()
    json.dumps(d)
    assert d["assignment"]["buckets"] and d["nbytes"] == tl.nbytes


def test_one_writer_many_saves_reuses_staging_memory(tmp_path: Path) -> None:
    with AsyncWriter(tmp_path / "unused", workers=1, buckets=3) as writer:
        states = []
        for step in range(3):
            state = async_workers.mixed_state(seed=step)
            states.append(_snapshot(state))
            dcp.save(state, checkpoint_id=str(tmp_path / f"step{step}"), storage_writer=writer,
                     no_dist=True)
            if step == 0:
                capacity = writer.staging_nbytes
            assert writer.staging_nbytes == capacity  # reused, not reallocated
        writer.wait()
    for step, want in enumerate(states):
        _assert_equal_state(_load(tmp_path / f"step{step}", want), want)
        assert len([f for f in os.listdir(tmp_path / f"step{step}") if f.endswith(".distcp")]) == 3


def test_reused_staging_memory_never_leaks_an_earlier_save(tmp_path: Path) -> None:
    """A second save of other shapes reuses the first one's staging slots: its files hold
    its own bytes and zeros, never a byte the first save staged there."""
    mark = 0xAB
    first = {"a": torch.full((3 << 20 | 5,), mark, dtype=torch.uint8),
             "b": torch.full((4099,), mark, dtype=torch.uint8)}
    second = {"x": torch.arange(700_001, dtype=torch.float32),  # ends mid-block
              "y": torch.arange(33, dtype=torch.int16), "z": torch.zeros(5, 3)}
    with AsyncWriter(tmp_path / "unused", workers=2) as writer:
        dcp.save(first, checkpoint_id=str(tmp_path / "one"), storage_writer=writer,
                 no_dist=True)
        writer.wait()
        capacity = writer.staging_nbytes
        dcp.save(second, checkpoint_id=str(tmp_path / "two"), storage_writer=writer,
                 no_dist=True)
        writer.wait()
        assert writer.staging_nbytes == capacity  # the same memory, reused
    _assert_equal_state(_load(tmp_path / "two", second), second)
    for name in os.listdir(tmp_path / "two"):
        assert bytes([mark]) * 64 not in (tmp_path / "two" / name).read_bytes(), name


def test_async_save_future_means_committed(tmp_path: Path) -> None:
    state = async_workers.mixed_state()
    want = _snapshot(state)
    with AsyncWriter(tmp_path / "a") as writer:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fut = async_workers.single_process_async_save(state, writer)
        _mutate(state)  # stage() already copied
        fut.result(timeout=60)
        assert (tmp_path / "a" / ".metadata").exists()
        tl = writer.last.timeline
        assert tl.committed
        # staged once by stage(); write_data found the tensors in staging memory
        assert sum(e.nbytes for e in tl.events if e.phase == "stage" and e.bucket is not None) \
            == 0
    _assert_equal_state(_load(tmp_path / "a", want), want)
    assert all(i.data_offset % 4096 == 0 for i in inspect_dcp(tmp_path / "a").items
               if i.kind == "tensor")


def test_buffered_writes_and_separation_hint(tmp_path: Path) -> None:
    state = async_workers.mixed_state()
    want = _snapshot(state)
    with AsyncWriter(tmp_path / "b", direct=False, workers=1, buckets=2,
                     separation_hint="optim.") as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        tl = writer.wait()
    assert {p for *_, p in tl.files} == {"POSIX"}
    _assert_equal_state(_load(tmp_path / "b", want), want)
    files = {i.fqn: i.file for i in inspect_dcp(tmp_path / "b").items}
    optim_files = {f for k, f in files.items() if k.startswith("optim.")}
    assert optim_files == {"__0_1.distcp"}
    assert not optim_files & {f for k, f in files.items() if not k.startswith("optim.")}


def test_o_direct_refused_midway_falls_back_to_buffered(tmp_path: Path) -> None:
    import errno

    refused = []

    def einval_once(bucket, phase, file, offset, nbytes):
        if phase == "write" and not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")

    state = async_workers.mixed_state()
    want = _snapshot(state)
    with AsyncWriter(tmp_path / "e", workers=1, buckets=1, io_hook=einval_once) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        tl = writer.wait()
    assert refused and tl.files[0][3] == "POSIX"
    _assert_equal_state(_load(tmp_path / "e", want), want)


def _blocking_hook(gate: threading.Event, entered: threading.Event):
    def hook(bucket, phase, file, offset, nbytes):
        if phase == "write":
            entered.set()
            assert gate.wait(30)
    return hook


def test_second_save_in_flight_raises_with_on_busy_raise(tmp_path: Path) -> None:
    gate, entered = threading.Event(), threading.Event()
    writer = AsyncWriter(tmp_path / "x", on_busy="raise", io_hook=_blocking_hook(gate, entered))
    try:
        dcp.save(async_workers.mixed_state(), storage_writer=writer, no_dist=True)
        assert entered.wait(30)
        with pytest.raises(WriterError, match="still in flight"):
            dcp.save(async_workers.mixed_state(1), checkpoint_id=str(tmp_path / "y"),
                     storage_writer=writer, no_dist=True)
        assert not (tmp_path / "y" / ".metadata").exists()
    finally:
        gate.set()
        writer.close()
    assert (tmp_path / "x" / ".metadata").exists()


def test_second_save_waits_and_never_mixes(tmp_path: Path) -> None:
    gate, entered = threading.Event(), threading.Event()
    writer = AsyncWriter(tmp_path / "first", io_hook=_blocking_hook(gate, entered))
    first, second = async_workers.mixed_state(0), async_workers.mixed_state(1)
    want_first, want_second = _snapshot(first), _snapshot(second)
    dcp.save(first, storage_writer=writer, no_dist=True)
    assert entered.wait(30)
    done = threading.Event()

    def save_second() -> None:
        dcp.save(second, checkpoint_id=str(tmp_path / "second"), storage_writer=writer,
                 no_dist=True)
        done.set()

    t = threading.Thread(target=save_second)
    t.start()
    assert not done.wait(0.5)  # blocked behind the first save's writes
    assert not (tmp_path / "first" / ".metadata").exists()
    gate.set()
    t.join(60)
    assert done.is_set()
    writer.wait()
    writer.close()
    _assert_equal_state(_load(tmp_path / "first", want_first), want_first)
    _assert_equal_state(_load(tmp_path / "second", want_second), want_second)


def test_overwrite_keeps_the_old_checkpoint_until_the_commit(tmp_path: Path) -> None:
    path = tmp_path / "same"
    with AsyncWriter(path) as writer:
        dcp.save(async_workers.mixed_state(0), storage_writer=writer, no_dist=True)
        writer.wait()
    old_names = sorted(os.listdir(path))
    assert old_names == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    seen = []

    def check(bucket, phase, file, offset, nbytes):
        if phase in ("open", "rename"):  # the old checkpoint is whole until the rename
            seen.append((file, sorted(n for n in os.listdir(path) if n in old_names)))

    state = async_workers.mixed_state(1)
    want = _snapshot(state)
    with AsyncWriter(path, io_hook=check) as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        writer.wait()
    assert {f for f, _ in seen} == {"g1__0_0.distcp", "g1__0_1.distcp", ".metadata"}
    assert all(names == old_names for _, names in seen)
    assert sorted(os.listdir(path)) == [".metadata", "g1__0_0.distcp", "g1__0_1.distcp"]
    _assert_equal_state(_load(path, want), want)
    # DCP wraps what prepare_local_plan raises in its CheckpointException
    from torch.distributed.checkpoint.api import CheckpointException

    with AsyncWriter(path, overwrite=False) as writer, \
            pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=writer, no_dist=True)
    cause = info.value.failures[0][0]  # (exception, traceback frames)
    assert isinstance(cause, WriterError) and "overwrite=False" in str(cause)
    assert (path / ".metadata").exists()


@pytest.mark.slow  # 26 s: spawns two ranks
def test_two_gloo_ranks_round_trip(tmp_path: Path) -> None:
    """Two ranks save, then save again over it: the coordinator picks the next generation
    for every rank, and after the commit removes every rank's old files."""
    path = tmp_path / "sharded"
    out = run_ranks(async_workers.save_sharded_async, 2, str(path), True, timeout=180)
    assert out[0]["committed"] and out[1]["committed"]
    assert out[0]["files"] == ["__0_0.distcp", "__0_1.distcp"]
    assert out[1]["files"] == ["__1_0.distcp", "__1_1.distcp"]
    assert "wait_ranks" in out[0]["phases"] and "commit" in out[0]["phases"]
    assert "commit" not in out[1]["phases"]
    assert out[0]["first"] == [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                               "__1_1.distcp"]  # the rank markers are gone
    assert out[0]["committed2"] and out[1]["committed2"]
    assert out[0]["files2"] == ["g1__0_0.distcp", "g1__0_1.distcp"]
    assert out[1]["files2"] == ["g1__1_0.distcp", "g1__1_1.distcp"]
    assert out[0]["old_whole"] and out[1]["old_whole"]  # while the new files were written
    names = sorted(os.listdir(path))
    assert names == [".metadata", "g1__0_0.distcp", "g1__0_1.distcp", "g1__1_0.distcp",
                     "g1__1_1.distcp"]
    full = async_workers.full_state(1)
    target = {k: torch.zeros_like(v) for k, v in full.items()}
    target["step"] = 0
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    for k, v in full.items():
        assert torch.equal(target[k], v), k
    assert target["step"] == 12
    for item in inspect_dcp(path).items:
        if item.kind == "tensor":
            assert item.data_offset % 4096 == 0


def test_progress_counts_up_to_the_total(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptlab.write import AsyncWriter

    state = {"a": torch.arange(5000, dtype=torch.float32), "b": torch.ones(3, 3), "n": 1}
    with AsyncWriter(tmp_path / "c") as writer:
        dcp.save(state, storage_writer=writer, no_dist=True)
        handle = writer.last
        timeline = handle.wait()
        written, total = handle.progress()
    assert written == total == timeline.nbytes > 20000
    assert total % 4096 == 0


def test_fsync_is_the_switch_and_sync_files_its_earlier_name(tmp_path: Path) -> None:
    with AsyncWriter(tmp_path / "a", fsync=False) as w:
        assert w.fsync is False and w.sync_files is False
        w.sync_files = True
        assert w.fsync is True
    with AsyncWriter(tmp_path / "b", sync_files=False) as w:
        assert w.fsync is False


def test_staging_memory_that_cannot_be_mapped_fails_this_save_only(tmp_path: Path,
                                                                     monkeypatch) -> None:
    """No memory for staging: a WriterError saying so, and the writer takes the next save
    (before, the half-begun save stayed in flight and every later save waited for it)."""
    import errno

    from ckptlab.write import _staging

    def no_memory(nbytes: int, **kw: object) -> memoryview:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    state = {"w": torch.arange(1000.0)}
    with AsyncWriter(tmp_path / "ckpt", commit_timeout_s=5, on_busy="raise") as writer:
        with monkeypatch.context() as m:
            m.setattr(_staging, "aligned_buffer", no_memory)
            with pytest.raises(WriterError, match=r"cannot map [\d,]+ bytes of staging memory.*"
                                                  r"Cannot allocate memory"):
                writer.stage(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            async_workers.single_process_async_save(state, writer).result(timeout=60)
    assert torch.equal(_load(tmp_path / "ckpt", state)["w"], state["w"])


def test_a_rank_told_by_its_plan_shows_in_the_timeline(tmp_path: Path) -> None:
    """torch 2.7 calls set_up_storage_writer without a rank; the coordinator's plan carries it,
    and the save's timeline says it too."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    writer = AsyncWriter(tmp_path / "ckpt")
    try:
        writer.set_up_storage_writer(False)  # torch 2.7's call
        planner = DefaultSavePlanner()
        planner.set_up_planner({"x": torch.ones(4)}, is_coordinator=False)
        plan = writer.prepare_local_plan(planner.create_local_plan())
        plans = writer.prepare_global_plan([plan, plan])
        writer.write_data(plans[1], planner).wait()
        save = writer._current
        assert save is not None and save.rank == 1 and save.snapshot().rank == 1
    finally:
        writer._current = None  # the other rank never comes: nothing to wait for
        writer.close()
