"""The columnar ``.metadata`` decoder reads runs of per-item records many at a time (numpy over
the bytes, :func:`ckptlab.dcp.columns._vector`); it must give exactly what the
one-record-at-a-time path gives (``decode_columns(data, vectorised=False)``) on every input:
generated DCP metadata of varied shapes, ranks, dtypes, keys, ints of every pickle width and
frame layouts, and mutated bytes (both None, or equal columns).

The metadata is built from DCP's own classes and pickled here (as ``FileSystemWriter.finish``
pickles it); nothing is ever unpickled.
"""

from __future__ import annotations

import pickle
import pickletools
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptlab.dcp import columns as mc
from ckptlab.dcp._decode import decode_metadata
from ckptlab.dcp.columns import decode_columns, duplicate_keys
from ckptlab.testing.pickles import pickle_mutations

md = pytest.importorskip("torch.distributed.checkpoint.metadata")
torch = pytest.importorskip("torch")

_DTYPES = ("float32", "bfloat16", "float16", "int64", "uint8", "bool", "float64", "int8")
_FQN = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=10)
# every width pickle writes an int in: BININT1, BININT2, BININT, LONG1 (5 and 8 bytes)
_INT = st.one_of(st.integers(0, 255), st.integers(256, 65535), st.integers(65536, 2**31 - 1),
                 st.integers(2**31, 2**40), st.integers(2**40, 2**50))


def _metadata(tensors: list[tuple[str, str, tuple[int, ...], int]], objects: list[str],
              lengths: list[int], rank_major: bool, protocol: int = 4) -> tuple[bytes, Any]:
    """``.metadata`` bytes (and the Metadata) for tensors (fqn, dtype, per-rank chunk shape,
    ranks) sharded row-wise, each rank's items back to back in ``__{rank}_0.distcp``."""
    from ckptlab._torch_compat import storage_info_class

    info = storage_info_class()
    state: dict[str, Any] = {}
    planner: dict[str, Any] = {}
    items: list[tuple[int, Any]] = []
    n = 0
    for fqn, dtype, shape, ranks in tensors:
        chunks = []
        for r in range(ranks):
            offsets = torch.Size((r * shape[0], *(0,) * (len(shape) - 1))) if shape else \
                torch.Size(())
            chunks.append(md.ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(shape)))
            items.append((r, md.MetadataIndex(fqn, offsets, r)))
        size = (shape[0] * ranks, *shape[1:]) if shape else ()
        state[fqn] = md.TensorStorageMetadata(
            properties=md.TensorProperties(dtype=getattr(torch, dtype)),
            size=torch.Size(size), chunks=chunks)
        planner[fqn] = ("model", fqn)
    for fqn in objects:
        state[fqn] = md.BytesStorageMetadata()
        items.append((0, md.MetadataIndex(fqn)))
    if rank_major:
        items.sort(key=lambda x: x[0])
    storage: dict[Any, Any] = {}
    cursor: dict[int, int] = {}
    files: dict[int, str] = {}  # one str per file, as each rank's writer names its file
    for r, index in items:
        length = lengths[n % len(lengths)]
        n += 1
        at = cursor.get(r, 0)
        storage[index] = info(files.setdefault(r, f"__{r}_0.distcp"), at, length)
        cursor[r] = at + length
    meta = md.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage)
    return pickle.dumps(meta, protocol=protocol), meta


def _values(meta: Any) -> dict[str, Any]:
    tensors = {fqn: (str(m.properties.dtype).removeprefix("torch."), tuple(m.size),
                     [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks])
               for fqn, m in meta.state_dict_metadata.items() if hasattr(m, "chunks")}
    entries = [(k.fqn, -1 if k.index is None else k.index,
                None if k.offset is None else tuple(k.offset), v.relative_path, v.offset,
                v.length) for k, v in meta.storage_data.items()]
    return {"tensors": tensors, "entries": entries}


def _columns(cols: Any) -> dict[str, Any]:
    tensors = {fqn: (dtype, shape, [cols.chunk(r) for r in range(first, first + n)])
               for fqn, (dtype, _, shape, first, n) in cols.tensors.items()}
    entries = [(cols.fqns[cols.entry_fqn[e]], cols.entry_index[e], cols.entry_chunk_offsets(e),
                cols.files[cols.entry_file[e]], cols.entry_offset[e], cols.entry_length[e])
               for e in range(cols.entries)]
    return {"tensors": tensors, "entries": entries}


