"""Hypothesis strategies: random objects for ``torch.save`` and random save configurations.

Only tests import this module (it imports torch and hypothesis).

Objects (:func:`state_dicts`) are nested containers (dict, OrderedDict, list, tuple) of small
tensors in every dtype torch.save writes, with 0-byte tensors, views (slices, narrows,
transposes, selections, ``as_strided`` with zero strides) that share a storage at an offset,
the same tensor under several keys, several views of one base, ``torch.nn.Parameter`` with and
without ``requires_grad``, leaf tensors that require grad, and plain values (ints, floats,
strings, bytes, None, bools, frozensets).

Configurations (:func:`save_configs`) cover ``save.storage_alignment`` from 1 to 65504
(powers of two and not), ``save.compute_crc32``, ``skip_data``, pickle protocols 2 to 5,
``_disable_byteorder_record`` and file names whose dots decide the archive name.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

__all__ = [
    "ALIGNMENTS",
    "ALL_DTYPES",
    "FILENAMES",
    "GRAD_DTYPES",
    "REBUILD_V2_DTYPES",
    "REBUILD_V3_DTYPES",
    "SaveConfig",
    "alignments",
    "base_tensors",
    "iter_tensors",
    "make_tensor",
    "overwritten_bytes",
    "plain_values",
    "save_configs",
    "shapes",
    "state_dicts",
    "tensor_leaves",
    "view_of",
]


def _dtypes(*names: str) -> tuple[torch.dtype, ...]:
    return tuple(getattr(torch, n) for n in names if isinstance(getattr(torch, n, None),
                                                                 torch.dtype))


# every dtype torch.save writes that these strategies generate
ALL_DTYPES: tuple[torch.dtype, ...] = _dtypes(
    "float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool",
    "complex64", "complex128", "complex32",
)


def _legacy_storage_dtypes() -> frozenset[torch.dtype]:
    from ckptlab._torch_compat import dtype_to_storage_type_map

    return frozenset(dtype_to_storage_type_map())


# dtypes pickled as ``_rebuild_tensor_v2(torch.XStorage, ...)`` (a legacy typed storage class)
REBUILD_V2_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in ALL_DTYPES if d in _legacy_storage_dtypes())
# dtypes pickled as ``_rebuild_tensor_v3(torch.storage.UntypedStorage, ..., dtype)``
REBUILD_V3_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in ALL_DTYPES if d not in REBUILD_V2_DTYPES)
# dtypes a tensor may require grad in (a subset of floating and complex types)
GRAD_DTYPES: tuple[torch.dtype, ...] = _dtypes(
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128")

MAX_NUMEL = 256  # elements per generated base tensor


# ---------------------------------------------------------------------------------------------
# tensors


def make_tensor(dtype: torch.dtype, shape: Sequence[int], seed: int = 0) -> torch.Tensor:
    """A contiguous tensor of ``shape`` whose bytes are a deterministic function of ``seed``.

    Built from bytes and reinterpreted, so it works for every dtype (float8, complex32,
    uint64, ...); bools get 0/1 bytes only.
    """
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    with warnings.catch_warnings():  # "ComplexHalf support is experimental"
        warnings.simplefilter("ignore", UserWarning)
        itemsize = torch.empty((), dtype=dtype).element_size()
    raw = (torch.arange(numel * itemsize, dtype=torch.int64) * 37 + seed * 101 + 11) % 251
    if dtype is torch.bool:
        raw = raw % 2
    return raw.to(torch.uint8).view(dtype).reshape(shape)


@st.composite
def shapes(draw: st.DrawFn, max_rank: int = 3, max_numel: int = MAX_NUMEL,
           max_side: int = 9) -> tuple[int, ...]:
    """Shapes of rank 0..max_rank with at most ``max_numel`` elements; sides may be 0."""
    rank = draw(st.integers(0, max_rank))
    dims: list[int] = []
    for _ in range(rank):
        room = max(1, max_numel // max(1, math.prod(dims)))
        dims.append(draw(st.integers(0, min(max_side, room))))
    return tuple(dims)


@st.composite
def base_tensors(draw: st.DrawFn,
                 dtypes: Sequence[torch.dtype] = ALL_DTYPES) -> torch.Tensor:
    """A fresh contiguous tensor (which owns its storage)."""
    dtype = draw(st.sampled_from(list(dtypes)))
    shape = draw(shapes())
    return make_tensor(dtype, shape, seed=draw(st.integers(0, 250)))


@st.composite
def view_of(draw: st.DrawFn, base: torch.Tensor, max_ops: int = 2) -> torch.Tensor:
    """A view that shares ``base``'s storage: 1..max_ops of slice / narrow / transpose /
    select / as_strided / empty slice, applied in turn."""
    t = base
    for _ in range(draw(st.integers(1, max_ops))):
        ops = ["as_strided"]
        if t.is_contiguous():  # reshape(-1) is a view only then
            ops += ["flat_slice", "empty_slice"]
        if t.dim() >= 1:
            ops += ["narrow", "step_slice"]
            if t.shape[0] > 0:
                ops.append("select")
        if t.dim() >= 2:
            ops.append("transpose")
        op = draw(st.sampled_from(ops))
        if op == "flat_slice":
            flat = t.reshape(-1)
            n = flat.numel()
            start = draw(st.integers(0, n))
            stop = draw(st.integers(start, n))
            step = draw(st.integers(1, 3))
            t = flat[start:stop:step]
        elif op == "empty_slice":
            flat = t.reshape(-1)
            k = draw(st.integers(0, flat.numel()))
            t = flat[k:k]
        elif op == "narrow":
            d = draw(st.integers(0, t.dim() - 1))
            size = t.shape[d]
            start = draw(st.integers(0, size))
            t = t.narrow(d, start, draw(st.integers(0, size - start)))
        elif op == "step_slice":
            start = draw(st.integers(0, t.shape[0]))
            t = t[start::draw(st.integers(1, 3))]
        elif op == "select":
            t = t[draw(st.integers(0, t.shape[0] - 1))]
        elif op == "transpose":
            i, j = draw(st.permutations(range(t.dim())))[:2]
            t = t.transpose(i, j)
        else:  # as_strided inside the storage, with possibly zero or overlapping strides
            n = t.untyped_storage().nbytes() // t.element_size()
            rank = draw(st.integers(0, 2))
            size = [draw(st.integers(0, 4)) for _ in range(rank)]
            stride = [draw(st.integers(0, 5)) for _ in range(rank)]
            offset = draw(st.integers(0, n))
            if math.prod(size) > 0:
                last = offset + sum((s - 1) * k for s, k in zip(size, stride))
                if last >= n:  # does not fit: an empty view of the storage at that offset
                    size, stride = [0], [1]
            t = t.as_strided(size, stride, offset)
    return t


def _grad_ok(t: torch.Tensor) -> bool:
    return t.dtype in GRAD_DTYPES


@st.composite
def _maybe_wrap(draw: st.DrawFn, t: torch.Tensor, grad: bool = True,
                attributes: bool = False) -> torch.Tensor:
    """``t`` itself or, sharing its storage: a Parameter, a detached leaf that requires grad
    (with ``grad``), or a tensor with a Python attribute, which torch pickles through
    ``torch._tensor._rebuild_from_type_v2`` (with ``attributes``)."""
    kinds = ["plain"]
    if grad:
        kinds.append("param_nograd")
        if _grad_ok(t):
            kinds += ["param_grad", "leaf_grad"]
    if attributes:
        kinds.append("attr")
    kind = draw(st.sampled_from(kinds))
    if kind == "attr":
        tagged = t.detach()
        tagged.note = draw(st.sampled_from([1, "x", None]))
        return tagged
    if kind == "param_nograd":
        return torch.nn.Parameter(t, requires_grad=False)
    if kind == "param_grad":
        return torch.nn.Parameter(t, requires_grad=True)
    if kind == "leaf_grad":
        return t.detach().requires_grad_(True)
    return t


def plain_values() -> st.SearchStrategy[Any]:
    """Values without tensors that torch.save pickles alongside them."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=False, width=64),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.frozensets(st.integers(-5, 5), max_size=3),
    )


