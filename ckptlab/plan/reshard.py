"""Resharding: which bytes of which saved chunk fill which part of which wanted chunk.

A checkpoint saved as chunks of a tensor (one per rank and shard) is loaded into another set
of chunks (another world size or placement). Every wanted chunk needs the regions where it
overlaps saved chunks: the read items. Comparing every pair is quadratic; a sweep along one
dimension only compares chunks whose ranges overlap there. The choice of dimension decides
how much that prunes: torch sweeps the dimension with the largest extent, which for a wide
``Shard(0)`` weight ([4096, 14336], split along rows) is the unsplit one, where every chunk
overlaps every other; here the sweep takes the dimension with the most distinct chunk
boundaries.
"""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptlab.errors import InvalidArgumentError

__all__ = ["Chunk", "ReadItem", "read_items", "sweep_dimension"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """A box of a global tensor: where it starts and its shape, in elements."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    numel: int = field(init=False, repr=False, compare=False)  # elements in the box

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", math.prod(self.sizes))


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy the box ``lengths`` at ``storage_offsets`` of saved chunk ``storage_index`` to
    ``dest_offsets`` of wanted chunk ``dest_index`` (offsets relative to each chunk)."""

    fqn: str
    dest_index: int  # index into the wanted chunks
    dest_offsets: tuple[int, ...]
    storage_index: int  # index into the saved chunks
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


def _check(chunks: Sequence[Chunk], what: str, ndim: int | None) -> int:
    for c in chunks:
        if not isinstance(c, Chunk) or len(c.offsets) != len(c.sizes):
            raise InvalidArgumentError(f"{what}: expected Chunk(offsets, sizes) of equal length, "
                                       f"got {c!r}")
        if ndim is not None and len(c.offsets) != ndim:
            raise InvalidArgumentError(f"{what}: chunks of {ndim} and {len(c.offsets)} dims")
        if any(o < 0 for o in c.offsets) or any(s < 0 for s in c.sizes):
            raise InvalidArgumentError(f"{what}: negative offset or size in {c!r}")
        ndim = len(c.offsets)
    return ndim or 0


def sweep_dimension(saved: Sequence[Chunk], wanted: Sequence[Chunk]) -> int:
    """The dimension whose chunk boundaries split the chunks most (ties: the lower one)."""
    chunks = [*saved, *wanted]
    if not chunks or not chunks[0].offsets:
        return 0
    ndim = len(chunks[0].offsets)
    return max(range(ndim), key=lambda d: (len({c.offsets[d] for c in chunks}), -d))


def read_items(fqn: str, saved: Sequence[Chunk], wanted: Sequence[Chunk], *,
               dim: int | None = None) -> tuple[ReadItem, ...]:
    """The read items that fill ``wanted`` chunks from ``saved`` chunks of one tensor.

    Parameters
    ----------
    fqn
        The tensor's name, carried into each item.
    saved, wanted
        Chunks of the same global tensor (same number of dimensions).
    dim
        Sweep dimension; by default :func:`sweep_dimension`.

    Returns
    -------
    tuple of ReadItem
        Sorted by wanted chunk, then saved chunk. The same regions torch's
        ``create_read_items_for_chunk_list`` computes (a test checks it), found with a sweep:
        O((n + m) log n + k) for k overlaps on grid-like shardings.
    """
    ndim = _check(saved, "saved", None)
    _check(wanted, "wanted", ndim if saved else None)
    if not saved or not wanted:
        return ()
    if ndim == 0:  # scalars: every pair overlaps in the single element
        return tuple(ReadItem(fqn, w, (), s, (), ()) for w in range(len(wanted))
                     for s in range(len(saved)))
    d = sweep_dimension(saved, wanted) if dim is None else dim
    if not 0 <= d < ndim:
        raise InvalidArgumentError(f"dim must be in 0..{ndim - 1}, got {dim}")
    saved_order = sorted(range(len(saved)), key=lambda i: saved[i].offsets[d])
    wanted_order = sorted(range(len(wanted)), key=lambda i: wanted[i].offsets[d])
    active: list[tuple[int, int]] = []  # (end along d, saved index), sorted by end
    ptr = 0
    out = []
    for w in wanted_order:
        wc = wanted[w]
        w_start, w_end = wc.offsets[d], wc.offsets[d] + wc.sizes[d]
        del active[: bisect_right(active, (w_start, len(saved)))]  # ended at or before w_start
        while ptr < len(saved_order):
            s = saved_order[ptr]
            if saved[s].offsets[d] >= w_end:
                break
            insort(active, (saved[s].offsets[d] + saved[s].sizes[d], s))
            ptr += 1
        for _, s in active:
            sc = saved[s]
            lo = [max(a, b) for a, b in zip(sc.offsets, wc.offsets)]
            hi = [min(a + x, b + y) for a, x, b, y in zip(sc.offsets, sc.sizes, wc.offsets,
                                                          wc.sizes)]
            if any(h <= lw for lw, h in zip(lo, hi)):
                continue
            out.append(ReadItem(
                fqn, w, tuple(lw - o for lw, o in zip(lo, wc.offsets)), s,
                tuple(lw - o for lw, o in zip(lo, sc.offsets)),
                tuple(h - lw for lw, h in zip(lo, hi))))
    out.sort(key=lambda r: (r.dest_index, r.storage_index))
    return tuple(out)
