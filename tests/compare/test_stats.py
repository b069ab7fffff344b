"""``ckptlab.stats`` and ``ckptlab stats``: every statistic against torch computing it on the
tensor its own loader gives, across formats and dtypes; slices joined exactly; health."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.compare import _kernels
from ckptlab.compare._stats import BINS, health

pytestmark = pytest.mark.usefixtures("loops")  # NumPy loops, then compiled (conftest.py)


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    w = torch.randn(64, 32)
    with_nan = torch.randn(100)
    with_nan[[3, 50]] = float("nan")
    with_nan[7] = float("inf")
    return {"w": w, "bf": torch.randn(300).to(torch.bfloat16), "nan": with_nan,
            "zero": torch.zeros(10), "const": torch.full((5,), 2.5),
            "ints": torch.arange(-5, 20), "flags": torch.tensor([True, False, True, True]),
            "layers.0.w": torch.randn(8), "layers.1.w": torch.randn(8),
            "layers.2.w": torch.randn(8) * 1e4, "layers.3.w": torch.randn(8)}


def _check(s: Any, t: torch.Tensor) -> None:
    x = (t.to(torch.uint8) if t.dtype == torch.bool else t).double().reshape(-1)
    f = x[torch.isfinite(x)]
    assert s.numel == t.numel()
    assert s.nan == int(torch.isnan(x).sum()) and s.inf == int(torch.isinf(x).sum())
    assert s.zeros == int((x == 0).sum())
    assert s.min == f.min().item() and s.max == f.max().item()
    assert s.abs_max == f.abs().max().item()
    assert s.mean == pytest.approx(f.mean().item(), rel=1e-12, abs=1e-15)
    assert s.std == pytest.approx(f.std(correction=0).item(), rel=1e-9, abs=1e-15)
    assert sum(s.counts) == f.numel() and len(s.counts) == BINS and len(s.edges) == BINS + 1
    if s.max > s.min:
        want = torch.histc(f, bins=BINS, min=s.min, max=s.max)
        assert list(s.counts) == [int(c) for c in want]


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_every_statistic_against_torch(tmp_path: Path, fmt: str) -> None:
    state = _state()
    path = tmp_path / ("s.pt" if fmt == "torch" else "s.safetensors")
    if fmt == "torch":
        torch.save(state, path)
    else:
        save_file(state, str(path))
    found = cl.stats(path)
    assert list(found) == list(cl.open(path).tensors)
    for name, t in state.items():
        _check(found[name], t)


def test_slices_join_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor measured in many slices gives what one pass gives."""
    torch.manual_seed(2)
    t = torch.randn(10_007) * 3 + 1
    t[123] = float("nan")
    save_file({"t": t}, str(tmp_path / "t.safetensors"))
    whole = cl.stats(tmp_path / "t.safetensors")["t"]
    monkeypatch.setattr(_kernels, "SLICE", 1000)
    sliced = cl.stats(tmp_path / "t.safetensors")["t"]
    assert sliced.counts == whole.counts and (sliced.min, sliced.max) == (whole.min, whole.max)
    assert sliced.mean == pytest.approx(whole.mean, rel=1e-12)
    assert sliced.std == pytest.approx(whole.std, rel=1e-12)
    _check(sliced, t)


def test_health_names_what_looks_wrong(tmp_path: Path) -> None:
    torch.save(_state(), tmp_path / "s.pt")
    lines = health(cl.stats(tmp_path / "s.pt"))
    text = "\n".join(lines)
    assert "NaN or Inf in 1 tensor: nan" in text
    assert "all zero: zero" in text and "constant: const" in text
    assert "layers.2.w" in text and "layers.1.w" not in text


def test_a_subset_and_an_unreadable_tensor(tmp_path: Path) -> None:
    save_file({"a": torch.ones(1000), "b": torch.ones(4)}, str(tmp_path / "x.safetensors"))
    ck = cl.open(tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[:-100])
    found = cl.stats(ck)
    assert any(s.error and "cannot be read" in s.error for s in found.values())
    assert list(cl.stats(ck, names=["b"])) == ["b"]


def test_cli(tmp_path: Path, capsys: Any) -> None:
    torch.save(_state(), tmp_path / "s.pt")
    assert main(["stats", str(tmp_path / "s.pt")]) == 0
    out = capsys.readouterr().out
    assert "health: NaN or Inf in 1 tensor: nan" in out and "const" in out
    assert main(["stats", str(tmp_path / "s.pt"), "--check"]) == 1
    assert "NaN or Inf in nan" in capsys.readouterr().err
    assert main(["stats", str(tmp_path / "s.pt"), "--check", "--filter", "layers"]) == 0
    capsys.readouterr()
    assert main(["stats", str(tmp_path / "s.pt"), "--json", "--filter", "w"]) == 0
    doc = json.loads(capsys.readouterr().out)
    w = doc["tensors"]["w"]
    assert set(w) >= {"numel", "min", "max", "mean", "std", "abs_max", "nan", "inf", "zeros",
                      "hist"}
    assert len(w["hist"]["counts"]) == BINS and not math.isnan(w["mean"])
    assert "nan" not in doc["tensors"]  # (the filter)


def test_large_tensors_are_measured_in_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              read_sizes: list[int]) -> None:
    """With pieces of 4 KiB no read is larger than a piece (a float32 tensor is read twice,
    a bfloat16 one once), and every statistic is the whole tensor's."""
    torch.manual_seed(10)
    state = {"f": torch.randn(5000) * 3, "h": torch.randn(7000).to(torch.bfloat16)}
    state["f"][17] = float("inf")
    save_file(state, str(tmp_path / "s.safetensors"))
    whole = cl.stats(tmp_path / "s.safetensors")
    read_sizes.clear()  # (the reads of the whole-tensor pass above)
    monkeypatch.setattr(_kernels, "CHUNK_NBYTES", 4096)
    pieces = cl.stats(tmp_path / "s.safetensors")
    assert max(read_sizes) == 4096
    assert sum(read_sizes) == 2 * state["f"].nbytes + state["h"].nbytes
    for name, t in state.items():
        _check(pieces[name], t)
        assert pieces[name].counts == whole[name].counts
        assert pieces[name].std == pytest.approx(whole[name].std, rel=1e-12)
