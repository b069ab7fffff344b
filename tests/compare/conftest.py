"""The loops under test: ``kernels`` is the fixture of ``test_kernels.py``; ``loops`` runs a
whole module (``pytestmark = pytest.mark.usefixtures("loops")``) once with the NumPy loops
and once with the compiled ones, as ckptlab picks them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from ckptlab.compare import _diff, _kernels, _stats


def pick(which: str) -> Any:
    """The loops ``which`` names; a skip where the compiled ones are not built (a failure
    under CI, which builds them)."""
    try:
        return _kernels.kernels(which)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ckptlab.compare._ckernels is not built (pip install -e . with gcc)")
        pytest.skip("ckptlab.compare._ckernels is not built (no C compiler at install)")


@pytest.fixture(params=["python", "c"])
def kernels(request: pytest.FixtureRequest) -> Any:
    return pick(request.param)


@pytest.fixture(params=["python", "c"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    chosen = pick(request.param)
    for module in (_diff, _stats):
        monkeypatch.setattr(module, "kernels", lambda which=None: chosen)
    yield request.param


@pytest.fixture
def read_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every read of a local file from now on (``LocalTree.fetch``), in order."""
    from ckptlab.source._tree import LocalTree

    sizes: list[int] = []
    fetch = LocalTree.fetch

    def spy(self: Any, full: str, start: int, end: int, into: Any = None) -> Any:
        sizes.append(end - start)
        return fetch(self, full, start, end, into)

    monkeypatch.setattr(LocalTree, "fetch", spy)
    return sizes
