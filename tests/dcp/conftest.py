"""Fixtures of the DCP tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(params=["python", "c"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test against both implementations of the ``.metadata`` rows (and of the
    interpreter): the Python ``_Rows`` and the compiled ``DcpRows`` (``_pickle._IMPL``
    switches both). Modules that want it say ``pytestmark = pytest.mark.usefixtures("impl")``.
    """
    from ckptlab.format import _pickle

    if request.param == "c":
        try:
            from ckptlab.format._interp import DcpRows  # noqa: F401
        except ImportError:
            if os.environ.get("CI"):
                pytest.fail("ckptlab.format._interp is not built (pip install -e . with gcc)")
            pytest.skip("ckptlab.format._interp is not built")
    monkeypatch.setattr(_pickle, "_IMPL", request.param)
    return request.param
