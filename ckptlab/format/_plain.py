"""An inert, bounded, JSON-ready rendering of any value ckptlab's interpreter builds
(:func:`plain_value`): what views, notes and JSON show of the values a checkpoint holds."""

from __future__ import annotations

from typing import Any

__all__ = ["plain_value"]


def _key_text(key: Any) -> str:
    """A dict key as bounded text (keys can be deep tuples or records)."""
    from ckptlab.format._pickle_walk import path_key_text

    return path_key_text(key)


_MAX_ITEMS = 64
_MAX_DEPTH = 6
_MAX_TEXT = 200


def plain_value(value: Any, depth: int = 0) -> Any:
    """An inert, JSON-ready, bounded rendering of a value the checkpoint holds.

    Plain numbers, strings, bools and None stay as they are (strings cut at 200 characters);
    containers become lists and dicts (at most 64 items, 6 levels); anything the file builds
    from a class becomes ``{"type": "module.Class", ...}`` with its arguments and state.
    """
    from ckptlab.format._unpickle import Global, OpaqueKey, Reduced

    kind = type(value)
    if value is None or kind is bool or kind is float:
        return value
    if kind is int:
        return value if -(1 << 63) <= value < (1 << 64) else str(value)
    if kind is str:
        return value if len(value) <= _MAX_TEXT else value[:_MAX_TEXT] + "…"
    if kind in (bytes, bytearray):
        return {"type": "bytes", "nbytes": len(value)}
    if kind is complex:
        return {"type": "complex", "real": value.real, "imag": value.imag}
    if isinstance(value, Global):
        return value.qualname
    if isinstance(value, OpaqueKey):
        return plain_value(value.value, depth)
    if depth >= _MAX_DEPTH:
        return "…"
    if isinstance(value, dict):
        out = {}
        for i, (k, v) in enumerate(value.items()):
            if i >= _MAX_ITEMS:
                out["…"] = f"{len(value) - _MAX_ITEMS} more"
                break
            out[_key_text(k)] = plain_value(v, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [plain_value(v, depth + 1) for v in list(value)[:_MAX_ITEMS]]
        if len(value) > _MAX_ITEMS:
            items.append(f"… {len(value) - _MAX_ITEMS} more")
        return items
    if isinstance(value, Reduced):
        out = {"type": value.func.qualname}
        if value.args:
            out["args"] = plain_value(value.args, depth + 1)
        if value.state is not None:
            out["state"] = plain_value(value.state, depth + 1)
        if value.pairs:  # keys never hashed: they may be anything the file built
            out["items"] = {_key_text(k): plain_value(v, depth + 1)
                            for k, v in value.pairs[:_MAX_ITEMS]}
        elif value.items:
            out["items"] = plain_value(value.items, depth + 1)
        return out
    return {"type": type(value).__name__}
