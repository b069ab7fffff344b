"""Validate the chunks a global plan saves for a tensor: in bounds, no overlap, no gap."""

from __future__ import annotations

import math
from bisect import bisect_right, insort
from collections.abc import Sequence
from dataclasses import dataclass

from ckptlab.errors import PlanError
from ckptlab.plan.reshard import Chunk, sweep_dimension

__all__ = ["ChunkProblem", "require_valid", "validate_chunks"]


@dataclass(frozen=True, slots=True)
class ChunkProblem:
    """One thing wrong with a tensor's chunks."""

    fqn: str
    kind: str  # "out_of_bounds", "overlap" or "volume"
    chunks: tuple[int, ...]  # the chunk indices involved (two for an overlap)
    detail: str

    def __str__(self) -> str:
        return f"{self.fqn}: {self.kind.replace('_', ' ')}: {self.detail}"


def validate_chunks(fqn: str, size: Sequence[int], chunks: Sequence[Chunk], *,
                    check_volume: bool = True) -> list[ChunkProblem]:
    """Everything wrong with ``chunks`` as a tiling of a tensor of shape ``size``.

    Overlaps are found by a sweep along the dimension with the most chunk boundaries (torch's
    planner sweeps the largest dimension, which for a wide Shard(0) weight is the unsplit one
    and makes the check quadratic). With ``check_volume`` the chunk volumes must add up to the
    tensor's (no gap, given no overlap).

    Returns
    -------
    list of ChunkProblem
        Empty when the chunks tile the tensor.
    """
    size = tuple(size)
    problems = []
    volume = 0
    for i, c in enumerate(chunks):
        if len(c.offsets) != len(size) or any(
                o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, size)):
            problems.append(ChunkProblem(fqn, "out_of_bounds", (i,),
                                         f"chunk {i} {c.offsets}+{c.sizes} in {size}"))
        volume += c.numel
    if len(chunks) > 1 and size:
        d = sweep_dimension(chunks, ())
        order = sorted(range(len(chunks)), key=lambda i: chunks[i].offsets[d])
        active: list[tuple[int, int]] = []
        for i in order:
            c = chunks[i]
            del active[: bisect_right(active, (c.offsets[d], len(chunks)))]
            for _, j in active:
                o = chunks[j]
                if all(a < b + y and b < a + x for a, x, b, y in
                       zip(c.offsets, c.sizes, o.offsets, o.sizes)):
                    problems.append(ChunkProblem(fqn, "overlap", (min(i, j), max(i, j)),
                                                 f"chunks {min(i, j)} and {max(i, j)}"))
            insort(active, (c.offsets[d] + c.sizes[d], i))
    tensor_volume = math.prod(size)
    if check_volume and volume != tensor_volume:
        problems.append(ChunkProblem(fqn, "volume", (),
                                     f"chunks hold {volume} elements, the tensor {tensor_volume}"))
    return problems


def require_valid(fqn: str, size: Sequence[int], chunks: Sequence[Chunk]) -> None:
    """Raise :class:`~ckptlab.errors.PlanError` naming every problem of ``chunks``."""
    problems = validate_chunks(fqn, size, chunks)
    if problems:
        shown = "; ".join(map(str, problems[:5]))
        more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PlanError(f"invalid chunks for {fqn}: {shown}{more}")
