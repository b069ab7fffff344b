"""Every private torch (and CPython) symbol ckptlab uses, named in one place.

torch's public API does not expose everything a checkpoint workbench needs: the zip writer and
reader behind ``torch.save``/``torch.load``, the pickling step of ``torch.save`` without its zip
writer, DCP's per-item storage record, the constructors that rebuild quantized and nested
tensors from raw parts. ckptlab uses them, and this module is the only place that imports them,
so that a torch release which moves one breaks here, with a :class:`~ckptlab.errors.
TorchInternalsError` naming the symbol and the installed torch, rather than deep inside a
parser. ``tests/test_torch_compat.py`` resolves every entry of :data:`SYMBOLS` on the installed
torch.

Nothing is imported at module import time (the CLI imports lazily for speed): each accessor
imports on first call and caches the result.

Every entry says which torch versions it was checked on: the installed 2.13.0 (resolved by
the test), and 2.7.0 (the oldest ``pyproject.toml`` claims), read in the 2.7.0 wheel's Python
sources and ``.pyi`` stubs (same names and the signatures ckptlab calls). PyPI's 2.7.0 wheel
needs its CUDA packages to import, so 2.7.0 is checked by reading, not by running.

Pickle *global names* a checkpoint file mentions (``torch._utils._rebuild_tensor_v2`` and the
like, in :mod:`ckptlab.format._torch_handlers`) are not listed here: ckptlab never imports them, it
only compares the strings a file holds.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

from ckptlab.errors import TorchInternalsError

__all__ = [
    "CHECKED_ON",
    "SYMBOLS",
    "PrivateSymbol",
    "async_stager_sync_attribute",
    "checkpoint_offset",
    "chunk_sharding_spec",
    "dtype_to_storage_type_map",
    "empty_affine_quantized",
    "empty_per_channel_affine_quantized",
    "fake_tensor_mode",
    "flatten_state_dict",
    "gds_file_release_fd",
    "gds_register_handle",
    "load_from_bytes",
    "local_shape_and_global_offset",
    "memory_format_encoding",
    "metadata_file_name",
    "nested_tensor_class",
    "nested_view_from_buffer",
    "pytorch_file_reader",
    "pytorch_file_writer",
    "resolve",
    "shard_tensor",
    "sharded_zeros",
    "skip_data_inflates_storages",
    "storage_identity",
    "storage_info_class",
    "torch_save_pickle",
    "untyped_storage",
    "weights_only_rules",
]

#: The torch versions every symbol below was checked on (see each entry for more).
CHECKED_ON: tuple[str, ...] = ("2.7.0", "2.13.0")


@dataclass(frozen=True, slots=True)
class PrivateSymbol:
    """One private symbol ckptlab relies on.

    Parameters
    ----------
    name
        Dotted path: module, then attribute(s) (``torch.serialization._save``).
    module
        The importable module that holds it (``torch.serialization``).
    use
        What ckptlab does with it and where.
    checked_on
        torch versions on which it was checked to exist with the signature ckptlab uses.
    """

    name: str
    module: str
    use: str
    checked_on: tuple[str, ...] = CHECKED_ON

    @property
    def attributes(self) -> tuple[str, ...]:
        """The attribute path below :attr:`module`."""
        rest = self.name[len(self.module):].lstrip(".")
        return tuple(rest.split(".")) if rest else ()


def _entry(name: str, module: str, use: str) -> tuple[str, PrivateSymbol]:
    return name, PrivateSymbol(name, module, use)


#: name -> the symbol; every private torch/CPython name ckptlab (and its tests) touch.
SYMBOLS: dict[str, PrivateSymbol] = dict([
    _entry("torch.serialization._save", "torch.serialization",
           "torch.save's pickling step without its zip writer: format/predict.py (layout "
           "prediction against a recorder), write/_blob.py (blob templates); signature "
           "(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)"),
    _entry("torch._C.PyTorchFileWriter", "torch._C",
           "torch's zip writer: write/_blob.py (PyTorchFileWriter(sink, compute_crc32, "
           "storage_alignment)), tests writing hand-made archives"),
    _entry("torch._subclasses.fake_tensor.FakeTensorMode", "torch._subclasses.fake_tensor",
           "a torch.load that reads no storage bytes and records each storage's file offset "
           "(_checkpoint_offset) on every torch from 2.7: tests check ckptlab's offsets "
           "against it (a map_location='meta' load records them only from later versions)"),
    _entry("torch._weights_only_unpickler._get_allowed_globals", "torch._weights_only_unpickler",
           "torch.load(weights_only=True)'s default allow-list (name -> object): "
           "safety/_weights_only.py decides what torch's safe loader accepts from it"),
    _entry("torch._weights_only_unpickler._get_user_allowed_globals",
           "torch._weights_only_unpickler",
           "the globals added by torch.serialization.add_safe_globals, by the name torch "
           "matches: safety/_weights_only.py"),
    _entry("torch._weights_only_unpickler._blocklisted_modules", "torch._weights_only_unpickler",
           "the modules torch's safe loader refuses outright: safety/_weights_only.py"),
    _entry("torch._weights_only_unpickler.Unpickler", "torch._weights_only_unpickler",
           "torch's safe loader: its module imports from pickle exactly the opcodes it "
           "implements, which safety/_weights_only.py reads"),
    _entry("torch._utils.NAME_MAPPING", "torch._utils",
           "torch's Python 2 name mapping for GLOBAL (safety/_weights_only.py)"),
    _entry("torch._utils.IMPORT_MAPPING", "torch._utils",
           "torch's Python 2 module mapping for GLOBAL (safety/_weights_only.py)"),
    _entry("torch.storage._load_from_bytes", "torch.storage",
           "torch.load of bytes a pickle carries (pickle.dumps of a tensor): the payload "
           "carrier of testing/payloads.py"),
    _entry("torch._C.PyTorchFileReader", "torch._C",
           "torch's zip reader (get_record_offset): tests and benchmarks/open.py check "
           "ckptlab's offsets against it"),
    _entry("torch.distributed.checkpoint._nested_dict.flatten_state_dict",
           "torch.distributed.checkpoint._nested_dict",
           "DCP's state-dict flattening (names 'optim.state.0.exp_avg'): plan/items.py"),
    _entry("torch.distributed.checkpoint.filesystem._StorageInfo",
           "torch.distributed.checkpoint.filesystem",
           "DCP's per-item storage record (relative_path, offset, length, "
           "transform_descriptors): dcp/_decode.py, write/writer.py"),
    _entry("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
           "torch.distributed.checkpoint.metadata",
           "the enum a DCP .metadata pickles TensorProperties.memory_format as: "
           "dcp/_decode.py rebuilds it from the checked value"),
    _entry("torch.distributed.checkpoint.filesystem._metadata_fn",
           "torch.distributed.checkpoint.filesystem",
           "the name of DCP's metadata file ('.metadata'): plan/_synthetic_dcp.py"),
    _entry("torch.distributed.checkpoint.staging.AsyncStager._synchronize_after_execute",
           "torch.distributed.checkpoint.staging",
           "the AsyncStager attribute DCP reads to decide whether to call "
           "synchronize_staging(): write/writer.py sets it False on AsyncWriter"),
    _entry("torch._neg_view", "torch",
           "a tensor's negative-bit view, as torch.load gives one saved with the bit set "
           "(_rebuild_tensor_v2's metadata {'neg': True}): checkpoint/_tensors.py"),
    _entry("torch._empty_affine_quantized", "torch",
           "an empty per-tensor quantized tensor to set_() raw bytes into: "
           "checkpoint/_tensors.py"),
    _entry("torch._empty_per_channel_affine_quantized", "torch",
           "an empty per-channel quantized tensor: checkpoint/_tensors.py"),
    _entry("torch._nested_view_from_buffer", "torch",
           "a strided nested tensor from its buffer and size/stride/offset tensors: "
           "checkpoint/_tensors.py"),
    _entry("torch.nested._internal.nested_tensor.NestedTensor",
           "torch.nested._internal.nested_tensor",
           "the jagged nested tensor class, built from values/offsets/lengths: "
           "checkpoint/_tensors.py"),
    _entry("torch.storage._dtype_to_storage_type_map", "torch.storage",
           "the dtypes that have a legacy typed storage class (torch.FloatStorage, ...): "
           "testing/strategies.py draws dtypes pickled through one"),
    _entry("torch._C._gds_register_handle", "torch._C",
           "cuFile binding: a builtin on CUDA builds, a Python stub that raises on CPU builds "
           "(gds/_backends.py tells the two apart)"),
    _entry("torch.storage.TypedStorage._untyped_storage", "torch.storage",
           "a TypedStorage's untyped storage without .untyped()'s deprecation warning "
           "(instance attribute; checked on an instance): gds/"),
    _entry("torch.UntypedStorage._cdata", "torch",
           "a storage's identity (its C pointer) for dedup by storage: gds/"),
    _entry("torch.UntypedStorage._checkpoint_offset", "torch",
           "the file offset torch.load records on a storage it did not read: tests and "
           "benchmarks compare ckptlab's offsets with it. Set by torch.load(map_location="
           "'meta') on 2.13.0; on 2.7.0 only under FakeTensorMode (instance attribute)"),
    _entry("torch.distributed._shard.api._shard_tensor", "torch.distributed._shard.api",
           "a ShardedTensor from a full tensor and a sharding spec: testing/dcp_workers.py "
           "and testing/plan_workers.py save ShardedTensors as DCP's legacy sharding"),
    _entry("torch.distributed._shard.sharded_tensor.zeros",
           "torch.distributed._shard.sharded_tensor",
           "an all-zero ShardedTensor to dcp.load into: testing/dcp_workers.py"),
    _entry("torch.distributed._shard.sharding_spec.ChunkShardingSpec",
           "torch.distributed._shard.sharding_spec",
           "the ShardedTensor chunking spec (dim, placements): testing/dcp_workers.py, "
           "testing/plan_workers.py"),
    _entry("torch.distributed.tensor._utils.compute_local_shape_and_global_offset",
           "torch.distributed.tensor._utils",
           "a DTensor rank's local shape and global offset as torch computes them: "
           "testing/dcp_workers.py checks the saved chunks against it"),
    _entry("torch.cuda.gds.GdsFile.fd", "torch.cuda.gds",
           "GdsFile's file descriptor (instance attribute): gds/_backends.py closes it itself "
           "and swaps in /dev/null because GdsFile.__del__ closes it again"),
])


def _torch_version() -> str:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "not installed"
    return str(torch.__version__)


def _missing(symbol: PrivateSymbol, why: str) -> TorchInternalsError:
    version = _torch_version()
    return TorchInternalsError(
        f"torch {version} has no {symbol.name} ({why}); ckptlab uses it for {symbol.use}; it "
        f"was checked on torch {', '.join(symbol.checked_on)} (expected {symbol.name}, got "
        f"{why}): install a torch of those versions or report the move",
        symbol=symbol.name, torch_version=version, checked_on=symbol.checked_on)


# attributes that exist only on instances: resolved on a small instance by the test
_INSTANCE_ATTRIBUTES = frozenset({
    "torch.storage.TypedStorage._untyped_storage", "torch.UntypedStorage._cdata",
    "torch.UntypedStorage._checkpoint_offset", "torch.cuda.gds.GdsFile.fd"})


@functools.cache
def resolve(name: str) -> Any:
    """The object a :data:`SYMBOLS` entry names, imported now (cached).

    Parameters
    ----------
    name
        A key of :data:`SYMBOLS`.

    Returns
    -------
    Any
        The module attribute (function, class, ...).

    Raises
    ------
    TorchInternalsError
        When the module or an attribute is missing from the installed torch.
    KeyError
        When ``name`` is not listed in :data:`SYMBOLS` (a programming error).
    """
    symbol = SYMBOLS[name]
    if name in _INSTANCE_ATTRIBUTES:
        raise TorchInternalsError(
            f"{name} is an instance attribute; use its accessor", symbol=name,
            torch_version=_torch_version(), checked_on=symbol.checked_on)
    try:
        value: Any = importlib.import_module(symbol.module)
    except ImportError as exc:
        raise _missing(symbol, f"module {symbol.module} does not import: {exc}") from None
    done = symbol.module
    for attribute in symbol.attributes:
        if not hasattr(value, attribute):
            raise _missing(symbol, f"{done} has no attribute {attribute!r}")
        value = getattr(value, attribute)
        done = f"{done}.{attribute}"
    return value


# -- accessors: one per symbol, named for what it is ------------------------------------------
def torch_save_pickle() -> Any:
    """``torch.serialization._save``: torch.save's pickling step, writing into any object with
    ``write_record`` / ``write_record_metadata``."""
    return resolve("torch.serialization._save")


def pytorch_file_writer() -> Any:
    """``torch._C.PyTorchFileWriter``: the zip writer behind ``torch.save``."""
    return resolve("torch._C.PyTorchFileWriter")


def weights_only_rules() -> tuple[Any, Any, Any, Any, Any, Any]:
    """What torch's safe loader decides by: ``(_get_allowed_globals, _get_user_allowed_globals,
    _blocklisted_modules, Unpickler, NAME_MAPPING, IMPORT_MAPPING)``, each resolved (see
    :data:`SYMBOLS`)."""
    return tuple(resolve(name) for name in (  # type: ignore[return-value]
        "torch._weights_only_unpickler._get_allowed_globals",
        "torch._weights_only_unpickler._get_user_allowed_globals",
        "torch._weights_only_unpickler._blocklisted_modules",
        "torch._weights_only_unpickler.Unpickler", "torch._utils.NAME_MAPPING",
        "torch._utils.IMPORT_MAPPING"))


def load_from_bytes() -> Any:
    """``torch.storage._load_from_bytes``: ``torch.load(io.BytesIO(b), weights_only=False)``,
    what ``pickle.dumps`` of a tensor calls when loaded."""
    return resolve("torch.storage._load_from_bytes")


def fake_tensor_mode() -> Any:
    """``torch._subclasses.fake_tensor.FakeTensorMode``: under it ``torch.load`` reads no
    storage bytes and records each storage's file offset (see :func:`checkpoint_offset`)."""
    return resolve("torch._subclasses.fake_tensor.FakeTensorMode")


