"""Structure-aware fuzzing of every reader, each case in an isolated, memory-limited worker.

Strategies (``ckptlab.testing.pickles``) mutate a real torch.save archive at its structural
fields (local headers, central directory, zip64 records, end record), emit safetensors files
with hostile headers, and mutate a real DCP ``.metadata`` at its opcode arguments. Every case
must end in a correct result or a ckptlab error: no signal, no hang, and memory within the
interpreter's budget (64 bytes per input byte, plus a floor and the reader's own objects).
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ckptlab.format._unpickle import MEMORY_FLOOR, MEMORY_PER_BYTE
from ckptlab.testing.isolated import IsolatedReader
from ckptlab.testing.pickles import pickle_mutations, safetensors_files, zip_mutations

SLACK = 32 << 20


def budget(nbytes: int) -> int:
    return max(MEMORY_FLOOR, MEMORY_PER_BYTE * nbytes) + SLACK


@pytest.fixture(scope="module")
def isolated():
    with IsolatedReader(budget_nbytes=2 << 30, timeout_s=300) as reader:  # hang detection only
        yield reader


def assert_clean(outcome, nbytes: int) -> None:
    assert outcome.status in ("ok", "error") and outcome.clean, outcome
    assert outcome.peak_nbytes <= budget(nbytes), outcome


def _archive() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(2, dtype=torch.int64),
                "step": 3}, buf)
    return buf.getvalue()


ARCHIVE = _archive()


def _fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every structural field in a zip: local and central headers, the
    zip64 end record and locator, the end record."""
    table = {
        b"PK\x03\x04": [(6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)],
        b"PK\x01\x02": [(10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (32, 2),
                        (34, 2), (42, 4)],
        b"PK\x06\x06": [(4, 8), (16, 4), (20, 4), (24, 8), (32, 8), (40, 8), (48, 8)],
        b"PK\x06\x07": [(4, 4), (8, 8), (16, 4)],
        b"PK\x05\x06": [(4, 2), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (20, 2)],
    }
    out = []
    for sig, fields in table.items():
        start = data.find(sig)
        while start >= 0:
            out.extend((start + off, width) for off, width in fields
                       if start + off + width <= len(data))
            start = data.find(sig, start + 1)
    return out


FIELDS = _fields(ARCHIVE)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=zip_mutations(ARCHIVE, FIELDS))
def test_fuzzed_zip_structures(isolated, data: bytes) -> None:
    for reader in ("inspect", "open"):
        assert_clean(isolated.run(reader, data, name="fuzz.pt"), len(data))


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=safetensors_files())
def test_fuzzed_safetensors_headers(isolated, data: bytes) -> None:
    assert_clean(isolated.run("open", data, name="fuzz.safetensors"), len(data))


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp") / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(4, 3), "opt": {"step": 3, "lr": 0.1}}, checkpoint_id=root)
    return root


def _metadata() -> bytes:
    import tempfile
    import warnings

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.randn(4, 3), "opt": {"step": 3, "lr": 0.1}}, checkpoint_id=d)
        return (Path(d) / ".metadata").read_bytes()


METADATA = _metadata()


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=pickle_mutations(METADATA))
def test_fuzzed_dcp_metadata(isolated, dcp_dir: Path, tmp_path_factory, data: bytes) -> None:
    case = tmp_path_factory.mktemp("case") / "ck"
    shutil.copytree(dcp_dir, case)
    (case / ".metadata").write_bytes(data)
    for reader in ("inspect", "open"):
        assert_clean(isolated.run(reader, path=case), len(data))


def test_the_fields_cover_every_structure() -> None:
    for sig in (b"PK\x03\x04", b"PK\x01\x02", b"PK\x06\x06", b"PK\x06\x07", b"PK\x05\x06"):
        start = ARCHIVE.find(sig)
        assert start >= 0, sig
        assert any(start < offset < start + 64 for offset, _ in FIELDS), sig
