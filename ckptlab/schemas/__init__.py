"""JSON Schemas (draft 2020-12) of what the command line prints with ``--json``.

They are the contract of README's *The command line* and DESIGN's *CLI contract*, kept as
package data next to this module:

- ``inspect`` (``inspect.schema.json``): ``ckptlab inspect PATH --json``, for every format;
- ``records`` (``records.schema.json``): ``ckptlab inspect PATH --records --json``, the
  byte-level layout alone (a torch.save zip or safetensors file's, or a DCP directory's);
- ``offsets`` (``offsets.schema.json``): ``ckptlab offsets PATH --json``, both of its shapes
  (a torch.save file's storage keys; every other checkpoint's tensor parts);
- ``diff`` (``diff.schema.json``): ``ckptlab diff A B --json``;
- ``stats`` (``stats.schema.json``): ``ckptlab stats PATH --json``.

The keys a schema requires are the ones the contract promises, typed (offsets and sizes are
non-negative integers, dtypes torch's names without the ``torch.`` prefix); every object may
carry more keys. ``tests/test_cli_schema.py`` validates the output of every format against
them.

Examples
--------
>>> import jsonschema                                           # doctest: +SKIP
>>> from ckptlab.schemas import schema
>>> jsonschema.Draft202012Validator(schema("inspect")).validate(doc)  # doctest: +SKIP
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["NAMES", "schema", "schema_text"]

NAMES = ("diff", "inspect", "offsets", "records", "stats")


def schema_text(name: str) -> str:
    """The text of the schema ``name`` (one of :data:`NAMES`), as shipped."""
    if name not in NAMES:
        from ckptlab.errors import InvalidArgumentError

        raise InvalidArgumentError(f"no schema {name!r}: expected one of {', '.join(NAMES)}")
    return resources.files(__name__).joinpath(f"{name}.schema.json").read_text("utf-8")


def schema(name: str) -> dict[str, Any]:
    """The JSON Schema ``name`` (one of :data:`NAMES`) as a dict: a fresh copy on each call.

    Raises
    ------
    InvalidArgumentError
        For any other name (a ``ValueError`` too).
    """
    return json.loads(schema_text(name))