def pytorch_file_reader() -> Any:
    """``torch._C.PyTorchFileReader``: the zip reader behind ``torch.load``."""
    return resolve("torch._C.PyTorchFileReader")


def flatten_state_dict() -> Any:
    """``torch.distributed.checkpoint._nested_dict.flatten_state_dict``: DCP's flattening."""
    return resolve("torch.distributed.checkpoint._nested_dict.flatten_state_dict")


def storage_info_class() -> Any:
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: DCP's per-item record."""
    return resolve("torch.distributed.checkpoint.filesystem._StorageInfo")


def shard_tensor() -> Any:
    """``torch.distributed._shard.api._shard_tensor(tensor, spec)``: a ShardedTensor."""
    return resolve("torch.distributed._shard.api._shard_tensor")


def sharded_zeros() -> Any:
    """``torch.distributed._shard.sharded_tensor.zeros(spec, *shape)``."""
    return resolve("torch.distributed._shard.sharded_tensor.zeros")


def chunk_sharding_spec() -> Any:
    """``torch.distributed._shard.sharding_spec.ChunkShardingSpec``."""
    return resolve("torch.distributed._shard.sharding_spec.ChunkShardingSpec")


def local_shape_and_global_offset() -> Any:
    """``torch.distributed.tensor._utils.compute_local_shape_and_global_offset(shape, mesh,
    placements)``."""
    return resolve("torch.distributed.tensor._utils.compute_local_shape_and_global_offset")


