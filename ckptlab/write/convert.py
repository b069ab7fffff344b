"""``ckptlab.convert``: any checkpoint ckptlab opens, rewritten as safetensors or torch.save,
without running its pickle.

The new file is made from the checkpoint model (:func:`ckptlab.open`): tensors come from
``ck.read`` (their bytes only; no pickle of the source runs), and the non-tensor values from
what ckptlab's inert interpreter built, carried only where they are plain data (numbers,
strings, bytes, None and containers of them); every other value is *dropped*, and listed.

- **safetensors**: one file, or with ``shard_size`` a Hugging Face sharded directory
  (``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``, as
  ``save_pretrained`` writes it). The header is written first (it is known from the model),
  then each tensor's bytes, one tensor at a time. A tensor that is another's exact alias (the
  same storage, offset, shape and strides: tied weights) is written once, as transformers'
  ``save_pretrained`` does, and listed in ``aliases``; a view that only overlaps another is
  written as a copy of its own (safetensors has no shared storage). Plain values go into
  ``__metadata__``, each as JSON under its name.
- **torch**: a torch.save archive at any storage alignment, written by torch's own writer
  (``torch.serialization.skip_data`` with fake tensors: the layout, the pickle of the model's
  structure, no tensor bytes), then each storage's bytes put at its offset (read from the
  source one storage at a time). Tensors of one source storage stay views of one storage.
  ``torch.load(weights_only=True)`` loads it: the new pickle holds tensors and plain data.

Sparse (COO, CSR...), quantized and nested tensors are rebuilt from their parts' bytes
(``ck.read``: torch's constructors, no pickle of the source) and held in memory while they are
written. A torch target keeps them as they are (each part's bytes as the source's). A
safetensors file has one dense array per name, so a sparse tensor is written dense and a
quantized one dequantized (float32, as ``torch.dequantize`` gives it), each said in ``notes``;
a nested tensor has no one shape and is dropped there (``--to torch`` keeps it).

Every write goes to a temporary name beside ``dst`` and is renamed over it when complete
(kill -9 at any moment leaves the old ``dst`` or none, never a torn one), then verified: the
new checkpoint is opened again and every tensor's bytes compared with the source's.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptlab.errors import CkptlabError, InvalidArgumentError

__all__ = ["ConvertResult", "convert"]

TARGETS = ("safetensors", "torch")
_ST_TAG = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16",
           "int32": "I32", "uint32": "U32", "int64": "I64", "uint64": "U64",
           "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
           "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
           "float8_e8m0fnu": "F8_E8M0", "float8_e4m3fnuz": "F8_E4M3FNUZ",
           "float8_e5m2fnuz": "F8_E5M2FNUZ"}
_COPY_CHUNK = 64 << 20


@dataclass
class ConvertResult:
    """What :func:`convert` wrote."""

    src: str
    dst: str
    to: str
    files: list[str]  # the files written (relative to dst for a directory)
    tensors: list[str]  # the tensors written, by name
    aliases: dict[str, str] = field(default_factory=dict)  # tensor not written -> the one
    #                                                        it is an alias of
    values: list[str] = field(default_factory=list)  # plain values carried
    dropped: dict[str, str] = field(default_factory=dict)  # name -> why it was not written
    notes: list[str] = field(default_factory=list)
    nbytes: int = 0  # bytes written
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "to": self.to, "files": self.files,
                "tensors": len(self.tensors), "aliases": self.aliases, "values": self.values,
                "dropped": self.dropped, "notes": self.notes, "nbytes": self.nbytes,
                "verified": self.verified}

    def summary(self) -> str:
        lines = [f"{self.src} -> {self.dst} ({self.to}): {len(self.tensors):,} tensor"
                 f"{'s' * (len(self.tensors) != 1)}, {len(self.values):,} value"
                 f"{'s' * (len(self.values) != 1)}, {self.nbytes:,} bytes in "
                 f"{len(self.files)} file{'s' * (len(self.files) != 1)}; "
                 + ("verified: every tensor's bytes equal the source's" if self.verified
                    else "not verified")]
        lines += [f"  alias: {a} is {b} (written once)" for a, b in self.aliases.items()]
        lines += [f"  dropped: {n}: {why}" for n, why in self.dropped.items()]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- plain values -------------------------------------------------------------------------
class _Dropped(Exception):
    pass


def _carry(value: Any, depth: int = 0) -> Any:
    """``value`` as plain Python data, or _Dropped (what the file built from a class)."""
    from ckptlab.format._unpickle import OpaqueKey

    kind = type(value)
    if value is None or kind in (bool, int, float, str, bytes, complex):
        return value
    if kind is bytearray:
        return bytes(value)
    if isinstance(value, OpaqueKey):
        return _carry(value.value, depth)
    if depth > 64:
        raise _Dropped("nested too deeply")
    if kind is dict:
        return {_carry(k, depth + 1): _carry(v, depth + 1) for k, v in value.items()}
    if kind in (list, tuple, set, frozenset):
        items = [_carry(v, depth + 1) for v in value]
        return items if kind is list else tuple(items) if kind is tuple else kind(items)
    name = getattr(getattr(value, "func", None), "qualname", None) or type(value).__name__
    raise _Dropped(f"built from {name}, not plain data: not carried")


def _json_ready(value: Any) -> Any:
    if isinstance(value, bytes):
        raise _Dropped("bytes: JSON (safetensors __metadata__) has none")
    if isinstance(value, complex):
        return {"real": value.real, "imag": value.imag}
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and value != value:
        return "NaN"
    return value


# -- the plan -------------------------------------------------------------------------------
@dataclass
class _Group:
    """Tensors written over one storage: ``names`` (the first is read for safetensors), and
    where the source storage is (for torch, when it is one range of a local file)."""

    names: list[str]
    storage: tuple[str, int, int] | None = None  # (file path, start, nbytes)


# how a safetensors file holds a tensor it has no dtype or layout for (by TensorEntry.kind)
_AS_DENSE = {"sparse": "written dense", "quantized": "dequantized to float32"}


def _kept(ck: Any, name: str, to: str, result: ConvertResult) -> bool:
    """Whether tensor ``name`` can go to target ``to`` (dropped, with the reason, if not)."""
    entry = ck.tensors[name]
    if entry.kind == "dense" and entry.shape is not None:
        return True
    if entry.kind in ("sparse", "quantized", "nested") and (
            to == "torch" or entry.kind in _AS_DENSE):
        return True
    result.dropped[name] = (
        "a nested tensor: safetensors holds one shape per name (--to torch keeps it; ck.read "
        "reads it)" if entry.kind == "nested" else
        f"a {entry.kind} tensor: convert writes torch's own tensors only (ck.read reads it)")
    return False


def _dense_nbytes(ck: Any, name: str) -> int:
    """Bytes tensor ``name`` takes in a safetensors file (as :func:`_value` gives it)."""
    from ckptlab.format._dtypes import DTYPE_ITEMSIZE

    entry = ck.tensors[name]
    if entry.kind == "dense":
        return entry.nbytes
    return (entry.numel or 0) * (4 if entry.kind == "quantized" else
                                 DTYPE_ITEMSIZE[entry.dtype])


def _value(ck: Any, name: str) -> Any:
    """Tensor ``name`` as a safetensors file holds it: a sparse one dense, a quantized one
    dequantized, any other as it is."""
    tensor = ck.read(name)
    kind = ck.tensors[name].kind
    if kind == "sparse":
        return tensor.to_dense()
    if kind == "quantized":
        return tensor.dequantize()
    return tensor


def _storage_of(ck: Any, entry: Any) -> tuple[str, str, int, int] | None:
    """``(file, key, start, nbytes)`` of the storage a dense one-part tensor views, where the
    file's layout says (torch formats)."""
    if len(entry.parts) != 1 or not entry.parts[0].storage_key:
        return None
    part = entry.parts[0]
    try:
        f = ck.file(part.file)
    except KeyError:
        return None
    layout = f.layout
    storages = getattr(layout, "storages", None)
    if not storages or getattr(layout, "format", "") not in ("torch-zip", "torch-legacy"):
        return None
    info = next((s for s in storages if s.key == part.storage_key), None)
    if info is None:
        return None
    if not f.full_path or not os.path.isfile(f.full_path):
        return None  # (a URL, bytes: each tensor read on its own, views written as copies)
    return f.full_path, part.storage_key, info.data_offset, info.nbytes


