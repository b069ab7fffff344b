"""DeepSpeed save directories: the model states by name, the ZeRO partitions by parameter.

``engine.save_checkpoint(dir)`` writes one directory per save (``global_step<N>/`` or any
tag) holding:

- ``mp_rank_00_model_states.pt`` (ZeRO 0-2) or ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  for every data-parallel rank ``r`` (ZeRO 3): a torch.save of ``{"module": state_dict,
  "param_shapes": [{name: shape}] per optimizer group, "shared_params": {name: name it
  shares}, "frozen_param_shapes", "frozen_param_fragments", "buffer_names", ...}``. Under
  ZeRO 3 the module's parameters are saved as empty placeholders.
- ``[bf16_|fp16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (ZeRO 1-3), one per rank:
  rank ``r``'s partition of each group's flat fp32 master weights
  (``single_partition_of_fp32_groups`` for ZeRO 1/2, ``fp32_flat_groups`` for ZeRO 3) and
  the optimizer's state of that flat partition (Adam's ``exp_avg``, ``exp_avg_sq``).

Opened here as one checkpoint (format ``"deepspeed"``) named as DeepSpeed names things:

- the model states file's contents by their own keys (``module.body.weight``,
  ``lr_scheduler...``), as if that file were opened alone (ZeRO 3's placeholders left out);
- ``fp32.<param>``: each parameter's fp32 master weights, and ``<key>.<param>`` for each
  optimizer state of the flat partitions (``exp_avg.<param>``, ``exp_avg_sq.<param>``),
  assembled the way DeepSpeed's ``zero_to_fp32.py`` assembles the master weights: ZeRO 1/2
  concatenate the ranks' partitions of a group and take each parameter's run in order (plus
  the alignment paddings the file records); ZeRO 3 partitions every parameter across the
  ranks (``ceil(numel / ranks)`` elements each, the last padded) and concatenates its
  pieces. Frozen parameters and the names of ``shared_params`` are under ``fp32.`` too, as
  zero_to_fp32's state dict has them. So ``module.x`` and ``fp32.x`` are the same parameter
  as the model held it and as the optimizer holds it.

A pipeline-parallel save (``deepspeed.pipe.PipelineModule``; ``pp_degree`` stages, no tensor
parallelism) keeps each layer's weights in ``layer_<NN>-model_states.pt`` and each stage's
states in ``mp_rank_<stage>_model_states.pt`` (with ``zero_pp_rank_<r>_mp_rank_<stage>``
partitions under ZeRO 1): the layers' tensors are ``module.<NN>.<key>``, as
``PipelineModule.state_dict`` names them, and each stage's partitions are assembled as above
into ``fp32.<NN>.<key>`` and its optimizer states (the stage files' other contents keep
their file's name in front).

Each assembled tensor is a list of ``piece`` parts (byte ranges of the rank files, each with
its flat element position), read by byte ranges: reading one holds that parameter, never a
whole partition. Nothing is run, DeepSpeed is not needed. What ckptlab cannot assemble
(tensor or pipeline parallel saves, a missing rank file, sizes that do not add up) stays as
the files' own tensors under file-prefixed names, with a note saying why.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from ckptlab.checkpoint.model import Checkpoint, Part, TensorEntry, tensor_name
from ckptlab.format.layout import contiguous_strides

__all__ = ["MODEL_STATES_RE", "OPTIM_STATES_RE", "deepspeed_checkpoint", "is_deepspeed_save"]

MODEL_STATES_RE = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
LAYER_STATES_RE = re.compile(r"layer_(\d+)(?:-model_(\d+))?-model_states\.pt")
OPTIM_STATES_RE = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
MASTER = "fp32"  # the prefix of the master weights (zero_to_fp32's state dict)


UNIVERSAL = "zero"  # ds_to_universal's folder: zero/<param>/<state>.pt, zero/optimizer_state.pt


def universal_files(root: str) -> list[str]:
    """The files of a universal checkpoint's ``zero/`` folder under ``root`` (relative,
    sorted): ``zero/<param>/<state>.pt`` and ``zero/optimizer_state.pt``; [] without one."""
    top = os.path.join(root, UNIVERSAL)
    if not os.path.isdir(top) or os.path.islink(top):
        return []
    out = []
    for entry in sorted(os.listdir(top)):
        where = os.path.join(top, entry)
        if os.path.islink(where):
            continue
        if os.path.isfile(where) and entry.endswith(".pt"):
            out.append(f"{UNIVERSAL}/{entry}")
        elif os.path.isdir(where):
            out += [f"{UNIVERSAL}/{entry}/{name}" for name in sorted(os.listdir(where))
                    if name.endswith(".pt") and not os.path.islink(os.path.join(where, name))
                    and os.path.isfile(os.path.join(where, name))]
    return out


def is_deepspeed_save(names: Sequence[str]) -> bool:
    """Whether a directory listing is one DeepSpeed save (a model states file in it)."""
    return any(MODEL_STATES_RE.fullmatch(n) for n in names)


_MISSING = object()


class _Unassembled(Exception):
    """Why the partitions stay as they are (said in a note)."""


def _ranked(names: Sequence[str], pattern: re.Pattern[str], mp: int = 0) -> dict[int, str]:
    """{data-parallel rank: file} of the model-parallel rank ``mp`` files matching
    ``pattern``."""
    out = {}
    for name in names:
        m = pattern.fullmatch(name)
        if m and int(m.group(2)) == mp:
            out[int(m.group(1) or 0)] = name
    return out


def _pipeline_stages(names: Sequence[str], dims: Any) -> list[int]:
    """The stages of a pipeline-parallel save without tensor parallelism (``[]`` for any
    other save): ``checkpoint_parallel_dimensions`` says ``pp_degree`` N > 1 and
    ``tp_degree`` 1, the directory holds the model states of model-parallel ranks 0 to N-1
    and the layers' files."""
    if not isinstance(dims, dict) or dims.get("tp_degree") != 1:
        return []
    pp = dims.get("pp_degree")
    stages = sorted({int(m.group(2)) for n in names if (m := MODEL_STATES_RE.fullmatch(n))})
    layers = [m for n in names if (m := LAYER_STATES_RE.fullmatch(n))]
    if not isinstance(pp, int) or pp < 2 or stages != list(range(pp)) or not layers or any(
            m.group(2) not in (None, "00") for m in layers):
        return []
    return stages


