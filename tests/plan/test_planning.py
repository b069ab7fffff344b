"""The coordinator's global step (dedup, metadata, validation) against torch's planner, and
incremental re-planning against planning from scratch."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from ckptlab.errors import InvalidArgumentError, PlanError
from ckptlab.plan.items import LocalPlan, WriteItem, local_plan
from ckptlab.plan.planning import PlanBook, compare_plans, global_plan, merge_delta
from ckptlab.plan.reshard import Chunk
from ckptlab.plan.simulate import simulate_plans
from ckptlab.plan.torch_plans import from_torch_plan, metadata_chunks, torch_plans
from ckptlab.testing.strategies import local_plan_sets


def torch_global(plans: list[LocalPlan]):
    return DefaultSavePlanner(flatten_state_dict=False).create_global_plan(torch_plans(plans))


def chunk_sets(result) -> dict[str, tuple]:
    return {f: (e.size, e.dtype, sorted(e.chunks, key=lambda c: (c.offsets, c.sizes)))
            for f, e in result.tensors.items()}


def written_once(result, plans: list[LocalPlan]) -> None:
    """Every item of every local plan is written by exactly one rank that holds it."""
    holders: dict = {}
    for p in plans:
        for it in p.items:
            holders.setdefault(it.key, set()).add(p.rank)
    writers: dict = {}
    for p in result.plans:
        for it in p.items:
            assert it.key not in writers, f"{it.key} written twice"
            writers[it.key] = p.rank
    assert writers.keys() == holders.keys()
    for key, r in writers.items():
        assert r in holders[key]


@given(local_plan_sets())
def test_global_plan_matches_torch(plans):
    mine = global_plan(plans)
    torch_plan, md = torch_global(plans)
    theirs = metadata_chunks(md)
    assert {f: (s, d, sorted(c, key=lambda c: (c.offsets, c.sizes)))
            for f, (s, d, c) in theirs.items()} == chunk_sets(mine)
    assert set(mine.objects) == {f for f in md.state_dict_metadata} - set(theirs)
    written_once(mine, plans)
    # torch's dedup keeps the same set of items overall (maybe on other ranks)
    torch_items = sorted((it.key for p in torch_plan for it in from_torch_plan(p, 0).items),
                         key=repr)
    assert torch_items == sorted((it.key for p in mine.plans for it in p.items), key=repr)


def lone_plan_volume_checked() -> bool:
    """Whether this torch checks the volume of a one-rank save's chunks (2.7 does; 2.13, like
    ckptlab, checks volumes only from two plans on: a lone rank may save part of a tensor)."""
    item = WriteItem("t", "tensor", Chunk((1,), (1,)), (2,), "float32")
    try:
        torch_global([local_plan(0, [item])])
    except ValueError:
        return True
    return False


@given(local_plan_sets(broken=True))
def test_validation_verdict_matches_torch(plans):
    mine = global_plan(plans, validate=False)
    try:
        torch_global(plans)
        torch_valid = True
    except ValueError:
        torch_valid = False
    kinds = {p.kind for p in mine.problems}
    if torch_valid:  # ckptlab may only add what torch does not check: differing replicas
        assert kinds <= {"mismatch"}
    elif not (len(plans) == 1 and lone_plan_volume_checked()):
        assert mine.problems
    if mine.problems:
        with pytest.raises(PlanError, match="invalid global plan"):
            global_plan(plans)


def test_problems_name_the_tensor_and_kind():
    good = [Chunk((0, 0), (2, 3)), Chunk((2, 0), (2, 3))]
    item = lambda c: WriteItem("w", "shard", c, (4, 3), "float32")  # noqa: E731
    overlap = [local_plan(0, [item(good[0])]), local_plan(1, [item(Chunk((1, 0), (2, 3)))])]
    with pytest.raises(PlanError, match=r"w: overlap: \(0, 0\)\+\(2, 3\) \(rank 0\) and \(1, 0\)\+\(2, 3\) \(rank 1\)"):
        global_plan(overlap)
    gap = [local_plan(0, [item(good[0])]), local_plan(1, [])]
    with pytest.raises(PlanError, match=r"w: volume"):
        global_plan(gap)
    oob = [local_plan(0, [item(good[0])]), local_plan(1, [item(Chunk((3, 0), (2, 3)))])]
    with pytest.raises(PlanError, match=r"w: out of bounds: \(3, 0\)\+\(2, 3\) \(rank 1\)"):
        global_plan(oob)
    differ = [local_plan(0, [item(good[0]), item(good[1])]),
              local_plan(1, [dataclasses.replace(item(good[1]), dtype="bfloat16")])]
    result = global_plan(differ, validate=False)
    assert [p.kind for p in result.problems] == ["mismatch"]


def test_replicas_go_to_the_least_loaded_holder():
    big = WriteItem("big", "shard", Chunk((0,), (100,)), (200,), "float32")
    big2 = WriteItem("big", "shard", Chunk((100,), (100,)), (200,), "float32")
    rep = WriteItem("rep", "tensor", Chunk((0,), (10,)), (10,), "float32")
    plans = [local_plan(0, [big, rep]), local_plan(1, [big2, rep]),
             local_plan(2, [rep, WriteItem("o", "bytes")])]
    result = global_plan(plans)
    assert result.rank_nbytes == (400, 400, 40)  # rank 2 (empty otherwise) writes the replica
    assert result.plans[0].items == (big,) and result.plans[2].items[0] == rep
    assert result.tensors["rep"].writers == (2,)
    assert result.plans[1] is not plans[1] and result.plans[2] is plans[2]


@st.composite
def plan_changes(draw):
    """Random local plans and a second set in which a few ranks changed."""
    plans = draw(local_plan_sets(max_world=5))
    pool = [it for p in plans for it in p.items] or [WriteItem("x", "bytes")]
    new = list(plans)
    for r in draw(st.sets(st.integers(0, len(plans) - 1), min_size=1, max_size=3)):
        items = list(plans[r].items)
        for _ in range(draw(st.integers(1, 3))):
            how = draw(st.sampled_from(["drop", "add", "copy", "resize"]))
            if how == "drop" and items:
                items.pop(draw(st.integers(0, len(items) - 1)))
            elif how == "add":
                items.append(WriteItem(f"new{draw(st.integers(0, 2))}", "bytes"))
            elif how == "copy":  # take an item another rank holds: a new replica
                it = draw(st.sampled_from(pool))
                if it not in items:
                    items.append(it)
            elif how == "resize" and items:
                i = draw(st.integers(0, len(items) - 1))
                it = items[i]
                if it.chunk is not None and it.chunk.sizes:
                    sizes = (it.chunk.sizes[0] + 1, *it.chunk.sizes[1:])
                    items[i] = dataclasses.replace(it, chunk=Chunk(it.chunk.offsets, sizes))
        new[r] = local_plan(r, items)
    return plans, new


@given(plan_changes())
def test_update_equals_planning_from_scratch(change):
    old, new = change
    book = PlanBook(old)
    before = book.result
    before_tensors = chunk_sets(before)
    before_plans = [p.items for p in before.plans]
    sent = [p if p != o else o.fingerprint for p, o in zip(new, old)]  # unchanged: fingerprint
    diff = book.update(sent)
    assert set(diff.changed) == {r for r in range(len(new)) if new[r] != old[r]}
    fresh = PlanBook(new).result
    got = book.result
    assert chunk_sets(got) == chunk_sets(fresh)
    assert set(got.objects) == set(fresh.objects)
    # the same problems; the rank writing a replica may differ (an update keeps writers)
    assert sorted(re.sub(r" \(rank \d+\)", "", str(p)) for p in got.problems) == \
        sorted(re.sub(r" \(rank \d+\)", "", str(p)) for p in fresh.problems)
    written_once(got, new)
    # the earlier result is a snapshot: unchanged by the update
    assert chunk_sets(before) == before_tensors
    assert [p.items for p in before.plans] == before_plans


def test_update_keeps_replica_writers_and_touches_only_changed_ranks():
    plans = simulate_plans("tiny", 8)
    book = PlanBook(plans)
    first = book.result
    extra = local_plan(3, (*plans[3].items, WriteItem("rng.3", "bytes")))
    book.update([extra if r == 3 else p.fingerprint for r, p in enumerate(plans)])
    second = book.result
    assert second.objects["rng.3"] == 3
    assert {f: e.writers for f, e in second.tensors.items()} == \
        {f: e.writers for f, e in first.tensors.items()}
    same = [r for r in range(8) if second.plans[r] is first.plans[r]]
    assert same == [0, 1, 2, 4, 5, 6, 7]


def test_compare_and_merge():
    plans = simulate_plans("tiny", 4)
    other = local_plan(2, plans[2].items[:-1])
    diff = compare_plans(plans, [plans[0], plans[1].fingerprint, other, plans[3]])
    assert diff.changed == (2,) and not diff.same
    assert compare_plans(plans, plans).same
    assert compare_plans(plans, plans[:3]).removed == (3,)
    merged = merge_delta(plans, {2: other})
    assert merged[2] is other and merged[0] is plans[0]
    assert merge_delta(plans, [None, plans[1].fingerprint, other, None])[2] is other
    with pytest.raises(PlanError, match="rank 1 says its plan is unchanged"):
        merge_delta(plans, [None, "0" * 32, None, None])
    with pytest.raises(InvalidArgumentError, match="rank 9"):
        merge_delta(plans, {9: other})


def test_bad_input():
    with pytest.raises(InvalidArgumentError, match="no local plans"):
        PlanBook([])
    with pytest.raises(InvalidArgumentError, match="rank 0: expected LocalPlan"):
        PlanBook(["nope"])
    book = PlanBook(simulate_plans("tiny", 2))
    with pytest.raises(InvalidArgumentError, match="re-plan from scratch"):
        book.update([None])


def test_simulated_llm_plan_matches_torch():
    plans = simulate_plans("tiny", 16, sharding="fsdp+tp", tp=4)
    mine = global_plan(plans)
    _, md = torch_global(plans)
    assert {f: sorted(c, key=lambda c: c.offsets) for f, (_, _, c) in
            metadata_chunks(md).items()} == \
        {f: sorted(e.chunks, key=lambda c: c.offsets) for f, e in mine.tensors.items()}
    written_once(mine, plans)
    assert mine.imbalance < 1.05


@given(local_plan_sets(broken=True))
def test_reusing_validation_changes_nothing(plans):
    a = global_plan(plans, validate=False)
    b = global_plan(plans, validate=False, reuse_validation=False)
    assert sorted(map(str, a.problems)) == sorted(map(str, b.problems))
    assert chunk_sets(a) == chunk_sets(b)
