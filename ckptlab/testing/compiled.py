"""The compiled part of ckptlab (``ckptlab.format._entries``) in tests."""

from __future__ import annotations

import os
from typing import TypeVar

T = TypeVar("T")


def require_compiled(part: T | None) -> T:
    """``part`` of the compiled extension (a function or type found in it, None where it was
    not built): a test that needs it fails under CI (``CI`` set: the build must have it) and
    is skipped elsewhere (no C compiler where ckptlab was installed)."""
    if part is None:
        import pytest

        if os.environ.get("CI"):
            pytest.fail("ckptlab.format._entries is not built (pip install -e . with gcc)")
        pytest.skip("ckptlab.format._entries is not built (no C compiler at install)")
    return part
