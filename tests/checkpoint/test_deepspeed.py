"""DeepSpeed saves open by parameter name: runs written by DeepSpeed itself on CPU (ZeRO 0-3,
two gloo ranks, ckptlab.testing.deepspeed_run), each tensor compared bit for bit with
DeepSpeed's own tools: the master weights with ``zero_to_fp32``'s state dict, the Adam
moments with what ``ds_to_universal`` writes, the model states with ``torch.load``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint.model import Part
from ckptlab.cli import main
from ckptlab.testing.deepspeed_run import write_run

if not os.environ.get("CI"):  # CI installs it (the dev extra): a missing one fails there
    pytest.importorskip("deepspeed")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """ZeRO stage -> a run directory (two saves, ``latest`` naming the second); stages 1-3
    also converted by ds_to_universal into ``<run>-universal``."""
    base = tmp_path_factory.mktemp("deepspeed")
    return {stage: write_run(stage, base / f"zero{stage}", port=29617 + stage,
                             universal=base / f"zero{stage}-universal" if stage else None)
            for stage in (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-stage pipeline run under ZeRO 1 (four ranks: two data-parallel per stage), and
    ``ds_to_universal``'s conversion of its second save beside it."""
    base = tmp_path_factory.mktemp("ds-pipeline")
    write_run(1, base / "run", port=29625, pipeline=True, universal=base / "universal")
    return base


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _zero_to_fp32(run: Path, tag: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(
        str(run), tag=tag).items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_master_weights_are_zero_to_fp32s(runs: dict[int, Path], stage: int) -> None:
    ck = cl.open(runs[stage])  # the run: DeepSpeed's latest tag
    assert ck.format == "deepspeed" and ck.run.opened == "global_step2"
    assert [s.name for s in ck.steps] == ["global_step1", "global_step2"]
    assert any(f"ZeRO stage {stage} over 2 data-parallel ranks" in n for n in ck.notes)
    truth = _zero_to_fp32(runs[stage], "global_step2")
    buffers = {"scale"}
    for name, tensor in truth.items():
        mine = f"module.{name}" if name in buffers else f"fp32.{name}"
        assert _same(ck.read(mine), tensor), name
    assert {n[5:] for n in ck.tensors if n.startswith("fp32.")} == set(truth) - buffers
    # the tied weight is its source's bytes, not a copy
    assert ck.tensors["fp32.head.weight"].parts == ck.tensors["fp32.emb.weight"].parts


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_states_are_ds_to_universals(runs: dict[int, Path], stage: int) -> None:
    ck = cl.open(runs[stage])
    universal = runs[stage].with_name(f"zero{stage}-universal") / "zero"
    compared = 0
    for folder in sorted(universal.iterdir()):
        for key in ("exp_avg", "exp_avg_sq"):
            if not (folder / f"{key}.pt").exists():
                continue
            saved = torch.load(folder / f"{key}.pt", weights_only=False)
            saved = saved["param"] if isinstance(saved, dict) else saved
            mine = ck.read(f"{key}.{folder.name}")
            assert _same(mine.reshape(saved.shape), saved), (key, folder.name)
            compared += 1
    assert compared == 10  # emb, body.weight, body.bias, norm.weight, norm.bias: two each


@pytest.mark.parametrize("stage", [1, 2])
def test_module_is_the_master_rounded(runs: dict[int, Path], stage: int) -> None:
    """``module.x`` (the bf16 weights the model held) is ``fp32.x`` (the optimizer's master
    copy) rounded to bf16: the names line up parameter by parameter."""
    ck = cl.open(runs[stage])
    model = torch.load(runs[stage] / "global_step2" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"]
    for name, tensor in model.items():
        assert _same(ck.read(f"module.{name}"), tensor), name
    trained = ["emb.weight", "body.weight", "body.bias", "norm.weight", "norm.bias"]
    for name in trained:
        assert _same(ck.read(f"module.{name}"), ck.read(f"fp32.{name}").bfloat16()), name
    d = cl.diff(ck, ck, rename={f"module.{n}": f"fp32.{n}" for n in trained})
    for name in trained:  # bf16 against its fp32 master: close, not equal
        t = d.tensors[f"module.{name}"]
        assert t.dtype == ("bfloat16", "float32") and 0 < t.rel_l2 < 1e-2, (name, t)


def test_zero3_pieces_are_byte_ranges_of_the_partitions(runs: dict[int, Path]) -> None:
    ck = cl.open(runs[3])
    t = ck.tensors["fp32.emb.weight"]  # 66 elements over 2 ranks: 33 from each
    assert t.shape == (11, 6) and [p.role for p in t.parts] == ["piece", "piece"]
    assert [p.chunk_offsets for p in t.parts] == [(0,), (33,)]
    assert [p.file for p in t.parts] == [f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
                                         for r in (0, 1)]
    assert sum(p.nbytes for p in t.parts) == 66 * 4
    # the placeholders ZeRO 3 saves in the model states are not shown as the weights
    assert "module.emb.weight" not in ck.tensors and "module.scale" in ck.tensors
    for p in t.parts:  # each piece is the bytes the file holds there
        raw = (runs[3] / "global_step2" / p.file).read_bytes()[p.offset:p.offset + p.nbytes]
        assert isinstance(p, Part) and len(raw) == p.nbytes


def test_zero0_is_the_model_states_file(runs: dict[int, Path]) -> None:
    ck = cl.open(runs[0])
    saved = torch.load(runs[0] / "global_step2" / "mp_rank_00_model_states.pt",
                       weights_only=False)
    assert ck.format == "deepspeed"
    for name, tensor in saved["module"].items():
        assert _same(ck.read(f"module.{name}"), tensor)
    state = saved["optimizer"]["state"]
    for index, values in state.items():
        assert _same(ck.read(f"optimizer.state.{index}.exp_avg"), values["exp_avg"])
    assert ck.objects["global_steps"] == 2 and ck.objects["ds_version"]
    assert not any(n.startswith("fp32.") for n in ck.tensors)


def test_a_pipeline_save_opens_by_layer_and_parameter(pipeline: Path) -> None:
    """Each layer file's tensors as ``module.<layer>.<key>`` (PipelineModule's names) and each
    stage's ZeRO partitions assembled by parameter, against torch.load of the layer files and
    DeepSpeed's own ds_to_universal (zero_to_fp32 does not read pipeline saves)."""
    ck = cl.open(pipeline / "run")
    assert ck.format == "deepspeed" and ck.run.opened == "global_step2"
    assert any("pipeline-parallel save, 2 stages" in n for n in ck.notes)
    assert sum("ZeRO stage 1 over 2 data-parallel ranks (pipeline stage" in n
               for n in ck.notes) == 2
    layers = sorted((pipeline / "run" / "global_step2").glob("layer_*-model_states.pt"))
    expected = set()
    for f in layers:
        for key, tensor in torch.load(f, weights_only=True).items():
            name = f"module.{int(f.name[6:8])}.{key}"
            assert _same(ck.read(name), tensor), name
            expected.add(name)
    assert {n for n in ck.tensors if n.startswith("module.")} == expected
    assert len(expected) == 8  # layers 0, 1, 2 and 4 (3 is a ReLU), weight and bias each
    universal = pipeline / "universal" / "zero"
    params = sorted(p.name for p in universal.iterdir() if p.is_dir())
    assert params == sorted(n[len("module."):] for n in expected)  # 0.weight, 0.bias...
    for param in params:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = torch.load(universal / param / f"{state}.pt", weights_only=False)
            saved = saved["param"] if isinstance(saved, dict) else saved
            assert _same(ck.read(f"{state}.{param}").reshape(saved.shape), saved), (state,
                                                                                  param)
    assert {n.split(".", 1)[0] for n in ck.tensors if not n.startswith("module.")} >= {
        "fp32", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("stage", [2, 3])
def test_universal_checkpoint(runs: dict[int, Path], stage: int) -> None:
    root = runs[stage].with_name(f"zero{stage}-universal")
    ck = cl.open(root)
    assert ck.format == "deepspeed"
    assert any("universal" in n for n in ck.notes)
    for path in sorted((root / "zero").glob("*/*.pt")):
        saved = torch.load(path, weights_only=False)
        saved = saved["param"] if isinstance(saved, dict) else saved
        assert _same(ck.read(f"{path.stem}.{path.parent.name}"), saved), path


def test_a_missing_rank_is_said_and_nothing_assembled(runs: dict[int, Path],
                                                      tmp_path: Path) -> None:
    save = tmp_path / "global_step2"
    shutil.copytree(runs[2] / "global_step2", save)
    (save / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    ck = cl.open(save)
    assert not any(n.startswith("fp32.") for n in ck.tensors)
    assert any("not assembled" in n and "2 partitions" in n for n in ck.notes)
    # the partition the directory does hold is still there, under its file's name
    assert ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt.optimizer_state_dict."
            "single_partition_of_fp32_groups.0") in ck.tensors


def test_cli_inspects_the_run(runs: dict[int, Path], capsys: pytest.CaptureFixture[str]
                              ) -> None:
    from ckptlab.schemas import schema

    jsonschema = pytest.importorskip("jsonschema")
    assert main(["inspect", str(runs[3])]) == 0
    text = capsys.readouterr().out
    assert "DeepSpeed" in text and "fp32.emb.weight" in text and "global_step1" in text
    assert main(["inspect", "--json", str(runs[3])]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, schema("inspect"))
    assert doc["format"] == "deepspeed"
