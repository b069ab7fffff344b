"""Format detection and ``inspect``'s contract over sources (ckptlab/format/inspect.py).

Files that are not torch.save zip archives (legacy pickle, legacy tar, TorchScript, plain
pickle, random bytes, empty file, directory, zip without data.pkl) raise
UnsupportedFormatError (TruncatedArchiveError when empty) saying what the file is. A file
object is read from its position and handed back there.
"""

from __future__ import annotations

import io
import pickle
import random
import tarfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptlab
from ckptlab.errors import (
    ArchiveError,
    CorruptArchiveError,
    TruncatedArchiveError,
    UnsupportedFormatError,
)
from ckptlab.format import detect_format
from ckptlab.testing.archives import mixed_state_dict, save_bytes


def call_all(source: Any) -> list[Callable[[], Any]]:
    return [lambda: ckptlab.inspect(source), lambda: ckptlab.storage_offsets(source),
            lambda: ckptlab.storage_offsets(source, scan=True)]


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
    torch.save(mixed_state_dict(), path)
    layout = ckptlab.inspect(path)
    assert layout.format == "torch-zip" and layout.archive_name == "my.model.v2"
    assert ckptlab.storage_offsets(path).archive_name == "my.model.v2"




def test_file_object_positions_count_and_are_restored(tmp_path: Path) -> None:
    """A file object is read from where it stands, as torch.load reads it, and is handed
    back at that position."""
    path = tmp_path / "c.pt"
    torch.save(mixed_state_dict(), path)
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
        ckptlab.inspect(save_bytes(mixed_state_dict()))
        ckptlab.inspect(pytest.importorskip("safetensors.torch").save({"a": torch.ones(1)}))