class _Count:
    """Counts the records :func:`_vector` took."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.records = 0
        original = mc._vector

        def counted(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self.records += out[0]
            return out

        monkeypatch.setattr(mc, "_vector", counted)


def _same(data: bytes) -> Any:
    """Both paths on ``data``: equal (both None or equal columns); the columns."""
    fast = decode_columns(data)
    slow = decode_columns(data, vectorised=False)
    assert (fast is None) == (slow is None)
    if fast is not None:
        assert fast == slow
        assert _columns(fast) == _columns(slow)
    return fast


_TENSOR = st.tuples(_FQN, st.sampled_from(_DTYPES),
                    st.lists(st.one_of(st.integers(1, 300), _INT), min_size=0, max_size=6),
                    st.integers(1, 70))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_TENSOR, min_size=1, max_size=5, unique_by=lambda t: t[0]),
       st.lists(_FQN, max_size=2), st.lists(_INT, min_size=1, max_size=7), st.booleans(),
       st.sampled_from([4, 5]))
def test_generated_metadata_decodes_the_same_both_ways(
        tensors: list[Any], objects: list[str], lengths: list[int], rank_major: bool,
        protocol: int) -> None:
    names = {t[0] for t in tensors}
    objects = [o for o in dict.fromkeys(objects) if o not in names]
    tensors = [(f, d, tuple(s), r if s else 1) for f, d, s, r in tensors]
    data, meta = _metadata(tensors, objects, lengths, rank_major, protocol)
    cols = _same(data)
    assert cols is not None
    assert _columns(cols) == _values(meta)


def test_long_runs_across_frames_and_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk lists and a storage_data dict longer than pickle's 1,000-item batches, over
    many 64 KB frames: taken many at a time, equal to the one-at-a-time columns."""
    count = _Count(monkeypatch)
    shapes = ((1, 3), (2,), (300, 70000, 2), (1, 2, 3, 4, 5), ())
    tensors = [(f"layers.{i}.w", _DTYPES[i % 4], shapes[i % 5], 1 if i % 5 == 4 else 1100)
               for i in range(6)]
    data, meta = _metadata(tensors, ["step", "é"], [7, 700, 70000, 2**33], False)
    assert len(mc._frame_headers(data)) > 10
    cols = _same(data)
    assert cols is not None and _columns(cols) == _values(meta)
    # chunks and pairs, most of them at once: all but the first 16 of each chunk list, the
    # first tensor's pairs (each names its file for the first time: a new string, read one
    # at a time) and the 0-d tensor's and objects' pairs
    assert count.records > 0.7 * 2 * cols.entries


def _unframed(data: bytes) -> bytes:
    heads = mc._frame_headers(data)
    if not heads:
        return data[2:]
    return b"".join(data[h + 9:h + 9 + struct.unpack_from("<Q", data, h + 1)[0]]
                    for h in heads)


def _framed(proto: bytes, body: bytes, cuts: list[int]) -> bytes:
    out = [proto]
    last = 0
    for c in [*sorted(set(cuts)), len(body)]:
        if c > last:
            out.append(b"\x95" + struct.pack("<Q", c - last) + body[last:c])
            last = c
    return b"".join(out)


@pytest.fixture(scope="module")
def medium() -> bytes:
    tensors = [(f"t{i}", _DTYPES[i % 8], ((3, 2), (1,), (2, 2, 2, 2), (40000,))[i % 4], 40)
               for i in range(5)]
    return _metadata(tensors, ["step"], [3, 300, 2**20, 2**35], False)[0]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 10**9), max_size=40), st.booleans())
def test_frame_headers_anywhere(medium: bytes, picks: list[int], at_opcodes: bool) -> None:
    """FRAME headers between any two opcodes (inside records too), or inside an opcode (then
    both paths leave it to the interpreter)."""
    body = _unframed(medium)
    if at_opcodes:
        starts = [pos - 2 for _, _, pos in pickletools.genops(medium[:2] + body)][1:]
        cuts = [starts[p % len(starts)] for p in picks]
    else:
        cuts = [p % len(body) for p in picks]
    data = _framed(medium[:2], body, cuts)
    cols = _same(data)
    if at_opcodes:
        assert cols is not None


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1,
                max_size=3), st.booleans())
def test_mutated_bytes_decode_the_same_both_ways(medium: bytes, changes: list[Any],
                                                 records_only: bool) -> None:
    """A few bytes changed (mostly inside the per-item records): same columns or both None;
    and what is accepted, the bounded interpreter accepts with the same values."""
    out = bytearray(medium)
    lo = medium.find(b"ChunkStorageMetadata") if records_only else 0
    for pos, value in changes:
        out[lo + pos % (len(out) - lo)] = value
    data = bytes(out)
    cols = _same(data)
    if cols is not None:
        try:
            meta = decode_metadata(data)
        except Exception:  # what the interpreter refuses the columns must refuse too
            pytest.fail("the columns accepted what the interpreter refuses")
        if duplicate_keys(cols, cols.entries):
            # two equal MetadataIndex keys (a changed offset): the dict torch builds keeps one
            # of them, so the columns hold an entry more, and EntryColumns.order sends the
            # file to the general path, which reads it as the interpreter does
            assert len(meta.storage_data) < cols.entries
            return
        assert _columns(cols) == _values(meta)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_opcode_mutations_decode_the_same_both_ways(medium: bytes, data: Any) -> None:
    _same(data.draw(pickle_mutations(medium)))


def test_negative_ints_leave_the_fast_path() -> None:
    """A LONG1 offset that is negative is refused one at a time and many at a time (the
    interpreter then decides), not stored."""
    tensors = [("w", "float32", (2,), 40)]
    data, _ = _metadata(tensors, [], [2**40], False)
    assert _same(data) is not None
    bad = data.replace(b"\x8a\x06\x00\x00\x00\x00\x00\x01", b"\x8a\x06\x00\x00\x00\x00\x00\xff")
    assert bad != data
    assert _same(bad) is None
