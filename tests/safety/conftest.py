"""The safety tests compare ckptlab's verdicts with what torch's weights-only loader does *as
torch ships it*: each runs with no user safe globals (a library imported earlier in the
session may have added some, as ``megatron.core`` adds ``argparse.Namespace`` on import), and
what was there is put back after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def torch_default_safe_globals() -> Iterator[None]:
    import torch.serialization as ts

    saved = ts.get_safe_globals()
    ts.clear_safe_globals()
    try:
        yield
    finally:
        ts.clear_safe_globals()
        ts.add_safe_globals(saved)
