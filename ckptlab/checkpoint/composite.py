"""Composite models: a directory whose model is made of components in subdirectories, opened
as one checkpoint named the way the framework names its parts.

- **diffusers pipelines** (``model_index.json``: component name -> ``[library, class]``):
  each component directory with weights (``unet/``, ``vae/``, ``text_encoder/``...) opens as
  the Hugging Face directory it is, and its tensors are named ``<component>.<name>``
  (``unet.conv_in.weight``); components without weights (``scheduler/``, ``tokenizer/``)
  give their JSON files as values.
- **sentence-transformers models** (``modules.json``: the modules in order with their
  ``path``): the module at ``path ""`` is the root directory's own model, unprefixed; every
  other module's weights are named ``<path>.<name>`` (``2_Dense.linear.weight``).

Every file is listed (``ck.files``, paths relative to the top directory, each with its
layout); JSON files are values. A tensor is read through the component it belongs to.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from ckptlab.checkpoint.model import Checkpoint, FileEntry, TensorEntry, tensor_name
from ckptlab.errors import UnsupportedFormatError

__all__ = ["composite_parts", "open_composite"]

MODEL_INDEX = "model_index.json"  # diffusers
MODULES = "modules.json"  # sentence-transformers


def _json(root: str, name: str) -> Any:
    try:
        with open(os.path.join(root, name), "rb") as f:
            return json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None


def composite_parts(root: str, names: list[str]) -> list[tuple[str, str]] | None:
    """``[(prefix, subdirectory)]`` of a composite model directory ("" for the root's own
    files), from its ``model_index.json`` or ``modules.json``; None when it is neither."""
    if MODEL_INDEX in names:
        index = _json(root, MODEL_INDEX)
        if isinstance(index, dict):
            parts = [(key, key) for key, value in index.items()
                     if not key.startswith("_") and isinstance(value, list) and len(value) == 2
                     and os.path.isdir(os.path.join(root, key))]
            if parts:
                return parts
    if MODULES in names:
        modules = _json(root, MODULES)
        if isinstance(modules, list) and all(isinstance(m, dict) for m in modules):
            parts = []
            for m in modules:
                path = m.get("path")
                if not isinstance(path, str) or os.path.isabs(path) or ".." in path.split("/"):
                    return None
                if path == "" or os.path.isdir(os.path.join(root, path)):
                    parts.append((path.replace("/", "."), path))
            if any(prefix for prefix, _ in parts):  # a module beside the root's
                return parts
    return None


def _prefixed_entry(entry: FileEntry, sub: str) -> FileEntry:
    return dataclasses.replace(entry, path=f"{sub}/{entry.path}" if sub else entry.path)


def _prefixed_tensor(t: TensorEntry, prefix: str, sub: str) -> TensorEntry:
    parts = tuple(dataclasses.replace(p, file=f"{sub}/{p.file}") for p in t.parts) if sub \
        else t.parts
    if not prefix:
        return dataclasses.replace(t, parts=parts)
    path = (prefix, *t.path)
    return dataclasses.replace(t, name=tensor_name(path), path=path, parts=parts)


def open_composite(root: str, parts: list[tuple[str, str]],
                   open_dir: Callable[[str], Checkpoint],
                   json_entry: Callable[[str], tuple[FileEntry, Any]]) -> Checkpoint:
    """The composite model at ``root`` (``parts``: :func:`composite_parts`) as one checkpoint.

    ``open_dir(path)`` opens one directory as ckptlab does (its files only, not a composite
    again); ``json_entry(relative name)`` reads a JSON file of the model as an entry and a
    value."""
    files: list[FileEntry] = []
    tensors: list[TensorEntry] = []
    objects: dict[str, Any] = {}
    notes: list[str] = []
    owners: dict[str, tuple[Checkpoint, str]] = {}  # subdirectory -> (component, its prefix)
    for prefix, sub in parts:
        where = os.path.join(root, sub) if sub else root
        try:
            ck = open_dir(where)
        except UnsupportedFormatError:  # no weights (a scheduler, a tokenizer): its values
            ck = None
        if ck is None:
            for name in sorted(os.listdir(where)):
                if name.endswith(".json") and os.path.isfile(os.path.join(where, name)):
                    entry, value = json_entry(f"{sub}/{name}" if sub else name)
                    files.append(entry)
                    objects[tensor_name((prefix, name)) if prefix else name] = value
            continue
        owners[sub] = (ck, prefix)
        files.extend(_prefixed_entry(f, sub) for f in ck.files)
        tensors.extend(_prefixed_tensor(t, prefix, sub) for t in ck.tensors.values())
        for name, value in ck._objects.items():
            objects[tensor_name((prefix, name)) if prefix else name] = value
        notes.extend(f"{sub}: {n}" if sub else n for n in ck.notes)
    if not tensors:
        raise UnsupportedFormatError("a composite model directory whose components hold no "
                                     "weights", path=root)
    listed = {f.path for f in files}
    for name in sorted(os.listdir(root)):  # the top directory's own files (model_index...)
        if name not in listed and name.endswith(".json") and \
                os.path.isfile(os.path.join(root, name)):
            entry, objects[name] = json_entry(name)
            files.append(entry)

    def read(ck: Checkpoint, entry: TensorEntry, moved: Any = None, scratch: Any = None) -> Any:
        first = entry.parts[0].file if entry.parts else ""
        sub = next((s for s in owners if s and first.startswith(s + "/")), "")
        component, _ = owners[sub]
        if sub:
            n = len(sub) + 1
            entry = dataclasses.replace(entry, parts=tuple(
                dataclasses.replace(p, file=p.file[n:]) for p in entry.parts))
        return component._reader(component, entry, None, scratch)

    from ckptlab.checkpoint._tensors import unique_names

    return Checkpoint("hf", root, tuple(sorted(files, key=lambda f: f.path)),
                      unique_names(tensors), objects, read, tuple(notes))