def tensor_leaves(pool: Sequence[torch.Tensor], *,
                  dtypes: Sequence[torch.dtype] = ALL_DTYPES,
                  grad: bool = True, attributes: bool = False) -> st.SearchStrategy[torch.Tensor]:
    """Tensors: a pool base itself (shared storage), a view of one, or a fresh tensor;
    wrapped as a Parameter / grad leaf when ``grad`` (or given a Python attribute when
    ``attributes``)."""
    options = [base_tensors(dtypes)]
    if pool:
        bases = st.sampled_from(list(pool))
        options += [bases, bases.flatmap(view_of)]
    leaves = st.one_of(*options)
    if not (grad or attributes):
        return leaves
    return leaves.flatmap(lambda t: _maybe_wrap(t, grad, attributes))


_KEYS = st.one_of(
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789", min_size=1, max_size=8),
    st.integers(-3, 50),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_KEYS, children, max_size=4),
        st.dictionaries(_KEYS, children, max_size=4).map(collections.OrderedDict),
    )


@st.composite
def state_dicts(draw: st.DrawFn, *, dtypes: Sequence[torch.dtype] = ALL_DTYPES,
                max_leaves: int = 10, grad: bool = True,
                require_dtype: Sequence[torch.dtype] | None = None,
                plain: bool = True, attributes: bool = False) -> Any:
    """A random object for torch.save: usually a (nested) state dict, sometimes a bare tensor,
    list or tuple.

    A pool of 1..4 base tensors is drawn first; leaves then reuse them (same tensor under several
    keys), view them (several views of one storage, at offsets) or make fresh tensors.
    ``require_dtype`` forces a tensor of one of those dtypes into the result (under key
    ``"__required__"`` of a dict root). ``attributes`` adds tensors carrying a Python
    attribute (pickled through ``torch._tensor._rebuild_from_type_v2``).
    """
    pool = draw(st.lists(base_tensors(dtypes), min_size=1, max_size=4))
    tensor = tensor_leaves(pool, dtypes=dtypes, grad=grad, attributes=attributes)
    leaf = st.one_of(tensor, tensor, plain_values()) if plain else tensor
    tree = st.recursive(leaf, _containers, max_leaves=max_leaves)
    value = st.one_of(tensor, tree)  # state dicts are mostly flat: favour tensors at the top
    kind = draw(st.sampled_from(["dict", "dict", "dict", "ordered_dict", "list", "tuple",
                                 "tensor"]))
    if kind == "tensor":
        root: Any = draw(tensor)
    elif kind in ("list", "tuple"):
        items = draw(st.lists(value, min_size=1, max_size=6))
        root = items if kind == "list" else tuple(items)
    else:
        root = draw(st.dictionaries(_KEYS, value, min_size=1, max_size=8))
        if kind == "ordered_dict":
            root = collections.OrderedDict(root)
    if require_dtype:
        forced = draw(base_tensors(require_dtype))
        if not isinstance(root, dict):
            root = {"root": root}
        root["__required__"] = forced
    return root


