"""Format detection, safetensors layouts, and zips that torch.save did not write.

* Files that are not torch.save zip archives (legacy pickle, legacy tar, TorchScript, plain
  pickle, random bytes, empty file, directory, zip without data.pkl) raise
  UnsupportedFormatError (TruncatedArchiveError when empty) saying what the file is.
* safetensors: the layout matches an independent parse of the header (u64 length, JSON,
  data_offsets) and the tensor bytes; segments tile the file; truncation and mutation raise
  ArchiveError only.
* A Python-zipfile copy of a torch archive (no 'FB' padding, no descriptors) and torch archives
  with a foreign record between two storages: ``inspect`` finds the right bytes and
  ``storage_offsets`` falls back to the local headers instead of trusting torch's arithmetic.
"""

from __future__ import annotations

import io
import json
import pickle
import random
import struct
import tarfile
import time
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptlab
from ckptlab import SegmentKind
from ckptlab.errors import (
    ArchiveError,
    CorruptArchiveError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format import detect_format

safetensors_torch = pytest.importorskip("safetensors.torch")


def save(obj: Any, **kwargs: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def state() -> dict[str, Any]:
    base = torch.arange(40, dtype=torch.float32)
    return {"w": base.view(5, 8), "v": base[8:24].view(4, 4), "b": torch.ones(3, dtype=torch.bfloat16),
            "ids": torch.arange(7), "empty": torch.zeros(0), "mask": torch.tensor([True, False])}


def storage_bytes(t: torch.Tensor) -> bytes:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy().tobytes()


def check_tiles(layout: ckptlab.ArchiveLayout, nbytes: int) -> None:
    cursor = 0
    for seg in layout.segments:
        assert seg.offset == cursor and seg.nbytes >= 0, seg
        cursor = seg.end_offset
    assert cursor == nbytes == layout.file_nbytes


def local_data_offset(data: bytes, info: zipfile.ZipInfo) -> int:
    """Where a record's data starts, from its local header (independent of ckptlab)."""
    assert data[info.header_offset:info.header_offset + 4] == b"PK\x03\x04"
    n_name, n_extra = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + n_name + n_extra


def call_all(source: Any) -> list[Callable[[], Any]]:
    return [lambda: ckptlab.inspect(source), lambda: ckptlab.storage_offsets(source),
            lambda: ckptlab.storage_offsets(source, scan=True)]


# --------------------------------------------------------------------------------------------
# format detection
# --------------------------------------------------------------------------------------------
def make_legacy(path: Path) -> None:
    torch.save({"a": torch.ones(2)}, path, _use_new_zipfile_serialization=False)


def make_tar(path: Path) -> None:
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("sys_info")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"hello"))


def make_torchscript(path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))


