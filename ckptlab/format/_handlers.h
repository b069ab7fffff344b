/* ckptlab/format/_handlers.c: the FastHandler type, added to the _entries module. */
#ifndef CKPTLAB_HANDLERS_H
#define CKPTLAB_HANDLERS_H

#include <Python.h>

/* Add ``FastHandler``, ``slot_build`` and ``slot_columns`` to ``module``: 0, or -1 with an
 * exception. */
int handlers_add(PyObject *module);

/* Where the object slot ``name`` that ``type`` defines itself is in its instances (a
 * pointer that is NULL while unset), or -1: no such slot (no exception set). */
Py_ssize_t slot_offset(PyObject *type, const char *name);

#endif
