"""tests/dcp: the rank functions the DCP tests save with live in ``tests/plan/dcp_workers.py``
(shared with ``tests/plan/test_real_runs.py``); its folder goes on ``sys.path`` here, as pytest
puts a test's own folder there, so ``import dcp_workers`` works (and in the ranks
``run_ranks`` spawns, which inherit ``sys.path``) whichever tests run."""

from __future__ import annotations

import sys
from pathlib import Path

_PLAN_TESTS = str(Path(__file__).resolve().parent.parent / "plan")
if _PLAN_TESTS not in sys.path:
    sys.path.append(_PLAN_TESTS)
