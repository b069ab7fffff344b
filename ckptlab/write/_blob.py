"""The torch.save blob of one tensor chunk, minus its data: built once per (dtype, shape).

A DCP tensor item is ``torch.save(chunk)``. Everything in that archive except the storage's
bytes depends only on the chunk's dtype and shape, so it is produced once by torch's own zip
writer (``torch._C.PyTorchFileWriter``) under ``torch.serialization.skip_data`` against a sink
that keeps the bytes it is given and the hole torch seeks over, and then reused: a save writes
``prefix``, the tensor's bytes, and ``suffix``. With storage alignment 4096 every record's
data starts on a 4096-byte boundary of the blob, so a blob placed at a 4096-aligned file
offset has its tensor bytes 4096-aligned in the file (what O_DIRECT and GDS need).

CRC fields are 0, as ``torch.serialization.set_crc32_options(False)`` writes them; torch.load
does not check them.
"""

from __future__ import annotations

import io
import pickle
import threading
from dataclasses import dataclass
from typing import Any

from ckptlab._io import BLOCK
from ckptlab.errors import CkptlabError

ALIGNMENT = BLOCK  # storage_alignment of every blob, and of every item start in a data file


@dataclass(frozen=True, slots=True)
class BlobTemplate:
    """The bytes of ``torch.save(torch.empty(shape, dtype=dtype))`` around its data."""

    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    prefix: bytes  # blob bytes [0, data_offset): headers, data.pkl, small records, padding
    data_nbytes: int  # the storage's bytes
    suffix: bytes  # blob bytes [data_offset + data_nbytes, nbytes): descriptor, records, trailer

    @property
    def data_offset(self) -> int:
        """Where the tensor's bytes start inside the blob (a multiple of 4096)."""
        return len(self.prefix)

    @property
    def nbytes(self) -> int:
        return len(self.prefix) + self.data_nbytes + len(self.suffix)


class _Sink(io.RawIOBase):
    """A write-only seekable file that keeps written bytes and remembers the holes."""

    def __init__(self) -> None:
        self.pos = 0
        self.end = 0
        self.chunks: list[tuple[int, bytes]] = []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.end}[whence] + pos
        return self.pos

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.chunks.append((self.pos, bytes(view)))
        self.pos += len(view)
        self.end = max(self.end, self.pos)
        return len(view)


class BlobTemplates:
    """A cache of :class:`BlobTemplate` by (dtype, shape), owned by one writer (thread safe)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Any, tuple[int, ...]], BlobTemplate] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, dtype: Any, shape: tuple[int, ...]) -> BlobTemplate:
        key = (dtype, tuple(int(s) for s in shape))
        with self._lock:
            found = self._cache.get(key)
            if found is None:
                found = self._cache[key] = build_template(*key)
            return found


def build_template(dtype: Any, shape: tuple[int, ...]) -> BlobTemplate:
    """Run torch's zip writer once for an empty tensor of this dtype and shape."""
    import torch
    import torch.serialization as ts
    from torch.utils.serialization import config

    from ckptlab._torch_compat import pytorch_file_writer, torch_save_pickle

    # torch.empty does not touch its pages, and skip_data never reads them
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.untyped_storage().nbytes()
    sink = _Sink()
    with config.patch({"save.storage_alignment": ALIGNMENT}):
        writer = pytorch_file_writer()(sink, False, ALIGNMENT)
        with ts.skip_data():
            torch_save_pickle()(tensor, writer, pickle, 2, False)
        writer.write_end_of_file()
    del writer
    # the one hole in the written bytes is the storage's data
    sink.chunks.sort()
    cursor = 0
    holes = []
    for offset, data in sink.chunks:
        if offset > cursor:
            holes.append((cursor, offset))
        cursor = max(cursor, offset + len(data))
    image = bytearray(cursor)
    for offset, data in sink.chunks:
        image[offset:offset + len(data)] = data
    if nbytes == 0:
        data_offset = _empty_data_offset(bytes(image))
        holes = [(data_offset, data_offset)]
    if len(holes) != 1 or holes[0][1] - holes[0][0] != nbytes or holes[0][0] % ALIGNMENT:
        raise CkptlabError(
            f"torch's zip writer left holes {holes} for a {dtype} tensor of shape "
            f"{tuple(shape)} (expected one hole of {nbytes} bytes at a multiple of "
            f"{ALIGNMENT}); this torch version writes archives ckptlab does not predict")
    start, stop = holes[0]
    return BlobTemplate(dtype, tuple(shape), bytes(image[:start]), nbytes, bytes(image[stop:]))


def _empty_data_offset(image: bytes) -> int:
    """Where the (empty) storage record's data starts: after its local header's name and extra."""
    import struct

    name = b"/data/0"
    at = image.find(name)
    header = image.rfind(b"PK\x03\x04", 0, at)
    name_nbytes, extra_nbytes = struct.unpack_from("<HH", image, header + 26)
    return header + 30 + name_nbytes + extra_nbytes
