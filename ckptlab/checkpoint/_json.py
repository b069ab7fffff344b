"""The ``ckptlab inspect --json`` object, built in one place from the checkpoint model
(:meth:`Checkpoint.to_dict`) and, where the format has them, its byte layout's keys; the
contract is ``ckptlab/schemas/inspect.schema.json`` (``tests/test_cli_schema.py`` validates
every format's output against it)."""

from __future__ import annotations

from typing import Any

__all__ = ["dcp_layout_of", "inspect_json"]


def dcp_layout_of(ck: Any) -> Any:
    """The DcpLayout of a DCP checkpoint when it has one at hand: kept on its .metadata file
    (opened from a URL), or built from the fast open's columns (equal to ``inspect_dcp``'s);
    None otherwise."""
    from ckptlab.dcp import DcpLayout

    kept = next((f.layout for f in ck.files if isinstance(f.layout, DcpLayout)), None)
    if kept is None and callable(getattr(ck, "dcp_layout", None)):
        kept = ck.dcp_layout()
    return kept


def inspect_json(ck: Any, tensors: list[Any] | None = None) -> dict[str, Any]:
    """The ``inspect --json`` object of any checkpoint: the layout's byte-level keys where the
    format has them (a torch.save or safetensors file, a DCP directory), then the model's
    (``format``, ``path``, ``files``, ``tensors``, ``objects``, ``notes``, ``run``;
    ``tensors``: these entries, default all), and ``segments`` on every format (a single
    file's, else ``[]``)."""
    from ckptlab._inspect import inspect
    from ckptlab.format.archive import largest_alignment
    from ckptlab.format.layout import segments_json

    layout = next((f.layout for f in ck.files if f.layout is not None), None)
    base: dict[str, Any]
    if ck.format in ("torch-zip", "safetensors") and layout is not None:
        base = layout.to_dict()
    elif ck.format == "dcp":
        # the fast open's own layout (its columns and the item layouts the tensors read), or
        # the one kept for a URL (which inspect() cannot list), else inspect_dcp's
        dcp_layout = dcp_layout_of(ck)
        base = (dcp_layout if dcp_layout is not None else inspect(ck.path)).to_dict()
    else:
        offsets = [p.offset for t in ck.tensors.values() for p in t.parts if p.nbytes]
        base = {"file_nbytes": ck.nbytes, "archive_name": "",
                "alignment": largest_alignment(offsets) if offsets else 4096,
                "zip64": any(getattr(f.layout, "zip64", False) for f in ck.files),
                "records": [], "storages": []}
    model = ck.to_dict(tensors)
    model.pop("file_nbytes")  # (the layout's where it has one: the same bytes)
    base.update(model)
    if "segments" not in base:
        one = ck.files[0] if len(ck.files) == 1 and ck.format != "dcp" else None
        base["segments"] = segments_json(one.segments) if one is not None else []
    return base
