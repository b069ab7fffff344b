"""Hostile files: archives zip readers disagree on, zip bombs, and paths that are not files.

Parser differentials: torch reads archives with miniz, whose ``mz_zip_reader_locate_header_sig``
takes the last ``PK\\5\\6`` at least 22 bytes before the end of the file and never checks the
comment length. A second end record hidden in the comment of the real one is what torch loads;
ckptlab used to show the outer archive. Each test builds the file from benign torch.save
archives that hold different tensors, loads it with ``torch.load(weights_only=False)`` to prove
which archive torch takes, and checks that ckptlab refuses it (or shows exactly that archive).

Zip bombs: a deflated data.pkl is inflated only up to ``max(1 MiB, 16 x file size)``, in
bounded steps; memory is measured with tracemalloc in a subprocess.

Paths: a FIFO made ``ckptlab inspect`` hang forever; FIFOs, devices and sockets are refused
before anything blocks (checked in subprocesses with a timeout, so a regression fails instead of
hanging the suite).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import ckptlab
from ckptlab.errors import ArchiveError, CorruptArchiveError, UnsupportedFormatError
from ckptlab.format.archive import inflate_budget

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20
TIMEOUT_S = 120  # a guard against hangs (the subprocess imports torch), not a speed target


def save(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


BENIGN = {"w": torch.tensor([1.0, 2.0, 3.0])}  # what ckptlab used to show
OTHER = {"w": torch.tensor([7.0, 7.0, 7.0, 7.0])}  # what torch loads from the crafted file


def eocd_offset(data: bytes) -> int:
    """The end record of a torch.save archive (no comment: the last 22 bytes)."""
    assert data[-22:-18] == b"PK\x05\x06"
    return len(data) - 22


def relocate(archive: bytes, base: int) -> bytes:
    """A torch.save archive with every absolute offset moved by ``base`` (to sit there)."""
    z = bytearray(archive)
    eocd = eocd_offset(archive)
    loc = eocd - 20
    assert z[loc:loc + 4] == b"PK\x06\x07"
    z64 = struct.unpack_from("<Q", z, loc + 8)[0]
    entries = struct.unpack_from("<Q", z, z64 + 32)[0]
    cd = struct.unpack_from("<Q", z, z64 + 48)[0]
    pos = cd
    for _ in range(entries):
        n_name, n_extra, n_comment = struct.unpack_from("<HHH", z, pos + 28)
        struct.pack_into("<I", z, pos + 42, struct.unpack_from("<I", z, pos + 42)[0] + base)
        pos += 46 + n_name + n_extra + n_comment
    struct.pack_into("<Q", z, z64 + 48, cd + base)
    struct.pack_into("<Q", z, loc + 8, z64 + base)
    struct.pack_into("<I", z, eocd + 16, struct.unpack_from("<I", z, eocd + 16)[0] + base)
    return bytes(z)


def hidden_in_comment(outer: bytes, inner: bytes, *, inner_comment_nbytes: int = 0,
                      after: bytes = b"\x00") -> bytes:
    """``outer`` whose end-record comment holds all of ``inner`` (records, directory, end
    records), then ``after``; ``inner``'s own end record claims ``inner_comment_nbytes``."""
    hidden = bytearray(relocate(inner, len(outer)))
    struct.pack_into("<H", hidden, len(hidden) - 2, inner_comment_nbytes)
    comment = bytes(hidden) + after
    out = bytearray(outer)
    struct.pack_into("<H", out, len(outer) - 2, len(comment))
    return bytes(out + comment)


def torch_loads(path: Path) -> dict:
    """What torch loads (the files here are built by the tests from benign tensors only)."""
    return torch.load(path, weights_only=False)


def check_error(exc: ArchiveError, path: Path) -> None:
    """The message names the file and an offset, and says what was expected and found."""
    assert exc.path == str(path) and exc.offset is not None
    assert exc.expected is not None and exc.actual is not None
    assert str(path) in str(exc) and f"offset {exc.offset}" in str(exc)


