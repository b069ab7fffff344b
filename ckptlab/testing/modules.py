"""A small ``nn.Module`` that TorchScript and torch.export both take, for tests that write
``torch.jit.save`` and ``torch.export.save`` archives (this module imports torch)."""

from __future__ import annotations

import torch

__all__ = ["Small"]


class Small(torch.nn.Module):
    """A Linear(3, 2) and an int64 buffer used in ``forward`` (so both are saved)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = torch.nn.Linear(3, 2)
        self.register_buffer("steps", torch.arange(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x) + self.steps.sum()
