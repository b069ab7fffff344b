"""Staging memory (``ckptlab.write._staging``): aligned slots reused from save to save, the
copies a snapshot is made of, and state dicts staged for ``dcp.async_save``."""

from __future__ import annotations

import threading

import pytest
import torch

from ckptlab.write._staging import (
    SLAB_MIN_NBYTES,
    PendingCopy,
    StagingArena,
    StagingState,
    copy_in,
    copy_pairs,
    in_lanes,
    pair_nbytes,
    stage_tree,
    tree_nbytes,
)
from ckptlab.write.timeline import _Recorder


def test_slots_are_aligned_reused_and_found() -> None:
    arena = StagingArena()
    assert arena.begin(10_000) == 2 << 20  # one slab: what the save asked, to 2 MiB
    assert arena.capacity_nbytes == 2 << 20
    a, va = arena.alloc(100)
    b, vb = arena.alloc(5000)
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert b.data_ptr() - a.data_ptr() == 4096  # 100 bytes take one block
    assert len(va) == 100 and len(vb) == 5000 and arena.used_nbytes == 4096 + 8192
    assert bytes(arena.find(b)) == bytes(vb)  # type: ignore[arg-type]
    assert arena.find(a[1:]) is None  # not at a slot start
    assert arena.find(torch.zeros(10)) is None  # not staging memory
    base = a.data_ptr()
    assert arena.begin(10_000) == 0  # a new save: same memory (nothing mapped), rewound
    assert arena.used_nbytes == 0 and arena.alloc(1)[0].data_ptr() == base
    arena.release()
    assert arena.capacity_nbytes == 0


def test_staging_memory_is_private_and_huge_page_advised() -> None:
    from ckptlab.testing.memory import mapping_flags

    arena = StagingArena()
    arena.begin(SLAB_MIN_NBYTES + 1)
    slot, _ = arena.alloc(4096)
    flags = mapping_flags(slot.data_ptr())
    if flags is None:
        pytest.skip("/proc/self/smaps cannot be read here")
    assert "sh" not in flags  # private anonymous memory (shmem faults cost more)
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert "hg" in flags  # transparent huge pages: one fault per 2 MiB
    assert arena.capacity_nbytes % (2 << 20) == 0 and arena.capacity_nbytes > SLAB_MIN_NBYTES
    arena.release()


def test_a_full_arena_grows_without_moving_handed_out_slots() -> None:
    arena = StagingArena()
    arena.begin(0)
    first, _ = arena.alloc(SLAB_MIN_NBYTES - 4096)
    first.fill_(3)
    second, _ = arena.alloc(8192)  # does not fit: a new slab
    assert arena.capacity_nbytes > SLAB_MIN_NBYTES
    assert int(first[0]) == 3 and second.data_ptr() % 4096 == 0


def test_copy_in_fills_slots_and_records_one_span_per_bucket() -> None:
    arena = StagingArena()
    arena.begin(1 << 20)
    rec = _Recorder("/x", 0)
    tensors = [torch.arange(1000, dtype=torch.float32), torch.ones(3, 5, dtype=torch.int64),
               torch.full((7,), 2.5, dtype=torch.bfloat16)]
    copies: list[list[PendingCopy]] = [[], []]
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        slot, _ = arena.alloc(nbytes)
        copies[i % 2].append(PendingCopy(i % 2, f"f{i % 2}", slot, t, nbytes, threading.Event()))
    copy_in(rec, copies)
    for batch in copies:
        for c in batch:
            assert c.ready.is_set()
            assert torch.equal(c.slot.view(c.tensor.dtype).view(c.tensor.shape), c.tensor)
    stages = sorted((e.bucket, e.nbytes) for e in rec.events if e.phase == "stage")
    assert stages == [(0, 4000 + 14), (1, 120)]


def test_abort_wakes_every_waiting_worker() -> None:
    state = StagingState()
    events = [state.event() for _ in range(3)]
    error = RuntimeError("copy failed")
    state.abort(error)
    assert state.error is error and all(ev.is_set() for ev in events)


