"""Rank functions for the AsyncWriter tests (module level: torch.multiprocessing spawn imports
them) and a state dict builder shared with the single-process tests."""

from __future__ import annotations

import errno
from typing import Any


def single_process_async_save(state: Any, writer: Any) -> Any:
    """``dcp.async_save`` in one process without a process group: ``no_dist=True`` where
    torch takes it (2.8 on); torch 2.7's async_save has no such argument and runs single
    process by itself when no group is initialized."""
    import inspect

    import torch.distributed.checkpoint as dcp

    extra = {"no_dist": True} if "no_dist" in inspect.signature(dcp.async_save).parameters \
        else {}
    return dcp.async_save(state, storage_writer=writer, **extra)


def mixed_state(seed: int = 0) -> dict[str, Any]:
    """Tensors of several dtypes and shapes (a view, tied weights, 0-d, empty, a Parameter, a
    1 MiB+ tensor that takes the direct-write path) and plain objects."""
    import torch

    g = torch.Generator().manual_seed(seed)
    big = torch.randn(600, 700, generator=g)  # 1.6 MiB: the aligned body goes straight out
    base = torch.randn(10, 6, generator=g)
    return {
        "model": {
            "big": big,
            "view": base[2:7, 1:4],  # non-contiguous view of a larger storage
            "tied_a": base, "tied_b": base,
            "half": torch.randn(33, generator=g).to(torch.bfloat16),
            "ids": torch.arange(17, dtype=torch.int64),
            "mask": torch.rand(5, 3, generator=g) > 0.5,
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 4),
            "param": torch.nn.Parameter(torch.randn(4, 4, generator=g)),
        },
        "optim": {"m": torch.randn(257, 3, generator=g), "lr": 0.125},
        "step": 11,
        "note": "x" * 5000,
    }


def zeros_like_state(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state.detach())
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    return None if not isinstance(state, (int, float, str)) else type(state)()


def full_state(seed: int = 0) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(7, 5, generator=g), "big": torch.randn(900, 400, generator=g),
            "b": torch.randn(9, generator=g).to(torch.bfloat16)}


def _sharded(world_size: int, seed: int = 0) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state(seed)
    state: dict[str, Any] = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    state["step"] = 11
    return state


def save_sharded_async(rank: int, world_size: int, path: str,
                       again: bool = False) -> dict[str, Any]:
    """dcp.save of DTensor shards with an AsyncWriter on every rank; mutate, then wait.

    ``again``: then save full_state(1) over it with the same writer (the next generation:
    every rank's new files are written while the first checkpoint's are all still there).
    """
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptlab.write import AsyncWriter

    state = _sharded(world_size)
    writer = AsyncWriter(path, workers=2)
    dcp.save(state, storage_writer=writer)
    for k in ("w", "big", "b"):  # after return: must not reach the checkpoint
        state[k].to_local().fill_(-1)
    timeline = writer.wait()
    out = {"files": [f for _, f, _, _ in timeline.files], "committed": timeline.committed,
           "phases": sorted({e.phase for e in timeline.events})}
    if again:
        dist.barrier()  # every rank saw the first commit
        first = sorted(os.listdir(path))
        seen: list[list[str]] = []
        writer.io_hook = lambda bucket, phase, *_: seen.append(sorted(os.listdir(path))) \
            if phase == "open" else None
        state = _sharded(world_size, seed=1)
        state["step"] = 12
        dcp.save(state, storage_writer=writer)
        timeline = writer.wait()
        out.update(files2=[f for _, f, _, _ in timeline.files], committed2=timeline.committed,
                   first=first, old_whole=all(set(first) <= set(names) for names in seen))
    writer.close()
    return out


def save_sharded_failing(rank: int, world_size: int, path: str) -> dict[str, str]:
    """Rank 1's disk is 'full': every rank's wait() must raise, and nothing is committed."""
    import torch.distributed.checkpoint as dcp

    from ckptlab.errors import WriterError
    from ckptlab.write import AsyncWriter

    def full_disk(bucket, phase, file, offset, nbytes):
        if rank == 1 and phase == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    writer = AsyncWriter(path, workers=2, io_hook=full_disk, commit_timeout_s=60)
    dcp.save(_sharded(world_size), storage_writer=writer)
    try:
        writer.wait()
    except WriterError as exc:
        return {"error": str(exc), "failures": repr(sorted(map(str, exc.failures)))}
    finally:
        writer.close()
    return {"error": ""}
