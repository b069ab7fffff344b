"""Every GDS backend against plain ``os.pwrite`` / ``os.pread`` on real files.

One generic class, :class:`TestBackendConformance`, runs against every backend through the
``backend`` fixture: ``odirect`` and ``posix`` always, ``torch`` and ``kvikio`` (marked ``gpu``)
where :func:`ckptlab.gds.backend_status` says they can run; elsewhere they skip with its reason.
The oracle is the same writes done with ``os.pwrite`` on a copy of the file: the two files must be
byte-identical, so no byte outside a payload ever changes (a storage's last 4 KiB block also
holds its zip descriptor and the next record's header).

How errors are injected:

* a filesystem that refuses O_DIRECT, for real: a ramfs mount (tmpfs accepts O_DIRECT since
  Linux 6.6, so /dev/shm does not refuse it on this kernel);
* EINVAL (and EIO) from an O_DIRECT transfer: ``os.pwrite`` / ``os.preadv`` wrapped to fail for
  descriptors opened with O_DIRECT only (no filesystem here accepts the open but refuses 4 KiB
  aligned transfers);
* ENOSPC, for real: a 64 KiB tmpfs mount;
* EMFILE, for real: RLIMIT_NOFILE lowered to the lowest free descriptor (+1 to fail at the
  second open).

The mounts need root (CAP_SYS_ADMIN); those tests skip without it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import random
import re
import resource
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gds_support import BLOCK, require_backend, status_of, storage_bytes
from hypothesis import given
from hypothesis import strategies as st

from ckptlab import gds
from ckptlab.errors import CkptlabError, InvalidArgumentError, StorageIOError
from ckptlab.gds import _backends
from ckptlab.gds._buffers import aligned_buffer
from ckptlab.testing.mounts import mounted

GPU_BACKENDS = ("torch", "kvikio")
HOST_BACKENDS = ("odirect", "posix")
_PWRITE, _PREADV = os.pwrite, os.preadv  # the real ones, whatever a test wraps


# ---------------------------------------------------------------------------------------------
# helpers


def host_storage(data: bytes, shift: int | None = 0) -> torch.UntypedStorage:
    """A CPU storage holding ``data`` whose address is ``shift`` (mod 4096) past a page
    boundary, or wherever ``torch.empty`` puts it when ``shift`` is None."""
    n = len(data)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8).untyped_storage()
    if shift is None:
        t = torch.empty(n, dtype=torch.uint8)
        t.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        return t.untyped_storage()
    buf = aligned_buffer(shift + n)
    buf[shift:] = data
    storage = torch.frombuffer(buf[shift:], dtype=torch.uint8).untyped_storage()
    assert storage.data_ptr() % BLOCK == shift
    return storage


@dataclass(frozen=True)
class Backend:
    """A backend under test and where its storages live."""

    name: str
    device: str

    @property
    def on_host(self) -> bool:
        return self.device == "cpu"

    def storage(self, data: bytes, shift: int | None = 0) -> torch.UntypedStorage:
        """A storage holding ``data`` on this backend's device (``shift``: see host_storage)."""
        if self.on_host:
            return host_storage(data, shift)
        if not data:
            return torch.empty(0, dtype=torch.uint8, device=self.device).untyped_storage()
        host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return host.to(self.device).untyped_storage()

    def empty(self, nbytes: int, fill: int = 0xAA) -> torch.UntypedStorage:
        """A storage of ``nbytes`` filled with ``fill`` (so a read that skips bytes shows)."""
        return self.storage(bytes([fill]) * nbytes, shift=0)

    def require_host(self) -> None:
        if not self.on_host:
            pytest.skip(f"backend {self.name!r} moves device storages; this case is about "
                        "host buffers and raw bytes")


@pytest.fixture(params=[
    pytest.param("odirect", id="odirect"),
    pytest.param("posix", id="posix"),
    pytest.param("torch", id="torch", marks=pytest.mark.gpu),
    pytest.param("kvikio", id="kvikio", marks=pytest.mark.gpu),
])
def backend(request: pytest.FixtureRequest) -> Backend:
    require_backend(request.param)
    return Backend(request.param, "cuda" if request.param in GPU_BACKENDS else "cpu")


@pytest.fixture(params=HOST_BACKENDS)
def host_backend(request: pytest.FixtureRequest) -> Backend:
    return Backend(request.param, "cpu")


@contextlib.contextmanager
def chunk_size(nbytes: int | None) -> Iterator[None]:
    """The odirect backend's bounce-buffer size set to ``nbytes`` (None: its own 32 MiB), so
    small payloads run its two-buffer pipeline over many chunks."""
    if nbytes is None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_backends, "CHUNK", nbytes)
        yield