def test_stage_tree_copies_tensors_into_staging_and_other_values_deeply() -> None:
    arena = StagingArena()
    sd = {"w": torch.randn(64, 32), "p": torch.nn.Parameter(torch.ones(5)),
          "empty": torch.empty(0, 3), "nested": [torch.arange(10), (torch.zeros(2), 7)],
          "cfg": {"lr": 0.1, "names": ["a"]}}
    assert tree_nbytes(sd) == 2 * 4096 + 4096 + 0 + 4096 + 4096  # each tensor in whole blocks
    arena.begin(tree_nbytes(sd))
    staged, nbytes = stage_tree(arena, sd)
    assert nbytes == 64 * 32 * 4 + 5 * 4 + 10 * 8 + 2 * 4
    assert torch.equal(staged["w"], sd["w"]) and staged["w"].data_ptr() % 4096 == 0
    assert arena.find(staged["w"]) is not None
    assert staged["empty"].shape == (0, 3)
    assert isinstance(staged["nested"], list) and isinstance(staged["nested"][1], tuple)
    assert staged["nested"][1][1] == 7
    sd["w"].add_(1.0)  # the caller changes its tensors: the staged copy is a snapshot
    sd["cfg"]["names"].append("b")
    assert not torch.equal(staged["w"], sd["w"]) and staged["cfg"]["names"] == ["a"]


def test_stage_tree_can_leave_the_copies_to_several_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    arena = StagingArena()
    sd = {"a": torch.randn(300, 7), "b": [torch.arange(5000), torch.ones(3, dtype=torch.int8)],
          "step": 4}
    arena.begin(tree_nbytes(sd))
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    staged, nbytes = stage_tree(arena, sd, pairs)
    assert len(pairs) == 3 and nbytes == 300 * 7 * 4 + 5000 * 8 + 3
    assert not torch.equal(staged["a"], sd["a"])  # not copied yet: zero-filled slots
    with ThreadPoolExecutor(1) as pool:
        assert len(in_lanes(copy_pairs, pairs, pool, 2)) == 2  # two shares, two results
    assert torch.equal(staged["a"], sd["a"]) and torch.equal(staged["b"][0], sd["b"][0])
    assert torch.equal(staged["b"][1], sd["b"][1]) and staged["step"] == 4


def test_lanes_by_size_end_together_and_keep_the_order() -> None:
    from concurrent.futures import ThreadPoolExecutor

    sizes = [1, 100, 2, 3, 50, 49, 4]  # round-robin: 1+2+50+4 = 57 against 100+3+49 = 152
    with ThreadPoolExecutor(2) as pool:
        shares = in_lanes(list, sizes, pool, 3, nbytes=int)
        plain = in_lanes(list, sizes, pool, 2)
    assert sorted(x for share in shares for x in share) == sorted(sizes)  # each item once
    assert [sum(share) for share in shares] == [100, 55, 54]  # largest first, lightest share
    assert all(share == sorted(share, key=sizes.index) for share in shares)  # the items' order
    assert plain == [[1, 2, 50, 4], [100, 3, 49]]  # without sizes: dealt round-robin
    pair = (torch.empty(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64))
    assert pair_nbytes(pair) == 48


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8, torch.bool, torch.complex64])
def test_stage_tree_keeps_dtypes_and_shapes(dtype: torch.dtype) -> None:
    arena = StagingArena()
    t = torch.zeros(3, 4, dtype=dtype)
    arena.begin(tree_nbytes(t))
    out, nbytes = stage_tree(arena, t)
    assert out.dtype == dtype and out.shape == (3, 4) and nbytes == 12 * t.element_size()


def test_copy_in_with_helper_threads_copies_everything_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    arena = StagingArena()
    arena.begin(4 << 20)
    rec = _Recorder("/x", 0)
    tensors = [torch.full((1000 + i,), float(i)) for i in range(9)]
    copies: list[list[PendingCopy]] = [[], [], []]
    for i, t in enumerate(tensors):
        slot, _ = arena.alloc(t.nbytes)
        copies[i % 3].append(PendingCopy(i % 3, f"f{i % 3}", slot, t, t.nbytes,
                                         threading.Event()))
    with ThreadPoolExecutor(2) as pool:
        copy_in(rec, copies, pool, lanes=3)
        for batch in copies:
            for c in batch:
                assert c.ready.is_set() and torch.equal(c.slot.view(torch.float32), c.tensor)
        stages = sorted((e.bucket, e.nbytes) for e in rec.events if e.phase == "stage")
        assert stages == [(b, sum(t.nbytes for t in tensors[b::3])) for b in range(3)]
        bad = [PendingCopy(0, "f0", torch.empty(4, dtype=torch.uint8), torch.ones(3), 12,
                           threading.Event()), copies[1][0]]
        with pytest.raises(RuntimeError):  # a copy that cannot happen: raised, others done
            copy_in(_Recorder("/x", 0), [bad], pool, lanes=2)
