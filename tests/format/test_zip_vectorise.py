"""Archives of many records are read by numpy columns (``_zip.vectorise``; the thresholds are
patched here to force either way) and give what record-by-record reading gives: equal
results, or the same error type, message and offset; and what a scan lists on first use.
(The pickle has one path: see ``test_interp.py``.)"""

from __future__ import annotations

import dataclasses
import io
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab
from ckptlab import _torch_compat as tc
from ckptlab.errors import ArchiveError
from ckptlab.format import _zip
from ckptlab.format._bulk import build
from ckptlab.format.layout import Segment, SegmentKind


def save(obj: Any, protocol: int = 2) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.save(obj, buf, pickle_protocol=protocol)
    return buf.getvalue()


def state(n: int) -> dict[str, Any]:
    """Dense tensors of every shape the template knows, views, Parameters, shared storages."""
    torch.manual_seed(0)
    base = torch.arange(64.0)
    out: dict[str, Any] = {}
    for i in range(n):
        kind = i % 8
        if kind == 0:
            out[f"layer.{i}.weight"] = torch.empty(2)
        elif kind == 1:
            out[f"layer.{i}.view"] = base[i % 7: i % 7 + 5]
        elif kind == 2:
            out[f"layer.{i}.param"] = torch.nn.Parameter(torch.zeros(3, 2))
        elif kind == 3:
            out[f"layer.{i}.scalar"] = torch.tensor(float(i))
        elif kind == 4:
            out[f"layer.{i}.big"] = torch.zeros(300, 2, dtype=torch.bfloat16)
        elif kind == 5:
            out[f"layer.{i}.nd"] = torch.zeros(1, 2, 1, 3, 1)
        elif kind == 6:
            out[f"layer.{i}.grad"] = torch.zeros(4, requires_grad=True)
        else:
            out[f"layer.{i}.t"] = base.view(8, 8).t()[:, i % 8]
    out["step"] = 7
    return out


def data_pkl(archive: bytes) -> bytes:
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))


# --------------------------------------------------------------------------------------------
# the walk
# --------------------------------------------------------------------------------------------


def test_module_values_are_listed_when_first_looked_at(tmp_path: Path) -> None:
    """A pickled module's values (flags, hook dicts) are named on first use, and are what
    the walk over every container gives."""
    from ckptlab.format._bulk import LazyTuple
    from ckptlab.format._pickle import scan_pickle

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    scan = scan_pickle(data_pkl(save(model)))
    assert isinstance(scan.objects, LazyTuple) and not scan.objects.built
    values = dict(scan.objects)
    first, second = ("_modules", "0"), ("_modules", "1")
    assert values[(*first, "training")] is True and values[(*second, "eps")] == 1e-5
    assert values[(*first, "_forward_hooks")] == {} and (*first, "in_features") in values
    assert [t.path[1:] for t in scan.tensors] == [
        ("0", "_parameters", "weight"), ("0", "_parameters", "bias"),
        ("1", "_parameters", "weight"), ("1", "_parameters", "bias"),
        ("1", "_buffers", "running_mean"), ("1", "_buffers", "running_var"),
        ("1", "_buffers", "num_batches_tracked")]
    path = tmp_path / "m.pt"
    torch.save(model, path)
    ck = ckptlab.open(path)
    assert ck.objects["_modules.0.in_features"] == 2 and ck.objects["_modules.1.training"]
    assert len(ck.objects) == len(values)


# --------------------------------------------------------------------------------------------
# archives: numpy columns vs record by record
# --------------------------------------------------------------------------------------------


