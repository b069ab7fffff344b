"""assign_buckets: every item exactly once, LPT bound, bytes round-robin, separation hint."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptlab.errors import InvalidArgumentError
from ckptlab.write import SizedItem, assign_buckets, item_nbytes

items_st = st.lists(
    st.builds(SizedItem, key=st.sampled_from(["model.", "optim.", "x."]).flatmap(
        lambda p: st.text("abc", min_size=1, max_size=4).map(lambda s: p + s)),
        nbytes=st.integers(0, 10_000), is_tensor=st.booleans()),
    max_size=40)


def _flat(assignment):
    return [i for b in assignment.buckets for i in b.items]


@given(items=items_st, n=st.integers(1, 9))
def test_every_item_exactly_once_and_the_lpt_bound(items, n) -> None:
    a = assign_buckets(items, n)
    assert len(a.buckets) == n
    flat = _flat(a)
    assert sorted(map(id, flat)) == sorted(map(id, items))
    tensors = [i for i in items if i.is_tensor]
    total = sum(i.nbytes for i in tensors)
    largest = max((i.nbytes for i in tensors), default=0)
    assert a.nbytes == total
    for b in a.buckets:
        assert b.nbytes == sum(item_nbytes(i) for i in b.items)
        assert b.nbytes <= total / n + largest
        # bytes items first, then tensors largest first
        kinds = [i.is_tensor for i in b.items]
        assert kinds == sorted(kinds)
        sizes = [i.nbytes for i in b.items if i.is_tensor]
        assert sizes == sorted(sizes, reverse=True)
    byte_counts = [sum(not i.is_tensor for i in b.items) for b in a.buckets]
    assert max(byte_counts, default=0) - min(byte_counts, default=0) <= 1  # round-robin
    assert a.imbalance >= 1.0
    assert assign_buckets(items, n) == a  # deterministic


@given(items=items_st, n=st.integers(2, 9))
def test_separation_hint_keeps_groups_apart(items, n) -> None:
    a = assign_buckets(items, n, separation_hint="optim.")
    assert sorted(map(id, _flat(a))) == sorted(map(id, items))
    hinted = {id(i) for i in items if i.key.startswith("optim.")}
    for b in a.buckets:
        members = {id(i) in hinted for i in b.items}
        assert members <= {b.group == 1}
    if hinted and len(hinted) < len(items):  # the bucket split follows the groups' bytes
        k0, k1 = len(a.group_buckets(0)), len(a.group_buckets(1))
        assert k0 >= 1 and k1 >= 1 and k0 + k1 == n
        b0 = sum(i.nbytes for i in items if id(i) not in hinted and i.is_tensor)
        b1 = sum(i.nbytes for i in items if id(i) in hinted and i.is_tensor)
        best = min(max(b0 / k, b1 / (n - k)) for k in range(1, n)) if b0 + b1 else 0
        assert (max(b0 / k0, b1 / k1) if b0 + b1 else 0) == best


def test_separation_split_follows_bytes() -> None:
    items = [SizedItem(f"w{i}", 2) for i in range(4)] + \
        [SizedItem(f"optim.{i}", 8) for i in range(4)]
    a = assign_buckets(items, 5, separation_hint="optim.")
    assert (len(a.group_buckets(0)), len(a.group_buckets(1))) == (1, 4)
    assert max(a.bucket_nbytes) == 8
    for g in (0, 1):
        tensors = [i for b in a.group_buckets(g) for i in b.items if i.is_tensor]
        largest = max((i.nbytes for i in tensors), default=0)
        for b in a.group_buckets(g):
            assert b.nbytes <= a.ideal_nbytes(g) + largest


def test_known_answer_and_imbalance() -> None:
    a = assign_buckets([SizedItem("a", 6), SizedItem("b", 4), SizedItem("c", 3),
                        SizedItem("p", 0, is_tensor=False)], 2)
    assert a.bucket_nbytes == (6, 7)
    assert [i.key for i in a.buckets[0].items] == ["p", "a"]
    assert a.imbalance == pytest.approx(7 / 6.5)
    assert a.to_dict()["buckets"][1]["items"] == ["b", "c"]
    assert assign_buckets([], 3).imbalance == 1.0


def test_bad_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="int >= 1"):
        assign_buckets([], 0)
    with pytest.raises(InvalidArgumentError, match="at least 2 buckets"):
        assign_buckets([SizedItem("optim.a", 1), SizedItem("b", 1)], 1, separation_hint="optim.")
    # a hint that matches everything or nothing is no split
    only = assign_buckets([SizedItem("optim.a", 1)], 1, separation_hint="optim.")
    assert [b.group for b in only.buckets] == [1]


def test_real_write_items_are_sized_by_chunk() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    sd = {"w": torch.zeros(4, 5), "h": torch.zeros(3, dtype=torch.bfloat16), "step": 3}
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    plan = planner.create_local_plan()
    a = assign_buckets(plan.items, 2)
    sizes = {i.index.fqn: item_nbytes(i) for b in a.buckets for i in b.items}
    assert sizes == {"w": 80, "h": 6, "step": 0}
    assert a.bucket_nbytes in ((6, 80), (80, 6))