def deepspeed_checkpoint(ck: Checkpoint) -> Checkpoint:
    """``ck`` (one DeepSpeed save directory, opened file by file: names prefixed by file) as
    DeepSpeed names it; see the module docstring."""
    names = [f.path for f in ck.files]
    models = _ranked(names, MODEL_STATES_RE)
    if not models:
        return ck
    main = models[min(models)]
    others = [n for n in names if MODEL_STATES_RE.fullmatch(n) and n not in models.values()]
    objects = ck.objects
    tensors = {t.path: t for t in ck.tensors.values()}

    def value(file: str, *keys: Any) -> Any:
        """The value at ``keys`` of ``file``'s object: kept under its own name, or inside a
        container kept whole (a file without tensors is one object)."""
        path = (file, *keys)
        for end in range(len(path), 0, -1):
            found = objects.get(tensor_name(path[:end]), _MISSING)
            if found is _MISSING:
                continue
            for key in path[end:]:
                if not isinstance(found, dict) or key not in found:
                    return None
                found = found[key]
            return found
        return None

    notes = list(ck.notes)
    stages = _pipeline_stages(names, value(main, "checkpoint_parallel_dimensions"))
    if not stages and (others or (value(main, "mp_world_size") or 1) > 1):
        notes.append("DeepSpeed save with tensor or pipeline parallel model states "
                     f"({len(others) + len(models)} model states files): shown file by file")
        return Checkpoint("deepspeed", ck.path, ck.files, ck.tensors, ck._objects, ck._reader,
                          tuple(notes))
    if stages:
        notes.append(f"DeepSpeed pipeline-parallel save, {len(stages)} stages: module.<layer>.* "
                     f"from the layer_<NN>-model_states.pt files, as PipelineModule names them")
    used: set[tuple[Any, ...]] = set()  # the raw tensors the assembled ones stand for
    assembled: list[TensorEntry] = []
    for mp in stages or [0]:
        stage_models = _ranked(names, MODEL_STATES_RE, mp)
        optims = _ranked(names, OPTIM_STATES_RE, mp)
        if not optims or not stage_models:
            continue
        where = f" (pipeline stage {mp})" if stages else ""
        try:
            more, more_used = _assemble(stage_models[min(stage_models)], stage_models, optims,
                                        value, tensors)
            assembled += more
            used |= more_used
            stage = _stage(value(optims[min(optims)], "optimizer_state_dict", "zero_stage"))
            notes.append(
                f"DeepSpeed ZeRO stage {stage} over {len(optims)} data-parallel ranks{where}: "
                f"{MASTER}.* (master weights) and the optimizer's states by parameter, assembled "
                f"from the {len(optims)} *_optim_states.pt partitions as zero_to_fp32.py does")
        except _Unassembled as exc:
            notes.append(f"DeepSpeed ZeRO partitions{where} not assembled: {exc}; shown file by "
                         f"file")
    placeholders = {("module", n) for n in _param_names(value(main, "param_shapes"))}
    for more in ("frozen_param_shapes", "shared_params"):
        placeholders |= {("module", n) for n in (value(main, more) or {})}
    out: list[TensorEntry] = []
    for path, t in tensors.items():
        if path in used:
            continue
        universal = _universal_name(path)
        if universal is not None:  # zero/<param>/<state>.pt: {"param": tensor} or the tensor
            out.append(dataclasses.replace(t, name=tensor_name(universal), path=universal))
            continue
        if path[0] in models.values() and path[1:] in placeholders and t.numel == 0:
            continue  # ZeRO 3: the parameter's bytes are in the partitions
        layer = LAYER_STATES_RE.fullmatch(str(path[0])) if stages else None
        if layer is not None:  # a pipeline layer's weights: module.<layer index>.<key>
            named = ("module", str(int(layer.group(1))), *path[1:])
            t = dataclasses.replace(t, name=tensor_name(named), path=named)
        elif path[0] == main and not stages:
            t = dataclasses.replace(t, name=tensor_name(path[1:]), path=path[1:])
        out.append(t)
    if any(t.parts and t.parts[0].file.startswith(UNIVERSAL + "/") for t in out):
        notes.append(f"DeepSpeed universal checkpoint: <state>.<param> from "
                     f"{UNIVERSAL}/<param>/<state>.pt")
    from ckptlab.checkpoint._tensors import unique_names

    # the model states file's values by their own keys, as its tensors (a pipeline's stage
    # files keep their names in front: several hold the same keys)
    mine = main + "."
    values = dict(ck._objects) if stages else {
        name[len(mine):] if name.startswith(mine) else name: v
        for name, v in ck._objects.items()}
    return Checkpoint("deepspeed", ck.path, ck.files, unique_names([*out, *assembled]),
                      values, ck._reader, tuple(notes))


