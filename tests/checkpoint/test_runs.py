"""Training runs: a directory of saves opens as the save the framework resumes from, lists
every save (complete or not), and ``step=N`` / ``--step N`` opens another.

The transformers ``Trainer`` run, the Lightning run and the ``step-N`` DCP run are written by
the real libraries (a tiny GPT-2 trained two steps with a save each; a LightningModule with
``ModelCheckpoint(save_last=True)``; ``dcp.save``). DeepSpeed and Megatron-Core runs written
by their libraries are in tests/checkpoint/test_deepspeed.py and tests/dcp/test_megatron.py;
here their pointer files (``latest``, ``latest_checkpointed_iteration.txt``) and names are
also built with torch's own writers, to test the rules on their own.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab as cl
from ckptlab.checkpoint.runs import find_run
from ckptlab.cli import main
from ckptlab.errors import UnsupportedFormatError


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("trainer") / "run"
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50,
                                     bos_token_id=0, eos_token_id=0,
                                     n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 50, (8, 8))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=2, save_steps=1, per_device_train_batch_size=4,
        report_to=[], use_cpu=True, logging_strategy="no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.Trainer(model=model, args=args, train_dataset=data).train()
    return out


def test_trainer_run_opens_its_last_checkpoint(trainer_run: Path) -> None:
    from safetensors.torch import load_file
    from transformers.trainer_utils import get_last_checkpoint

    ck = cl.open(trainer_run)
    assert ck.run.framework == "trainer"
    assert [s.name for s in ck.steps] == ["checkpoint-1", "checkpoint-2"]
    assert [s.number for s in ck.steps] == [1, 2] and all(s.complete for s in ck.steps)
    assert os.path.join(trainer_run, ck.run.opened) == get_last_checkpoint(trainer_run)
    truth = load_file(trainer_run / "checkpoint-2" / "model.safetensors")
    assert truth and set(truth) <= set(ck.tensors)
    for name, t in truth.items():
        assert torch.equal(ck.read(name), t), name
    first = cl.open(trainer_run, step=1)
    assert first.run.opened == "checkpoint-1"
    truth1 = load_file(trainer_run / "checkpoint-1" / "model.safetensors")
    assert any(not torch.equal(first.read(n), truth[n]) for n in truth1)  # it trained
    for name, t in truth1.items():
        assert torch.equal(first.read(name), t)
    with pytest.raises(UnsupportedFormatError, match="no save for step 7"):
        cl.open(trainer_run, step=7)


def test_an_incomplete_save_is_listed_never_opened(trainer_run: Path, tmp_path: Path
                                                    ) -> None:
    run = tmp_path / "run"
    shutil.copytree(trainer_run, run)
    (run / "checkpoint-2" / "trainer_state.json").unlink()  # killed before its last file
    found = find_run(str(run))
    assert found is not None and [s.complete for s in found.steps] == [True, False]
    with pytest.raises(UnsupportedFormatError, match="checkpoint-2 is an incomplete save"):
        cl.open(run)  # the Trainer itself would resume from it: refused, with the way out
    assert cl.open(run, step=1).run.opened == "checkpoint-1"


def _dcp_save(state: dict[str, Any], where: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=where)


def test_dcp_steps_resume_from_the_last_complete_one(tmp_path: Path) -> None:
    run = tmp_path / "checkpoint"
    for step in (10, 20, 30):
        _dcp_save({"w": torch.full((3,), float(step)), "step": step}, run / f"step-{step}")
    (run / "step-30" / ".metadata").unlink()  # its writer's last file: killed mid-save
    ck = cl.open(run)
    assert ck.run.framework == "dcp-steps" and ck.run.opened == "step-20"
    assert [(s.number, s.complete) for s in ck.steps] == [(10, True), (20, True),
                                                          (30, False)]
    assert torch.equal(ck.read("w"), torch.full((3,), 20.0))
    assert torch.equal(cl.open(run, step=10).read("w"), torch.full((3,), 10.0))
    with pytest.raises(UnsupportedFormatError, match="incomplete"):
        cl.open(run, step=30)


def test_megatron_runs_follow_their_tracker_file(tmp_path: Path) -> None:
    run = tmp_path / "megatron"
    for it in (5, 10):
        where = run / f"iter_{it:07d}"
        _dcp_save({"decoder.weight": torch.full((2, 2), float(it))}, where)
        (where / "metadata.json").write_text(json.dumps(
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
             "common_backend": "torch", "common_backend_version": 1}))
    (run / "latest_checkpointed_iteration.txt").write_text("5")  # not the highest
    ck = cl.open(run)
    assert ck.run.framework == "megatron" and ck.run.opened == "iter_0000005"
    assert torch.equal(ck.read("decoder.weight"), torch.full((2, 2), 5.0))
    assert [s.number for s in ck.steps] == [5, 10]


def test_deepspeed_runs_follow_latest(tmp_path: Path) -> None:
    run = tmp_path / "ds"
    for step in (1, 2):
        (run / f"global_step{step}").mkdir(parents=True)
        torch.save({"module": {"w": torch.full((2,), float(step))}},
                   run / f"global_step{step}" / "mp_rank_00_model_states.pt")
    (run / "latest").write_text("global_step1")
    (run / "zero_to_fp32.py").write_text("# DeepSpeed copies its script here\n")
    ck = cl.open(run)
    assert ck.run.framework == "deepspeed" and ck.run.opened == "global_step1"
    assert [s.name for s in ck.steps] == ["global_step1", "global_step2"]
    assert torch.equal(ck.read(next(iter(ck.tensors))), torch.full((2,), 1.0))


def test_lightning_runs_take_last_ckpt(tmp_path: Path) -> None:
    run = tmp_path / "lightning"
    run.mkdir()
    for step in (5, 10):
        torch.save({"state_dict": {"w": torch.full((2,), float(step))}, "global_step": step},
                   run / f"epoch=0-step={step}.ckpt")
    shutil.copy(run / "epoch=0-step=5.ckpt", run / "last.ckpt")
    ck = cl.open(run)
    assert ck.run.framework == "lightning" and ck.run.opened == "last.ckpt"
    assert cl.open(run, step=10).run.opened == "epoch=0-step=10.ckpt"


def test_a_real_lightning_run(tmp_path: Path) -> None:
    """Three training steps of a LightningModule on CPU, a checkpoint each and ``last.ckpt``
    (Lightning's ``ModelCheckpoint``): the run opens ``last.ckpt`` (what
    ``Trainer.fit(ckpt_path="last")`` resumes from), its tensors bit for bit torch.load's."""
    if not os.environ.get("CI"):
        pytest.importorskip("lightning")
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(3, 2)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 3)),
                                       batch_size=2)
    run = tmp_path / "checkpoints"
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=run, every_n_train_steps=1,
                                                save_top_k=-1, save_last=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", callbacks=[saver], logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny(), data)
    ck = cl.open(run)
    assert ck.run.framework == "lightning" and ck.run.opened == "last.ckpt"
    assert [s.number for s in ck.steps if s.name != "last.ckpt"] == [1, 2, 3]
    saved = torch.load(run / "last.ckpt", weights_only=False)
    for name, tensor in saved["state_dict"].items():
        assert torch.equal(ck.read(f"state_dict.{name}"), tensor), name
    exp_avg = saved["optimizer_states"][0]["state"][0]["exp_avg"]
    assert torch.equal(ck.read("optimizer_states.0.state.0.exp_avg"), exp_avg)
    assert ck.objects["global_step"] == 3
    first = cl.open(run, step=1)
    assert first.run.opened.endswith("step=1.ckpt")


