"""safetensors files (ckptlab/format/safetensors.py).

The layout matches an independent parse of the header (u64 length, JSON, data_offsets) and
the tensor bytes; segments tile the file; truncation and mutation raise ArchiveError only.
"""

from __future__ import annotations

import io
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlab
from ckptlab.errors import ArchiveError, CorruptArchiveError
from ckptlab.format import SegmentKind
from ckptlab.testing.archives import storage_bytes
from ckptlab.testing.damage import assert_tiles, truncations
from ckptlab.testing.work import WorkLimitExceeded, counting

safetensors_torch = pytest.importorskip("safetensors.torch")


# Python calls + lines one inspect of a ~1 KB mutant may run (ckptlab.testing.work): the most
# seen is ~1,600; a loop over a declared size or shape runs far past this
ST_WORK_LIMIT = 50_000


def check_tiles(layout: ckptlab.format.ArchiveLayout, nbytes: int) -> None:
    assert layout.file_nbytes == nbytes
    assert_tiles(layout.segments, nbytes, layout.path)


ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
             "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
             "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def st_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {
        "embed.weight": torch.randn(7, 3, generator=gen),
        "pos": torch.randn(5, generator=gen).to(torch.bfloat16),
        "half": torch.randn(3, 3, generator=gen).to(torch.float16),
        "double": torch.randn(2, generator=gen).to(torch.float64),
        "ids": torch.arange(5),
        "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-2, 3, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8),
        "mask": torch.tensor([[True, False, True]]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    for name, dtype in (("f8", "float8_e4m3fn"), ("u16", "uint16")):
        if hasattr(torch, dtype):
            out[name] = torch.zeros(4, dtype=getattr(torch, dtype))
    return out


def st_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    try:
        return safetensors_torch.save(tensors, metadata=metadata)
    except Exception:  # an old safetensors without some dtype: leave those out
        tensors = {k: v for k, v in tensors.items() if v.dtype in ST_DTYPES.values()}
        return safetensors_torch.save(tensors, metadata=metadata)


def parse_safetensors(data: bytes) -> tuple[int, dict[str, Any]]:
    (n,) = struct.unpack_from("<Q", data)
    return n, json.loads(data[8:8 + n])


def test_safetensors_layout(tmp_path: Path) -> None:
    tensors = st_tensors()
    metadata = {"format": "pt", "step": "100", "note": "ünïcode"}
    path = tmp_path / "model.safetensors"
    try:
        safetensors_torch.save_file(tensors, str(path), metadata=metadata)
    except Exception:
        tensors = {k: v for k, v in tensors.items() if v.dtype in ST_DTYPES.values()}
        safetensors_torch.save_file(tensors, str(path), metadata=metadata)
    data = path.read_bytes()
    n, header = parse_safetensors(data)
    assert header.pop("__metadata__") == metadata
    loaded = safetensors_torch.load_file(str(path))

    layout = ckptlab.inspect(path)
    assert layout.format == "safetensors" and layout.path == str(path)
    assert layout.metadata == metadata and layout.records == ()
    assert layout.file_nbytes == len(data)
    check_tiles(layout, len(data))
    assert [s.kind for s in layout.segments[:2]] == [SegmentKind.HEADER_LENGTH, SegmentKind.HEADER]
    storages = {s.key: s for s in layout.storages}
    infos = {t.path[0]: t for t in layout.tensors}
    assert set(storages) == set(infos) == set(header)
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        s, t = storages[name], infos[name]
        assert s.data_offset == 8 + n + begin and s.nbytes == end - begin, name
        assert t.shape == tuple(entry["shape"]) == tuple(loaded[name].shape), name
        assert t.dtype == str(loaded[name].dtype).removeprefix("torch."), name
        assert t.storage_key == name and t.storage_offset == 0
        assert t.stride == tuple(loaded[name].contiguous().stride()), name
        assert data[s.data_offset:s.data_offset + s.nbytes] == storage_bytes(
            loaded[name].contiguous()), name
        if s.nbytes:
            seg = next(g for g in layout.segments if g.offset == s.data_offset and g.nbytes)
            assert seg.kind is SegmentKind.DATA and seg.record == name
    # the data begins 8-aligned (the header is padded with spaces)
    assert (8 + n) % 8 == 0
    for source in (data, io.BytesIO(data)):
        again = ckptlab.inspect(source)
        assert again.storages == layout.storages and again.tensors == layout.tensors


def test_safetensors_alignment_when_tensors_are_8_aligned() -> None:
    tensors = {"a": torch.ones(4, dtype=torch.float16), "b": torch.ones(2, 8),
               "c": torch.arange(3), "d": torch.zeros(8, dtype=torch.uint8)}
    data = st_bytes(tensors)
    layout = ckptlab.inspect(data)
    assert all(s.data_offset % 8 == 0 for s in layout.storages)
    assert layout.alignment % 8 == 0 and layout.alignment >= 8
    for s in layout.storages:
        assert s.data_offset % layout.alignment == 0


def test_safetensors_is_not_a_torch_archive_for_storage_offsets() -> None:
    data = st_bytes({"a": torch.ones(2)})
    with pytest.raises(ArchiveError):
        ckptlab.storage_offsets(data)


def test_safetensors_every_prefix() -> None:
    data = st_bytes(st_tensors(), {"k": "v"})
    for prefix in truncations(data):
        try:
            ckptlab.inspect(prefix)
        except ArchiveError:
            continue
        except Exception as exc:
            raise AssertionError(f"{type(exc).__name__} at cut {len(prefix)}: {exc}") from exc
        pytest.fail(f"inspect accepted the first {len(prefix)} of {len(data)} bytes")
    check_tiles(ckptlab.inspect(data), len(data))


def check_st_mutant(data: bytes, what: str) -> bool:
    """inspect(data) returns a sane layout (True) or raises ArchiveError (False).

    Its work is bounded too: at most :data:`ST_WORK_LIMIT` Python calls + lines, counted (and
    stopped there) by :mod:`ckptlab.testing.work`, whatever sizes, offsets or shapes the
    header declares: a loop run as many times as a corrupt number says fails here, by name.
    """
    try:
        with counting(lines=True, limit=ST_WORK_LIMIT) as work:
            try:
                layout = ckptlab.inspect(data)
            except ArchiveError:
                layout = None
    except WorkLimitExceeded:
        raise AssertionError(f"inspect ran more than {ST_WORK_LIMIT:,} calls + lines ({what})"
                             ) from None
    except Exception as exc:
        raise AssertionError(f"{type(exc).__name__} ({what}): {exc!s:.300}") from exc
    assert not work.exceeded, f"inspect caught the stop at {ST_WORK_LIMIT:,} ({what})"
    if layout is not None:
        check_tiles(layout, len(data))
        for s in layout.storages:
            assert 0 <= s.data_offset <= s.data_offset + s.nbytes <= len(data), (what, s)
    return layout is not None


def _json_mutants(data: bytes, rng: random.Random) -> bytes:
    """Re-encode the header with one field changed (sizes, offsets, dtypes, shapes)."""
    n, header = parse_safetensors(data)
    names = [k for k in header if k != "__metadata__"]
    name = rng.choice(names)
    entry = header[name]
    choice = rng.randrange(9)
    if choice == 0:
        entry["data_offsets"] = [rng.choice([0, 1, 7, 2**31, 2**63, 2**64 + 5, -1]),
                                 rng.choice([0, 8, 2**32, -3])]
    elif choice == 1:
        entry["data_offsets"] = entry["data_offsets"][::-1]
    elif choice == 2:
        entry["dtype"] = rng.choice(["F128", "", "f32", 5, None, "F4", "F8_E8M0", "C64"])
    elif choice == 3:
        entry["shape"] = rng.choice([[-1], [2**40, 2**40], [1.5], "x", [], [0], None])
    elif choice == 4:
        del entry[rng.choice(list(entry))]
    elif choice == 5:
        header["__metadata__"] = rng.choice([{"a": 1}, [], "x", {"k": None}, None])
    elif choice == 6:
        other = rng.choice(names)
        entry["data_offsets"] = list(header[other]["data_offsets"])  # overlap
    elif choice == 7:
        header[name] = rng.choice([[], "x", 3, None])
    else:
        header = rng.choice([[], "x", 1, None, {}])  # type: ignore[assignment]
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


@pytest.mark.timeout(120)
def test_safetensors_random_mutations() -> None:
    data = st_bytes(st_tensors(), {"k": "v"})
    n, _ = parse_safetensors(data)
    rng = random.Random(0)
    accepted = 0
    for i in range(1500):
        out = bytearray(data)
        r = rng.random()
        if r < 0.25:
            out = bytearray(_json_mutants(data, rng))
            how = "json field"
        elif r < 0.65:
            lo, hi = rng.choice([(0, 8), (8, 8 + n), (8, 8 + n), (0, len(data))])
            for _ in range(rng.randint(1, 4)):
                out[rng.randrange(lo, hi)] = rng.randrange(256)
            how = "overwrite"
        elif r < 0.8:
            p = rng.randrange(len(out))
            out[p:p] = rng.randbytes(rng.randint(1, 8))
            how = "insert"
        else:
            p = rng.randrange(len(out))
            del out[p:p + rng.randint(1, 8)]
            how = "delete"
        accepted += check_st_mutant(bytes(out), f"#{i} {how}")
    assert 50 < accepted < 1400, accepted  # both outcomes exercised


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_safetensors_hypothesis_mutations(data: st.DataObject) -> None:
    blob = bytearray(st_bytes({"a": torch.ones(3), "b": torch.arange(4, dtype=torch.int16)},
                              {"k": "v"}))
    n, _ = parse_safetensors(bytes(blob))
    for p, b in data.draw(st.lists(st.tuples(st.integers(0, 8 + n - 1), st.integers(0, 255)),
                                   min_size=1, max_size=4)):
        blob[p] = b
    check_st_mutant(bytes(blob), "hypothesis")


def test_safetensors_deeply_nested_header() -> None:
    raw = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    raw += b" " * (-len(raw) % 8)
    data = struct.pack("<Q", len(raw)) + raw
    with pytest.raises(CorruptArchiveError):
        ckptlab.inspect(data)




@pytest.mark.parametrize("shape", [(2, 0), (0,), (0, 3), (3, 0, 2), (1, 0, 0), (4, 1, 0, 5),
                                   (), (2, 3)])
def test_strides_of_empty_tensors_are_torchs(tmp_path: Path, shape: tuple[int, ...]) -> None:
    """A dimension of size 0 counts as 1 in torch's contiguous strides: shape (2, 0) has
    stride (1, 1), as torch.empty and safetensors' own loader give it."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "empty.safetensors"
    save_file({"t": torch.zeros(shape)}, str(path))
    want = load_file(str(path))["t"]
    assert want.stride() == torch.empty(shape).stride()
    ck = ckptlab.open(path)
    assert ck.tensors["t"].stride == want.stride()
    got = ck.read("t")
    assert got.stride() == want.stride() and got.shape == want.shape
    (info,) = ckptlab.inspect(path).tensors
    assert info.stride == want.stride()
