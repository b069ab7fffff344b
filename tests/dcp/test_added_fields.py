"""Attributes a writer adds to DCP's records beyond their fields: Megatron-Core's save keeps
its planners' local plans in ``Metadata.all_local_plans`` (``global_metadata.all_local_plans
= all_local_plans`` before ``finish``), so ``.metadata`` pickles them as a sixth field.

The directory is written by torch's ``dcp.save``; its ``Metadata`` is then given the
``SavePlan`` list torch's own ``DefaultSavePlanner`` makes for the same state dict (the
objects Megatron gathers), and pickled again as ``FileSystemWriter.finish`` pickles it.
The added attribute is kept as an inert value and named in the notes; every field DCP
defines is still checked; a class outside DCP in it is still refused.
"""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab as cl
from ckptlab.errors import CkptlabError, UnsupportedFormatError

dcp = pytest.importorskip("torch.distributed.checkpoint")


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"layer.weight": torch.randn(6, 4), "layer.bias": torch.randn(6),
            "emb": torch.randn(3, 2).to(torch.bfloat16), "iteration": 5}


def _local_plans(state: dict[str, Any]) -> list[Any]:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        planner.set_up_planner(state, is_coordinator=True)
        return [planner.create_local_plan()]


@pytest.fixture(scope="module")
def megatron_like(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("megatron") / "iter_0000005"
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=root)
    meta = pickle.loads((root / ".metadata").read_bytes())  # the test's own file
    meta.all_local_plans = _local_plans(state)
    (root / ".metadata").write_bytes(pickle.dumps(meta))
    return root, state


def _torch_load(root: Path, state: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else 0
           for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(out, checkpoint_id=root)
    return out


def test_opens_with_the_added_attribute_shown(megatron_like: tuple[Path, Any]) -> None:
    root, state = megatron_like
    ck = cl.open(root)
    truth = _torch_load(root, state)
    assert sorted(ck.tensors) == sorted(k for k in state if k != "iteration")
    for name in ck.tensors:
        got = ck.read(name)
        assert got.dtype == truth[name].dtype and torch.equal(
            got.view(torch.uint8), truth[name].view(torch.uint8))
    assert ck.objects["iteration"] == 5
    note = next(n for n in ck.notes if "all_local_plans" in n)
    assert "Megatron-Core" in note and "inert" in note
    layout = cl.inspect(root)
    plans = layout.metadata.all_local_plans
    assert isinstance(plans, list) and plans[0]["type"].endswith("planner.SavePlan")
    assert "layer.weight" in str(plans)  # the plans' items, rendered (nothing built)


def test_cli_shows_the_note(megatron_like: tuple[Path, Any], capsys: Any) -> None:
    from ckptlab.cli import main

    assert main(["inspect", str(megatron_like[0])]) == 0
    assert "all_local_plans" in capsys.readouterr().out


def _rewrite(src: Path, dst: Path, change: Any) -> Path:
    import shutil

    shutil.copytree(src, dst)
    meta = pickle.loads((src / ".metadata").read_bytes())
    change(meta)
    (dst / ".metadata").write_bytes(pickle.dumps(meta))
    return dst


def test_known_fields_are_still_checked(megatron_like: tuple[Path, Any], tmp_path: Path
                                        ) -> None:
    root, _ = megatron_like

    def negative(meta: Any) -> None:
        next(iter(meta.storage_data.values())).length = -5

    with pytest.raises(CkptlabError, match="length"):
        cl.open(_rewrite(root, tmp_path / "a", negative))


def test_a_foreign_class_in_the_added_attribute_is_refused(
        megatron_like: tuple[Path, Any], tmp_path: Path) -> None:
    root, _ = megatron_like

    def foreign(meta: Any) -> None:
        meta.all_local_plans.append(print)  # a global outside DCP: never imported

    with pytest.raises(UnsupportedFormatError, match=r"builtins\.print"):
        cl.open(_rewrite(root, tmp_path / "b", foreign))
