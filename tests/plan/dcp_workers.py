"""Rank functions for the DCP tests (module level: torch.multiprocessing spawn imports them)."""

from __future__ import annotations

from typing import Any


def full_state(seed: int = 0) -> dict[str, Any]:
    """The global tensors every rank shards: uneven row counts on purpose."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g),  # 7 rows over 2 ranks: 4 + 3
        "b": torch.randn(9, generator=g).to(torch.bfloat16),
        "replicated": torch.arange(6, dtype=torch.int64),
    }


def save_sharded(rank: int, world_size: int, path: str) -> list[tuple[str, list[int]]]:
    """dcp.save of DTensors sharded on dim 0 over a 1-D CPU mesh, plus non-tensor objects."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    full = full_state()
    state = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
        "replicated": distribute_tensor(full["replicated"], mesh, [Replicate()]),
        "step": 11,
        "config": {"lr": 0.5, "name": "tiny"},
    }
    dcp.save(state, checkpoint_id=path)
    return [(k, list(v.to_local().shape)) for k, v in state.items() if hasattr(v, "to_local")]
