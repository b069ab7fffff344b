"""Counts in words, one rule everywhere (``ckptlab._words.plural``): "1 tensor", "2 tensors";
the report, the figures and the CLI of a one-tensor checkpoint never say "1 tensors"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ckptlab._words import plural
from ckptlab.cli import main


def test_plural() -> None:
    assert plural(1, "tensor") == "1 tensor"
    assert plural(0, "tensor") == "0 tensors"
    assert plural(1234, "tensor") == "1,234 tensors"
    assert plural(2, "entry", "entries") == "2 entries"


def test_a_one_tensor_checkpoint_is_one_tensor(tmp_path: Path, capsys: Any) -> None:
    save_file({"w": torch.ones(3)}, str(tmp_path / "one.safetensors"))
    torch.save({"w": torch.ones(3)}, tmp_path / "one.pt")
    for path in (tmp_path / "one.safetensors", tmp_path / "one.pt"):
        out = tmp_path / f"{path.suffix[1:]}.html"
        assert main(["report", str(path), "-o", str(out)]) == 0
        page = out.read_text()
        assert "1 tensors" not in page and "1 tensor" in page, path
        assert main(["inspect", str(path)]) == 0
        assert "1 tensors" not in capsys.readouterr().out
