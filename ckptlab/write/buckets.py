"""Which write item goes to which bucket (one bucket = one data file = one worker's job).

Pure functions over sizes: nothing is read, copied or written here.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import InvalidArgumentError
from ckptlab.format._dtypes import DTYPE_ITEMSIZE
from ckptlab.plan.simulate import CONFIGS, ModelConfig, state_shapes

__all__ = ["Bucket", "BucketAssignment", "SizedItem", "assign_buckets", "item_is_tensor",
           "item_nbytes", "sized_items"]


@dataclass(frozen=True, slots=True)
class SizedItem:
    """A stand-in for a DCP ``WriteItem`` when only its name, kind and size matter."""

    key: str  # the item's name (a DCP item's fqn)
    nbytes: int  # bytes of the tensor chunk; 0 for a bytes item (unknown before it is resolved)
    is_tensor: bool = True  # False: a pickled object (DCP ``BYTE_IO``)


def item_is_tensor(item: Any) -> bool:
    """A :class:`SizedItem`'s ``is_tensor``; for a DCP ``WriteItem``, whether it has tensor
    data (``BYTE_IO`` items have none)."""
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
    byte_items = [i for i in items if not item_is_tensor(i)]
    for k, item in enumerate(byte_items):
        contents[k % n].append(item)
    # sort is stable: equal sizes keep their plan order, so the result is deterministic
    tensors = sorted((i for i in items if item_is_tensor(i)), key=item_nbytes, reverse=True)
    heap = [(0, b) for b in range(n)]  # (load, bucket index): ties go to the lower index
    for item in tensors:
        load, b = heapq.heappop(heap)
        nbytes = item_nbytes(item)
        contents[b].append(item)
        loads[b] = load + nbytes
        heapq.heappush(heap, (loads[b], b))
    return [(contents[b], loads[b]) for b in range(n)]


def _split(n: int, group_nbytes: list[int]) -> list[int]:
    """Buckets per group (each >= 1): minimise the larger ideal share, ties to an even split."""
    a, b = group_nbytes
    if a + b == 0:
        return [n - n // 2, n // 2]
    return list(min(((k, n - k) for k in range(1, n)),
                    key=lambda c: (max(a / c[0], b / c[1]), abs(c[0] - c[1]))))


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
        that matches some but not all items, the ``n`` buckets (``n`` must then be at least
        2) are split between the groups in proportion to their bytes: the split that makes
        the larger of the two ideal shares smallest (Adam's float32 state is about four
        times bf16 weights, so it gets about four fifths of the buckets); a hint that matches
        nothing or everything leaves one group with all ``n`` buckets.

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
    counts = [n] if len(groups) == 1 else _split(n, [sum(map(item_nbytes, g)) for g in groups])
    group_ids = [0] if len(groups) == 1 else [0, 1]
    if len(groups) == 1 and separation_hint is not None and items and \
            all(item_key(i).startswith(separation_hint) for i in items):
        group_ids = [1]
    out: list[Bucket] = []
    for group, members, count in zip(group_ids, groups, counts):
        for contents, load in _fill(members, count):
            out.append(Bucket(len(out), group, tuple(contents), load))
    return BucketAssignment(tuple(out), separation_hint)


def _flatten(obj: Any, prefix: str, out: list[SizedItem]) -> None:
    """DCP's flattening: nested dicts and lists become dotted keys; other leaves are objects."""
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(SizedItem(prefix, obj.numel() * obj.element_size()))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)) and obj and not hasattr(obj, "_fields"):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out.append(SizedItem(prefix, 0, is_tensor=False))


def sized_items(source: Mapping[str, Any] | ModelConfig | str, *, optimizer: bool = True,
                dtype: str = "bfloat16") -> list[SizedItem]:
    """The write items of one rank holding a whole state dict, as :class:`SizedItem` s.

    Parameters
    ----------
    source
        A state dict (nested dicts and lists are flattened to dotted keys as DCP does;
        every tensor is one item of ``numel * element_size`` bytes, every other leaf a
        bytes item), or a model config: a :class:`~ckptlab.plan.ModelConfig` or a name in
        :data:`ckptlab.plan.CONFIGS` (its parameters from :func:`ckptlab.plan.state_shapes`,
        none of them sharded: the whole model on one rank).
    optimizer
        For a config: add Adam's state (``optim.state.*``: ``exp_avg`` and ``exp_avg_sq``
        in float32, a 0-d ``step``) and the pickled ``optim.param_groups``.
    dtype
        For a config: the parameters' dtype.

    Returns
    -------
    list of SizedItem
        In state-dict order, ready for :func:`ckptlab.write.assign_buckets`.

    Raises
    ------
    InvalidArgumentError
        For an unknown config name or dtype, or a source of another type.

    Examples
    --------
    >>> items = sized_items("tiny", optimizer=False)
    >>> items[0]
    SizedItem(key='model.embed_tokens.weight', nbytes=128000, is_tensor=True)
    """
    if isinstance(source, (str, ModelConfig)):
        if isinstance(source, str) and source not in CONFIGS:
            raise InvalidArgumentError(
                f"unknown model config {source!r}; expected one of {sorted(CONFIGS)}")
        tensors, objects = state_shapes(source, optimizer=optimizer, dtype=dtype)
        out = []
        for t in tensors:
            if t.dtype not in DTYPE_ITEMSIZE:
                raise InvalidArgumentError(f"unknown dtype {t.dtype!r} for {t.fqn}")
            out.append(SizedItem(t.fqn, math.prod(t.shape) * DTYPE_ITEMSIZE[t.dtype]))
        return out + [SizedItem(name, 0, is_tensor=False) for name in objects]
    if isinstance(source, Mapping):
        items: list[SizedItem] = []
        _flatten(source, "", items)
        return items
    raise InvalidArgumentError(
        "expected a state dict, a ckptlab.plan.ModelConfig or a config name, got "
        f"{type(source).__name__}")
