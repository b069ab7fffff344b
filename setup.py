"""The optional compiled part of ckptlab (everything else is in pyproject.toml).

``ckptlab.format._entries`` locates and decodes a pickle's state dict entries in one pass
(see its source). ``ckptlab.format._interp`` is the pickle interpreter of
``ckptlab.format._unpickle`` compiled whole (see its source). Both are optional: where no C
compiler is at hand the build goes on without them and ckptlab uses the pure-Python path that
gives the same results.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ckptlab.format._entries", ["ckptlab/format/_entries.c",
                                                       "ckptlab/format/_handlers.c"],
                             depends=["ckptlab/format/_handlers.h"], optional=True),
                   Extension("ckptlab.format._interp", ["ckptlab/format/_interp.c"],
                             optional=True)])
