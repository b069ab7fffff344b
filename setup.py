"""The optional compiled part of ckptlab (everything else is in pyproject.toml).

``ckptlab.format._interp`` is the pickle interpreter of ``ckptlab.format._unpickle`` compiled
whole, with the hot torch handlers of ``ckptlab.format._torch_handlers``, its walk (``_walk.c``) and
the rows of a DCP ``.metadata`` (``ckptlab/dcp/_rows.c``: ``ckptlab.dcp.columns._Rows``). It is optional: where no C compiler is at hand the build goes on
without it and ckptlab uses the Python implementation, which gives the same results.
``ckptlab.compare._ckernels`` holds the element loops of ``ckptlab.compare._kernels`` (diff and
stats), optional in the same way.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptlab.format._interp", ["ckptlab/format/_interp.c",
                                                      "ckptlab/format/_walk.c",
                                                      "ckptlab/dcp/_rows.c"],
                             optional=True),
                   # no fused multiply-add: the histogram bins are computed as torch.histc does
                   Extension("ckptlab.compare._ckernels", ["ckptlab/compare/_ckernels.c"],
                             extra_compile_args=["-ffp-contract=off"], optional=True)])
