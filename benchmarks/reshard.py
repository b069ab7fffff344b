"""Benchmark: resharding read items, ckptlab's sweep vs torch's create_read_items_for_chunk_list.

Run from the repository root::

    .venv/bin/python benchmarks/reshard.py [--repeat 5]

A wide ``Shard(0)`` weight ([4096, 14336], the MLP of a Llama-3-8B layer) saved over N ranks
and loaded over M ranks, each rank holding a band of rows. torch sweeps the dimension with the
largest extent (the 14336 columns, which no shard splits, so every chunk overlaps every other
there); ckptlab sweeps the dimension with the most chunk boundaries. Both must produce the
same read items (checked); the table shows the median time of ``--repeat`` runs. A second
table times the validation of the saved chunks (torch's ``_validate_global_plan`` sweeps the
same way) against ``ckptlab.plan.validate_chunks``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributed.checkpoint.default_planner import _validate_global_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckptlab.plan.reshard import Chunk, read_items
from ckptlab.plan.validate import validate_chunks

ROWS, COLS = 4096, 14336
CASES = ((128, 64), (256, 512), (1024, 512), (1024, 1024), (2048, 1024))


def bands(n: int) -> list[Chunk]:
    edges = [r * ROWS // n for r in range(n + 1)]
    return [Chunk((a, 0), (b - a, COLS)) for a, b in itertools.pairwise(edges)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'saved ranks':>11} {'wanted ranks':>12} {'torch ms':>9} {'ckptlab ms':>10} "
          f"{'ratio':>7} {'items':>6}")
    for n_saved, n_wanted in CASES:
        saved, wanted = bands(n_saved), bands(n_wanted)
        md = TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size((ROWS, COLS)),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in saved])
        local = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                 for c in wanted]
        t_torch, t_ours = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            theirs = create_read_items_for_chunk_list("w", md, local)
            t_torch.append(time.perf_counter() - t)
            t = time.perf_counter()
            ours = read_items("w", saved, wanted)
            t_ours.append(time.perf_counter() - t)
        assert {(r.dest_index.index, tuple(r.dest_offsets), r.storage_index.index,
                 tuple(r.storage_offsets), tuple(r.lengths)) for r in theirs} == {
            (r.dest_index, r.dest_offsets, r.storage_index, r.storage_offsets, r.lengths)
            for r in ours}, "read items differ"
        a, b = statistics.median(t_torch), statistics.median(t_ours)
        print(f"{n_saved:>11} {n_wanted:>12} {1000 * a:>9.1f} {1000 * b:>10.1f} "
              f"{a / b:>6.1f}x {len(ours):>6}")
    print(f"\nvalidation of the saved chunks (overlap / bounds / volume)\n"
          f"{'ranks':>6} {'torch ms':>9} {'ckptlab ms':>10} {'ratio':>7}")
    for n in (256, 1024, 2048):
        chunks = bands(n)
        md = Metadata(state_dict_metadata={"w": TensorStorageMetadata(
            TensorProperties(dtype=torch.bfloat16), torch.Size((ROWS, COLS)),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
             for c in chunks])})
        t_torch, t_ours = [], []
        for _ in range(args.repeat):
            t = time.perf_counter()
            theirs = _validate_global_plan([None, None], md)  # two plans: volume checked too
            t_torch.append(time.perf_counter() - t)
            t = time.perf_counter()
            ours = validate_chunks("w", (ROWS, COLS), chunks)
            t_ours.append(time.perf_counter() - t)
        assert not theirs and not ours
        a, b = statistics.median(t_torch), statistics.median(t_ours)
        print(f"{n:>6} {1000 * a:>9.1f} {1000 * b:>10.2f} {a / b:>6.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