def _universal_name(path: tuple[Any, ...]) -> tuple[str, str] | None:
    """``(state, param)`` of a universal checkpoint's tensor, else None."""
    parts = str(path[0]).split("/")
    if len(parts) != 3 or parts[0] != UNIVERSAL or not parts[2].endswith(".pt") or \
            path[1:] not in ((), ("param",)):
        return None
    return parts[2][:-3], parts[1]


def _stage(value: Any) -> str:
    """The ZeRO stage a ``ZeroStageEnum`` value (inert: ``{"type", "args"}``) holds."""
    args = value.get("args") if isinstance(value, dict) else None
    return str(args[0]) if isinstance(args, list) and len(args) == 1 else "?"


def _param_names(shapes: Any) -> Iterator[str]:
    for group in shapes or ():
        if isinstance(group, dict):
            yield from group


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value):
        raise _Unassembled(f"{where} is not a shape ({value!r})")
    return tuple(value)


def _flat(tensors: dict[tuple[Any, ...], TensorEntry], path: tuple[Any, ...]) -> TensorEntry:
    t = tensors.get(path)
    if t is None:
        raise _Unassembled(f"{tensor_name(path)} is missing")
    if t.kind != "dense" or len(t.parts) != 1 or t.shape is None or len(t.shape) != 1 \
            or not t.parts[0].contiguous:
        raise _Unassembled(f"{tensor_name(path)} is not a flat dense tensor")
    return t


