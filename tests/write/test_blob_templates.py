"""The torch.save blob of a chunk: built once per (dtype, shape), loads with torch.load, and
matches torch.save with storage alignment 4096 and ckptlab's predicted layout."""

from __future__ import annotations

import io

import pytest
import torch

import ckptlab as cl
from ckptlab.write._blob import ALIGNMENT, BlobTemplates, build_template

CASES = [(torch.float32, (33, 7)), (torch.bfloat16, (5,)), (torch.int64, ()),
         (torch.bool, (3, 2)), (torch.float32, (0,)), (torch.float16, (2, 0, 3)),
         (torch.complex64, (4,)), (torch.uint8, (4097,))]


def _value(dtype, shape):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


@pytest.mark.parametrize(("dtype", "shape"), CASES)
def test_blob_loads_bit_exact_and_data_is_aligned(dtype, shape) -> None:
    tpl = build_template(dtype, shape)
    x = _value(dtype, shape)
    raw = x.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b""
    assert len(raw) == tpl.data_nbytes
    blob = tpl.prefix + raw + tpl.suffix
    assert len(blob) == tpl.nbytes
    assert tpl.data_offset % ALIGNMENT == 0
    y = torch.load(io.BytesIO(blob), weights_only=True)
    assert y.dtype == dtype and tuple(y.shape) == shape and torch.equal(y, x)
    # ckptlab reads it as a torch zip whose one storage sits where the template says
    layout = cl.inspect(io.BytesIO(blob))
    assert [s.data_offset for s in layout.storages] == [tpl.data_offset]
    assert layout.storages[0].nbytes == tpl.data_nbytes


@pytest.mark.parametrize(("dtype", "shape"), CASES[:3])
def test_blob_matches_torch_save_at_alignment_4096(dtype, shape) -> None:
    from torch.utils.serialization import config

    x = _value(dtype, shape)
    with config.patch({"save.storage_alignment": 4096, "save.compute_crc32": False}):
        buf = io.BytesIO()
        torch.save(x, buf)
    theirs = buf.getvalue()
    tpl = build_template(dtype, shape)
    ours = tpl.prefix + x.contiguous().view(-1).view(torch.uint8).numpy().tobytes() + tpl.suffix
    assert len(ours) == len(theirs)
    # identical except the 40-digit serialization id torch draws for every archive
    sid = ours.find(b"serialization_id")
    diff = [i for i in range(len(ours)) if ours[i] != theirs[i]]
    assert all(i > sid for i in diff) and len(diff) <= 40
    predicted = cl.predict_layout(x, alignment=4096)
    assert predicted.file_nbytes == tpl.nbytes
    assert predicted.storages[0].data_offset == tpl.data_offset


def test_templates_are_cached_per_dtype_and_shape() -> None:
    cache = BlobTemplates()
    a = cache.get(torch.float32, (3, 4))
    assert cache.get(torch.float32, torch.Size([3, 4])) is a
    assert cache.get(torch.float32, (4, 3)) is not a
    assert len(cache) == 2
