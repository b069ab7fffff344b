"""Fixtures shared by the planning tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptlab.plan.examples import save_sample_sharded
from ckptlab.plan.ranks import run_ranks


@pytest.fixture(scope="session")
def sample_sharded_save(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """The sample state saved by torch's DCP on 2 gloo ranks (``save_sample_sharded``) and
    the ranks' local plans: one run for every test that reads it (it spawns 2 processes,
    about 30 s here). Read it only."""
    path = tmp_path_factory.mktemp("sample-sharded") / "checkpoint"
    return path, run_ranks(save_sample_sharded, 2, str(path), timeout=180)