def refuses(path: Path, match: str) -> CorruptArchiveError:
    """inspect and storage_offsets (both ways) raise the same CorruptArchiveError."""
    with pytest.raises(CorruptArchiveError, match=match) as info:
        ckptlab.inspect(path)
    for scan in (False, True):
        with pytest.raises(CorruptArchiveError, match=match):
            ckptlab.storage_offsets(path, scan=scan)
    check_error(info.value, path)
    return info.value


# --------------------------------------------------------------------------------------------
# which end record: the parser differential
# --------------------------------------------------------------------------------------------
def test_end_record_in_the_comment_is_what_torch_loads_and_ckptlab_refuses(
        tmp_path: Path) -> None:
    outer = save(BENIGN)
    path = tmp_path / "differential.pt"
    path.write_bytes(hidden_in_comment(outer, save(OTHER)))
    # the proof: torch loads the archive hidden in the comment, not the one around it
    loaded = torch_loads(path)
    assert torch.equal(loaded["w"], OTHER["w"])
    exc = refuses(path, "after the end-of-central-directory record")
    assert exc.offset == path.stat().st_size - 1  # the hidden record ends one byte short


def test_hidden_end_record_with_a_comment_past_the_end(tmp_path: Path) -> None:
    path = tmp_path / "past.pt"
    path.write_bytes(hidden_in_comment(save(BENIGN), save(OTHER), inner_comment_nbytes=0xFFFF))
    assert torch.equal(torch_loads(path)["w"], OTHER["w"])  # miniz never reads the length
    refuses(path, "comment .* runs past the end of the file")


def test_hidden_end_record_that_ends_the_file_is_a_second_end_record(tmp_path: Path) -> None:
    """Both records end exactly at the end of the file: torch takes the inner one; the outer
    one is a plausible end record too, so the file is refused."""
    outer = save(BENIGN)
    path = tmp_path / "both.pt"
    path.write_bytes(hidden_in_comment(outer, save(OTHER), after=b""))
    assert torch.equal(torch_loads(path)["w"], OTHER["w"])
    exc = refuses(path, "second, plausible end-of-central-directory record")
    assert exc.offset == eocd_offset(outer)


@pytest.mark.parametrize("trailing", [b"\x00", b"\x00" * 21, b"\x00" * 22, b"x" * 1000,
                                      b"PK\x05\x06"])
def test_bytes_after_the_end_record_are_refused(tmp_path: Path, trailing: bytes) -> None:
    data = save(BENIGN)
    path = tmp_path / "trailing.pt"
    path.write_bytes(data + trailing)
    assert torch.equal(torch_loads(path)["w"], BENIGN["w"])  # torch ignores them
    exc = refuses(path, "after the end-of-central-directory record")
    assert exc.offset == len(data)


def test_fake_end_record_after_the_archive_is_refused(tmp_path: Path) -> None:
    """An empty-archive end record appended: the last signature, so miniz takes it."""
    data = save(BENIGN)
    path = tmp_path / "fake.pt"
    path.write_bytes(data + b"PK\x05\x06" + bytes(18))
    with pytest.raises(RuntimeError):
        torch_loads(path)  # "archive does not contain any files"
    refuses(path, "second, plausible end-of-central-directory record")


def test_signature_in_the_short_comment_tail_is_refused(tmp_path: Path) -> None:
    """A comment whose last 21 bytes hold PK\\5\\6: miniz skips it, Python's zipfile takes it."""
    data = bytearray(save(BENIGN))
    comment = b"note" + b"PK\x05\x06" + bytes(10)
    struct.pack_into("<H", data, len(data) - 2, len(comment))
    path = tmp_path / "comment.pt"
    path.write_bytes(bytes(data) + comment)
    assert torch.equal(torch_loads(path)["w"], BENIGN["w"])
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(path)
    refuses(path, "signature in the last 21 bytes")


