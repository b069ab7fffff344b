"""One DeepSpeed training run on CPU, saved after each of two steps with DeepSpeed's own
``engine.save_checkpoint``: :func:`write_run` runs it on two gloo ranks under
``torch.distributed.run`` (``python -m torch.distributed.run --nproc_per_node 2 -m
ckptlab.testing.deepspeed_run STAGE OUT``; ``DS_ACCELERATOR=cpu``). For the tests (DeepSpeed
installed); importing this module imports neither torch nor DeepSpeed.

The model has what zero_to_fp32.py treats specially: two optimizer groups (decay and no
decay), a frozen layer, a weight tied to another (``head.weight`` is ``emb.weight``), a
buffer, and parameters whose sizes do not divide by the ranks. With ``pipeline``, a
``deepspeed.pipe.PipelineModule`` of five layers (one without parameters) in two stages over
four ranks (two data-parallel ranks per stage), trained with ``engine.train_batch``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def write_run(stage: int, out: str | os.PathLike[str], *, port: int = 29617,
              universal: str | os.PathLike[str] | None = None, width: int = 0,
              pipeline: bool = False) -> Path:
    """Train and save a ZeRO ``stage`` run into ``out`` (``global_step1/``,
    ``global_step2/``, ``latest``) with DeepSpeed on two CPU ranks; with ``universal``, also
    convert ``global_step2`` there with DeepSpeed's ``ds_to_universal``. ``width``: instead
    of the small model, four ``width`` x ``width`` linear layers (for benchmarks).
    ``pipeline``: a two-stage pipeline on four ranks instead (ZeRO 0 or 1)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    runs = [[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
             "4" if pipeline else "2", "--master_port", str(port), "-m", __name__, str(stage),
             str(out), str(width), "pipeline" if pipeline else ""]]
    if universal is not None:
        runs.append([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                     "--input_folder", str(Path(out) / "global_step2"), "--output_folder",
                     str(universal), "--num_extract_workers", "1", "--num_merge_workers", "1"])
    for args in runs:
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(args[:6])}... failed:\n{proc.stdout[-3000:]}"
                               f"{proc.stderr[-3000:]}")
    return Path(out)


def _net() -> Any:
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.frozen = torch.nn.Linear(6, 6)
            self.body = torch.nn.Linear(6, 6)
            self.norm = torch.nn.LayerNorm(6)
            self.head = torch.nn.Linear(6, 11, bias=False)
            self.head.weight = self.emb.weight
            self.register_buffer("scale", torch.tensor([2.0, 3.0]))
            for p in self.frozen.parameters():
                p.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.body(self.frozen(self.emb(x)))))

    return Net()


def _pipeline(stage: int, out: str) -> None:
    """Two pipeline stages (layers 0-1 and 2-4: a ReLU, layer 3, holds no parameter), two
    data-parallel ranks each; two steps of ``train_batch``, each saved."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    layers = [LayerSpec(torch.nn.Linear, 6, 7), LayerSpec(torch.nn.Linear, 7, 5),
              LayerSpec(torch.nn.Linear, 5, 6), LayerSpec(torch.nn.ReLU),
              LayerSpec(torch.nn.Linear, 6, 3)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(),
                           partition_method="uniform")
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(
        model.parameters()), config=config)

    def batches() -> Any:
        while True:
            yield torch.randn(2, 6), torch.randn(2, 3)

    data = batches()
    for _ in range(2):
        engine.train_batch(data)
        engine.save_checkpoint(out, client_state={"universal_checkpoint_info": {}})


def main() -> None:
    import deepspeed
    import torch

    stage, out = int(sys.argv[1]), sys.argv[2]
    width = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    if len(sys.argv) > 4 and sys.argv[4] == "pipeline":
        _pipeline(stage, out)
        return
    model = _net() if not width else torch.nn.Sequential(
        torch.nn.Embedding(11, width), *(torch.nn.Linear(width, width) for _ in range(4)))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in trainable if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in trainable if not n.endswith("weight")],
               "weight_decay": 0.0}]
    config = {"train_batch_size": 2 * int(os.environ.get("WORLD_SIZE", "1")),
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "bf16": {"enabled": stage > 0}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    for _ in range(2):
        x = torch.randint(0, 11, (2, 3))
        loss = engine(x).float().pow(2).mean()  # (the wide model: embedding, then linears)
        engine.backward(loss)
        engine.step()
        # universal_checkpoint_info: what ds_to_universal needs (Megatron-DeepSpeed adds it)
        engine.save_checkpoint(out, client_state={"universal_checkpoint_info": {}})


if __name__ == "__main__":
    main()