def memory_format_encoding() -> Any:
    """``torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING`` (an Enum)."""
    return resolve("torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING")


def metadata_file_name() -> str:
    """``torch.distributed.checkpoint.filesystem._metadata_fn``: DCP's ``.metadata`` name."""
    return str(resolve("torch.distributed.checkpoint.filesystem._metadata_fn"))


def async_stager_sync_attribute() -> str:
    """The name of the ``AsyncStager`` attribute DCP reads before ``synchronize_staging()``.

    A stager whose ``stage()`` is synchronous sets it to ``False`` (as a class attribute).
    """
    name = "torch.distributed.checkpoint.staging.AsyncStager._synchronize_after_execute"
    resolve(name)
    return name.rsplit(".", 1)[1]


def neg_view() -> Any:
    """``torch._neg_view``."""
    return resolve("torch._neg_view")


def empty_affine_quantized() -> Any:
    """``torch._empty_affine_quantized``."""
    return resolve("torch._empty_affine_quantized")


def empty_per_channel_affine_quantized() -> Any:
    """``torch._empty_per_channel_affine_quantized``."""
    return resolve("torch._empty_per_channel_affine_quantized")


def nested_view_from_buffer() -> Any:
    """``torch._nested_view_from_buffer``."""
    return resolve("torch._nested_view_from_buffer")