def _plan(ck: Any, to: str, result: ConvertResult
          ) -> tuple[list[_Group], dict[str, Any]]:
    """The tensors in groups over one storage, and the values carried."""
    groups: list[_Group] = []
    by_storage: dict[tuple[str, str], _Group] = {}
    exact: dict[tuple[Any, ...], str] = {}
    for name, entry in ck.tensors.items():
        if not _kept(ck, name, to, result):
            continue
        if entry.kind != "dense":  # rebuilt in memory and written on its own
            groups.append(_Group([name]))
            continue
        part = entry.parts[0] if len(entry.parts) == 1 else None
        if part is not None and part.storage_key:
            key = (part.file, part.storage_key, part.storage_offset, entry.shape, entry.stride,
                   entry.dtype)
            if key in exact:
                result.aliases[name] = exact[key]
                continue
            exact[key] = name
        where = _storage_of(ck, entry)
        if where is not None:
            group = by_storage.get((where[0], where[1]))
            if group is not None:
                group.names.append(name)
                continue
            group = by_storage[(where[0], where[1])] = _Group([name], (where[0], where[2],
                                                                       where[3]))
        else:
            group = _Group([name])
        groups.append(group)
    values: dict[str, Any] = {}
    raw = ck._objects
    for name in raw:
        try:
            values[name] = _carry(raw[name])
        except _Dropped as why:
            result.dropped[name] = str(why)
    return groups, values


