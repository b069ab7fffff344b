"""The rows of a DCP ``.metadata`` (:class:`ckptlab.dcp.columns._Rows` and its compiled twin
``ckptlab.format._interp.DcpRows``, ``ckptlab/dcp/_rows.c``), called directly: the
``torch.Size`` handler and the ``BUILD`` hook accept what the converter accepts and refuse
the rest, each row once and in order. No torch needed (the newest CPython runs these too);
``test_columns.py`` runs both on whole ``.metadata`` files against DCP's own objects.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("impl")  # (tests/dcp/conftest.py)


def test_the_rows_hand_out_their_class(impl: str) -> None:
    """The implementation the switch names is the one decoding."""
    from ckptlab.dcp.columns import _Decoding

    assert (type(_Decoding().rows).__name__ == "DcpRows") == (impl == "c")


@pytest.mark.parametrize("value", [(1, 2), [0, 2**63 - 1], (), [5]])
def test_size_handler_accepts(value: Any) -> None:
    from ckptlab.dcp._decode import Size
    from ckptlab.dcp.columns import _Decoding

    got = _Decoding().rows.size(value)
    assert type(got) is Size and tuple(got) == tuple(value)
    assert tuple(_Decoding().rows.size()) == ()


@pytest.mark.parametrize("value", [(True,), (-1,), (2**63,), (1.0,), ("1",), (1,) * 65,
                                   "ab", {1: 2}, None, (1, None)])
def test_size_handler_refuses(value: Any) -> None:
    from ckptlab.dcp.columns import _Decoding
    from ckptlab.format._unpickle import PickleDataError

    with pytest.raises(PickleDataError, match=r"torch\.Size of something other than "
                                              "non-negative ints"):
        _Decoding().rows.size(value)


def _row(decoding: Any, kind: int, row: int = 0) -> float:
    from ckptlab.dcp.columns import _SPAN

    return float(decoding.base + kind * _SPAN + row)


@pytest.mark.parametrize("kind, state", [
    (0, {"offsets": (0,), "sizes": (1,)}),  # plain tuples, not torch.Size
    (0, {"offsets": "S"}),
    (0, {"offsets": "S", "sizes": "S2"}),  # lengths differ
    (0, {"offsets": "S", "sizes": "S", "x": 1}),
    (0, None),
    (1, {"offset": "S"}),  # no fqn
    (1, {"fqn": b"w"}),
    (1, {"fqn": "w", "index": -1}),
    (1, {"fqn": "w", "index": True}),
    (1, {"fqn": "w", "offset": (0,)}),
    (1, {"fqn": "w", "sizes": "S"}),
    (2, {"relative_path": "f", "offset": 0}),
    (2, {"relative_path": "f", "offset": 0, "length": 2**63}),
    (2, {"relative_path": "f", "offset": 1.0, "length": 1}),
    (2, {"relative_path": "f", "offset": 0, "length": 1, "index": 0}),
    (2, {"relative_path": "f", "offset": 0, "length": 1, "transform_descriptors": [1]}),
    (2, {"relative_path": "f", "offset": 0, "length": 1, "transform_descriptors": "ab"}),
])
def test_build_refuses_fields_the_converter_refuses(kind: int, state: Any) -> None:
    from ckptlab.dcp.columns import _Decoding, _GiveUp

    decoding = _Decoding()
    size = decoding.rows.size
    if isinstance(state, dict):
        state = {k: size((0,)) if v == "S" else size((0, 1)) if v == "S2" else v
                 for k, v in state.items()}
    with pytest.raises(_GiveUp):
        decoding.rows.build(_row(decoding, kind), state)


def test_build_takes_rows_once_and_in_order() -> None:
    from ckptlab.dcp.columns import _Decoding, _GiveUp

    decoding = _Decoding()
    rows = decoding.rows
    chunk = {"offsets": rows.size((0, 0)), "sizes": rows.size((2, 3))}
    rows.build(_row(decoding, 0), chunk)
    rows.build(_row(decoding, 0, 1), (None, chunk))  # a slotted dataclass's state
    for target in (_row(decoding, 0), _row(decoding, 0, 3), _row(decoding, 3), 0, 1.5,
                   decoding.base + 0.0 - 1):
        with pytest.raises(_GiveUp):
            rows.build(target, chunk)
    rows.build(_row(decoding, 1), {"fqn": "w", "offset": rows.size((0, 0)), "index": 7})
    rows.build(_row(decoding, 1, 1), {"fqn": "step"})
    rows.build(_row(decoding, 2), {"relative_path": "__0_0.distcp", "offset": 3,
                                   "length": 2**40, "transform_descriptors": ["zstd"]})
    assert rows.built == [2, 2, 1] and rows.transforms
    assert rows.fqn_ids == {"w": 0, "step": 1} and rows.file_ids == {"__0_0.distcp": 0}
    from ckptlab.dcp.columns import _typed

    cols = [list(c) for c in _typed(rows.columns())]
    assert cols == [[2, 2], [0, 4], [0, 0, 2, 3, 0, 0, 2, 3], [0, 1], [7, -1], [2, 0],
                    [0, -1], [0, 0], [0], [3], [2**40]]
