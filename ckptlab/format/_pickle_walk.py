"""The walk of a scan: every tensor record in an interpreted pickle, by its path.

:func:`_walk` goes depth first through what the interpreter made (dicts, lists, tuples, sets,
:class:`~ckptlab.format._unpickle.Reduced` records) and names every tensor record
(:mod:`ckptlab.format._tensor_refs`) by its path from the root object, the way ``torch.load``
would reach it (``dd['k']`` for a ``defaultdict``), with the non-tensor values beside them.
Each container is entered once, so the walk is linear in the object graph; nesting deeper than
:data:`MAX_DEPTH` is an error. Its first pass, :func:`walk_tensors`, is also compiled
(:mod:`ckptlab.format._interp`, ``_walk.c``), given this module's rules; a scan picks one by
:data:`ckptlab.format._pickle._IMPL`. :func:`path_key_text` is a path element as text.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ckptlab.errors import PickleDataError
from ckptlab.format._bulk import LazyTuple
from ckptlab.format._tensor_refs import _TENSOR_REFS, _bad, _PendingTensor, _short
from ckptlab.format._unpickle import OpaqueKey, Reduced

__all__ = ["MAX_DEPTH", "path_key_text", "walk_tensors"]


MAX_DEPTH = 256  # object nesting the walk follows; real checkpoints stay under ~20
_CONTAINERS = (dict, list, tuple, set, frozenset, Reduced)


def _children(obj: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(obj, dict):
        return iter(obj.items())
    if isinstance(obj, (list, tuple)):
        return enumerate(obj)
    if isinstance(obj, (set, frozenset)):
        return enumerate(v.value if isinstance(v, OpaqueKey) else v for v in obj)
    if type(obj.state) is dict and not (obj.pairs or obj.args or obj.items):
        return iter(obj.state.items())  # an object built from its __dict__: a module
    return _reduced_children(obj)


# what the walk does with a value of each type: 0 nothing (a plain value), 1 list it (a
# tensor), 2 walk into it when it is not empty (a container); filled in as types are met
_LEAF, _TENSOR, _CONTAINER = 0, 1, 2
_WALK_KIND: dict[type, int] = {}


def _walk_kind(kind: type) -> int:
    found = _TENSOR if issubclass(kind, _TENSOR_REFS) else \
        _CONTAINER if issubclass(kind, _CONTAINERS) else _LEAF
    _WALK_KIND[kind] = found
    return found


def _reduced_children(obj: Reduced) -> Iterator[tuple[Any, Any]]:
    """Mapping items (as torch would index them), attributes, constructor args, list items."""
    yield from obj.pairs
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
        state = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
    if isinstance(state, dict):
        yield from state.items()
    elif state is not None:
        yield "state", state
    if not obj.pairs:  # a defaultdict's factory is not part of what users index
        for i, v in enumerate(obj.args):
            yield f"args[{i}]", v
    for i, v in enumerate(obj.items):
        yield i, v


def _path_key(key: Any) -> Any:
    """A path element that prints and serialises safely: plain keys as they are, others as a
    bounded repr (a key can be any object, even a deep tuple)."""
    if isinstance(key, OpaqueKey):
        key = key.value
    kind = type(key)
    if kind is str or kind is bool or kind is float or key is None:
        return key
    if kind is int:
        return key if -(1 << 64) < key < (1 << 64) else _short(key)
    return _short(key)


def path_key_text(key: Any) -> str:
    """A path element as text: str keys as they are, anything else as a bounded repr."""
    key = _path_key(key)
    return key if isinstance(key, str) else str(key)


def _walk(root: Any, impl: str | None = None
          ) -> tuple[list[tuple[tuple[Any, ...], Any]], Sequence[tuple[tuple[Any, ...], Any]]]:
    """Every tensor reachable from root with its path, and the non-tensor values beside them.

    Depth first in container order; each container is entered once (one reachable twice is
    listed under its first path), so the walk is linear in the object graph. The values are
    the children of tensor-holding containers that are not tensors and hold none: a container
    without tensors is one value (``config``, ``betas``), never walked into for the list.
    The values are listed when first looked at (:func:`_values`): a whole ``nn.Module``
    pickled holds a dozen per module (flags, hook dicts), which opening it need not list.
    ``impl`` picks the first pass, as :func:`walk_tensors` takes it.
    """
    if isinstance(root, _TENSOR_REFS):
        return [((), root)], []
    if not isinstance(root, _CONTAINERS):
        return [], [((), root)]
    found, holds_tensor = walk_tensors(root, impl)
    if id(root) not in holds_tensor:
        return found, [((), root)]
    return found, LazyTuple(None, lambda: _values(root, holds_tensor))


def _too_deep() -> PickleDataError:
    return _bad(f"objects nested deeper than {MAX_DEPTH} levels")


def _walk_tensors(root: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], set[int]]:
    """:func:`_walk`'s first pass: the tensors with their paths, and the ids of the
    containers that hold one."""
    found: list[tuple[tuple[Any, ...], Any]] = []
    holds_tensor: set[int] = set()
    seen = {id(root)}
    path: list[Any] = []  # keys from the root to the container on top of the stack
    ids = [id(root)]
    marked = 0  # how many of ids (from the root) are known to be in holds_tensor
    stack = [_children(root)]
    kinds = _WALK_KIND
    while stack:
        for key, value in stack[-1]:
            kind = kinds.get(type(value))
            if kind is None:
                kind = _walk_kind(type(value))
            if not kind:  # _LEAF
                continue
            if kind == _TENSOR:
                if not (type(value) is _PendingTensor and value.pending):
                    found.append(((*path, key if type(key) is str else _path_key(key)), value))
                    if marked < len(ids):
                        holds_tensor.update(ids[marked:])
                        marked = len(ids)
                continue
            # (an empty container holds no tensor: a module's many hook dicts)
            if value and id(value) not in seen:
                seen.add(id(value))
                if len(stack) >= MAX_DEPTH:
                    raise _too_deep()
                path.append(_path_key(key))
                ids.append(id(value))
                stack.append(_children(value))
                break
        else:
            stack.pop()
            ids.pop()
            marked = min(marked, len(ids))
            if path:
                path.pop()
    return found, holds_tensor


def _walk_tensors_c(root: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], set[int]]:
    """:func:`_walk_tensors` compiled (:mod:`ckptlab.format._interp`, ``_walk.c``): the
    rules it needs (a type's kind, a rare container's children, a path element, the depth
    error) are this module's, passed in."""
    return _c_walk(root, _WALK_KIND, _walk_kind, _PendingTensor, Reduced,  # type: ignore[no-any-return]
                   _children, _path_key, MAX_DEPTH, _too_deep)