def test_gap_before_the_end_records_is_refused(tmp_path: Path) -> None:
    """Bytes between the central directory and the zip64 end record: miniz follows the
    absolute offsets, Python's zipfile shifts every offset by the gap."""
    data = save(BENIGN)
    eocd = eocd_offset(data)
    z64 = struct.unpack_from("<Q", data, eocd - 20 + 8)[0]
    out = bytearray(data[:z64] + bytes(16) + data[z64:])
    struct.pack_into("<Q", out, eocd + 16 - 20 + 8, z64 + 16)  # the locator follows it
    path = tmp_path / "gap.pt"
    path.write_bytes(bytes(out))
    assert torch.equal(torch_loads(path)["w"], BENIGN["w"])
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(path).testzip()
    refuses(path, "16 bytes between the central directory and the end")


def test_names_that_differ_only_in_case_are_refused(tmp_path: Path) -> None:
    """torch looks records up ignoring ASCII case: a second ``DATA.PKL`` is what it loads."""
    src = zipfile.ZipFile(io.BytesIO(save(BENIGN)))
    other = zipfile.ZipFile(io.BytesIO(save({"other": 5})))
    path = tmp_path / "case.pt"
    with zipfile.ZipFile(path, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name))
        dst.writestr("archive/DATA.PKL", other.read("archive/data.pkl"))
    assert torch_loads(path) == {"other": 5}
    with pytest.raises(CorruptArchiveError, match="differ only in case") as info:
        ckptlab.inspect(path)
    assert info.value.record == "archive/DATA.PKL" and info.value.offset is not None
    with pytest.raises(CorruptArchiveError, match="differ only in case"):
        ckptlab.storage_offsets(path)


def test_a_zip_carried_inside_a_checkpoint_is_not_an_end_record(tmp_path: Path) -> None:
    """A zip saved as bytes or as a uint8 tensor has its own end record in the tail, with
    offsets relative to its start: not a second archive, the file opens."""
    inner = save(OTHER)
    for name, obj in {"bytes": {"blob": inner, "w": BENIGN["w"]},
                      "tensor": {"blob": torch.frombuffer(bytearray(inner), dtype=torch.uint8)}
                      }.items():
        path = tmp_path / f"{name}.pt"
        torch.save(obj, path)
        data = path.read_bytes()
        assert data.count(b"PK\x05\x06") == 2
        layout = ckptlab.inspect(path)
        assert layout.eocd_offset == len(data) - 22
        assert ckptlab.storage_offsets(path).offsets == {s.key: s.data_offset
                                                         for s in layout.storages}


@pytest.mark.parametrize("alignment", [1, 64, 4096, 65504])
def test_torch_save_files_still_open(tmp_path: Path, alignment: int) -> None:
    from torch.utils.serialization import config

    state = {"a": torch.arange(10.0), "b": torch.ones(3, dtype=torch.bfloat16), "n": 3,
             "c": torch.arange(5)}
    path = tmp_path / "plain.pt"
    with config.patch({"save.storage_alignment": alignment}):
        torch.save(state, path)
    data = path.read_bytes()
    for source in (path, str(path), data, io.BytesIO(data)):
        layout = ckptlab.inspect(source)
        assert layout.eocd_offset == len(data) - 22 and layout.zip64_eocd_offset is not None
        cursor = 0
        for seg in layout.segments:  # the segments tile the file
            assert seg.offset == cursor, seg
            cursor = seg.end_offset
        assert cursor == len(data)
    assert set(ckptlab.storage_offsets(path).offsets) == {"0", "1", "2"}


def test_the_embedded_sample_still_opens(sample_file: Path) -> None:
    layout = ckptlab.inspect(sample_file)
    assert layout.eocd_offset == sample_file.stat().st_size - 22


