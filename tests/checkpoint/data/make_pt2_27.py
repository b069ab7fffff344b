"""Write the torch 2.7 ``torch.export.save`` fixtures (the legacy ``.pt2`` layout).

Run it with a Python that has torch 2.7.x (this writer is what the fixtures exist to test;
later torch writes the ``archive_format`` layout instead)::

    /tmp/venv27/bin/python tests/checkpoint/data/make_pt2_27.py

It writes, next to itself, for each model below:

- ``pt2_27_<name>.pt2``: ``torch.export.save(torch.export.export(model, args))``: a zip with
  ``serialized_exported_program.json``, ``serialized_state_dict.pt``,
  ``serialized_constants.pt``, ``serialized_example_inputs.pt`` (each ``.pt`` a whole
  ``torch.save`` archive) and ``version``;
- ``pt2_27_<name>.expected.pt``: what torch 2.7's ``torch.export.load`` gives back, as
  ``torch.save({"state_dict": dict(ep.state_dict), "constants": dict(ep.constants),
  "schema_version": "<major>.<minor>", "torch_version": str})`` (tensors and Parameters only,
  so ``torch.load(..., weights_only=True)`` reads it on any later torch).

The models are small and seeded, so each file is a few KB.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


class Linear(torch.nn.Module):
    """A Linear layer and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(4, 3)
        self.register_buffer("b", torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) + self.b.sum()


class Const(torch.nn.Module):
    """A tensor attribute (a lifted constant), a non-persistent buffer (a constant too), a
    frozen bfloat16 parameter and an int64 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 2))
        self.hp = torch.nn.Parameter(torch.randn(4).bfloat16(), requires_grad=False)
        self.register_buffer("steps", torch.arange(5))
        self.register_buffer("scratch", torch.arange(3.0), persistent=False)
        self.c = torch.tensor([1.0, 2.0, 3.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w).sum() + self.c.sum() + self.scratch.sum() + \
            self.hp.float().sum() + self.steps.sum()


class Tied(torch.nn.Module):
    """Two Linear layers sharing one weight, and a buffer that views another at an offset."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 3)
        self.b = torch.nn.Linear(3, 3)
        self.b.weight = self.a.weight
        base = torch.arange(12.0).reshape(3, 4)
        self.register_buffer("base", base)
        self.register_buffer("view", base[:, 1::2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) + self.base.sum() + self.view.sum()


MODELS = {"linear": (Linear, (4,)), "const": (Const, (3,)), "tied": (Tied, (3,))}


def write(name: str) -> None:
    """Export, save and load back one model; write its archive and its expected values."""
    torch.manual_seed(0)
    cls, shape = MODELS[name]
    model = cls()
    path = HERE / f"pt2_27_{name}.pt2"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(model, (torch.randn(1, *shape),))
        torch.export.save(ep, path)
        loaded = torch.export.load(path)
    with zipfile.ZipFile(path) as z:
        program = json.loads(z.read("serialized_exported_program.json"))
    version = program["schema_version"]
    torch.save({"state_dict": dict(loaded.state_dict), "constants": dict(loaded.constants),
                "schema_version": f"{version['major']}.{version['minor']}",
                "torch_version": program["torch_version"]},
               HERE / f"pt2_27_{name}.expected.pt")
    print(path.name, path.stat().st_size, list(loaded.state_dict), list(loaded.constants))


def main() -> None:
    if not torch.__version__.startswith("2.7."):
        raise SystemExit(f"run this with torch 2.7.x (got {torch.__version__}): later "
                         "versions write the archive_format layout")
    for name in MODELS:
        write(name)


if __name__ == "__main__":
    main()