def test_step_on_something_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "one.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(UnsupportedFormatError, match="not one"):
        cl.open(path, step=1)
    assert cl.open(path).run is None and cl.open(path).steps == ()


def test_cli_shows_the_steps(trainer_run: Path, capsys: Any) -> None:
    assert main(["inspect", str(trainer_run)]) == 0
    out = capsys.readouterr().out
    assert "trainer run: 2 saves; resumes from checkpoint-2" in out
    assert "checkpoint-1" in out and "shown: checkpoint-2 (*)" in out
    assert main(["inspect", str(trainer_run), "--step", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"]["opened"] == "checkpoint-1" and len(doc["run"]["steps"]) == 2
    import jsonschema

    from tests.test_cli_schema import assert_valid, schema  # the contract

    assert_valid(jsonschema.Draft202012Validator(schema("inspect")), doc)
    assert main(["offsets", str(trainer_run), "--step", "2"]) == 0
    capsys.readouterr()
    assert main(["readiness", str(trainer_run / "checkpoint-1"), "--step", "1"]) == 2
    assert "--step is for a training run's directory" in capsys.readouterr().err


def test_serve_accepts_a_run_of_directories(trainer_run: Path) -> None:
    """A Trainer run holds only its checkpoint-N directories: serve's up-front check lets it
    through (the server then opens the save the Trainer resumes from)."""
    from ckptlab.cli._checks import _check_servable

    _check_servable(str(trainer_run))  # no error


def test_a_model_beside_its_saves_is_that_model(trainer_run: Path, tmp_path: Path,
                                                capsys: Any) -> None:
    """After ``Trainer.save_model`` the output directory holds the final model beside its
    checkpoint-N saves: it opens as that model (as before runs were read), the saves listed;
    ``step=N`` opens a save."""
    import transformers

    run = tmp_path / "run"
    shutil.copytree(trainer_run, run)
    model = transformers.GPT2LMHeadModel.from_pretrained(run / "checkpoint-2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(run)  # what save_model writes
    ck = cl.open(run)
    assert ck.path == str(run) and ck.run.opened is None
    assert [s.name for s in ck.steps] == ["checkpoint-1", "checkpoint-2"]
    assert cl.open(run, step=1).run.opened == "checkpoint-1"
    assert main(["inspect", str(run)]) == 0
    assert "shown: the directory's own model" in capsys.readouterr().out