def iter_tensors(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...],
                                                                        torch.Tensor]]:
    """Every tensor in a (loaded or generated) object with its path of keys / indices.

    Follows dicts, lists and tuples only (what :func:`state_dicts` builds), every occurrence.
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, (*path, i))


# ---------------------------------------------------------------------------------------------
# save configurations

ALIGNMENTS: tuple[int, ...] = (1, 2, 3, 7, 8, 24, 63, 64, 65, 100, 127, 128, 1000, 4096,
                               4097, 65503, 65504)
FILENAMES: tuple[str, ...] = ("a.b.c.pt", "model", "x.y", "ckpt.pt", "weights.pth.tar",
                              "trailing.", "dots..pt", "with space.bin", "módel.pt", "X")


def alignments() -> st.SearchStrategy[int]:
    """``save.storage_alignment`` values: interesting ones and any of 1..65504."""
    return st.one_of(st.sampled_from(ALIGNMENTS), st.integers(1, 65504))


@dataclass(frozen=True)
class SaveConfig:
    """How to call torch.save: config values, context, protocol and the file name."""

    alignment: int = 64
    compute_crc32: bool = True
    skip_data: bool = False
    pickle_protocol: int = 2
    filename: str = "model.pt"
    disable_byteorder_record: bool = False

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """The config patch and (if asked) ``skip_data`` around a torch.save call."""
        from torch.utils.serialization import config

        with config.patch({"save.storage_alignment": self.alignment,
                           "save.compute_crc32": self.compute_crc32}):
            if self.skip_data:
                with torch.serialization.skip_data():
                    yield
            else:
                yield

    def save(self, obj: Any, directory: str | os.PathLike[str]) -> Path:
        """``torch.save(obj, directory/filename)`` under this configuration; returns the path."""
        path = Path(directory) / self.filename
        with self.context():
            torch.save(obj, path, pickle_protocol=self.pickle_protocol,
                       _disable_byteorder_record=self.disable_byteorder_record)
        return path

    def save_to(self, obj: Any, f: Any) -> None:
        """``torch.save`` into a file object (archive name ``archive``)."""
        with self.context():
            torch.save(obj, f, pickle_protocol=self.pickle_protocol,
                       _disable_byteorder_record=self.disable_byteorder_record)


def save_configs(*, alignment: st.SearchStrategy[int] | None = None,
                 skip_data: st.SearchStrategy[bool] | None = None,
                 filenames: Sequence[str] = FILENAMES,
                 disable_byteorder_record: st.SearchStrategy[bool] | None = None,
                 ) -> st.SearchStrategy[SaveConfig]:
    """Random :class:`SaveConfig`: alignment 1..65504, crc on/off, skip_data on/off,
    protocols 2..5, file names with several dots."""
    return st.builds(
        SaveConfig,
        alignment=alignment if alignment is not None else alignments(),
        compute_crc32=st.booleans(),
        skip_data=skip_data if skip_data is not None else st.booleans(),
        pickle_protocol=st.integers(2, 5),
        filename=st.sampled_from(list(filenames)),
        disable_byteorder_record=(disable_byteorder_record if disable_byteorder_record
                                  is not None else st.booleans()),
    )



@st.composite
def chunk_grids(draw: st.DrawFn, shape: Sequence[int], max_cuts: int = 4) -> list[Any]:
    """A grid chunking of ``shape`` (``ckptlab.plan.Chunk`` boxes): random split points per
    dimension, so shards are uneven, as DTensor / FSDP shardings can be."""
    import itertools

    from ckptlab.plan.reshard import Chunk

    cuts = []
    for n in shape:
        points = draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=min(max_cuts, n - 1))) \
            if n > 1 else set()
        cuts.append(list(itertools.pairwise([0, *sorted(points), n])))
    return [Chunk(tuple(a for a, _ in box), tuple(b - a for a, b in box))
            for box in itertools.product(*cuts)]


@st.composite
def local_plan_sets(draw: st.DrawFn, *, max_world: int = 6, max_tensors: int = 4,
                    broken: bool = False) -> list[Any]:
    """Random local plans of one save (``ckptlab.plan.LocalPlan`` per rank).

    Each tensor is cut into a grid of chunks (:func:`chunk_grids`); each chunk goes to one
    rank or, as a replica, to several; 0-d tensors and pickled objects are held by random
    subsets of ranks. With ``broken``, one chunk may be dropped, shifted or duplicated under
    another offset, so the plan can be invalid.
    """
    from ckptlab.plan.items import WriteItem, local_plan
    from ckptlab.plan.reshard import Chunk

    world = draw(st.integers(1, max_world))
    per_rank: list[list[Any]] = [[] for _ in range(world)]
    ranks = st.integers(0, world - 1)
    for t in range(draw(st.integers(1, max_tensors))):
        fqn = f"t{t}"
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int64"]))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
        chunks = draw(chunk_grids(shape)) if shape else [Chunk((), ())]
        if broken and shape and chunks and draw(st.booleans()):
            i = draw(st.integers(0, len(chunks) - 1))
            c = chunks[i]
            how = draw(st.sampled_from(["drop", "shift", "grow"]))
            d = draw(st.integers(0, len(shape) - 1))
            if how == "drop":
                chunks.pop(i)
            elif how == "shift":
                chunks[i] = Chunk(tuple(o + (k == d) for k, o in enumerate(c.offsets)), c.sizes)
            else:
                chunks[i] = Chunk(c.offsets, tuple(s + (k == d) for k, s in enumerate(c.sizes)))
        kind = "shard" if len(chunks) > 1 else draw(st.sampled_from(["tensor", "shard"]))
        for c in chunks:
            holders = draw(st.sets(ranks, min_size=1, max_size=min(world, 3)))
            for r in holders:
                per_rank[r].append(WriteItem(fqn, kind, c, shape, dtype))
    for o in range(draw(st.integers(0, 2))):
        for r in draw(st.sets(ranks, min_size=1, max_size=world)):
            per_rank[r].append(WriteItem(f"obj{o}", "bytes"))
    for items in per_rank:  # ranks list their items in any order
        perm = draw(st.permutations(items))
        items[:] = perm
    return [local_plan(r, items) for r, items in enumerate(per_rank)]


@st.composite
def overwritten_bytes(draw: st.DrawFn, data: bytes,
                      ranges: Sequence[tuple[int, int]] | None = None,
                      max_count: int = 4) -> bytes:
    """``data`` with 1 to ``max_count`` bytes overwritten by arbitrary values, each at a
    position inside one of ``ranges`` (``[start, end)`` pairs; default the whole of ``data``).

    The mutation half of a parser's damage tests (:mod:`ckptlab.testing.damage` has the
    exhaustive bit flips and truncations).
    """
    spans = [(0, len(data))] if ranges is None else [(a, b) for a, b in ranges if b > a]
    if not spans:
        raise ValueError("overwritten_bytes needs a non-empty range")
    raw = bytearray(data)
    for _ in range(draw(st.integers(1, max_count))):
        start, end = draw(st.sampled_from(spans))
        raw[draw(st.integers(start, end - 1))] = draw(st.integers(0, 255))
    return bytes(raw)