def make_pickle(protocol: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_bytes(pickle.dumps({"weights": [1.0, 2.0], "step": 3}, protocol=protocol))
    return make


def make_random(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(4096))


def make_empty(path: Path) -> None:
    path.write_bytes(b"")


def make_plain_zip(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("model/weights.bin", b"\0" * 64)
        zf.writestr("model/config.json", "{}")


def make_two_pickles(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a/data.pkl", pickle.dumps({}, protocol=2))
        zf.writestr("b/data.pkl", pickle.dumps({}, protocol=2))


def make_text(path: Path) -> None:
    path.write_text("just some text, not a checkpoint\n" * 20)


FORMATS = [
    # (id, maker, error class, words the message must contain, detect_format kind)
    ("legacy-pickle", make_legacy, UnsupportedFormatError, ["legacy"], "legacy-pickle"),
    ("legacy-tar", make_tar, UnsupportedFormatError, ["tar"], "legacy-tar"),
    ("torchscript", make_torchscript, UnsupportedFormatError, ["TorchScript"], "torch-zip"),
    ("pickle-2", make_pickle(2), UnsupportedFormatError, ["pickle"], "pickle"),
    ("pickle-3", make_pickle(3), UnsupportedFormatError, ["pickle"], "pickle"),
    ("pickle-4", make_pickle(4), UnsupportedFormatError, ["pickle"], "pickle"),
    ("pickle-5", make_pickle(5), UnsupportedFormatError, ["pickle"], "pickle"),
    # protocols 0/1 have no PROTO opcode: no magic to recognise, 'unknown' is fair
    ("pickle-0", make_pickle(0), UnsupportedFormatError, [], None),
    ("pickle-1", make_pickle(1), UnsupportedFormatError, [], None),
    ("random", make_random, UnsupportedFormatError, ["not a checkpoint"], "unknown"),
    ("text", make_text, UnsupportedFormatError, ["not a checkpoint"], "unknown"),
    ("empty", make_empty, TruncatedArchiveError, ["empty"], "empty"),
    ("zip-without-data.pkl", make_plain_zip, UnsupportedFormatError, ["data.pkl"], "torch-zip"),
    ("zip-with-two-data.pkl", make_two_pickles, UnsupportedFormatError, ["data.pkl"],
     "torch-zip"),
]


@pytest.mark.parametrize("maker,error,words,kind", [f[1:] for f in FORMATS],
                         ids=[f[0] for f in FORMATS])
def test_unsupported_formats(maker: Callable[[Path], None], error: type[ArchiveError],
                             words: list[str], kind: str | None, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    maker(path)
    data = path.read_bytes()
    if kind is not None:
        assert detect_format(data[:512], len(data)) == kind
    with open(path, "rb") as fh:
        sources = [path, str(path), data, io.BytesIO(data), fh]
        for source in sources:
            for call in call_all(source):
                with pytest.raises(error) as info:
                    call()
                message = str(info.value)
                for word in words:
                    assert word.lower() in message.lower(), message
                if isinstance(source, (Path, str)):
                    assert str(path) in message and info.value.path == str(path)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="directory"):
        ckptlab.inspect(tmp_path)


def test_directory_storage_offsets(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="directory"):
        ckptlab.storage_offsets(tmp_path)


def test_dcp_directory(tmp_path: Path) -> None:
    (tmp_path / ".metadata").write_bytes(b"\0")
    # the file-level inspector says what the directory is and where to go ...
    with pytest.raises(UnsupportedFormatError, match=r"distributed.*ckptlab\.plan\.inspect_dcp"):
        ckptlab.format.inspect(tmp_path)
    # ... and the top-level one reads it as DCP, so a bad .metadata is named as such
    with pytest.raises(CorruptArchiveError, match=r"\.metadata, offset \d+: not a readable pickle"):
        ckptlab.inspect(tmp_path)


def test_missing_file(tmp_path: Path) -> None:
    for call in call_all(tmp_path / "nope.pt"):
        with pytest.raises(ArchiveError, match=r"nope\.pt"):
            call()


def test_torch_archive_under_any_name(tmp_path: Path) -> None:
    """The archive prefix comes from the file name; inspect does not care what it is."""
    path = tmp_path / "my.model.v2.pt"
    torch.save(state(), path)
    layout = ckptlab.inspect(path)
    assert layout.format == "torch-zip" and layout.archive_name == "my.model.v2"
    assert ckptlab.storage_offsets(path).archive_name == "my.model.v2"


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------
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
    for cut in range(len(data)):
        try:
            ckptlab.inspect(data[:cut])
        except ArchiveError:
            continue
        except Exception as exc:
            raise AssertionError(f"{type(exc).__name__} at cut {cut}: {exc}") from exc
        pytest.fail(f"inspect accepted the first {cut} of {len(data)} bytes")
    check_tiles(ckptlab.inspect(data), len(data))


def check_st_mutant(data: bytes, what: str) -> bool:
    """inspect(data) returns a sane layout (True) or raises ArchiveError (False)."""
    start = time.perf_counter()
    try:
        layout = ckptlab.inspect(data)
    except ArchiveError:
        layout = None
    except Exception as exc:
        raise AssertionError(f"{type(exc).__name__} ({what}): {exc!s:.300}") from exc
    assert time.perf_counter() - start < 2.0, what
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


# --------------------------------------------------------------------------------------------
# zips torch.save did not write
# --------------------------------------------------------------------------------------------
def rezip(data: bytes, compress: Callable[[str], int] = lambda name: zipfile.ZIP_STORED) -> bytes:
    """The same records, re-written by Python's zipfile (no FB padding, no descriptors)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name), compress_type=compress(name))
    return out.getvalue()


def check_offsets_point_at_storages(data: bytes, offsets: dict[str, int]) -> None:
    """Each offset is the record's data offset (local header) and holds the storage bytes."""
    zf = zipfile.ZipFile(io.BytesIO(data))
    prefix = zf.namelist()[0].split("/", 1)[0]
    for key, off in offsets.items():
        info = zf.getinfo(f"{prefix}/data/{key}")
        assert off == local_data_offset(data, info), key
        assert data[off:off + info.file_size] == zf.read(info), key


@pytest.mark.parametrize("protocol", [2, 4])
def test_python_zipfile_copy(protocol: int) -> None:
    original = save(state(), pickle_protocol=protocol)
    data = rezip(original)
    layout = ckptlab.inspect(data)
    assert layout.format == "torch-zip" and layout.pickle_protocol == protocol
    check_tiles(layout, len(data))
    assert all(r.padding_nbytes == 0 and r.descriptor_nbytes == 0 for r in layout.records)
    loaded = torch.load(io.BytesIO(data), weights_only=False)
    for t in layout.tensors:
        real = loaded[t.path[0]]
        s = layout.storage(t.storage_key)
        assert data[s.data_offset:s.data_offset + s.nbytes] == storage_bytes(real), t
    by_key = {s.key: s.data_offset for s in layout.storages}
    for scan in (False, True):
        result = ckptlab.storage_offsets(data, scan=scan)
        assert result.method == "central_directory" and result.reason
        assert result.offsets == by_key
        check_offsets_point_at_storages(data, result.offsets)
    # the original torch archive: verified arithmetic, same storages
    result = ckptlab.storage_offsets(original)
    assert result.method == "cursor" and result.reason is None
    check_offsets_point_at_storages(original, result.offsets)


def rewrite(data: bytes, extra_after: dict[str, list[tuple[str, bytes]]],
            order: Callable[[list[str]], list[str]] = lambda names: names) -> bytes:
    """The archive re-written by torch's own writer, with foreign records inserted."""
    src = zipfile.ZipFile(io.BytesIO(data))
    buf = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buf)
    shorts = [n.split("/", 1)[1] for n in src.namelist()]
    shorts = [s for s in shorts if s not in ("version", ".data/serialization_id")]
    prefix = src.namelist()[0].split("/", 1)[0]
    for short in order(shorts):
        payload = src.read(f"{prefix}/{short}")
        writer.write_record(short, payload, len(payload))
        for name, blob in extra_after.get(short, []):
            writer.write_record(name, blob, len(blob))
    writer.write_end_of_file()
    del writer
    return buf.getvalue()


def naive_cursor_offsets(data: bytes) -> dict[str, int]:
    """torch's calculate_storage_offsets: data/0's real offset, then arithmetic (unverified)."""
    from ckptlab.format._zip import record_geometry

    zf = zipfile.ZipFile(io.BytesIO(data))
    prefix = zf.namelist()[0].split("/", 1)[0]
    keys = sorted((n for n in zf.namelist() if n.startswith(f"{prefix}/data/")),
                  key=lambda n: int(n.rsplit("/", 1)[1]))
    cursor = zf.getinfo(keys[0]).header_offset
    out = {}
    for name in keys:
        info = zf.getinfo(name)
        geom = record_geometry(cursor, len(name), info.file_size, 64)
        out[name.rsplit("/", 1)[1]] = geom.data_offset
        cursor = geom.end_offset
    return out


INSERTIONS = {
    "between-0-and-1": {"data/0": [("extra/notes.txt", b"x" * 100)]},
    "empty-record-between": {"data/0": [("extra/empty", b"")]},
    "aligned-record-between": {"data/1": [("extra/blob", b"y" * 64)]},
    "after-last-storage": {"data/3": [("extra/tail", b"z" * 10)]},
}


@pytest.mark.parametrize("insert", list(INSERTIONS.values()), ids=list(INSERTIONS))
def test_foreign_record_between_storages(insert: dict[str, list[tuple[str, bytes]]]) -> None:
    original = save(state())
    data = rewrite(original, insert)
    assert torch.load(io.BytesIO(data))["w"].sum() == torch.arange(40.0).sum()
    zf = zipfile.ZipFile(io.BytesIO(data))
    layout = ckptlab.inspect(data)
    check_tiles(layout, len(data))
    truth = {s.key: local_data_offset(data, zf.getinfo(s.record)) for s in layout.storages}
    assert {s.key: s.data_offset for s in layout.storages} == truth
    if "data/3" not in insert:  # torch's unverified arithmetic goes wrong here
        assert naive_cursor_offsets(data) != truth
    for scan in (False, True):
        result = ckptlab.storage_offsets(data, scan=scan)
        assert result.method == "central_directory" and result.reason, result
        assert result.offsets == truth
        check_offsets_point_at_storages(data, result.offsets)


def test_storages_written_out_of_pickle_order() -> None:
    """Records data/1 and data/0 swapped: the arithmetic in pickle order cannot be trusted."""
    def swap(names: list[str]) -> list[str]:
        i, j = names.index("data/0"), names.index("data/1")
        names[i], names[j] = names[j], names[i]
        return names

    data = rewrite(save(state()), {}, order=swap)
    zf = zipfile.ZipFile(io.BytesIO(data))
    layout = ckptlab.inspect(data)
    truth = {s.key: local_data_offset(data, zf.getinfo(s.record)) for s in layout.storages}
    assert {s.key: s.data_offset for s in layout.storages} == truth
    for scan in (False, True):
        result = ckptlab.storage_offsets(data, scan=scan)
        assert result.offsets == truth
        check_offsets_point_at_storages(data, result.offsets)
    assert ckptlab.storage_offsets(data, scan=True).method == "central_directory"


def test_rewritten_archive_without_foreign_records_keeps_the_cursor_method() -> None:
    data = rewrite(save(state()), {})
    result = ckptlab.storage_offsets(data)
    assert result.method == "cursor" and result.reason is None
    check_offsets_point_at_storages(data, result.offsets)


def test_deflated_copy_is_inspected() -> None:
    data = rezip(save(state()), lambda name: zipfile.ZIP_DEFLATED)
    layout = ckptlab.inspect(data)
    check_tiles(layout, len(data))
    assert {r.method for r in layout.records} == {8}
    assert len(layout.tensors) == 6
    for call in call_all(data)[1:]:
        with pytest.raises(UnsupportedFormatError, match="compressed"):
            call()


def test_deflated_storages_give_no_wrong_offsets() -> None:
    original = save(state())
    data = rezip(original, lambda name: zipfile.ZIP_DEFLATED if "/data/" in name
                 else zipfile.ZIP_STORED)
    loaded = torch.load(io.BytesIO(data))  # torch inflates them
    assert torch.equal(loaded["w"], torch.arange(40.0).view(5, 8))
    zf = zipfile.ZipFile(io.BytesIO(data))
    for scan in (False, True):
        try:
            result = ckptlab.storage_offsets(data, scan=scan)
        except UnsupportedFormatError:
            continue
        for key, off in result.offsets.items():
            raw = zf.read(f"archive/data/{key}")
            assert data[off:off + len(raw)] == raw, f"offset {off} of storage {key} is wrong"


def test_zip_with_comment() -> None:
    """An archive comment moves the EOCD; inspect still tiles the file."""
    data = save(state())
    zf_bytes = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(zf_bytes, "w") as dst:
        dst.comment = b"a comment" * 10
        for name in src.namelist():
            dst.writestr(name, src.read(name))
    out = zf_bytes.getvalue()
    layout = ckptlab.inspect(out)
    check_tiles(layout, len(out))
    assert layout.segments[-1].kind is SegmentKind.EOCD and layout.segments[-1].nbytes == 22 + 90
    result = ckptlab.storage_offsets(out)
    check_offsets_point_at_storages(out, result.offsets)


def test_file_object_positions_count_and_are_restored(tmp_path: Path) -> None:
    """A file object is read from where it stands, as torch.load reads it, and is handed
    back at that position."""
    path = tmp_path / "c.pt"
    torch.save(state(), path)
    with open(path, "rb") as fh:
        layout = ckptlab.inspect(fh)
        assert fh.tell() == 0
        result = ckptlab.storage_offsets(fh)
        fh.seek(100)
        with pytest.raises(ArchiveError):
            ckptlab.inspect(fh)  # 100 bytes in, there is no archive
        assert fh.tell() == 100
    assert result.offsets == {s.key: s.data_offset for s in layout.storages}
    assert layout.path == str(path)


def test_warnings_free() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckptlab.inspect(save(state()))
        ckptlab.inspect(st_bytes({"a": torch.ones(1)}))
