"""The optional compiled part of ckptlab (everything else is in pyproject.toml).

``ckptlab.format._interp`` is the pickle interpreter of ``ckptlab.format._unpickle`` compiled
whole, with the hot torch handlers of ``ckptlab.format._pickle``, its walk (``_walk.c``) and
the rows of a DCP ``.metadata`` (``ckptlab/dcp/_rows.c``: ``ckptlab.dcp.columns._Rows``). It is optional: where no C compiler is at hand the build goes on
without it and ckptlab uses the Python implementation, which gives the same results.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptlab.format._interp", ["ckptlab/format/_interp.c",
                                                      "ckptlab/format/_walk.c",
                                                      "ckptlab/dcp/_rows.c"],
                             optional=True)])