# -- writing ---------------------------------------------------------------------------------
def _contiguous_bytes(tensor: Any) -> memoryview:
    """A tensor's elements in C order, as bytes (one copy at most)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _write_all(f: Any, data: memoryview) -> int:
    f.write(data)
    return len(data)


def _safetensors_file(ck: Any, path: str, names: list[str], metadata: dict[str, str] | None,
                      alignment: int) -> int:
    """One safetensors file of ``names``: header, then each tensor read and written in
    turn (a sparse or quantized one, rebuilt in memory before, as :func:`_value` gives it)."""
    from ckptlab.format._dtypes import DTYPE_ITEMSIZE

    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    rebuilt = {n: _value(ck, n) for n in names if ck.tensors[n].kind != "dense"}
    offset = 0
    for name in names:
        entry = ck.tensors[name]
        dtype, shape = ((str(rebuilt[name].dtype).removeprefix("torch."),
                         tuple(rebuilt[name].shape)) if name in rebuilt
                        else (entry.dtype, entry.shape))
        tag = _ST_TAG.get(dtype)
        if tag is None:
            raise InvalidArgumentError(f"{ck.path}: tensor {name!r} is {dtype}, which "
                                       f"safetensors cannot hold; convert --to torch")
        nbytes = DTYPE_ITEMSIZE[dtype]
        for d in shape:
            nbytes *= d
        header[name] = {"dtype": tag, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    # the data section starts at a multiple of `alignment` (the header padded with spaces)
    pad = (-(8 + len(text))) % max(alignment, 8)
    text += b" " * pad
    written = 0
    with open(path, "xb") as f:
        written += _write_all(f, memoryview(len(text).to_bytes(8, "little")))
        written += _write_all(f, memoryview(text))
        for name in names:
            tensor = rebuilt.pop(name) if name in rebuilt else ck.read(name)
            written += _write_all(f, _contiguous_bytes(tensor))
        f.flush()
        os.fsync(f.fileno())
    return written


def _shards(ck: Any, names: list[str], shard_size: int) -> list[list[str]]:
    """``names`` in shards of at most ``shard_size`` bytes, in order (a tensor larger than
    that is a shard of its own), as transformers' sharding does."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = _dense_nbytes(ck, name)
        if shards[-1] and size + nbytes > shard_size:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_safetensors(ck: Any, out: str, groups: list[_Group], values: dict[str, Any],
                       result: ConvertResult, shard_size: int | None, alignment: int) -> None:
    names = []
    for g in groups:
        entry = ck.tensors[g.names[0]]
        if entry.kind in _AS_DENSE:
            what = entry.layout if entry.kind == "sparse" else f"{entry.dtype} quantized"
            result.notes.append(f"{g.names[0]}: a {what} tensor, {_AS_DENSE[entry.kind]} "
                                f"(safetensors holds dense arrays; --to torch keeps it as it "
                                f"is)")
        names.append(g.names[0])
        if len(g.names) > 1:
            result.notes.append(f"{', '.join(g.names)} view one storage: written as "
                                f"{len(g.names)} tensors of their own (safetensors has no "
                                f"shared storage)")
            names.extend(g.names[1:])
    metadata: dict[str, str] = {"format": "pt"}
    for name, value in values.items():
        try:
            metadata[name] = json.dumps(_json_ready(value), ensure_ascii=False)
        except (_Dropped, TypeError, ValueError) as why:
            result.dropped[name] = f"not JSON for __metadata__: {why}"
            continue
        result.values.append(name)
    if shard_size is None:
        result.nbytes = _safetensors_file(ck, out, names, metadata, alignment)
        result.files = [os.path.basename(out)]
        result.tensors = names
        return
    os.mkdir(out)
    shards = _shards(ck, names, shard_size)
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        result.nbytes += _safetensors_file(ck, os.path.join(out, fname), shard,
                                           metadata if i == 1 else {"format": "pt"},
                                           alignment)
        weight_map.update(dict.fromkeys(shard, fname))
        total += sum(_dense_nbytes(ck, n) for n in shard)
        result.files.append(fname)
    index = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                       indent=2).encode()
    with open(os.path.join(out, "model.safetensors.index.json"), "xb") as f:
        f.write(index)
        f.flush()
        os.fsync(f.fileno())
    result.files.append("model.safetensors.index.json")
    result.nbytes += len(index)
    result.tensors = names


