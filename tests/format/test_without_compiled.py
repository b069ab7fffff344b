"""ckptlab with its compiled part switched off (as where it was installed without a C
compiler): ``inspect`` and ``open`` give what they give with it, for every kind of pickle the
compiled paths take (state dicts past ten storages, whole modules, optimizer state)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import ckptlab
from ckptlab.format import _bulk, _pickle, _unpickle
from ckptlab.testing.archives import save_bytes


def switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("_c_opcodes", "_c_entries", "_c_units"):
        monkeypatch.setattr(_unpickle, name, None)
    for name in ("_c_walk", "_FastHandler", "_slot_columns"):
        monkeypatch.setattr(_pickle, name, None)
    monkeypatch.setattr(_bulk, "_slot_build", None)


def seen(data: bytes) -> Any:
    """What a user sees of a checkpoint: the layout's records and storages, every tensor
    entry, the objects beside them."""
    layout = ckptlab.inspect(data)
    ck = ckptlab.open(data)
    return (layout.records, layout.storages, layout.tensors, list(ck.tensors.items()),
            [(name, repr(value)) for name, value in ck.objects.items()])


def model() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
                                 for _ in range(8)])


@pytest.mark.parametrize("kind", ["state", "module", "optimizer", "mixed"])
def test_the_same_without_the_compiled_part(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    net = model()
    if kind == "state":
        obj: Any = {f"layer.{i}.weight": torch.zeros(i % 3 + 1) for i in range(40)}
    elif kind == "module":
        obj = net
    elif kind == "optimizer":
        net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
        opt = torch.optim.Adam(net.parameters())
        net(torch.ones(1, 2)).sum().backward()
        opt.step()
        obj = {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": 3}
    else:
        base = torch.arange(20.0)
        obj = {"views": [base[i:i + 4] for i in range(12)], "p": torch.nn.Parameter(base[:3]),
               "meta": {"lr": 0.1, "betas": (0.9, 0.99)}, "half": base.half()}
    data = save_bytes(obj)
    want = seen(data)
    switched_off(monkeypatch)
    assert seen(data) == want
