"""Shared test set-up: hypothesis profiles sized for CI, and a fresh sample checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large],
)
settings.register_profile(
    "dev", max_examples=200, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def sample_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded sample written once per session (archive name 'sample')."""
    from ckptlab import samples

    return samples.write_sample(tmp_path_factory.mktemp("sample") / "sample.pt")


@pytest.fixture(scope="session")
def sample_layout(sample_file: Path):
    """``ckptlab.inspect`` of the embedded sample (121 records, about 1.4 MB)."""
    import ckptlab

    return ckptlab.inspect(sample_file)


@pytest.fixture(scope="session")
def small_obj() -> dict:
    """A small deterministic state dict: tied weights (three tensors over one storage, one a
    view at an offset), bfloat16, int64 and bool buffers, and an empty tensor."""
    import torch

    from ckptlab import samples

    sd = samples.tiny_gpt(n_layer=1, d_model=8, vocab=16, context=4)
    sd["extra.view"] = sd["transformer.wte.weight"][3:5]
    sd["extra.empty"] = torch.empty(0)
    return sd


@pytest.fixture(scope="session")
def small_file(tmp_path_factory: pytest.TempPathFactory, small_obj: dict) -> Path:
    """``small_obj`` written by torch.save (alignment 64, archive name 'small')."""
    import torch

    path = tmp_path_factory.mktemp("small") / "small.pt"
    torch.save(small_obj, path)
    return path


@pytest.fixture(scope="session")
def hostile_name() -> str:
    """A tensor name that must be escaped wherever it is shown as HTML."""
    return '<script>alert("x")</script>&'


@pytest.fixture(scope="session")
def safetensors_file(tmp_path_factory: pytest.TempPathFactory, hostile_name: str) -> Path:
    """A .safetensors file: a 3x2 float32 tensor 'a' and a bfloat16 one named ``hostile_name``."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("st") / "m.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.float32).reshape(3, 2),
               hostile_name: torch.ones(5, dtype=torch.bfloat16)}, str(path))
    return path
