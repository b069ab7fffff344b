"""Hostile pickles stay harmless and bounded (issue 15): every reader, every attack shape.

Each case runs in an isolated worker (``ckptlab.testing.isolated``) with an address-space
limit and a timeout, so a crash is a failed assertion, not a dead test run. Every case must end
in a correct result or a ckptlab error, with no signal, within the memory budget of
``MEMORY_PER_BYTE`` bytes per input byte (plus the interpreter's floor).
"""

from __future__ import annotations

import copyreg
import json
import pickle
import struct

import pytest
from hypothesis import given, settings

import ckptlab
from ckptlab.errors import CorruptArchiveError
from ckptlab.format._pickle import scan_pickle
from ckptlab.format._unpickle import MEMORY_FLOOR, MEMORY_PER_BYTE
from ckptlab.testing.isolated import IsolatedReader
from ckptlab.testing.pickles import (
    amplifier,
    deep_tuple_key,
    distinct_globals,
    opcode_streams,
    torch_zip,
)

SLACK = 16 << 20  # reader objects beside the interpreter (layout, records, error text)


def budget(nbytes: int) -> int:
    return max(MEMORY_FLOOR, MEMORY_PER_BYTE * nbytes) + SLACK


@pytest.fixture(scope="module")
def isolated():
    # the timeout only detects hangs (a case takes seconds); never a speed assertion
    with IsolatedReader(budget_nbytes=2 << 30, timeout_s=300) as reader:
        yield reader


def assert_clean(outcome, nbytes: int) -> None:
    assert outcome.status in ("ok", "error"), outcome
    assert outcome.clean, outcome
    assert outcome.peak_nbytes <= budget(nbytes), (outcome.peak_nbytes, budget(nbytes))


# -- 1. the segfault: hashing a 150,000-deep tuple key recursed in C -------------------------
def test_deep_tuple_key_in_data_pkl_does_not_crash(isolated) -> None:
    pkl = deep_tuple_key(150_000)
    for reader, data in (("scan_pickle", pkl), ("inspect", torch_zip(pkl))):
        outcome = isolated.run(reader, data, name="deep.pt")
        assert_clean(outcome, len(data))
    # a 3,000-deep key (a RecursionError before) inspects, and its JSON prints
    layout = ckptlab.inspect(torch_zip(deep_tuple_key(3_000)))
    json.dumps(layout.to_dict())


def test_deep_tuple_key_in_dcp_metadata_does_not_crash(isolated, tmp_path) -> None:
    (tmp_path / ".metadata").write_bytes(deep_tuple_key(150_000))
    for reader in ("metadata", "inspect"):
        target = tmp_path / ".metadata" if reader == "metadata" else tmp_path
        outcome = isolated.run(reader, path=target)
        assert outcome.status == "error" and outcome.clean, outcome


# -- 3. a 9-byte .metadata made the C unpickler allocate gigabytes ------------------------
def test_nine_byte_metadata_stays_small(isolated, tmp_path) -> None:
    data = b"\x80\x02Nr" + struct.pack("<I", 2**28) + b"."
    assert len(data) == 9
    (tmp_path / ".metadata").write_bytes(data)
    outcome = isolated.run("inspect", path=tmp_path)
    assert outcome.status == "error" and outcome.clean, outcome
    assert outcome.peak_nbytes <= budget(len(data))


# -- 4. BUILD with slot state on an allow-listed class patched torch ----------------------
def test_build_on_a_class_is_refused_and_patches_nothing(tmp_path) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    before = MetadataIndex.__hash__
    evil = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"
            b"N}X\x08\x00\x00\x00__hash__Ns\x86b.")
    (tmp_path / ".metadata").write_bytes(evil)
    with pytest.raises(CorruptArchiveError, match="BUILD"):
        ckptlab.inspect(tmp_path)
    assert MetadataIndex.__hash__ is before and before is not None
    with pytest.raises(CorruptArchiveError, match="BUILD"):
        scan_pickle(evil)


# -- 5. EXT opcodes went through copyreg's process-wide cache -----------------------------
RAN: list[str] = []


def trap() -> None:
    RAN.append("trap")