def walk_tensors(root: Any, impl: str | None = None
                 ) -> tuple[list[tuple[tuple[Any, ...], Any]], set[int]]:
    """Every tensor reachable from the container ``root`` with its path, and the ids of the
    containers that hold one: by ``impl`` (``"python"``, ``"c"``, or None: the compiled walk
    where it is built; a scan gives its :data:`ckptlab.format._pickle._IMPL`)."""
    if impl == "python" or (impl is None and _c_walk is None):
        return _walk_tensors(root)
    if _c_walk is None:
        raise ImportError("ckptlab.format._interp is not built")
    return _walk_tensors_c(root)


try:
    from ckptlab.format._interp import walk_tensors as _c_walk
except ImportError:  # built without a C compiler
    _c_walk = None


def _values(root: Any, holds_tensor: set[int]) -> list[tuple[tuple[Any, ...], Any]]:
    """:func:`_walk`'s second pass: the non-tensor children of the containers that hold
    tensors (ids in ``holds_tensor``, all reachable through each other from ``root``)."""
    objects: list[tuple[tuple[Any, ...], Any]] = []
    entered = {id(root)}
    todo = [((), root)]
    while todo:  # only through containers that hold tensors
        prefix, container = todo.pop()
        children = []
        for key, value in _children(container):
            if isinstance(value, _TENSOR_REFS):
                continue
            vpath = (*prefix, _path_key(key))
            if id(value) in holds_tensor:
                if id(value) not in entered:
                    entered.add(id(value))
                    children.append((vpath, value))
            else:
                objects.append((vpath, value))
        todo.extend(reversed(children))
    return objects