def _nested(pairs: Iterator[tuple[tuple[Any, ...], Any]]) -> Any:
    """The object whose paths of keys hold these values (containers rebuilt as dicts)."""
    root: dict[Any, Any] = {}
    for path, value in pairs:
        if not path:
            return value
        node = root
        for key in path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        node[path[-1]] = value
    return root


def _dense_tensors(ck: Any, groups: list[_Group], real: bool) -> dict[str, Any]:
    """The dense tensors of ``groups``, those of one source storage views of one storage, as
    in the source: fake ones (shapes and strides only: call it in a fake tensor mode), or
    ``real`` ones holding the source's bytes."""
    import torch

    from ckptlab.source import ByteSource

    tensors: dict[str, Any] = {}
    for g in groups:
        first = ck.tensors[g.names[0]]
        dtype = getattr(torch, first.dtype)
        if g.storage is None:
            tensors[g.names[0]] = (ck.read(g.names[0]) if real else
                                   torch.empty_strided(first.shape, first.stride or (),
                                                       dtype=dtype))
            continue
        path, start, nbytes = g.storage
        itemsize = torch.empty((), dtype=dtype).element_size()
        if real and nbytes:
            with ByteSource(path) as src:
                data = bytearray(src.read(start, nbytes, what="storage"))
            base = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        else:
            base = torch.empty(nbytes // itemsize, dtype=dtype)
        for name in g.names:
            e = ck.tensors[name]
            view = base.view(getattr(torch, e.dtype)) if e.dtype != first.dtype else base
            tensors[name] = view.as_strided(e.shape, e.stride, e.parts[0].storage_offset)
    return tensors


def _write_torch(ck: Any, out: str, groups: list[_Group], values: dict[str, Any],
                 result: ConvertResult, alignment: int) -> None:
    import torch

    from ckptlab._torch_compat import fake_tensor_mode
    from ckptlab.format.archive import scan_torch_zip
    from ckptlab.source import ByteSource

    # sparse, quantized and nested tensors rebuilt (their bytes too); the dense ones fake,
    # their bytes copied in after torch wrote the archive without them
    rebuilt = {g.names[0]: ck.read(g.names[0]) for g in groups
               if ck.tensors[g.names[0]].kind != "dense"}
    dense = [g for g in groups if g.names[0] not in rebuilt]
    result.notes += [f"{name}: a jagged nested tensor: torch.load(weights_only=True) reads it "
                     f"only once torch.nested and torch._dynamo are imported (torch's rule "
                     f"for the globals its pickle names)"
                     for name in rebuilt if ck.tensors[name].layout == "jagged"]
    result.values = list(values)
    result.tensors = [n for g in groups for n in g.names]
    result.files = [os.path.basename(out)]
    with fake_tensor_mode()():
        fake = _dense_tensors(ck, dense, real=False)
    try:
        paths = _save_torch(ck, {**fake, **rebuilt}, values, result, out, alignment, True)
    except RuntimeError as err:
        # torch lays out some tensors only with their bytes ("Cannot serialize qtensor /
        # nested tensor under skip_data"): then torch.save writes every tensor, all held
        if "skip_data" not in str(err):
            raise
        result.notes.append(f"every tensor held in memory and written by torch.save (torch "
                            f"{torch.__version__} lays some out only with their bytes: "
                            f"{_first_line(err)!r}): peak memory about the checkpoint's size")
        if os.path.lexists(out):
            os.unlink(out)
        real = _dense_tensors(ck, dense, real=True)
        _save_torch(ck, {**real, **rebuilt}, values, result, out, alignment, False)
        result.nbytes = os.path.getsize(out)
        return
    # each storage's bytes at its offset (torch numbered the storages as it met them)
    with ByteSource(out) as src:
        layout = scan_torch_zip(src)
    key_of = {}
    for t in layout.tensors:
        key_of.setdefault(".".join(map(str, t.path)), t.storage_key)
    where = {s.key: s for s in layout.storages}
    fd = os.open(out, os.O_WRONLY)
    try:
        for g in dense:
            info = where[key_of[_name(paths[g.names[0]])]]
            if g.storage is not None:
                _copy_range(g.storage[0], g.storage[1], fd, info.data_offset, g.storage[2])
            else:
                data = _contiguous_bytes(ck.read(g.names[0]))
                os.pwrite(fd, data, info.data_offset)
        if rebuilt:
            _write_rebuilt(rebuilt, out, where, fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    result.nbytes = os.path.getsize(out)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _save_torch(ck: Any, tensors: dict[str, Any], values: dict[str, Any],
                result: ConvertResult, out: str, alignment: int, skip_data: bool
                ) -> dict[str, tuple[Any, ...]]:
    """torch.save of the source's structure (``tensors`` and the plain ``values`` at their
    paths, the aliases sharing their tensor) at ``alignment``, without the storages' bytes
    when ``skip_data``; the tensors' paths."""
    import torch
    import torch.utils.serialization as serialization

    for alias, of in result.aliases.items():
        tensors[alias] = tensors[of]
    paths = {name: ck.tensors[name].path for name in tensors}
    object_paths = ck.object_paths()
    obj = _nested([(paths[n], t) for n, t in tensors.items()]
                  + [(object_paths[n], v) for n, v in values.items()])
    saved = serialization.config.save.storage_alignment
    serialization.config.save.storage_alignment = alignment
    try:
        if skip_data:
            with torch.serialization.skip_data(materialize_fake_tensors=True):
                torch.save(obj, out)
        else:
            torch.save(obj, out)
    finally:
        serialization.config.save.storage_alignment = saved
    return paths


def _write_rebuilt(rebuilt: dict[str, Any], out: str, where: dict[str, Any], fd: int) -> None:
    """The storages of the sparse, quantized and nested tensors torch wrote into ``out``
    without their bytes: saved again, alone and with their bytes, in a side file; then each
    storage copied to where ``out`` has it, matched by tensor name and part role (the parts
    ckptlab's interpreter finds in both)."""
    import torch

    from ckptlab.checkpoint import open_checkpoint
    from ckptlab.format.archive import scan_torch_zip
    from ckptlab.source import ByteSource

    side = out + ".parts"
    torch.save(rebuilt, side)
    with ByteSource(side) as src:
        side_where = {s.key: s for s in scan_torch_zip(src).storages}
    written, alone = open_checkpoint(out), open_checkpoint(side)
    try:
        for name in rebuilt:
            ours = {p.role: p.storage_key for p in alone.tensors[name].parts}
            for part in written.tensors[name].parts:
                have, want = side_where[ours[part.role]], where[part.storage_key]
                if have.nbytes != want.nbytes:
                    raise CkptlabError(f"{out}: tensor {name!r}, part {part.role}: torch "
                                       f"wrote a storage of {want.nbytes:,} bytes, "
                                       f"{have.nbytes:,} expected")
                _copy_range(side, have.data_offset, fd, want.data_offset, have.nbytes)
    finally:
        os.unlink(side)


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def _copy_range(path: str, start: int, fd: int, offset: int, nbytes: int) -> None:
    """Bytes ``[start, start + nbytes)`` of file ``path`` to ``fd`` at ``offset``, a chunk at
    a time."""
    from ckptlab.source import ByteSource

    with ByteSource(path) as src:
        done = 0
        while done < nbytes:
            n = min(_COPY_CHUNK, nbytes - done)
            os.pwrite(fd, src.read(start + done, n, what="storage"), offset + done)
            done += n


# -- verification ---------------------------------------------------------------------------
def _verify(ck: Any, out: str, result: ConvertResult) -> None:
    """Open what was written and compare every tensor's bytes with the source's (a sparse,
    quantized or nested tensor: each part's; one written dense: its dense values')."""
    from ckptlab.checkpoint import open_checkpoint
    from ckptlab.compare._diff import same_bytes

    new = open_checkpoint(out)
    written = set(new.tensors)
    missing = [n for n in result.tensors if n not in written]
    if missing:
        raise CkptlabError(f"{out}: verification failed: {len(missing)} tensors are missing "
                           f"from what was written ({missing[:3]})")
    for name in result.tensors:
        entry = ck.tensors[name]
        if entry.kind == "dense":
            pairs = [(ck.read(name), new.read(name))]
        elif result.to == "safetensors":
            pairs = [(_value(ck, name), new.read(name))]
        else:
            pairs = [(ck.read_part(name, p.role), new.read_part(name, p.role))
                     for p in entry.parts]
            if new.tensors[name].extra != entry.extra:
                pairs = []  # (the scale, zero point, ... differ: not the same tensor)
        if not pairs or not all(same_bytes(a, b) for a, b in pairs):
            raise CkptlabError(f"{out}: verification failed: tensor {name!r} differs from "
                               f"the source's")
    result.verified = True


# -- the API ---------------------------------------------------------------------------------
def convert(src: Any, dst: str | os.PathLike[str], *, to: str = "safetensors",
            shard_size: int | None = None, alignment: int | None = None,
            step: int | None = None, verify: bool = True) -> ConvertResult:
    """Rewrite a checkpoint as safetensors or torch.save, without running its pickle.

    Parameters
    ----------
    src
        Anything :func:`ckptlab.open` opens (a file, a directory, a URL, a training run: its
        resume save, or ``step``), or a ``Checkpoint``.
    dst
        The file to write (a directory for sharded safetensors); an existing one is replaced
        only once the new one is complete.
    to
        ``"safetensors"`` or ``"torch"``.
    shard_size
        safetensors only: shards of at most this many bytes, in a Hugging Face sharded
        directory.
    alignment
        torch: the storage alignment (a power of two, 1 to 32768; default torch's 64; 4096
        makes the file GDS-ready). safetensors: where the data section starts (the header
        padded; tensors follow one another).
    step
        A training run's save to convert.
    verify
        Open the result again and compare every tensor's bytes with the source's.

    Returns
    -------
    ConvertResult
        What was written, what was dropped and why.
    """
    from ckptlab.checkpoint import open_checkpoint
    from ckptlab.cli import MAX_STORAGE_ALIGNMENT

    if to not in TARGETS:
        raise InvalidArgumentError(f"to is one of {', '.join(TARGETS)}, not {to!r}")
    if alignment is not None and (alignment < 1 or alignment & (alignment - 1) or
                                  alignment > MAX_STORAGE_ALIGNMENT):
        raise InvalidArgumentError(f"alignment is a power of two from 1 to "
                                   f"{MAX_STORAGE_ALIGNMENT}, not {alignment}")
    if shard_size is not None and (to != "safetensors" or shard_size < 1):
        raise InvalidArgumentError("shard_size is a positive number of bytes, for "
                                   "safetensors")
    if hasattr(src, "tensors") and hasattr(src, "files"):
        ck = src
    else:
        from ckptlab.checkpoint.runs import resolve_run
        from ckptlab.source import is_url

        path, run = (resolve_run(src, step) if not is_url(src) else (src, None))
        ck = open_checkpoint(path)
        ck.run = run
    dst = os.fspath(dst)
    result = ConvertResult(ck.path, dst, to, [], [])
    groups, values = _plan(ck, to, result)
    parent = os.path.dirname(os.path.abspath(dst)) or "."
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.convert-", dir=parent)
    out = os.path.join(work, os.path.basename(dst))
    try:
        if to == "safetensors":
            _write_safetensors(ck, out, groups, values, result, shard_size, alignment or 8)
        else:
            _write_torch(ck, out, groups, values, result, alignment or 64)
        if verify:
            _verify(ck, out, result)
        _replace(out, dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _replace(new: str, dst: str) -> None:
    """Put ``new`` at ``dst`` by renames (durable): a file over a file at once; a directory
    by moving the old one aside first (between the two renames there is no ``dst``)."""
    from ckptlab._io.durable import fsync_dir

    parent = os.path.dirname(os.path.abspath(dst))
    if os.path.isdir(new) and os.path.lexists(dst):
        aside = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=parent)
        os.rename(dst, os.path.join(aside, "old"))
        os.rename(new, dst)
        fsync_dir(parent)
        shutil.rmtree(aside, ignore_errors=True)
        return
    if os.path.isdir(dst) and not os.path.islink(dst):
        raise InvalidArgumentError(f"{dst}: is a directory; convert writes a file there only "
                                   f"over a file (or give --shard-size for a directory)")
    os.replace(new, dst)
    fsync_dir(parent)