class _Flat:
    """One group's flat tensor on every rank: element ``i`` of the concatenation (or of one
    rank's tensor) -> pieces of the files."""

    def __init__(self, per_rank: list[TensorEntry]) -> None:
        self.per_rank = per_rank
        self.starts = [0]
        for t in per_rank:
            self.starts.append(self.starts[-1] + (t.numel or 0))

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def pieces(self, start: int, count: int, at: int) -> Iterator[Part]:
        """Elements ``[start, start + count)`` of the concatenation, placed from flat
        position ``at`` of the tensor they make."""
        for rank, t in enumerate(self.per_rank):
            lo, hi = max(start, self.starts[rank]), min(start + count, self.starts[rank + 1])
            if lo < hi:
                yield _piece(t, lo - self.starts[rank], hi - lo, at + lo - start)


def _piece(t: TensorEntry, first: int, count: int, at: int) -> Part:
    """Elements ``[first, first + count)`` of flat tensor ``t``, placed at flat position
    ``at`` of the tensor they make."""
    return dataclasses.replace(t.parts[0].run(first, count), role="piece", chunk_offsets=(at,))


def _entry(prefix: str, name: str, shape: tuple[int, ...], dtype: str, parts: list[Part]
           ) -> TensorEntry:
    path = (prefix, name)
    return TensorEntry(tensor_name(path), path, dtype, shape, contiguous_strides(shape),
                       "dense", tuple(parts))


def _state_keys(state: dict[tuple[Any, ...], TensorEntry], sizes: list[int]) -> list[str]:
    """The optimizer state keys whose tensors are flat partitions on every rank (``sizes``:
    the fp32 partition's elements per rank; a state may carry the group's padding too)."""
    keys = []
    for key in sorted({path[-1] for path in state}, key=str):
        ts = [state.get((rank, key)) for rank in range(len(sizes))]
        if all(t is not None and t.kind == "dense" and t.shape is not None and len(t.shape) == 1
               and (t.numel or 0) >= n and t.parts for t, n in zip(ts, sizes)) and \
                isinstance(key, str) and key != "step":
            keys.append(key)
    return keys


