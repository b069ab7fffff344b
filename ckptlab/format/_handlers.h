/* ckptlab/format/_handlers.c: the FastHandler type, added to the _entries module. */
#ifndef CKPTLAB_HANDLERS_H
#define CKPTLAB_HANDLERS_H

#include <Python.h>

/* Add ``FastHandler`` to ``module``: 0, or -1 with an exception. */
int handlers_add(PyObject *module);

#endif
