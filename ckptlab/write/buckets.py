"""Which write item goes to which bucket (one bucket = one data file = one worker's job).

Pure functions over sizes: nothing is read, copied or written here.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import InvalidArgumentError

__all__ = ["Bucket", "BucketAssignment", "SizedItem", "assign_buckets", "item_nbytes"]


@dataclass(frozen=True, slots=True)
class SizedItem:
    """A stand-in for a DCP ``WriteItem`` when only its name, kind and size matter."""

    key: str  # the item's name (a DCP item's fqn)
    nbytes: int  # bytes of the tensor chunk; 0 for a bytes item (unknown before it is resolved)
    is_tensor: bool = True  # False: a pickled object (DCP ``BYTE_IO``)


def _is_tensor(item: Any) -> bool:
    if isinstance(item, SizedItem):
        return item.is_tensor
    return getattr(item, "tensor_data", None) is not None


def item_key(item: Any) -> str:
    """The item's name: ``SizedItem.key`` or a DCP ``WriteItem``'s ``index.fqn``."""
    if isinstance(item, SizedItem):
        return item.key
    return str(item.index.fqn)


def item_nbytes(item: Any) -> int:
    """Bytes of an item's **chunk** (not of the whole tensor); 0 for a bytes item.

    Accepts :class:`SizedItem` and DCP ``WriteItem`` (``tensor_data.chunk.sizes`` times the
    element size of ``tensor_data.properties.dtype``).
    """
    if isinstance(item, SizedItem):
        return item.nbytes if item.is_tensor else 0
    td = getattr(item, "tensor_data", None)
    if td is None:
        return 0
    import torch

    dtype = td.properties.dtype
    element = torch.empty((), dtype=dtype).element_size()
    return math.prod(td.chunk.sizes) * element


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket: the items one worker writes into one data file, in write order."""

    index: int  # position in BucketAssignment.buckets; also the file number
    group: int  # 0, or 1 for items matched by the separation hint
    items: tuple[Any, ...]  # bytes items first (round-robin order), then tensors largest first
    nbytes: int  # sum of the tensor items' chunk bytes (bytes items count 0)


@dataclass(frozen=True, slots=True)
class BucketAssignment:
    """The result of :func:`assign_buckets`: every item in exactly one bucket."""

    buckets: tuple[Bucket, ...]
    separation_hint: str | None  # the prefix that formed group 1, if one was given

    @property
    def nbytes(self) -> int:
        """Tensor bytes over all buckets."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def bucket_nbytes(self) -> tuple[int, ...]:
        return tuple(b.nbytes for b in self.buckets)

    def group_buckets(self, group: int) -> tuple[Bucket, ...]:
        return tuple(b for b in self.buckets if b.group == group)

    def ideal_nbytes(self, group: int = 0) -> float:
        """A group's tensor bytes divided evenly over its buckets."""
        members = self.group_buckets(group)
        return sum(b.nbytes for b in members) / len(members) if members else 0.0

    @property
    def imbalance(self) -> float:
        """The fullest bucket over the ideal (even) share of its group; 1.0 is perfect.

        With a separation hint each group is judged against its own ideal and the worse
        group is reported. 1.0 when there are no tensor bytes.
        """
        worst = 1.0
        for group in {b.group for b in self.buckets}:
            ideal = self.ideal_nbytes(group)
            if ideal > 0:
                worst = max(worst, max(b.nbytes for b in self.group_buckets(group)) / ideal)
        return worst

    def to_dict(self) -> dict[str, Any]:
        return {"separation_hint": self.separation_hint, "imbalance": self.imbalance,
                "buckets": [{"index": b.index, "group": b.group, "nbytes": b.nbytes,
                             "items": [item_key(i) for i in b.items]} for b in self.buckets]}


def _fill(items: Sequence[Any], n: int) -> list[tuple[list[Any], int]]:
    """Bytes items round-robin; tensors largest first into the least-loaded bucket (a heap)."""
    buckets: list[tuple[list[Any], int]] = [([], 0) for _ in range(n)]
    contents = [b[0] for b in buckets]
    loads = [0] * n
    byte_items = [i for i in items if not _is_tensor(i)]
    for k, item in enumerate(byte_items):
        contents[k % n].append(item)
    # sort is stable: equal sizes keep their plan order, so the result is deterministic
    tensors = sorted((i for i in items if _is_tensor(i)), key=item_nbytes, reverse=True)
    heap = [(0, b) for b in range(n)]  # (load, bucket index): ties go to the lower index
    for item in tensors:
        load, b = heapq.heappop(heap)
        nbytes = item_nbytes(item)
        contents[b].append(item)
        loads[b] = load + nbytes
        heapq.heappush(heap, (loads[b], b))
    return [(contents[b], loads[b]) for b in range(n)]


def assign_buckets(items: Sequence[Any], n: int,
                   separation_hint: str | None = None) -> BucketAssignment:
    """Spread write items over ``n`` buckets so that the fullest one is as small as possible.

    Parameters
    ----------
    items
        DCP ``WriteItem`` s (from a ``SavePlan``) or :class:`SizedItem` s.
    n
        Number of buckets (data files, one worker job each), at least 1.
    separation_hint
        A key prefix. Items whose key starts with it (for example ``"optim."``) form a second
        group with buckets of its own, so that they end up in separate files. With a hint
        that matches some but not all items, group 0 gets ``n - n // 2`` buckets and group 1
        ``n // 2`` (``n`` must then be at least 2); a hint that matches nothing or everything
        leaves one group with all ``n`` buckets.

    Returns
    -------
    BucketAssignment
        Bytes items are dealt round-robin (their size is unknown until they are resolved and
        they are small); tensor items go largest first into the least-loaded bucket by the
        size of their **chunk** (longest-processing-time greedy with a heap). Every item is
        in exactly one bucket and, within each group, the fullest bucket holds at most the
        ideal share plus the largest item. The result depends only on the items' order,
        kinds and sizes.

    Raises
    ------
    InvalidArgumentError
        For ``n < 1``, or a hint that splits the items with ``n < 2``.

    Examples
    --------
    >>> from ckptlab.write import SizedItem, assign_buckets
    >>> a = assign_buckets([SizedItem("a", 6), SizedItem("b", 4), SizedItem("c", 3)], 2)
    >>> a.bucket_nbytes, round(a.imbalance, 3)
    ((6, 7), 1.077)
    """
    if type(n) is not int or n < 1:
        raise InvalidArgumentError(f"the number of buckets must be an int >= 1, got {n!r}")
    items = list(items)
    groups: list[list[Any]] = [items]
    if separation_hint is not None:
        second = [i for i in items if item_key(i).startswith(separation_hint)]
        first = [i for i in items if not item_key(i).startswith(separation_hint)]
        if first and second:
            if n < 2:
                raise InvalidArgumentError(
                    f"a separation hint ({separation_hint!r}) that splits the items needs at "
                    f"least 2 buckets, got {n}")
            groups = [first, second]
    counts = [n] if len(groups) == 1 else [n - n // 2, n // 2]
    group_ids = [0] if len(groups) == 1 else [0, 1]
    if len(groups) == 1 and separation_hint is not None and items and \
            all(item_key(i).startswith(separation_hint) for i in items):
        group_ids = [1]
    out: list[Bucket] = []
    for group, members, count in zip(group_ids, groups, counts):
        for contents, load in _fill(members, count):
            out.append(Bucket(len(out), group, tuple(contents), load))
    return BucketAssignment(tuple(out), separation_hint)
