"""Small torch.save archives and independent ways to look inside them, for tests.

The checks here do not use ckptlab's parser: they read zip headers with :mod:`struct` and
:mod:`zipfile`, so a test can compare ckptlab's answer with an independent one. Importing this
module imports nothing heavy; each function imports torch when it runs.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["local_data_offset", "mixed_state_dict", "rewrite_archive", "save_bytes",
           "storage_bytes"]


def save_bytes(obj: Any, **kwargs: Any) -> bytes:
    """``torch.save(obj)`` into memory; ``kwargs`` go to torch.save (``pickle_protocol``...).

    Returns
    -------
    bytes
        The whole archive.
    """
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    return buf.getvalue()


def mixed_state_dict() -> dict[str, Any]:
    """Six tensors over five storages: two float32 views of one storage (one at an element
    offset), bfloat16, int64, an empty tensor and bool.

    Returns
    -------
    dict
        A fresh state dict (new tensors on every call).
    """
    import torch

    base = torch.arange(40, dtype=torch.float32)
    return {"w": base.view(5, 8), "v": base[8:24].view(4, 4),
            "b": torch.ones(3, dtype=torch.bfloat16), "ids": torch.arange(7),
            "empty": torch.zeros(0), "mask": torch.tensor([True, False])}


def storage_bytes(tensor: Any) -> bytes:
    """Every byte of ``tensor``'s storage (all of it, not just the view's elements)."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).numpy().tobytes()


def local_data_offset(data: bytes, info: zipfile.ZipInfo) -> int:
    """Where a record's data starts, from its local header (independent of ckptlab).

    Parameters
    ----------
    data
        The whole zip file.
    info
        The record, as :mod:`zipfile` lists it.

    Returns
    -------
    int
        Header offset + 30 + name length + extra length, as the local header says.
    """
    if data[info.header_offset:info.header_offset + 4] != b"PK\x03\x04":
        raise ValueError(f"no local header signature at offset {info.header_offset}")
    n_name, n_extra = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + n_name + n_extra


def rewrite_archive(data: bytes, replace: Mapping[str, bytes] | None = None, *,
                    insert_after: Mapping[str, Sequence[tuple[str, bytes]]] | None = None,
                    order: Callable[[list[str]], list[str]] | None = None) -> bytes:
    """The archive re-written by torch's own zip writer (``PyTorchFileWriter``), changed.

    Parameters
    ----------
    data
        A torch.save archive.
    replace
        Short record name (``data/0``, ``data.pkl``, ``.storage_alignment``) -> new payload.
    insert_after
        Short record name -> foreign records ``(short name, payload)`` written right after it.
    order
        Rearranges the list of short names before writing (records out of pickle order).

    Returns
    -------
    bytes
        The new archive; ``version`` and ``.data/serialization_id`` are written by torch's
        ``write_end_of_file`` as always.
    """
    from ckptlab._torch_compat import pytorch_file_writer

    src = zipfile.ZipFile(io.BytesIO(data))
    names = src.namelist()
    prefix = names[0].split("/", 1)[0]
    shorts = [n.split("/", 1)[1] for n in names]
    shorts = [s for s in shorts if s not in ("version", ".data/serialization_id")]
    replace = replace or {}
    insert_after = insert_after or {}
    buf = io.BytesIO()
    writer = pytorch_file_writer()(buf)
    for short in (order(shorts) if order is not None else shorts):
        payload = replace.get(short)
        if payload is None:
            payload = src.read(f"{prefix}/{short}")
        writer.write_record(short, payload, len(payload))
        for name, blob in insert_after.get(short, ()):
            writer.write_record(name, blob, len(blob))
    writer.write_end_of_file()
    del writer
    return buf.getvalue()
