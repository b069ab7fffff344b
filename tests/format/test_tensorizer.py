"""tensorizer ``.tensors`` files, written by tensorizer itself, open as format ``tensorizer``:
every tensor bit for bit what ``TensorDeserializer(verify_hash=True)`` loads, its hashes
checked on read as tensorizer checks them, every byte of the file accounted for; encrypted
files refused by name; damaged ones refused with a ckptlab error, never a traceback.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlab as cl
from ckptlab.cli import main
from ckptlab.errors import CkptlabError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format.layout import SegmentKind

if not os.environ.get("CI"):  # CI installs it (the dev extra): a missing one fails there
    pytest.importorskip("tensorizer")

from tensorizer import TensorDeserializer, TensorSerializer


def _state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(3, 4), "steps": torch.arange(5), "bf16": torch.randn(2, 2).bfloat16(),
            "flag": torch.tensor([True, False]), "scalar": torch.tensor(3.5),
            "empty": torch.zeros(2, 0), "half": torch.randn(3).half(),
            "c64": torch.randn(2, dtype=torch.complex64), "u8": torch.arange(4, dtype=torch.uint8),
            "f8": torch.randn(3).to(torch.float8_e4m3fn),
            "meta": torch.empty(2, 3, device="meta")}


def _write(path: Path, how: str) -> Path:
    serializer = TensorSerializer(str(path))
    if how == "module":
        torch.manual_seed(0)
        serializer.write_module(torch.nn.Sequential(torch.nn.Linear(3, 2),
                                                    torch.nn.BatchNorm1d(2)))
    elif how == "nested":
        serializer.write_state_dict({"model": {"w": torch.ones(2)},
                                     "opt": {"state": {"0": torch.zeros(3, 2)}}})
    else:
        serializer.write_state_dict(_state_dict())
    serializer.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tensorizer")
    return {how: _write(base / f"{how}.tensors", how) for how in ("state_dict", "module", "nested")}


def _flat(tree: object, prefix: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {".".join(prefix): tree}
    out = {}
    for key, value in tree.items():  # type: ignore[attr-defined]
        out.update(_flat(value, (*prefix, str(key))))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("how", ["state_dict", "module", "nested"])
def test_every_tensor_is_what_tensorizer_loads(files: dict[str, Path], how: str) -> None:
    ck = cl.open(files[how])
    assert ck.format == "tensorizer"
    with TensorDeserializer(str(files[how]), device="cpu", verify_hash=True) as loaded:
        truth = _flat(loaded.tree())
    assert list(ck.tensors) == list(truth)
    for name, tensor in truth.items():
        assert _same(ck.read(name), tensor), name
    segments = ck.files[0].segments  # they tile the file
    assert segments[0].offset == 0 and segments[-1].end_offset == ck.files[0].nbytes
    assert all(a.end_offset == b.offset for a, b in itertools.pairwise(segments))
    assert {s.kind for s in segments} >= {SegmentKind.FILE_HEADER, SegmentKind.HEADER,
                                          SegmentKind.TENSOR_HEADER}


def test_types_meta_and_names(files: dict[str, Path]) -> None:
    module = cl.open(files["module"])
    assert module.tensors["0.weight"].is_parameter
    assert not module.tensors["1.running_mean"].is_parameter
    assert dict(module.tensors["1.running_mean"].extra)["type"] == "buffer"
    sd = cl.open(files["state_dict"])
    meta = sd.tensors["meta"]  # saved from the meta device: no bytes, loaded as zeros
    assert meta.parts == () and _same(sd.read("meta"), torch.zeros(2, 3))
    nested = cl.open(files["nested"])
    assert nested.tensors["opt.state.0"].path == ("opt", "state", "0")


def test_a_changed_byte_is_caught_on_read(files: dict[str, Path], tmp_path: Path) -> None:
    ck = cl.open(files["state_dict"])
    part = ck.tensors["a.weight"].parts[0]
    damaged = tmp_path / "damaged.tensors"
    raw = bytearray(files["state_dict"].read_bytes())
    raw[part.offset + 5] ^= 0x40
    damaged.write_bytes(bytes(raw))
    from tensorizer.serialization import HashMismatchError

    with pytest.raises(HashMismatchError):  # tensorizer refuses it too
        with TensorDeserializer(str(damaged), device="cpu", verify_hash=True) as d:
            d["a.weight"]
    mine = cl.open(damaged)
    with pytest.raises(CorruptArchiveError, match=r"crc32|sha256") as err:
        mine.read("a.weight")
    assert err.value.path == str(damaged) and err.value.record == "a.weight"
    assert _same(mine.read("steps"), ck.read("steps"))  # the others still read


def test_encrypted_files_are_refused_by_name(tmp_path: Path) -> None:
    from tensorizer import EncryptionParams

    path = tmp_path / "secret.tensors"
    serializer = TensorSerializer(str(path), encryption=EncryptionParams.random())
    serializer.write_state_dict({"w": torch.ones(3)})
    serializer.close()
    with pytest.raises(UnsupportedFormatError, match="encrypted tensorizer file"):
        cl.open(path)
    assert main(["inspect", str(path)]) == 2


def test_cli_and_schema(files: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    from ckptlab.schemas import schema

    jsonschema = pytest.importorskip("jsonschema")
    assert main(["inspect", "--json", str(files["state_dict"])]) == 0
    doc = json.loads(capsys.readouterr().out)
    jsonschema.validate(doc, schema("inspect"))
    assert doc["format"] == "tensorizer" and len(doc["tensors"]) == len(_state_dict())
    assert main(["inspect", str(files["state_dict"])]) == 0
    assert "tensorizer checkpoint" in capsys.readouterr().out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_truncated_or_mutated_files_fail_cleanly(files: dict[str, Path], tmp_path: Path,
                                                 data: st.DataObject) -> None:
    raw = bytearray(files["nested"].read_bytes())
    ck = cl.open(files["nested"])
    cuts = sorted({0, *(s.offset for s in ck.files[0].segments), len(raw) - 1})
    if data.draw(st.booleans(), label="truncate"):
        cut = data.draw(st.sampled_from(cuts) | st.integers(0, len(raw) - 1), label="cut")
        raw = raw[:cut]
    else:
        header = [s for s in ck.files[0].segments if s.kind is not SegmentKind.HEADER_PADDING]
        seg = data.draw(st.sampled_from(header), label="segment")
        at = data.draw(st.integers(seg.offset, seg.end_offset - 1), label="at")
        raw[at] ^= data.draw(st.integers(1, 255), label="xor")
    path = tmp_path / "bad.tensors"
    path.write_bytes(bytes(raw))
    try:
        opened = cl.open(path)
        for name in opened.tensors:
            opened.read(name)
    except CkptlabError as exc:
        assert exc.path  # names the file