def test_ext_opcodes_never_consult_copyreg(tmp_path) -> None:
    code = 0x7FF0
    copyreg.add_extension(__name__, "trap", code)
    try:
        pickle.loads(pickle.dumps(trap, protocol=2))  # the application uses it: cached
        cache_before = dict(copyreg._extension_cache)
        evil = b"\x80\x02\x83" + struct.pack("<H", code) + b")R."
        assert pickle.loads(evil) is None and RAN == ["trap"]  # live under pickle
        RAN.clear()
        with pytest.raises(CorruptArchiveError, match="EXT"):
            scan_pickle(evil)
        with pytest.raises(CorruptArchiveError, match="EXT"):
            ckptlab.inspect(torch_zip(evil))
        (tmp_path / ".metadata").write_bytes(evil)
        with pytest.raises(CorruptArchiveError, match="EXT"):
            ckptlab.inspect(tmp_path)
        assert RAN == [] and dict(copyreg._extension_cache) == cache_before
    finally:
        copyreg.remove_extension(__name__, "trap", code)
    # registered but unused: ckptlab leaves nothing in the cache
    copyreg.add_extension(__name__, "trap", code)
    try:
        with pytest.raises(CorruptArchiveError):
            scan_pickle(b"\x80\x02\x83" + struct.pack("<H", code) + b")R.")
        assert code not in copyreg._extension_cache
    finally:
        copyreg.remove_extension(__name__, "trap", code)


# -- 7. inputs that ended in a traceback ---------------------------------------------------
STORAGE_PID = (b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000"
               b"X\x03\x00\x00\x00cpuK\x04tQ")


def test_build_on_a_storage_stand_in_is_refused() -> None:
    with pytest.raises(CorruptArchiveError, match="BUILD"):
        scan_pickle(b"\x80\x02" + STORAGE_PID + b"}b.")


@pytest.mark.parametrize("digits", [4_301, 20_000])
def test_huge_ints_are_refused_or_printable(digits: int) -> None:
    value = 10 ** digits
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    key = b"\x8b" + struct.pack("<i", len(raw)) + raw
    with pytest.raises(CorruptArchiveError, match="an int of"):
        scan_pickle(b"\x80\x02}" + key + b"K\x01s.")
    # the largest int the interpreter accepts still prints and serialises
    big = b"\x8a\xff" + b"\x7f" * 255
    layout = ckptlab.inspect(torch_zip(b"\x80\x02}" + big + b"K\x01s."))
    json.dumps(layout.to_dict())


def test_lone_surrogates_in_names_print_and_serialise() -> None:
    name = "\ud800bad".encode("utf-8", "surrogatepass")
    pkl = (b"\x80\x02}X" + struct.pack("<I", len(name)) + name +
           b"ctorch._utils\n_rebuild_tensor_v2\n(" + STORAGE_PID +
           b"K\x00K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtRs.")
    with pytest.raises(CorruptArchiveError, match="storage '0'"):
        ckptlab.inspect(torch_zip(pkl))  # the archive has no data/0: a clean error
    scan = scan_pickle(pkl)
    assert scan.tensors[0].path == ("\ud800bad",)
    json.dumps([list(t.path) for t in scan.tensors])


def test_objects_nested_past_the_walk_limit_are_an_error() -> None:
    assert scan_pickle(b"\x80\x02" + b"]" * 200 + b"a" * 199 + b".").tensors == ()
    with pytest.raises(CorruptArchiveError, match="nested deeper"):
        scan_pickle(b"\x80\x02" + b"]" * 300 + b"a" * 299 + b".")
    tensorful = (b"\x80\x02" + b"]" * 300 + b"ctorch._utils\n_rebuild_tensor_v2\n(" +
                 STORAGE_PID + b"K\x00K\x04\x85K\x01\x85\x89ccollections\nOrderedDict\n)RtR"
                 + b"a" * 300 + b".")
    with pytest.raises(CorruptArchiveError, match="nested deeper"):
        scan_pickle(tensorful)


# -- 8. amplification ----------------------------------------------------------------------
@pytest.mark.parametrize("opcode", [b"\x8f", b"(", b"}", b"\x94", b"]"],
                         ids=["EMPTY_SET", "MARK", "EMPTY_DICT", "MEMOIZE", "EMPTY_LIST"])
def test_one_byte_amplifiers_stay_within_budget(isolated, opcode: bytes) -> None:
    data = amplifier(opcode, 1_000_000)
    for reader, payload in (("scan_pickle", data), ("inspect", torch_zip(data))):
        assert_clean(isolated.run(reader, payload, name="amp.pt"), len(payload))


def test_distinct_globals_stay_within_budget(isolated) -> None:
    data = distinct_globals(80_000)
    outcome = isolated.run("scan_pickle", data)
    assert outcome.status == "ok", outcome
    assert outcome.peak_nbytes <= budget(len(data))


# -- the fuzzer ----------------------------------------------------------------------------
@settings(max_examples=150)
@given(data=opcode_streams())
def test_fuzzed_opcode_streams(isolated, data: bytes) -> None:
    for reader in ("scan_pickle", "metadata"):
        outcome = isolated.run(reader, data)
        assert outcome.status in ("ok", "error"), outcome
        # metadata's decoder raises its own MetadataDecodeError (ckptlab.plan module)
        assert outcome.clean, outcome
        assert outcome.peak_nbytes <= budget(len(data)), outcome
