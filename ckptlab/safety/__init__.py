"""Is this checkpoint safe to load? (:func:`scan`), read without running anything.

- :mod:`ckptlab.safety.scan`: which pickles a file's loader runs, and the report;
- :mod:`ckptlab.safety._pickle_scan`: one pickle through ckptlab's inert interpreter, what it
  imports, calls and builds written down;
- :mod:`ckptlab.safety._classes`: what each global would do (``torch``, ``data``, ``code``),
  ckptlab's documented list;
- :mod:`ckptlab.safety._weights_only`: what ``torch.load(weights_only=True)`` of the installed
  torch does, from torch's own rules read at call time.
"""

from ckptlab.safety._classes import classify
from ckptlab.safety.scan import VERDICTS, Call, FileSafety, SafetyReport, WeightsOnly, scan

__all__ = ["VERDICTS", "Call", "FileSafety", "SafetyReport", "WeightsOnly", "classify", "scan"]
