"""The dtype tables ckptlab keeps (so the scanner never imports torch) match torch."""

import torch

from ckptlab.format._dtypes import DTYPE_ALIASES, DTYPE_ITEMSIZE, STORAGE_DTYPE, canonical_dtype


def test_every_torch_dtype_is_known_with_its_itemsize():
    for name in dir(torch):
        value = getattr(torch, name)
        if isinstance(value, torch.dtype):
            canonical = str(value).removeprefix("torch.")
            assert canonical_dtype(name) == canonical, name
            assert DTYPE_ITEMSIZE[canonical] == value.itemsize, name


def test_aliases_point_at_canonical_names():
    for alias, canonical in DTYPE_ALIASES.items():
        assert str(getattr(torch, alias)) == f"torch.{canonical}"


def test_storage_types_match_torch():
    mapping = torch.storage._dtype_to_storage_type_map()
    for dtype, storage_name in mapping.items():
        assert STORAGE_DTYPE[storage_name] == str(dtype).removeprefix("torch.")
    assert STORAGE_DTYPE["UntypedStorage"] == "uint8"