@contextlib.contextmanager
def fresh_dir(base: Path) -> Iterator[Path]:
    """A directory of its own for one hypothesis example."""
    with tempfile.TemporaryDirectory(dir=base) as d:
        yield Path(d)


def fill(path: Path, nbytes: int, seed: int) -> bytes:
    data = random.Random(seed).randbytes(nbytes)
    path.write_bytes(data)
    return data


def pwrite_reference(path: Path, writes: list[tuple[int, bytes]]) -> bytes:
    """Apply ``writes`` with plain os.pwrite; returns the file's bytes."""
    fd = os.open(path, os.O_RDWR)
    try:
        for offset, payload in writes:
            done = 0
            while done < len(payload):
                done += _PWRITE(fd, payload[done:], offset + done)
    finally:
        os.close(fd)
    return path.read_bytes()


def assert_same_bytes(got: bytes, want: bytes) -> None:
    if got == want:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                 min(len(got), len(want)))
    raise AssertionError(f"files differ: {len(got)} vs {len(want)} bytes, first difference at "
                         f"offset {first} (block {first // BLOCK})")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def direct_span(offset: int, nbytes: int) -> int:
    """Bytes of ``[offset, offset + nbytes)`` that lie in whole 4 KiB blocks."""
    lo = -(-offset // BLOCK) * BLOCK
    hi = (offset + nbytes) // BLOCK * BLOCK
    return max(0, hi - lo)


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


def address(data: Any) -> int:
    return int(np.frombuffer(data, dtype=np.uint8).ctypes.data) if len(data) else 0


@dataclass
class DirectWrites:
    """What reached O_DIRECT descriptors through os.pwrite: (address, nbytes) per call."""

    calls: list[tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.calls)


@pytest.fixture
def spy_direct_writes(monkeypatch: pytest.MonkeyPatch) -> DirectWrites:
    """Record every os.pwrite on an O_DIRECT descriptor; the writes still happen."""
    seen = DirectWrites([])

    def pwrite(fd: int, data: Any, offset: int) -> int:
        if is_direct(fd):
            seen.calls.append((address(data), len(data)))
        return _PWRITE(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return seen


def require_o_direct(directory: Path) -> None:
    """Skip when ``directory``'s filesystem refuses O_DIRECT (the injections need it to accept)."""
    with gds.open(directory / ".probe", os.O_RDWR | os.O_CREAT, backend="odirect") as h:
        io_path = h.io_path
    (directory / ".probe").unlink()
    if io_path != "O_DIRECT":
        pytest.skip(f"{directory}'s filesystem refuses O_DIRECT")


def fail_on_direct(monkeypatch: pytest.MonkeyPatch, name: str, code: int) -> list[int]:
    """Make ``os.<name>`` raise OSError(code) on O_DIRECT descriptors only; returns a list
    that counts the failures."""
    real = {"pwrite": _PWRITE, "preadv": _PREADV}[name]
    failures: list[int] = []

    def wrapper(fd: int, *args: Any) -> int:
        if is_direct(fd):
            failures.append(fd)
            raise OSError(code, os.strerror(code))
        return real(fd, *args)

    monkeypatch.setattr(os, name, wrapper)
    return failures


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs: it refuses O_DIRECT at open (EINVAL), for real."""
    with mounted("ramfs", tmp_path / "ramfs") as d:
        yield d


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, to run out of space for real."""
    with mounted("tmpfs", tmp_path / "tiny", "size=64k") as d:
        yield d


@contextlib.contextmanager
def descriptors_left(spare: int) -> Iterator[None]:
    """RLIMIT_NOFILE lowered so that the next ``spare`` opens succeed and the one after
    fails with EMFILE."""
    probe = os.open(os.devnull, os.O_RDONLY)
    os.close(probe)  # the lowest free descriptor: opens get it, then one above the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (probe + spare, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---------------------------------------------------------------------------------------------
# strategies

INTERESTING = (0, 1, 511, 512, 4095, 4096, 4097, 8191, 8192, 8193, 3 * BLOCK)
chunks = st.sampled_from([None, BLOCK, 2 * BLOCK])  # bounce-buffer sizes (None: the default)
file_sizes = st.one_of(st.sampled_from((0, 1, 100, 4095, 4096, 4097, 3 * BLOCK)),
                       st.integers(0, 5 * BLOCK))
LENGTHS = (0, 1, 100, 4095, 4096, 4097, 8191, 8192, 8193, 3 * BLOCK)
lengths = st.one_of(st.sampled_from(LENGTHS), st.integers(0, 5 * BLOCK + 100))


def offsets(limit: int) -> st.SearchStrategy[int]:
    """Offsets up to ``limit``: block edges, multiples of 4096 and anything else."""
    return st.one_of(st.sampled_from(INTERESTING),
                     st.integers(0, limit // BLOCK).map(lambda k: k * BLOCK),
                     st.integers(0, limit))


@dataclass(frozen=True)
class Transfer:
    """One save_storage / load_storage: offset, length, payload seed and source alignment."""

    offset: int
    nbytes: int
    seed: int
    shift: int | None  # source address mod 4096 (None: torch.empty's)

    @property
    def payload(self) -> bytes:
        return random.Random(self.seed).randbytes(self.nbytes)


@st.composite
def transfers(draw: st.DrawFn, limit: int, *, inside: int | None = None) -> Transfer:
    """A transfer at an offset up to ``limit``; with ``inside``, one that ends by that size."""
    if inside is None:
        offset, nbytes = draw(offsets(limit)), draw(lengths)
    else:
        offset = draw(st.one_of(st.sampled_from([o for o in INTERESTING if o <= inside]),
                                st.integers(0, inside // BLOCK).map(lambda k: k * BLOCK),
                                st.integers(0, inside)))
        room = inside - offset
        nbytes = draw(st.one_of(st.sampled_from([n for n in LENGTHS if n <= room]),
                                st.just(room), st.integers(0, room)))
    kind = draw(st.sampled_from(["page", "matched", "odd", "torch"]))
    shift = {"page": 0, "matched": offset % BLOCK, "torch": None,
             "odd": draw(st.integers(1, BLOCK - 1))}[kind]
    return Transfer(offset, nbytes, draw(st.integers(0, 2**32)), shift)


@st.composite
def write_scenarios(draw: st.DrawFn) -> tuple[int, int, list[Transfer]]:
    size = draw(file_sizes)
    writes = draw(st.lists(transfers(size + 2 * BLOCK), min_size=1, max_size=4))
    return size, draw(st.integers(0, 2**32)), writes


@st.composite
def read_scenarios(draw: st.DrawFn) -> tuple[int, int, list[Transfer]]:
    size = draw(file_sizes.filter(bool))
    reads = draw(st.lists(transfers(size, inside=size), min_size=1, max_size=4))
    return size, draw(st.integers(0, 2**32)), reads


# ---------------------------------------------------------------------------------------------
# the conformance class


class TestBackendConformance:
    """What every backend promises, checked against os.pwrite / the file's bytes."""

    @given(scenario=write_scenarios(), chunk=chunks)
    def test_writes_equal_pwrite(self, backend: Backend, tmp_path: Path,
                                 scenario: tuple[int, int, list[Transfer]],
                                 chunk: int | None) -> None:
        size, seed, writes = scenario
        with fresh_dir(tmp_path) as d, chunk_size(chunk):
            fill(d / "handle.bin", size, seed)
            shutil.copyfile(d / "handle.bin", d / "pwrite.bin")
            with gds.open(d / "handle.bin", os.O_RDWR, backend=backend.name) as h:
                for w in writes:
                    h.save_storage(backend.storage(w.payload, w.shift), w.offset)
                moved = h.direct_nbytes + h.buffered_nbytes
            want = pwrite_reference(d / "pwrite.bin", [(w.offset, w.payload) for w in writes])
            assert_same_bytes((d / "handle.bin").read_bytes(), want)
        assert moved == sum(w.nbytes for w in writes)

    @given(scenario=read_scenarios(), chunk=chunks)
    def test_reads_return_file_bytes(self, backend: Backend, tmp_path: Path,
                                     scenario: tuple[int, int, list[Transfer]],
                                     chunk: int | None) -> None:
        size, seed, reads = scenario
        with fresh_dir(tmp_path) as d, chunk_size(chunk):
            data = fill(d / "f.bin", size, seed)
            with gds.open(d / "f.bin", os.O_RDONLY, backend=backend.name) as h:
                for r in reads:
                    dest = backend.storage(b"\xaa" * r.nbytes, r.shift)
                    h.load_storage(dest, r.offset)
                    assert storage_bytes(dest) == data[r.offset:r.offset + r.nbytes], r
                    if backend.on_host:
                        assert h.read_bytes(r.offset, r.nbytes) == data[r.offset:
                                                                         r.offset + r.nbytes]
            assert (d / "f.bin").read_bytes() == data  # reads change nothing

    @pytest.mark.parametrize(("offset", "nbytes"), [
        (0, 3 * BLOCK),  # whole blocks only
        (BLOCK, BLOCK),  # exactly one block
        (100, 3 * BLOCK),  # partial head and tail around two whole blocks
        (4000, BLOCK + 200),  # spans three blocks, one whole
        (BLOCK + 1, BLOCK - 2),  # inside one block
        (2 * BLOCK - 10, 20),  # across one block edge, no whole block
        (0, 0),
    ])
    @pytest.mark.parametrize("chunk", [None, BLOCK], ids=["chunk-default", "chunk-4k"])
    def test_zero_copy_and_bounce_paths_write_the_same_file(
            self, backend: Backend, tmp_path: Path, spy_direct_writes: DirectWrites,
            monkeypatch: pytest.MonkeyPatch, offset: int, nbytes: int,
            chunk: int | None) -> None:
        backend.require_host()
        if chunk:
            monkeypatch.setattr(_backends, "CHUNK", chunk)
        payload = random.Random(offset * 7 + nbytes).randbytes(nbytes)
        files = {}
        for kind, shift in (("aligned", offset % BLOCK), ("unaligned", (offset + 64) % BLOCK)):
            path = tmp_path / f"{kind}.bin"
            fill(path, 5 * BLOCK, seed=1)
            spy_direct_writes.calls.clear()
            source = host_storage(payload, shift)
            with gds.open(path, os.O_RDWR, backend=backend.name) as h:
                h.save_storage(source, offset)
                io_path, direct, buffered = h.io_path, h.direct_nbytes, h.buffered_nbytes
            files[kind] = path.read_bytes()
            whole = direct_span(offset, nbytes) if io_path == "O_DIRECT" else 0
            # accounting: the whole blocks go around the page cache, the rest through it
            assert (direct, buffered) == (whole, nbytes - whole), (kind, io_path)
            assert spy_direct_writes.nbytes == whole
            lo, hi = source.data_ptr(), source.data_ptr() + nbytes
            inside = [lo <= a < hi for a, _ in spy_direct_writes.calls]
            if kind == "aligned":  # written in place from the source (zero copy)
                assert all(inside), spy_direct_writes.calls
            else:  # through the page-aligned bounce buffer
                assert not any(inside), spy_direct_writes.calls
                assert all(a % BLOCK == 0 for a, _ in spy_direct_writes.calls)
        ref = tmp_path / "pwrite.bin"
        fill(ref, 5 * BLOCK, seed=1)
        want = pwrite_reference(ref, [(offset, payload)])
        assert_same_bytes(files["aligned"], want)
        assert_same_bytes(files["unaligned"], want)

    def test_posix_never_uses_o_direct(self, tmp_path: Path,
                                       spy_direct_writes: DirectWrites) -> None:
        fill(tmp_path / "f.bin", 4 * BLOCK, seed=2)
        with gds.open(tmp_path / "f.bin", os.O_RDWR, backend="posix") as h:
            h.save_storage(host_storage(b"x" * 3 * BLOCK, 0), 0)
            assert (h.io_path, h.direct_nbytes, h.buffered_nbytes) == ("POSIX", 0, 3 * BLOCK)
        assert spy_direct_writes.calls == []

    @pytest.mark.parametrize(("size", "offset", "nbytes"), [
        (100, 50, 51),  # ends one byte past EOF
        (100, 100, 1),  # starts at EOF
        (100, 1000, 10),  # starts past EOF
        (0, 0, 1),  # empty file
        (2 * BLOCK, BLOCK, 2 * BLOCK),  # whole blocks, the last one missing
        (3 * BLOCK, 2 * BLOCK + 5, BLOCK),  # partial blocks, the tail missing
    ])
    def test_read_past_eof_raises_storage_io_error(self, backend: Backend, tmp_path: Path,
                                                   request: pytest.FixtureRequest, size: int,
                                                   offset: int, nbytes: int) -> None:
        path = tmp_path / "short.bin"
        data = fill(path, size, seed=3)
        with gds.open(path, os.O_RDONLY, backend=backend.name) as h:
            with pytest.raises(StorageIOError) as info:
                h.load_storage(backend.empty(nbytes), offset)
            if backend.on_host:
                with pytest.raises(StorageIOError):
                    h.read_bytes(offset, nbytes)
        exc = info.value
        assert isinstance(exc, OSError) and isinstance(exc, CkptlabError)
        assert exc.path == str(path)
        assert (exc.offset, exc.nbytes) == (offset, nbytes)
        assert str(path) in str(exc) and f"[{offset}, {offset + nbytes})" in str(exc)
        assert path.read_bytes() == data

    @pytest.mark.parametrize("size", [0, 100, BLOCK, BLOCK + 904])
    @pytest.mark.parametrize(("past_eof", "nbytes"), [
        (0, 10), (0, BLOCK), (0, 3 * BLOCK + 7),  # at EOF
        (1, 5000), (BLOCK, 2 * BLOCK), (10 * BLOCK + 3, 9000),  # after EOF: a hole first
        (10, 0),  # zero bytes after EOF: the file keeps its size, as with pwrite
    ])
    def test_writes_that_extend_the_file_behave_like_pwrite(
            self, backend: Backend, tmp_path: Path, size: int, past_eof: int,
            nbytes: int) -> None:
        payload = random.Random(nbytes).randbytes(nbytes)
        fill(tmp_path / "handle.bin", size, seed=4)
        shutil.copyfile(tmp_path / "handle.bin", tmp_path / "pwrite.bin")
        with gds.open(tmp_path / "handle.bin", os.O_RDWR, backend=backend.name) as h:
            h.save_storage(backend.storage(payload, 0), size + past_eof)
        want = pwrite_reference(tmp_path / "pwrite.bin", [(size + past_eof, payload)])
        assert_same_bytes((tmp_path / "handle.bin").read_bytes(), want)

    def test_creates_the_file_with_o_creat(self, backend: Backend, tmp_path: Path) -> None:
        path = tmp_path / "new.bin"
        payload = random.Random(5).randbytes(2 * BLOCK + 17)
        with gds.open(path, os.O_RDWR | os.O_CREAT, backend=backend.name) as h:
            h.save_storage(backend.storage(payload, 0), 3)
            h.fsync()
        assert path.read_bytes() == b"\0" * 3 + payload

    def test_missing_file_raises_storage_io_error(self, host_backend: Backend,
                                                  tmp_path: Path) -> None:
        path = tmp_path / "missing.bin"
        with pytest.raises(StorageIOError) as info:
            gds.open(path, os.O_RDWR, backend=host_backend.name)
        assert info.value.errno == errno.ENOENT and str(path) in str(info.value)
        assert not path.exists()

    def test_disk_full_raises_enospc(self, backend: Backend, tiny_fs: Path,
                                     request: pytest.FixtureRequest) -> None:
        require_backend(backend.name, tiny_fs)
        path = tiny_fs / "full.bin"
        data = fill(path, BLOCK, seed=6)
        fds = open_fds()
        with gds.open(path, os.O_RDWR, backend=backend.name) as h:
            h.save_storage(backend.storage(b"fits" * 1000, 0), 100)  # a write that fits
            with pytest.raises(StorageIOError) as info:
                h.save_storage(backend.storage(bytes(256 * 1024), 0), BLOCK)
        assert open_fds() == fds
        exc = info.value
        assert exc.errno == errno.ENOSPC and isinstance(exc, OSError)
        assert exc.path == str(path) and str(path) in str(exc)
        assert BLOCK <= exc.offset and exc.offset + exc.nbytes == BLOCK + 256 * 1024
        assert path.read_bytes()[:BLOCK] == (data[:100] + b"fits" * 1000)[:BLOCK]

    def test_closed_handle_refuses_transfers(self, backend: Backend, tmp_path: Path) -> None:
        path = tmp_path / "f.bin"
        fill(path, BLOCK, seed=7)
        h = gds.open(path, os.O_RDWR, backend=backend.name)
        h.close()
        h.close()  # idempotent
        with pytest.raises(InvalidArgumentError, match="closed"):
            h.save_storage(backend.storage(b"abc", 0), 0)
        with pytest.raises(InvalidArgumentError, match="closed"):
            h.load_storage(backend.empty(3), 0)
        if backend.on_host:
            with pytest.raises(InvalidArgumentError):
                h.write_bytes(b"abc", 0)
            with pytest.raises(InvalidArgumentError):
                h.read_bytes(0, 3)
        assert path.read_bytes() == random.Random(7).randbytes(BLOCK)

    @pytest.mark.parametrize("storage", [
        pytest.param(lambda: torch.arange(4), id="tensor"),
        pytest.param(lambda: b"abcd", id="bytes"),
        pytest.param(lambda: bytearray(4), id="bytearray"),
        pytest.param(lambda: np.zeros(4, dtype=np.uint8), id="ndarray"),
        pytest.param(lambda: None, id="None"),
    ])
    def test_wrong_storage_type_raises(self, backend: Backend, tmp_path: Path,
                                       storage: Callable[[], Any]) -> None:
        fill(tmp_path / "f.bin", BLOCK, seed=8)
        with gds.open(tmp_path / "f.bin", os.O_RDWR, backend=backend.name) as h:
            with pytest.raises(InvalidArgumentError, match="UntypedStorage"):
                h.save_storage(storage(), 0)
            with pytest.raises(InvalidArgumentError, match="UntypedStorage"):
                h.load_storage(storage(), 0)
        assert (tmp_path / "f.bin").read_bytes() == random.Random(8).randbytes(BLOCK)

    @pytest.mark.parametrize("offset", [-1, -BLOCK, 1.0, 4096.0, "0", None, True, b"\0"])
    def test_wrong_offset_raises(self, backend: Backend, tmp_path: Path, offset: Any) -> None:
        fill(tmp_path / "f.bin", BLOCK, seed=9)
        with gds.open(tmp_path / "f.bin", os.O_RDWR, backend=backend.name) as h:
            with pytest.raises(InvalidArgumentError, match="offset"):
                h.save_storage(backend.storage(b"abc", 0), offset)
            with pytest.raises(InvalidArgumentError, match="offset"):
                h.load_storage(backend.empty(3), offset)
        assert (tmp_path / "f.bin").read_bytes() == random.Random(9).randbytes(BLOCK)

    @pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
    def test_typed_storage_is_written_like_its_untyped_storage(self, backend: Backend,
                                                              tmp_path: Path) -> None:
        t = torch.arange(1000, dtype=torch.float32).to(backend.device)
        fill(tmp_path / "f.bin", BLOCK, seed=10)
        typed = torch.TypedStorage(wrap_storage=t.untyped_storage(), dtype=t.dtype,
                                   _internal=True)  # what t.storage() gives, without its warning
        with gds.open(tmp_path / "f.bin", os.O_RDWR, backend=backend.name) as h:
            h.save_storage(typed, 96)
        assert (tmp_path / "f.bin").read_bytes()[96:96 + 4000] == t.cpu().numpy().tobytes()

    def test_context_manager_closes_descriptors(self, backend: Backend, tmp_path: Path) -> None:
        path = tmp_path / "f.bin"
        fill(path, 2 * BLOCK, seed=11)
        before = open_fds()
        with gds.open(path, os.O_RDWR, backend=backend.name) as h:
            assert open_fds() > before
            h.save_storage(backend.storage(b"z" * BLOCK, 0), BLOCK)
        assert open_fds() == before
        with pytest.raises(KeyError), gds.open(path, os.O_RDWR, backend=backend.name):
            raise KeyError("boom")
        assert open_fds() == before

    @pytest.mark.parametrize("which", ["first", "last"])
    def test_open_failure_raises_storage_io_error_and_leaks_nothing(
            self, backend: Backend, tmp_path: Path, request: pytest.FixtureRequest,
            which: str) -> None:
        """EMFILE at the first (or the last) descriptor the backend opens."""
        backend.require_host()
        spare = 0 if which == "first" else {"posix": 0, "odirect": 1}[backend.name]
        path = tmp_path / "f.bin"
        fill(path, BLOCK, seed=12)
        before = open_fds()
        with pytest.raises(StorageIOError) as info, descriptors_left(spare):
            gds.open(path, os.O_RDWR, backend=backend.name)
        assert open_fds() == before
        assert info.value.errno == errno.EMFILE and str(path) in str(info.value)


# ---------------------------------------------------------------------------------------------
# backend selection and the O_DIRECT fallbacks


def test_backend_status_lists_every_backend_in_auto_order() -> None:
    statuses = gds.backend_status()
    assert tuple(s.name for s in statuses) == gds.BACKENDS == ("torch", "kvikio", "odirect",
                                                             "posix")
    assert status_of("posix").available
    for s in statuses:
        assert s.reason, s


def test_auto_picks_the_first_backend_that_runs(tmp_path: Path) -> None:
    fill(tmp_path / "f.bin", BLOCK, seed=13)
    with gds.open(tmp_path / "f.bin") as h:
        assert h.reason.startswith("auto: ")
        skipped = [s for s in gds.backend_status() if not s.available]
        for s in skipped:
            assert f"{s.name}: {s.reason}" in h.reason
        if not status_of("torch").available and not status_of("kvikio").available:
            assert h.backend == "odirect"
        assert h.backend in gds.BACKENDS


def test_unknown_backend_name_raises(tmp_path: Path) -> None:
    fill(tmp_path / "f.bin", 10, seed=14)
    for name in ("cufile", "", "ODIRECT", None):
        with pytest.raises(InvalidArgumentError, match="backend"):
            gds.open(tmp_path / "f.bin", backend=name)


@pytest.mark.parametrize("name", GPU_BACKENDS)
def test_unavailable_gpu_backend_says_why(name: str, tmp_path: Path) -> None:
    status = status_of(name)
    if status.available:
        pytest.skip(f"backend {name!r} runs here")
    from ckptlab.errors import BackendUnavailableError

    fill(tmp_path / "f.bin", 10, seed=15)
    with pytest.raises(BackendUnavailableError, match=re.escape(status.reason.split(" (")[0])):
        gds.open(tmp_path / "f.bin", backend=name)


class TestODirectFallback:
    """EINVAL from O_DIRECT turns an ``odirect`` handle into a POSIX one that says why."""

    WRITES: tuple[tuple[int, int], ...] = ((0, 3 * BLOCK), (100, 2 * BLOCK + 5),
                                           (5 * BLOCK, BLOCK), (7 * BLOCK + 1, 10))

    def run_writes(self, path: Path, *, zero_copy: bool = True) -> tuple[gds.GdsHandle, bytes,
                                                                          int]:
        """Writes WRITES with an odirect handle (from sources it can write in place, or ones
        it must copy to its bounce buffers) and with pwrite; returns the (open) handle, the
        reference bytes and the payload size."""
        fill(path, 6 * BLOCK, seed=20)
        ref = path.with_suffix(".ref")
        shutil.copyfile(path, ref)
        writes = [(o, random.Random(o).randbytes(n)) for o, n in self.WRITES]
        h = gds.open(path, os.O_RDWR, backend="odirect")
        for offset, payload in writes:
            shift = offset % BLOCK if zero_copy else (offset + 512) % BLOCK
            h.save_storage(host_storage(payload, shift), offset)
        return h, pwrite_reference(ref, writes), sum(n for _, n in self.WRITES)

    def test_filesystem_that_refuses_o_direct(self, ramfs: Path) -> None:
        path = ramfs / "f.bin"
        before = open_fds()
        h, want, total = self.run_writes(path)
        with h:
            assert (h.backend, h.io_path) == ("odirect", "POSIX")
            assert "refused O_DIRECT at open" in h.reason and "POSIX" in h.reason
            assert (h.direct_nbytes, h.buffered_nbytes) == (0, total)
            data = path.read_bytes()
            assert h.read_bytes(BLOCK - 3, 2 * BLOCK) == data[BLOCK - 3:3 * BLOCK - 3]
        assert_same_bytes(data, want)
        assert open_fds() == before

    def test_auto_on_a_filesystem_that_refuses_o_direct(self, ramfs: Path) -> None:
        if status_of("torch").available or status_of("kvikio").available:
            pytest.skip("auto picks a GPU backend here")
        fill(ramfs / "f.bin", BLOCK, seed=21)
        with gds.open(ramfs / "f.bin") as h:
            assert (h.backend, h.io_path) == ("odirect", "POSIX")
            assert h.reason.startswith("auto: ") and "refused O_DIRECT at open" in h.reason

    @pytest.mark.parametrize("zero_copy", [True, False], ids=["in-place", "bounce"])
    @pytest.mark.parametrize("chunk", [None, BLOCK], ids=["chunk-default", "chunk-4k"])
    def test_einval_at_the_first_write(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       zero_copy: bool, chunk: int | None) -> None:
        require_o_direct(tmp_path)
        if chunk:
            monkeypatch.setattr(_backends, "CHUNK", chunk)
        failures = fail_on_direct(monkeypatch, "pwrite", errno.EINVAL)
        h, want, total = self.run_writes(tmp_path / "f.bin", zero_copy=zero_copy)
        with h:
            assert (h.backend, h.io_path) == ("odirect", "POSIX")
            assert "refused an O_DIRECT write" in h.reason
            assert (h.direct_nbytes, h.buffered_nbytes) == (0, total)
        # no O_DIRECT write is tried after the fallback (the bounce pipeline may have had
        # every buffer of its ring in flight when the first one failed)
        assert 1 <= len(failures) <= _backends.DEPTH
        assert_same_bytes((tmp_path / "f.bin").read_bytes(), want)

    def test_fallback_after_einval_leaks_no_descriptor(self, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
        require_o_direct(tmp_path)
        fill(tmp_path / "f.bin", 2 * BLOCK, seed=22)
        before = open_fds()
        fail_on_direct(monkeypatch, "pwrite", errno.EINVAL)
        with gds.open(tmp_path / "f.bin", os.O_RDWR, backend="odirect") as h:
            h.save_storage(host_storage(b"q" * BLOCK, 0), 0)
            assert h.io_path == "POSIX"
        assert open_fds() == before

    @pytest.mark.parametrize(("offset", "nbytes"), [(0, 2 * BLOCK), (10, 3 * BLOCK + 10)])
    @pytest.mark.parametrize("chunk", [None, BLOCK], ids=["chunk-default", "chunk-4k"])
    def test_einval_at_the_first_read(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      offset: int, nbytes: int, chunk: int | None) -> None:
        require_o_direct(tmp_path)
        if chunk:
            monkeypatch.setattr(_backends, "CHUNK", chunk)
        data = fill(tmp_path / "f.bin", 4 * BLOCK, seed=23)
        failures = fail_on_direct(monkeypatch, "preadv", errno.EINVAL)
        with gds.open(tmp_path / "f.bin", os.O_RDONLY, backend="odirect") as h:
            assert h.io_path == "O_DIRECT"
            dest = host_storage(b"\xaa" * nbytes, 0)
            h.load_storage(dest, offset)
            assert storage_bytes(dest) == data[offset:offset + nbytes]
            assert h.io_path == "POSIX" and "refused an O_DIRECT read" in h.reason
            assert h.read_bytes(3, BLOCK) == data[3:BLOCK + 3]
        assert 1 <= len(failures) <= _backends.DEPTH  # the read-ahead may have been in flight

    def test_other_errors_are_reported_not_hidden(self, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        require_o_direct(tmp_path)
        fill(tmp_path / "f.bin", 4 * BLOCK, seed=24)
        fail_on_direct(monkeypatch, "pwrite", errno.EIO)
        with gds.open(tmp_path / "f.bin", os.O_RDWR, backend="odirect") as h:
            with pytest.raises(StorageIOError) as info:
                h.save_storage(host_storage(b"e" * 2 * BLOCK, 0), BLOCK)
            assert h.io_path == "O_DIRECT"  # no silent fallback for a real I/O error
        assert info.value.errno == errno.EIO
        assert str(tmp_path / "f.bin") in str(info.value)
        assert (info.value.offset, info.value.nbytes) == (BLOCK, 2 * BLOCK)


# ---------------------------------------------------------------------------------------------
# regressions: bugs these tests found (all fixed)


def test_closed_handle_still_reports_what_ran(tmp_path: Path) -> None:
    fill(tmp_path / "f.bin", BLOCK, seed=30)
    with gds.open(tmp_path / "f.bin", os.O_RDWR, backend="posix") as h:
        h.write_bytes(b"abc", 0)
    assert "closed" in repr(h) or "posix" in repr(h)
    assert (h.io_path, h.buffered_nbytes, h.direct_nbytes) == ("POSIX", 3, 0)


@pytest.mark.parametrize("name", HOST_BACKENDS)
def test_closed_handle_says_closed_for_every_method(name: str, tmp_path: Path) -> None:
    fill(tmp_path / "f.bin", BLOCK, seed=31)
    h = gds.open(tmp_path / "f.bin", os.O_RDWR, backend=name)
    h.close()
    for call in (lambda: h.write_bytes(b"x", 0), lambda: h.read_bytes(0, 1), h.fsync):
        with pytest.raises(InvalidArgumentError, match="closed"):
            call()


@pytest.mark.parametrize("name", HOST_BACKENDS)
@pytest.mark.parametrize("call", [
    pytest.param(lambda h: h.write_bytes("abc", 0), id="write-str"),
    pytest.param(lambda h: h.write_bytes(b"abc", 1.5), id="write-float-offset"),
    pytest.param(lambda h: h.write_bytes(b"abc", -1), id="write-negative-offset"),
    pytest.param(lambda h: h.read_bytes(1.5, 3), id="read-float-offset"),
    pytest.param(lambda h: h.read_bytes(-1, 3), id="read-negative-offset"),
    pytest.param(lambda h: h.read_bytes(0, -3), id="read-negative-nbytes"),
])
def test_raw_byte_methods_validate_arguments(name: str, call: Callable[[Any], Any],
                                             tmp_path: Path) -> None:
    fill(tmp_path / "f.bin", BLOCK, seed=32)
    with gds.open(tmp_path / "f.bin", os.O_RDWR, backend=name) as h:
        with pytest.raises(InvalidArgumentError):
            call(h)
