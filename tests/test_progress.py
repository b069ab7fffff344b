"""Progress of long work: the core reports tasks, the CLI draws them on stderr."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptlab
from ckptlab._progress import listening, task

safetensors_torch = pytest.importorskip("safetensors.torch")


class _Record:
    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def start(self, label: str, total: int | None) -> None:
        self.log.append(("start", label, total))

    def advance(self, done: int) -> None:
        self.log.append(("advance", done))

    def end(self) -> None:
        self.log.append(("end",))


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    weight_map = {}
    for s in range(3):
        name = f"model-0000{s + 1}-of-00003.safetensors"
        safetensors_torch.save_file({f"w{s}.{i}": torch.zeros(4) for i in range(2)},
                                    str(tmp_path / name))
        weight_map.update({f"w{s}.{i}": name for i in range(2)})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path


def test_without_a_listener_a_task_is_silent() -> None:
    with task("nothing listens", total=2) as t:
        t.advance()
        t.advance()


def test_open_reports_one_step_per_shard(hf_dir: Path) -> None:
    log: list[tuple] = []
    with listening(lambda: _Record(log)):
        ck = ckptlab.open(hf_dir)
    assert len(ck.tensors) == 6
    i = log.index(("start", "reading shards", 3))
    assert log[i + 1:i + 5] == [("advance", 1)] * 3 + [("end",)]
    assert log.count(("end",)) == sum(1 for e in log if e[0] == "start")


def test_a_failing_task_still_ends() -> None:
    log: list[tuple] = []
    with pytest.raises(ValueError), listening(lambda: _Record(log)):
        with task("fails", total=None):
            raise ValueError("boom")
    assert log == [("start", "fails", None), ("end",)]


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("CKPTLAB_PROGRESS")}
    return subprocess.run([sys.executable, "-m", "ckptlab", *args], capture_output=True,
                          text=True, env={**full, **env}, timeout=120)


def test_cli_draws_bars_on_stderr_when_asked(hf_dir: Path) -> None:
    pytest.importorskip("tqdm")
    done = _cli(["inspect", str(hf_dir)], CKPTLAB_PROGRESS="1", CKPTLAB_PROGRESS_DELAY="0")
    assert done.returncode == 0, done.stderr
    assert "reading shards" in done.stderr and "/3" in done.stderr
    assert "reading shards" not in done.stdout  # the table stays clean for pipes


def test_cli_is_quiet_when_stderr_is_not_a_terminal(hf_dir: Path) -> None:
    done = _cli(["inspect", str(hf_dir)], CKPTLAB_PROGRESS_DELAY="0")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
