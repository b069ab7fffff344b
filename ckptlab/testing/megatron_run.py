"""A Megatron-Core ``dist_checkpointing`` save (``torch_dist`` backend) written by
megatron-core itself on two gloo ranks under ``torch.distributed.run`` (:func:`write_save`),
and what ``dist_checkpointing.load`` gives back for it (:func:`load_save`). For the tests
(megatron-core installed); importing this module imports neither torch nor megatron-core.

megatron-core 0.16 calls ``torch.cuda.synchronize()`` and ``torch.cuda.current_device()``
unconditionally on its synchronous save path; on a machine without CUDA there is no device
to wait for, so this script makes those two calls what they mean there (nothing, the CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

WORLD = 2


def _run(ranks: int, port: int, *args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
           "--master_port", str(port), "-m", __name__, *args]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:8])}... failed:\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")


def write_save(out: str | os.PathLike[str], *, port: int = 29641) -> Path:
    """Save a small sharded state dict into ``out`` with megatron-core on two CPU ranks: a
    row-sharded ``decoder.weight`` (4 x 6 float32), a replicated bf16
    ``embedding.word_embeddings.weight``, one ``rng_state`` ShardedObject per rank, and common
    values (``iteration``, ``args``)."""
    _run(WORLD, port, "save", str(out))
    return Path(out)


def load_save(out: str | os.PathLike[str], *, port: int = 29642) -> dict[str, Any]:
    """What ``dist_checkpointing.load`` gives for :func:`write_save`'s directory on one rank:
    both tensors whole and each rank's ShardedObject (``rng_state_<rank>``)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        where = os.path.join(tmp, "loaded.pt")
        _run(1, port, "load", str(out), where)
        return torch.load(where, weights_only=False)


def _no_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_device = lambda: "cpu"


def save(out: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    rank = dist.get_rank()
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)  # row-sharded over the ranks
    state = {
        "decoder.weight": ShardedTensor.from_rank_offsets(
            "decoder.weight", full.chunk(WORLD, 0)[rank].clone(), (0, rank, WORLD)),
        "embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
            "embedding.word_embeddings.weight", torch.linspace(-1, 1, 10).bfloat16(),
            replica_id=rank),
        "rng_state": ShardedObject("rng_state", {"seed": 1234 + rank}, (WORLD,), (rank,),
                                   replica_id=0),
        "iteration": 5, "args": {"lr": 0.1, "tokenizer": "gpt2"},
    }
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(state, out,
                            sharded_strategy=TorchDistSaveShardedStrategy("torch_dist", 1))
    dist.barrier()


def load(out: str, where: str) -> None:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    template = {
        "decoder.weight": ShardedTensor.from_rank_offsets("decoder.weight", torch.empty(4, 6)),
        "embedding.word_embeddings.weight": ShardedTensor.from_rank_offsets(
            "embedding.word_embeddings.weight", torch.empty(10, dtype=torch.bfloat16)),
        **{f"rng_state_{r}": ShardedObject("rng_state", None, (WORLD,), (r,), replica_id=0)
           for r in range(WORLD)},
    }
    loaded = dist_checkpointing.load(template, out, validate_access_integrity=False)
    torch.save(loaded, where)


def main() -> None:
    import torch.distributed as dist

    _no_cuda()
    dist.init_process_group("gloo")
    if sys.argv[1] == "load":
        load(sys.argv[2], sys.argv[3])
    else:
        save(sys.argv[2])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