def run(fn: Any, source: Any, vectorise: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(_zip, "VECTOR_MIN_ENTRIES", 0 if vectorise else 1 << 60)
    monkeypatch.setattr(_zip, "VECTOR_ALWAYS_ENTRIES", 0 if vectorise else 1 << 60)
    try:
        got = fn(source)
    except ArchiveError as exc:
        return ("error", type(exc).__name__, str(exc), exc.offset, exc.record)
    return ("ok", (got, got.logical, got.objects) if hasattr(got, "logical") else got)


def agree(fn: Any, source: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    fast = run(fn, source, True, monkeypatch)
    slow = run(fn, source, False, monkeypatch)
    assert fast == slow
    return fast


def opened(source: Any) -> Any:
    ck = ckptlab.open(source)
    return list(ck.tensors.items()), ck.objects, ck.files


FUNCTIONS = (ckptlab.inspect, ckptlab.storage_offsets,
             lambda s: ckptlab.storage_offsets(s, scan=True), opened)


@pytest.fixture(scope="module")
def archive() -> bytes:
    return save(state(300))


def test_intact_archives_agree(archive, tmp_path, monkeypatch) -> None:
    from torch.utils.serialization import config

    path = tmp_path / "a.pt"
    path.write_bytes(archive)
    for fn in FUNCTIONS:
        assert agree(fn, path, monkeypatch)[0] != "error"
    for alignment in (1, 4096):  # padding fields of every size, and none
        with config.patch({"save.storage_alignment": alignment}):
            torch.save(state(200), tmp_path / f"{alignment}.pt")
        for fn in FUNCTIONS:
            agree(fn, tmp_path / f"{alignment}.pt", monkeypatch)


def test_mutated_archives_agree(archive, monkeypatch) -> None:
    """Flipped bytes in local headers, names, extra fields, descriptors, the central directory
    and the trailer; each function both ways."""
    rng = random.Random(3)
    cd = archive.rfind(b"PK\x01\x02") - 46 * 300  # roughly where the directory starts
    spots = [i for i in range(len(archive) - 4) if archive[i:i + 4] in (
        b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02")]
    for trial in range(240):
        mutated = bytearray(archive)
        if trial % 3 == 0:
            at = rng.choice(spots) + rng.randrange(46)
        elif trial % 3 == 1:
            at = rng.randrange(max(0, cd), len(archive))
        else:
            at = rng.randrange(len(archive))
        at = min(at, len(mutated) - 1)
        mutated[at] = rng.choice((rng.randrange(256), mutated[at] ^ 0x20, mutated[at] ^ 1, 0xFF))
        for fn in FUNCTIONS[:3] if trial % 4 else FUNCTIONS:
            agree(fn, bytes(mutated), monkeypatch)


def test_truncated_archives_agree(archive, monkeypatch) -> None:
    for cut in range(0, len(archive), len(archive) // 40):
        for fn in FUNCTIONS[:2]:
            assert agree(fn, archive[:cut], monkeypatch)[0] == "error"


def test_gaps_and_foreign_extra_fields_agree(tmp_path, monkeypatch) -> None:
    """A zip written by Python's zipfile (no padding field, no descriptors) with bytes between
    records and an extra field of its own on some records."""
    import zipfile

    source = io.BytesIO(save(state(150)))
    out = io.BytesIO()
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(out, "w") as dst:
        for i, info in enumerate(src.infolist()):
            new = zipfile.ZipInfo(info.filename)
            if i % 7 == 3:
                new.extra = b"\xfe\xca\x04\x00abcd"
            dst.writestr(new, src.read(info.filename))
            if i % 11 == 5:
                dst.fp.write(b"gap!")  # unaccounted bytes between records
                dst.start_dir = dst.fp.tell()
    for fn in FUNCTIONS:
        agree(fn, out.getvalue(), monkeypatch)


# --------------------------------------------------------------------------------------------
# the builders
# --------------------------------------------------------------------------------------------


def test_build_makes_ordinary_instances() -> None:
    from itertools import repeat

    made = build(Segment, 3, repeat(SegmentKind.DATA), [1, 2, 3], [4, 5, 6])
    assert made == [Segment(SegmentKind.DATA, i, i + 3) for i in (1, 2, 3)]
    assert all(type(s) is Segment and s.record is None for s in made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made[0].offset = 9  # type: ignore[misc]
    with pytest.raises(TypeError):
        build(Segment, 1, [SegmentKind.DATA])  # offset has no default
    with pytest.raises(ValueError):
        build(Segment, 2, [SegmentKind.DATA] * 2, [1], [1, 2])

def test_large_checkpoint_round_trip(tmp_path: Path) -> None:
    """10,000 tensors: the numpy paths by default; every tensor reads back as torch loads it."""
    sd = {f"layer.{i}.weight": torch.full((2,), float(i)) for i in range(10_000)}
    path = tmp_path / "big.pt"
    torch.save(sd, path)
    layout = ckptlab.inspect(path)
    assert len(layout.records) == 10_006 and len(layout.tensors) == 10_000
    ck = ckptlab.open(path)
    for name in ("layer.0.weight", "layer.4321.weight", "layer.9999.weight"):
        assert torch.equal(ck.read(name), sd[name])
    offsets = ckptlab.storage_offsets(path)
    assert offsets.method == "cursor" and offsets.reads <= 3
    reader = tc.pytorch_file_reader()(str(path))
    assert offsets.offsets == {n[5:]: reader.get_record_offset(n)
                               for n in reader.get_all_records() if n.startswith("data/")}


# --------------------------------------------------------------------------------------------
# state dict entries in batches (_Machine.entry_run, with the fused torch handlers)
# --------------------------------------------------------------------------------------------




def test_segment_columns_are_the_segments(archive, monkeypatch) -> None:
    """The columns a vectorised scan keeps beside its lazy segments give every segment's
    kind, offset, size and record, in file order."""
    from ckptlab.format.layout import SEGMENT_KINDS, SegmentTuple

    monkeypatch.setattr(_zip, "VECTOR_MIN_ENTRIES", 0)
    monkeypatch.setattr(_zip, "VECTOR_ALWAYS_ENTRIES", 0)
    segments = ckptlab.inspect(archive).segments
    assert isinstance(segments, SegmentTuple)
    cols = segments.columns
    assert [Segment(SEGMENT_KINDS[k], o, n, cols.names[r] if r >= 0 else None) for k, o, n, r
            in zip(cols.kinds.tolist(), cols.offsets.tolist(), cols.nbytes.tolist(),
                   cols.records.tolist(), strict=True)] == list(segments)
    assert {SegmentKind.CENTRAL_DIRECTORY, SegmentKind.EOCD} <= {s.kind for s in segments}