def nested_tensor_class() -> Any:
    """``torch.nested._internal.nested_tensor.NestedTensor`` (jagged layout)."""
    return resolve("torch.nested._internal.nested_tensor.NestedTensor")


def dtype_to_storage_type_map() -> dict[Any, str]:
    """``torch.storage._dtype_to_storage_type_map()``: dtype -> legacy storage class name."""
    return dict(resolve("torch.storage._dtype_to_storage_type_map")())


def gds_register_handle() -> Any:
    """``torch._C._gds_register_handle``, or None when this torch has no such name.

    On CPU builds it exists as a Python stub that raises; on CUDA builds with cuFile it is a
    builtin. Callers tell the two apart by its type.
    """
    try:
        return resolve("torch._C._gds_register_handle")
    except TorchInternalsError:
        return None


def untyped_storage(storage: Any) -> Any:
    """The untyped storage under ``storage`` (a TypedStorage or already an UntypedStorage),
    without ``TypedStorage.untyped()``'s deprecation warning."""
    import torch

    if not isinstance(storage, torch.storage.TypedStorage):
        return storage
    try:
        return storage._untyped_storage
    except AttributeError:
        raise _missing(SYMBOLS["torch.storage.TypedStorage._untyped_storage"],
                       "TypedStorage instances have no _untyped_storage") from None


