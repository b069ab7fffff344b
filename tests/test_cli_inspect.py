"""``ckptlab inspect`` on every format: tensors first, filter and sort, DESIGN's JSON contract."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptlab.cli import main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptlab", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("formats")
    sd = {"model.layers.0.mlp.weight": torch.randn(8, 4),
          "model.layers.0.attn.weight": torch.randn(4, 4).bfloat16(),
          "model.embed.weight": torch.randn(16, 4)}
    torch.save({**sd, "step": 7}, root / "m.pt")
    save_file(sd, root / "m.safetensors")
    hf = root / "hf"
    hf.mkdir()
    save_file({k: v for k, v in sd.items() if "layers" in k}, hf / "model-1.safetensors")
    save_file({"model.embed.weight": sd["model.embed.weight"]}, hf / "model-2.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.layers.0.mlp.weight": "model-1.safetensors",
        "model.layers.0.attn.weight": "model-1.safetensors",
        "model.embed.weight": "model-2.safetensors"}}))
    dcp.save({**sd, "step": 7}, checkpoint_id=root / "dcp")
    return {"torch-zip": root / "m.pt", "safetensors": root / "m.safetensors", "hf": hf,
            "dcp": root / "dcp"}


@pytest.mark.parametrize("fmt", ["torch-zip", "safetensors", "hf", "dcp"])
def test_json_contract_on_every_format(checkpoints, fmt: str, capsys) -> None:
    assert main(["inspect", str(checkpoints[fmt]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == fmt
    for key in ("path", "file_nbytes", "archive_name", "alignment", "zip64", "records",
                "storages", "tensors", "files"):
        assert key in doc, key
    assert {f["path"] for f in doc["files"]} and all(
        {"path", "format", "nbytes"} <= set(f) for f in doc["files"])
    names = {t["name"] for t in doc["tensors"]}
    assert names == {"model.layers.0.mlp.weight", "model.layers.0.attn.weight",
                     "model.embed.weight"}
    for t in doc["tensors"]:
        assert {"name", "path", "dtype", "shape", "stride", "kind", "nbytes", "parts"} <= set(t)
        assert t["parts"] and all({"role", "file", "offset", "nbytes"} <= set(p)
                                  for p in t["parts"])
    if fmt == "dcp":
        assert doc["items"]


def test_table_filter_and_sort(checkpoints, capsys) -> None:
    assert main(["inspect", str(checkpoints["hf"]), "--filter", "*.layers.*", "--sort",
                 "size"]) == 0
    out = capsys.readouterr().out
    assert "hf checkpoint: 3 tensors" in out
    table = out.split("tensors matching")[1]
    assert table.index("mlp.weight") < table.index("attn.weight")  # 128 B before 32 B
    assert "embed" not in table
    assert main(["inspect", str(checkpoints["torch-zip"])]) == 0
    out = capsys.readouterr().out
    assert "other values" in out and "step" in out


def test_names_that_do_not_print_are_shown_escaped(tmp_path: Path) -> None:
    torch.save({"\ud800bad": torch.ones(2), "tab\there": torch.zeros(1)}, tmp_path / "odd.pt")
    proc = run("inspect", str(tmp_path / "odd.pt"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "\\ud800bad" in proc.stdout and "tab\\there" in proc.stdout
    proc = run("inspect", str(tmp_path / "odd.pt"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert {t["name"] for t in json.loads(proc.stdout)["tensors"]} == {"\ud800bad", "tab\there"}


def test_tables_fit_the_terminal_and_wide_does_not(tmp_path, capsys, monkeypatch) -> None:
    """At an 80-column terminal the tensor table fits (columns with one value in every row
    said once below it, names cut in the middle, both ends kept); ``--wide`` and a pipe
    print the names whole."""
    import os
    import shutil
    import sys

    import torch

    from ckptlab.cli import main

    long = "model.transformer.h.0.attention_block.with_a_long_name_that_goes_on.c_attn.weight"
    torch.save({long: torch.ones(2), long.replace("c_attn", "c_proj"): torch.ones(3).half(),
                "bias": torch.zeros(2)}, tmp_path / "m.pt")
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size",
                        lambda fallback=(80, 24): os.terminal_size((80, 24)))
    assert main(["inspect", str(tmp_path / "m.pt")]) == 0
    out = capsys.readouterr().out
    table = out[out.index("name "):].splitlines()
    assert all(len(line) <= 80 for line in table), table
    assert any("…" in line and line.split()[0].endswith("c_attn.weight") for line in table)
    assert any(line.split()[0].endswith("c_proj.weight") for line in table)
    assert main(["inspect", str(tmp_path / "m.pt"), "--wide"]) == 0
    assert long in capsys.readouterr().out
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    assert main(["inspect", str(tmp_path / "m.pt")]) == 0
    assert long in capsys.readouterr().out
