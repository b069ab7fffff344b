"""DCP ``.metadata`` whose fields have the wrong types: a clean ckptlab error, field named.

Each case is a real ``Metadata`` from ``dcp.save`` with one field replaced, pickled by Python's
own pickler (so the file is exactly what a careless or hostile writer would produce).
"""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab as cl
from ckptlab.errors import CkptlabError, CorruptArchiveError


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp") / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(4, 3), "step": 3}, checkpoint_id=root)
    meta = pickle.loads((root / ".metadata").read_bytes())  # our own file: safe to load
    return root, meta


def _index(meta: Any, fqn: str) -> Any:
    return next(k for k in meta.storage_data if k.fqn == fqn)


def _replace_index(meta: Any, fqn: str, **fields: Any) -> None:
    import dataclasses

    key = _index(meta, fqn)
    info = meta.storage_data.pop(key)
    new = dataclasses.replace(key, **{k: v for k, v in fields.items() if k != "index"})
    if "index" in fields:
        object.__setattr__(new, "index", fields["index"])
    meta.storage_data[new] = info


def _wrong_chunks(meta: Any) -> None:
    meta.state_dict_metadata["w"].chunks = "not a list"


def _offset_is_text(meta: Any) -> None:
    meta.storage_data[_index(meta, "w")].offset = "12"


def _negative_length(meta: Any) -> None:
    meta.storage_data[_index(meta, "w")].length = -5


def _huge_relative_path_int(meta: Any) -> None:
    meta.storage_data[_index(meta, "w")].relative_path = 10 ** 5000


def _fqn_is_int(meta: Any) -> None:
    meta.state_dict_metadata[7] = meta.state_dict_metadata.pop("w")


def _negative_chunk_index(meta: Any) -> None:
    _replace_index(meta, "w", index=-1)


def _size_not_a_size(meta: Any) -> None:
    meta.state_dict_metadata["w"].size = [4, 3]


def _missing_state_dict_metadata(meta: Any) -> None:
    del meta.__dict__["state_dict_metadata"]


def _dtype_is_a_string(meta: Any) -> None:
    meta.state_dict_metadata["w"].properties.dtype = "float32"


CASES = {f.__name__.strip("_"): f for f in (
    _wrong_chunks, _offset_is_text, _negative_length, _huge_relative_path_int, _fqn_is_int,
    _negative_chunk_index, _size_not_a_size, _missing_state_dict_metadata, _dtype_is_a_string)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_wrong_field_types_are_ckptlab_errors(saved, tmp_path: Path, case: str) -> None:
    import shutil

    root, meta = saved
    bad = copy.deepcopy(meta)
    CASES[case](bad)
    target = tmp_path / "ck"
    shutil.copytree(root, target)
    try:
        data = pickle.dumps(bad)
    except (TypeError, ValueError, pickle.PicklingError) as exc:  # pragma: no cover
        pytest.skip(f"Python cannot pickle this case: {exc}")
    (target / ".metadata").write_bytes(data)
    for reader in (cl.inspect, cl.open):
        with pytest.raises(CkptlabError) as info:
            reader(target)
        assert isinstance(info.value, CorruptArchiveError | CkptlabError)
        assert "Traceback" not in str(info.value)