def _assemble(main: str, models: dict[int, str], optims: dict[int, str], value: Any,
              tensors: dict[tuple[Any, ...], TensorEntry]
              ) -> tuple[list[TensorEntry], set[tuple[Any, ...]]]:
    ranks = len(optims)
    if sorted(optims) != list(range(ranks)):
        raise _Unassembled(f"optimizer states of ranks {sorted(optims)}: a rank file is missing")
    first = optims[0]
    count = value(first, "optimizer_state_dict", "partition_count")
    count = max(count) if isinstance(count, list) and count else count
    if count != ranks:
        raise _Unassembled(f"{first} says {count!r} partitions, the directory holds {ranks} "
                           "optimizer states files (a save overwritten or cut short?)")
    shapes = value(main, "param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise _Unassembled(f"{main} has no param_shapes list")
    zero3 = (first, "optimizer_state_dict", "fp32_flat_groups", 0) in tensors
    key = "fp32_flat_groups" if zero3 else "single_partition_of_fp32_groups"
    state_root = ("optimizer_state_dict", "optimizer_state_dict") if zero3 else \
        ("optimizer_state_dict", "base_optimizer_state")
    used: set[tuple[Any, ...]] = set()
    groups: list[_Flat] = []
    states: list[dict[str, _Flat]] = []
    for g in range(len(shapes)):
        paths = [(optims[r], "optimizer_state_dict", key, g) for r in range(ranks)]
        flat = _Flat([_flat(tensors, p) for p in paths])
        used.update(paths)
        groups.append(flat)
        sizes = [t.numel or 0 for t in flat.per_rank]
        index = _group_param_index(value(optims[0], *state_root, "param_groups"), g)
        state = {(r, path[len(state_root) + 3]): t for path, t in tensors.items()
                 for r in range(ranks)
                 if path[:len(state_root) + 3] == (optims[r], *state_root, "state", index)
                 and len(path) == len(state_root) + 4}
        per_key = {}
        for k in _state_keys(state, sizes):
            per_key[k] = _Flat([state[(r, k)] for r in range(ranks)])
            used.update((optims[r], *state_root, "state", index, k) for r in range(ranks))
        states.append(per_key)
    out: list[TensorEntry] = []
    if zero3:
        out += _zero3(shapes, groups, states, ranks)
    else:
        paddings = value(first, "optimizer_state_dict", "param_alignment_paddings")
        out += _zero12(shapes, groups, states, ranks, paddings)
    out += _frozen(main, models, value, tensors, zero3, ranks, used)
    by_name = {t.name: t for t in out}
    shared = value(main, "shared_params") or {}
    for name, source in shared.items() if isinstance(shared, dict) else ():
        for prefix in (MASTER, *{k for s in states for k in s}):
            t = by_name.get(tensor_name((prefix, source)))
            if t is not None:
                out.append(dataclasses.replace(t, name=tensor_name((prefix, name)),
                                               path=(prefix, name)))
    return out, used


def _group_param_index(groups: Any, g: int) -> Any:
    """The optimizer state key of group ``g``'s flat parameter (its ``params`` entry)."""
    if isinstance(groups, list) and g < len(groups) and isinstance(groups[g], dict):
        params = groups[g].get("params")
        if isinstance(params, list) and len(params) == 1:
            return params[0]
    return g


def _zero12(shapes: list[dict[str, Any]], groups: list[_Flat], states: list[dict[str, _Flat]],
            ranks: int, paddings: Any) -> list[TensorEntry]:
    out = []
    for g, (group, flat) in enumerate(zip(shapes, groups)):
        pads = paddings[g] if isinstance(paddings, list) and g < len(paddings) else None
        if pads is not None and (not isinstance(pads, list) or len(pads) != len(group)):
            raise _Unassembled(f"group {g}: {len(group)} parameters but alignment paddings "
                               f"{pads!r}")
        offset = 0
        for i, (name, shape) in enumerate(group.items()):
            shape = _shape(shape, f"param_shapes[{g}][{name!r}]")
            n = math.prod(shape)
            if offset + n > flat.numel:
                raise _Unassembled(f"group {g} holds {flat.numel} elements, {name} would end "
                                   f"at {offset + n}")
            out.append(_entry(MASTER, name, shape, flat.per_rank[0].dtype,
                              list(flat.pieces(offset, n, 0))))
            for k, moments in states[g].items():
                out.append(_entry(k, name, shape, moments.per_rank[0].dtype,
                                  list(moments.pieces(offset, n, 0))))
            offset += n + (pads[i] if pads else 0)
        # zero_to_fp32's check: the group's elements, both rounded up to 2 * ranks
        align = 2 * ranks
        if math.ceil(offset / align) != math.ceil(flat.numel / align):
            raise _Unassembled(f"group {g}: its parameters make {offset} elements, the "
                               f"partitions hold {flat.numel}")
    return out


def _zero3(shapes: list[dict[str, Any]], groups: list[_Flat], states: list[dict[str, _Flat]],
           ranks: int) -> list[TensorEntry]:
    """Every parameter split over the ranks, ``ceil(numel / ranks)`` elements each, at the
    same position of every rank's concatenated groups (a parameter may cross groups)."""
    sizes = [t.numel or 0 for t in groups[0].per_rank] if groups else []
    if any([t.numel for t in flat.per_rank] != [flat.per_rank[0].numel] * ranks
           for flat in groups):
        raise _Unassembled(f"ZeRO 3 flat groups of unequal sizes across ranks ({sizes})")
    bounds = [0]
    for flat in groups:
        bounds.append(bounds[-1] + (flat.per_rank[0].numel or 0))
    out = []
    offset = 0
    keys = sorted({k for s in states for k in s})
    for g, group in enumerate(shapes):
        for name, shape in group.items():
            shape = _shape(shape, f"param_shapes[{g}][{name!r}]")
            n = math.prod(shape)
            each = math.ceil(n / ranks)
            sources = [(MASTER, groups)] + [(k, [s.get(k) for s in states]) for k in keys]
            for prefix, flats in sources:
                parts = []
                for r in range(ranks):
                    want = min(each, max(0, n - r * each))  # the last rank's padding left out
                    parts += _across(flats, bounds, r, offset, want, r * each, prefix, name)
                dtype = next(f for f in flats if f is not None).per_rank[0].dtype
                out.append(_entry(prefix, name, shape, dtype, parts))
            offset += each
    if offset != bounds[-1]:
        raise _Unassembled(f"the parameters take {offset} elements of each rank's partition, "
                           f"the partitions hold {bounds[-1]}")
    return out


def _across(flats: list[_Flat | None], bounds: list[int], rank: int, start: int, count: int,
            at: int, prefix: str, name: str) -> list[Part]:
    """Elements ``[start, start + count)`` of one rank's groups laid end to end."""
    parts = []
    for g, flat in enumerate(flats):
        lo, hi = max(start, bounds[g]), min(start + count, bounds[g + 1])
        if lo >= hi:
            continue
        if flat is None:
            raise _Unassembled(f"{prefix} of {name}: group {g} has no such state")
        parts.append(_piece(flat.per_rank[rank], lo - bounds[g], hi - lo, at + lo - start))
    if sum(p.numel for p in parts) != count:
        raise _Unassembled(f"{name} runs past the partitions")
    return parts


def _frozen(main: str, models: dict[int, str], value: Any,
            tensors: dict[tuple[Any, ...], TensorEntry], zero3: bool, ranks: int,
            used: set[tuple[Any, ...]]) -> list[TensorEntry]:
    """Frozen parameters as zero_to_fp32 gives them: whole in the model states (ZeRO 1/2),
    ``frozen_param_fragments`` of every rank's model states concatenated (ZeRO 3)."""
    shapes = value(main, "frozen_param_shapes")
    out = []
    for name, shape in (shapes or {}).items() if isinstance(shapes, dict) else ():
        shape = _shape(shape, f"frozen_param_shapes[{name!r}]")
        n = math.prod(shape)
        if not zero3:
            t = tensors.get((main, "frozen_param_fragments", name))
            if t is not None:
                used.add(t.path)
                out.append(dataclasses.replace(t, name=tensor_name((MASTER, name)),
                                               path=(MASTER, name)))
            continue
        if sorted(models) != list(range(ranks)):
            raise _Unassembled(f"model states of ranks {sorted(models)} for {ranks} ranks")
        paths = [(models[r], "frozen_param_fragments", name) for r in range(ranks)]
        per_rank = [_flat(tensors, p) for p in paths]
        used.update(paths)
        out.append(_entry(MASTER, name, shape, per_rank[0].dtype,
                          list(_Flat(per_rank).pieces(0, n, 0))))
    return out
