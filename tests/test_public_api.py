"""The top level is small: ``ckptlab.__all__`` names at most 15 things (19 with the verbs
issues 29 and 30 made contracts, ``scan``, ``convert``, ``diff`` and ``stats``), each
importable, and
the names that left it still resolve, with a DeprecationWarning naming their subpackage."""

from __future__ import annotations

import pytest

import ckptlab as cl


def test_all_is_small_and_resolves() -> None:
    assert len(cl.__all__) <= 19  # 15, and issues 29/30's scan, convert, diff, stats
    assert {"open", "inspect", "storage_offsets", "predict_layout", "CkptlabError",
            "__version__"} <= set(cl.__all__)
    for name in cl.__all__:
        assert getattr(cl, name) is not None, name


@pytest.mark.parametrize(("name", "home"), [("realign", "format"), ("ArchiveLayout", "format"),
                                            ("SegmentKind", "format"),
                                            ("Checkpoint", "checkpoint")])
def test_moved_names_warn_and_are_the_same_object(name: str, home: str) -> None:
    import importlib

    with pytest.warns(DeprecationWarning, match=f"ckptlab.{home}.{name}"):
        value = getattr(cl, name)
    assert value is getattr(importlib.import_module(f"ckptlab.{home}"), name)


def test_error_types_stay_catchable_at_the_top() -> None:
    from ckptlab import errors

    assert cl.ArchiveError is errors.ArchiveError
    assert cl.UnsupportedFormatError is errors.UnsupportedFormatError


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        cl.no_such_name  # noqa: B018
