"""The optional compiled part of ckptlab (everything else is in pyproject.toml).

``ckptlab.format._entries`` locates and decodes a pickle's state dict entries in one pass
(see its source). It is optional: where no C compiler is at hand the build goes on without
it and ckptlab uses the pure-Python path that gives the same results.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptlab.format._entries", ["ckptlab/format/_entries.c",
                                                       "ckptlab/format/_handlers.c"],
                             depends=["ckptlab/format/_handlers.h"], optional=True)])