# --------------------------------------------------------------------------------------------
# zip bombs
# --------------------------------------------------------------------------------------------
def deflated_pickle_archive(path: Path, payload_nbytes: int) -> Path:
    """A torch-shaped zip whose data.pkl is a pickled str of ``payload_nbytes`` 'A's,
    deflated (written in 1 MiB steps: the pickle never exists in memory)."""
    head = b"\x80\x02X" + struct.pack("<I", payload_nbytes)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open("archive/data.pkl", "w") as f:
            f.write(head)
            left = payload_nbytes
            chunk = b"A" * MiB
            while left:
                f.write(chunk[:min(left, MiB)])
                left -= min(left, MiB)
            f.write(b"q\x00.")
        z.writestr("archive/byteorder", "little", compress_type=zipfile.ZIP_STORED)
        z.writestr("archive/version", "3\n", compress_type=zipfile.ZIP_STORED)
    return path


def set_uncompressed_nbytes(path: Path, name: str, nbytes: int) -> None:
    """Write ``nbytes`` as the uncompressed size of ``name`` (local header and directory)."""
    data = bytearray(path.read_bytes())
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo(name)
    struct.pack_into("<I", data, info.header_offset + 22, nbytes)
    cd = struct.unpack_from("<I", data, eocd_offset(bytes(data)) + 16)[0]  # no zip64 here
    while data[cd:cd + 4] == b"PK\x01\x02":
        n_name, n_extra, n_comment = struct.unpack_from("<HHH", data, cd + 28)
        if data[cd + 46:cd + 46 + n_name] == name.encode():
            struct.pack_into("<I", data, cd + 24, nbytes)
            break
        cd += 46 + n_name + n_extra + n_comment
    else:
        raise AssertionError(f"no directory entry for {name}")
    path.write_bytes(bytes(data))


def test_deflated_data_pkl_is_read_by_torch_and_ckptlab(tmp_path: Path) -> None:
    """torch's reader (miniz) inflates a deflated data.pkl; so does ckptlab, within budget."""
    src = zipfile.ZipFile(io.BytesIO(save(BENIGN)))
    path = tmp_path / "deflated.pt"
    with zipfile.ZipFile(path, "w") as dst:
        for name in src.namelist():
            dst.writestr(name, src.read(name), compress_type=zipfile.ZIP_DEFLATED
                         if name.endswith("data.pkl") else zipfile.ZIP_STORED)
    assert torch.equal(torch_loads(path)["w"], BENIGN["w"])
    layout = ckptlab.inspect(path)
    assert layout.record("data.pkl").method == 8
    assert [t.path for t in layout.tensors] == [("w",)]


def test_a_big_pickle_within_the_budget_is_inflated(tmp_path: Path) -> None:
    path = deflated_pickle_archive(tmp_path / "ok.pt", 900_000)  # < 1 MiB: inside the budget
    assert torch_loads(path) == "A" * 900_000
    layout = ckptlab.inspect(path)
    assert layout.record("data.pkl").uncompressed_nbytes == 900_000 + 10


def test_zip_bomb_is_refused_with_its_ratio(tmp_path: Path) -> None:
    path = deflated_pickle_archive(tmp_path / "bomb.pt", 64 * MiB)
    file_nbytes = path.stat().st_size
    budget = inflate_budget(file_nbytes)
    assert file_nbytes < 128 * 1024 and budget == max(MiB, 16 * file_nbytes) < 2 * MiB
    with pytest.raises(CorruptArchiveError, match=r"record inflates \d+x") as info:
        ckptlab.inspect(path)
    exc = info.value
    assert exc.record == "archive/data.pkl" and exc.offset == 0
    assert "zip bomb" in str(exc) and str(path) in str(exc)
    assert exc.expected == f"<= {budget} bytes uncompressed"
    assert exc.actual == f"{64 * MiB + 10} bytes"
    ratio = int(str(exc).split("record inflates ")[1].split("x")[0])
    assert ratio > 500  # deflate reaches ~1030x on a run of one byte


_MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys, tracemalloc
    import ckptlab
    from ckptlab.errors import ArchiveError
    path = sys.argv[1]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        ckptlab.inspect(path)
        error = None
    except ArchiveError as exc:
        error = str(exc)
    peak = tracemalloc.get_traced_memory()[1]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss
    print(json.dumps({"error": error, "peak": peak, "rss_grown_kib": grown}))