def storage_identity(storage: Any) -> int:
    """A key equal for two Python objects over the same storage (``._cdata``)."""
    try:
        return int(storage._cdata)
    except AttributeError:
        raise _missing(SYMBOLS["torch.UntypedStorage._cdata"],
                       f"{type(storage).__name__} has no _cdata") from None


def checkpoint_offset(storage: Any) -> int | None:
    """The file offset ``torch.load`` recorded on a storage it did not read (``map_location=
    "meta"`` or under FakeTensorMode), or None where torch recorded none."""
    return getattr(untyped_storage(storage), "_checkpoint_offset", None)


def gds_file_release_fd(file: Any, placeholder_fd: int) -> int:
    """Take ``GdsFile.fd`` from ``file`` (to close it now) and leave ``placeholder_fd`` there,
    which ``GdsFile.__del__`` closes later. Returns the descriptor taken."""
    try:
        fd = int(file.fd)
        file.fd = placeholder_fd
    except AttributeError:
        raise _missing(SYMBOLS["torch.cuda.gds.GdsFile.fd"],
                       f"{type(file).__name__} has no fd attribute") from None
    return fd


@functools.cache
def skip_data_inflates_storages() -> bool:
    """Whether ``torch.load`` under ``torch.serialization.skip_data()`` sizes each storage at
    its byte count times its element size (torch 2.7: ``persistent_load`` passes bytes to
    ``load_tensor``, which multiplies by the element size again; 2.13 does not).

    Found by a probe (one float32 storage of 2 elements, saved and loaded in memory), not by
    version, so a torch that fixes or changes it is read as it behaves.
    """
    import io

    import torch

    buf = io.BytesIO()
    torch.save(torch.zeros(2, dtype=torch.float32), buf)
    buf.seek(0)
    with torch.serialization.skip_data():
        probe = torch.load(buf, weights_only=True)
    return probe.untyped_storage().nbytes() != 8
