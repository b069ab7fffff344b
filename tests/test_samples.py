"""ckptlab.samples: deterministic sample state dicts and files."""

from __future__ import annotations

import pytest
import torch

import ckptlab as cl
from ckptlab.errors import InvalidArgumentError


def test_tiny_gpt_is_deterministic():
    a, b = cl.samples.tiny_gpt(), cl.samples.tiny_gpt()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_writes_differ_at_most_in_the_serialization_id(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = cl.samples.write_sample(tmp_path / "a" / "sample.pt")
    two = cl.samples.write_sample(tmp_path / "b" / "sample.pt")
    x, y = one.read_bytes(), two.read_bytes()
    assert len(x) == len(y)
    rec = cl.inspect(one).record(".data/serialization_id")
    differ = [i for i, (p, q) in enumerate(zip(x, y)) if p != q]
    assert all(rec.data_offset <= i < rec.data_offset + rec.data_nbytes
                          for i in differ)


@pytest.mark.parametrize("kwargs", [{"alignment": 4096}, {"storage_alignment": 4096},
                                    {"alignment": 4096, "storage_alignment": 4096}])
def test_write_sample_alignment(tmp_path, kwargs):
    layout = cl.inspect(cl.samples.write_sample(tmp_path / "s.pt", **kwargs))
    assert layout.storage_alignment == 4096 and layout.alignment == 4096


def test_write_sample_default_and_conflict(tmp_path):
    assert cl.inspect(cl.samples.write_sample(tmp_path / "d.pt")).storage_alignment == 64
    with pytest.raises(InvalidArgumentError, match="alignment=64, storage_alignment=128"):
        cl.samples.write_sample(tmp_path / "c.pt", alignment=64, storage_alignment=128)
    assert not (tmp_path / "c.pt").exists()


def test_sample_path_is_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = cl.samples.sample_path()
    assert first.is_file() and str(first).startswith(str(tmp_path))
    stamp = first.stat().st_mtime_ns
    assert cl.samples.sample_path() == first and first.stat().st_mtime_ns == stamp
    assert cl.inspect(first).archive_name == "sample"