""")


def probe_memory(path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(path)], capture_output=True,
                         text=True, timeout=TIMEOUT_S, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_zip_bomb_memory_stays_bounded(tmp_path: Path) -> None:
    """The bomb (64 MiB declared) and a liar (declares 1,000 bytes, inflates to 64 MiB) are
    refused having allocated at most a few MiB: the liar is inflated in bounded steps."""
    bomb = deflated_pickle_archive(tmp_path / "bomb.pt", 64 * MiB)
    liar = deflated_pickle_archive(tmp_path / "liar.pt", 64 * MiB)
    set_uncompressed_nbytes(liar, "archive/data.pkl", 1000)
    for path, match in ((bomb, "record inflates"), (liar, "inflates past the size")):
        result = probe_memory(path)
        assert result["error"] is not None and match in result["error"], result
        assert result["peak"] < 4 * MiB, result  # was 64 MiB (inflated whole, then walked)
        assert result["rss_grown_kib"] < 32 * 1024, result


# --------------------------------------------------------------------------------------------
# regular files only
# --------------------------------------------------------------------------------------------
_FIFO_PROBE = textwrap.dedent("""
    import json, sys
    import ckptlab
    from ckptlab.format import read_range
    out = {}
    calls = {"inspect": ckptlab.inspect, "storage_offsets": ckptlab.storage_offsets,
             "read_range": lambda p: read_range(p, 0, 1)}
    for name, call in calls.items():
        try:
            call(sys.argv[1])
            out[name] = None
        except Exception as exc:
            out[name] = [type(exc).__name__, str(exc)]
    print(json.dumps(out))
""")


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs on this platform")
    path = tmp_path / "model.pt"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("via_symlink", [False, True])
def test_fifo_is_refused_without_blocking(fifo: Path, via_symlink: bool) -> None:
    path = fifo
    if via_symlink:
        path = fifo.with_name("link.pt")
        path.symlink_to(fifo)
    out = subprocess.run([sys.executable, "-c", _FIFO_PROBE, str(path)], capture_output=True,
                         text=True, timeout=TIMEOUT_S, cwd=ROOT, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for name, error in result.items():
        assert error is not None, f"{name} returned on a FIFO"
        kind, message = error
        assert kind == "UnsupportedFormatError", error
        assert message.startswith(f"{path}: is a FIFO (named pipe), not a regular file"), error


def test_cli_inspect_fifo_exits_2_with_one_error_line(fifo: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "ckptlab", "inspect", str(fifo)],
                         capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptlab: error:"), out.stderr
    assert "FIFO" in lines[0] and str(fifo) in lines[0]
    assert out.stdout == ""


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null", "/dev/urandom"])
def test_device_files_are_refused(device: str) -> None:
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    for call in (ckptlab.inspect, ckptlab.storage_offsets):
        with pytest.raises(UnsupportedFormatError, match="is a character device, not a "
                                                         "regular file") as info:
            call(device)
        assert info.value.path == device


def test_file_object_over_a_pipe_is_refused() -> None:
    read_fd, write_fd = os.pipe()
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        with pytest.raises(UnsupportedFormatError, match="is a FIFO"):
            ckptlab.inspect(f)


def test_socket_is_refused(tmp_path: Path) -> None:
    import socket

    if not hasattr(socket, "AF_UNIX"):
        pytest.skip("no unix sockets")
    path = tmp_path / "s.pt"
    with socket.socket(socket.AF_UNIX) as sock:
        try:
            sock.bind(str(path))
        except OSError as exc:  # path too long for sun_path on some systems
            pytest.skip(f"cannot bind a unix socket here: {exc}")
        with pytest.raises(UnsupportedFormatError, match="is a socket"):
            ckptlab.inspect(path)


def test_directory_still_says_directory(tmp_path: Path) -> None:
    with pytest.raises(ArchiveError, match="is a directory"):
        ckptlab.format.inspect(tmp_path)
