"""A Megatron-Core ``dist_checkpointing`` directory (``torch_dist``) written by megatron-core
itself on two gloo ranks (ckptlab.testing.megatron_run) opens whole: its ShardedTensors as
global tensors equal bit for bit to what ``dist_checkpointing.load`` gives, each rank's
ShardedObject as the value it saved, ``common.pt`` and ``metadata.json`` as values, and the
``all_local_plans`` Megatron's planner adds to ``.metadata`` kept inert.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.testing.megatron_run import load_save, write_save

# CI installs it (the dev extra): a missing one fails there. Looked up, not imported: importing
# megatron.core adds safe globals to torch for the whole test session
if not os.environ.get("CI") and importlib.util.find_spec("megatron") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = write_save(tmp_path_factory.mktemp("megatron") / "iter_0000005")
    return out, load_save(out)


def test_megatron_directory_opens_as_megatron_loads_it(saved: tuple[Path, dict]) -> None:
    out, loaded = saved
    ck = cl.open(out)
    assert ck.format == "dcp"
    for name in ("decoder.weight", "embedding.word_embeddings.weight"):
        mine, theirs = ck.read(name), loaded[name]
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
    assert len(ck.tensors["decoder.weight"].parts) == 2  # one chunk per rank's file
    # each rank's ShardedObject, as stored: the list of that rank's objects for the key
    for rank in range(2):
        assert ck.objects[f"rng_state/shard_{rank}_2"] == [loaded[f"rng_state_{rank}"]]
    assert ck.objects["common.pt"] == {"iteration": 5, "args": {"lr": 0.1, "tokenizer": "gpt2"}}
    assert ck.objects["metadata.json"]["sharded_backend"] == "torch_dist"
    assert any("all_local_plans" in n for n in ck.notes)


def test_megatron_run_directory(saved: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = saved
    run = tmp_path / "run"
    shutil.copytree(out, run / "iter_0000005")  # the tracker names the one to resume from
    (run / "latest_checkpointed_iteration.txt").write_text("5")
    ck = cl.open(run)
    assert ck.run.framework == "megatron" and ck.run.opened == "iter_0000005"
    assert main(["inspect", str(run)]) == 0
