/* DcpRows: ckptlab.dcp.columns._Rows compiled (the same interface, results and refusals;
 * tests/dcp/test_columns.py runs against both). Built into ckptlab.format._interp.
 *
 * DcpRows(base, span, size_type, data_error, give_up): the per-item records of a DCP
 * .metadata as columns. ``size(value=())`` is the torch.Size handler (a tuple or list of at
 * most 64 ints in 0..2**63-1, as ``size_type``; else ``data_error``); ``build(target,
 * state)`` is the interpreter's build hook: ``target`` a row number (the float ``base +
 * kind * span + row``, kind 0 chunk, 1 MetadataIndex, 2 _StorageInfo), built once and in
 * order, ``state`` its fields, checked as the converter checks them and appended to the
 * columns; anything else raises ``give_up``. ``columns()`` gives the 11 columns as
 * bytearrays (native int8 / int32 / int64), ``built`` the rows built per kind, ``fqn_ids``
 * / ``file_ids`` the names in order of first use, ``transforms`` whether an entry has
 * transform descriptors. Only CPython's public API is used. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MAX_INDEX INT64_MAX
enum { CHUNK_NDIM, CHUNK_START, CHUNK_VALUES, KEY_FQN, KEY_INDEX, KEY_NDIM, KEY_OFFSETS,
       INDEX_VALUES, INFO_FILE, INFO_OFFSET, INFO_LENGTH, NCOLS };
enum { F_OFFSETS, F_SIZES, F_FQN, F_OFFSET, F_INDEX, F_PATH, F_LENGTH, F_DESCRIPTORS, NFIELDS };
static const char *field_names[NFIELDS] = {"offsets", "sizes", "fqn", "offset", "index",
                                           "relative_path", "length",
                                           "transform_descriptors"};

typedef struct {
    PyObject_HEAD
    double base, span;
    Py_ssize_t built[3];
    PyObject *size_type, *data_error, *give_up;
    PyObject *fqn_ids, *file_ids;
    PyObject *cols[NCOLS];
    PyObject *names[NFIELDS];
    int transforms;
} DcpRows;

static int
put(PyObject *column, const void *value, Py_ssize_t nbytes)
{
    Py_ssize_t n = PyByteArray_GET_SIZE(column);
    if (PyByteArray_Resize(column, n + nbytes) < 0)
        return -1;
    memcpy(PyByteArray_AS_STRING(column) + n, value, (size_t)nbytes);
    return 0;
}

static int
put8(PyObject *column, long long value)
{
    int8_t v = (int8_t)value;
    return put(column, &v, 1);
}

static int
put32(PyObject *column, long long value)
{
    int32_t v = (int32_t)value;
    return put(column, &v, 4);
}

static int
put64(PyObject *column, long long value)
{
    int64_t v = (int64_t)value;
    return put(column, &v, 8);
}

static int
give_up(DcpRows *self)
{
    PyErr_SetString(self->give_up, "not a shape the columns represent");
    return -1;
}

/* A non-negative int below 2**63 (an exact int: not a bool), or -1 with no error set. */
static long long
index_value(PyObject *value)
{
    if (value == NULL || !PyLong_CheckExact(value))
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow || v < 0) {
        PyErr_Clear();
        return -1;
    }
    return v;
}

/* The values of a Size (validated ints) appended to ``column``. */
static int
put_size(PyObject *column, PyObject *size)
{
    Py_ssize_t n = PyTuple_GET_SIZE(size);
    for (Py_ssize_t i = 0; i < n; i++)
        if (put64(column, PyLong_AsLongLong(PyTuple_GET_ITEM(size, i))) < 0)
            return -1;
    return 0;
}

/* The id of ``name`` in ``ids`` (a new one at the end where it is new). */
static long long
name_id(PyObject *ids, PyObject *name)
{
    PyObject *next = PyLong_FromSsize_t(PyDict_GET_SIZE(ids));
    if (next == NULL)
        return -1;
    PyObject *id = PyDict_SetDefault(ids, name, next);
    Py_DECREF(next);
    return id == NULL ? -1 : PyLong_AsLongLong(id);
}

/* Whether every key of ``state`` is one of fields[lo..hi]. */
static int
only_fields(DcpRows *self, PyObject *state, int lo, int hi)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(state, &pos, &key, &value)) {
        int known = 0;
        for (int f = lo; f <= hi && !known; f++) {
            int eq = PyUnicode_Check(key) ? PyUnicode_Compare(key, self->names[f]) == 0 : 0;
            if (PyErr_Occurred())
                return -1;
            known = eq;
        }
        if (!known)
            return 0;
    }
    return 1;
}

static PyObject *
get(DcpRows *self, PyObject *state, int field)
{
    PyObject *value = PyDict_GetItemWithError(state, self->names[field]);
    return value;  /* borrowed, NULL: absent (or an error, which the caller checks) */
}

static int
build_chunk(DcpRows *self, PyObject *state)
{
    PyObject *offsets = get(self, state, F_OFFSETS), *sizes = get(self, state, F_SIZES);
    if (PyErr_Occurred())
        return -1;
    if (PyDict_GET_SIZE(state) != 2 || offsets == NULL || sizes == NULL ||
        (PyObject *)Py_TYPE(offsets) != self->size_type ||
        (PyObject *)Py_TYPE(sizes) != self->size_type ||
        PyTuple_GET_SIZE(offsets) != PyTuple_GET_SIZE(sizes))
        return give_up(self);
    if (put8(self->cols[CHUNK_NDIM], PyTuple_GET_SIZE(offsets)) < 0 ||
        put64(self->cols[CHUNK_START], PyByteArray_GET_SIZE(self->cols[CHUNK_VALUES]) / 8) < 0 ||
        put_size(self->cols[CHUNK_VALUES], offsets) < 0 ||
        put_size(self->cols[CHUNK_VALUES], sizes) < 0)
        return -1;
    return 0;
}

static int
build_index(DcpRows *self, PyObject *state)
{
    PyObject *fqn = get(self, state, F_FQN), *offset = get(self, state, F_OFFSET);
    PyObject *index = get(self, state, F_INDEX);
    if (PyErr_Occurred())
        return -1;
    if (fqn == NULL || !PyUnicode_CheckExact(fqn))
        return give_up(self);
    int only = only_fields(self, state, F_FQN, F_INDEX);
    if (only <= 0)
        return only < 0 ? -1 : give_up(self);
    long long row_index = -1;
    if (index != NULL && index != Py_None && (row_index = index_value(index)) < 0)
        return give_up(self);
    int has_offset = offset != NULL && offset != Py_None;
    if (has_offset && (PyObject *)Py_TYPE(offset) != self->size_type)
        return give_up(self);
    if (has_offset) {
        if (put8(self->cols[KEY_NDIM], PyTuple_GET_SIZE(offset)) < 0 ||
            put64(self->cols[KEY_OFFSETS],
                  PyByteArray_GET_SIZE(self->cols[INDEX_VALUES]) / 8) < 0 ||
            put_size(self->cols[INDEX_VALUES], offset) < 0)
            return -1;
    } else if (put8(self->cols[KEY_NDIM], 0) < 0 || put64(self->cols[KEY_OFFSETS], -1) < 0) {
        return -1;
    }
    long long id = name_id(self->fqn_ids, fqn);
    if (id < 0 || put32(self->cols[KEY_FQN], id) < 0 ||
        put64(self->cols[KEY_INDEX], row_index) < 0)
        return -1;
    return 0;
}

static int
build_info(DcpRows *self, PyObject *state)
{
    PyObject *path = get(self, state, F_PATH), *offset = get(self, state, F_OFFSET);
    PyObject *length = get(self, state, F_LENGTH);
    PyObject *descriptors = get(self, state, F_DESCRIPTORS);
    if (PyErr_Occurred())
        return -1;
    long long at = index_value(offset), nbytes = index_value(length);
    if (path == NULL || !PyUnicode_CheckExact(path) || at < 0 || nbytes < 0)
        return give_up(self);
    int only = only_fields(self, state, F_OFFSET, F_DESCRIPTORS);
    if (only <= 0 || PyDict_Contains(state, self->names[F_INDEX]))
        return only < 0 || PyErr_Occurred() ? -1 : give_up(self);
    if (descriptors != NULL && descriptors != Py_None) {
        if (!PyList_CheckExact(descriptors) && !PyTuple_CheckExact(descriptors))
            return give_up(self);
        PyObject *fast = PySequence_Fast(descriptors, "descriptors");
        if (fast == NULL)
            return -1;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
        for (Py_ssize_t i = 0; i < n; i++) {
            if (!PyUnicode_CheckExact(PySequence_Fast_GET_ITEM(fast, i))) {
                Py_DECREF(fast);
                return give_up(self);
            }
        }
        Py_DECREF(fast);
        if (n)
            self->transforms = 1;
    }
    long long id = name_id(self->file_ids, path);
    if (id < 0 || put32(self->cols[INFO_FILE], id) < 0 ||
        put64(self->cols[INFO_OFFSET], at) < 0 || put64(self->cols[INFO_LENGTH], nbytes) < 0)
        return -1;
    return 0;
}

static PyObject *
rows_build(DcpRows *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "build(target, state)");
        return NULL;
    }
    PyObject *target = args[0], *state = args[1];
    if (!PyFloat_CheckExact(target)) {
        give_up(self);
        return NULL;
    }
    double row = PyFloat_AS_DOUBLE(target) - self->base;
    int kind = row >= 0 && row < self->span ? 0 : row >= self->span && row < 2 * self->span
               ? 1 : row >= 2 * self->span && row < 3 * self->span ? 2 : -1;
    if (kind < 0 || row - kind * self->span != (double)self->built[kind]) {
        give_up(self);
        return NULL;
    }
    self->built[kind]++;
    if (PyTuple_CheckExact(state) && PyTuple_GET_SIZE(state) == 2 &&
        PyTuple_GET_ITEM(state, 0) == Py_None)
        state = PyTuple_GET_ITEM(state, 1);  /* (None, slots) of a slotted dataclass */
    if (!PyDict_CheckExact(state)) {  /* (None: no fields, which every record needs) */
        give_up(self);
        return NULL;
    }
    int rc = kind == 0 ? build_chunk(self, state) : kind == 1 ? build_index(self, state)
                                                               : build_info(self, state);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
rows_size(DcpRows *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 1) {
        PyErr_Format(PyExc_TypeError, "size() takes at most 1 argument (%zd given)", nargs);
        return NULL;
    }
    if (nargs == 0)
        return PyObject_CallNoArgs(self->size_type);
    PyObject *value = args[0];
    int ok = PyTuple_CheckExact(value) || PyList_CheckExact(value);
    Py_ssize_t n = ok ? PySequence_Fast_GET_SIZE(value) : 0;
    ok = ok && n <= 64;
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = index_value(PySequence_Fast_GET_ITEM(value, i)) >= 0;
    if (!ok) {
        PyErr_SetString(self->data_error,
                        "torch.Size of something other than non-negative ints");
        return NULL;
    }
    return PyObject_CallOneArg(self->size_type, value);
}

static PyObject *
rows_columns(DcpRows *self, PyObject *unused)
{
    PyObject *out = PyTuple_New(NCOLS);
    if (out == NULL)
        return NULL;
    for (int i = 0; i < NCOLS; i++)
        PyTuple_SET_ITEM(out, i, Py_NewRef(self->cols[i]));
    return out;
}

static PyObject *
rows_get_built(DcpRows *self, void *closure)
{
    return Py_BuildValue("[nnn]", self->built[0], self->built[1], self->built[2]);
}

static PyObject *
rows_get_transforms(DcpRows *self, void *closure)
{
    return PyBool_FromLong(self->transforms);
}

static PyObject *
rows_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    double base, span;
    PyObject *size_type, *data_error, *give_up_type;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "DcpRows takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "ddOOO:DcpRows", &base, &span, &size_type, &data_error,
                          &give_up_type))
        return NULL;
    DcpRows *self = (DcpRows *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->base = base;
    self->span = span;
    self->size_type = Py_NewRef(size_type);
    self->data_error = Py_NewRef(data_error);
    self->give_up = Py_NewRef(give_up_type);
    if ((self->fqn_ids = PyDict_New()) == NULL || (self->file_ids = PyDict_New()) == NULL)
        goto error;
    for (int i = 0; i < NCOLS; i++)
        if ((self->cols[i] = PyByteArray_FromStringAndSize(NULL, 0)) == NULL)
            goto error;
    for (int f = 0; f < NFIELDS; f++)
        if ((self->names[f] = PyUnicode_InternFromString(field_names[f])) == NULL)
            goto error;
    return (PyObject *)self;
error:
    Py_DECREF(self);
    return NULL;
}

static void
rows_dealloc(DcpRows *self)
{
    PyTypeObject *type = Py_TYPE(self);
    Py_XDECREF(self->size_type);
    Py_XDECREF(self->data_error);
    Py_XDECREF(self->give_up);
    Py_XDECREF(self->fqn_ids);
    Py_XDECREF(self->file_ids);
    for (int i = 0; i < NCOLS; i++)
        Py_XDECREF(self->cols[i]);
    for (int f = 0; f < NFIELDS; f++)
        Py_XDECREF(self->names[f]);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

static PyMethodDef rows_methods[] = {
    {"build", (PyCFunction)(void (*)(void))rows_build, METH_FASTCALL,
     "build(target, state): a row's fields into the columns (the interpreter's build hook)"},
    {"size", (PyCFunction)(void (*)(void))rows_size, METH_FASTCALL,
     "size(value=()): the torch.Size handler"},
    {"columns", (PyCFunction)rows_columns, METH_NOARGS, "columns(): the 11 columns"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef rows_members[] = {
    {"fqn_ids", T_OBJECT, offsetof(DcpRows, fqn_ids), READONLY, NULL},
    {"file_ids", T_OBJECT, offsetof(DcpRows, file_ids), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef rows_getset[] = {
    {"built", (getter)rows_get_built, NULL, "rows built, per kind", NULL},
    {"transforms", (getter)rows_get_transforms, NULL, "an entry has transform descriptors",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot rows_slots[] = {
    {Py_tp_new, rows_new},
    {Py_tp_dealloc, rows_dealloc},
    {Py_tp_methods, rows_methods},
    {Py_tp_members, rows_members},
    {Py_tp_getset, rows_getset},
    {Py_tp_doc, "DcpRows(base, span, size_type, data_error, give_up): "
                "ckptlab.dcp.columns._Rows compiled"},
    {0, NULL},
};

PyType_Spec ckptlab_dcp_rows_spec = {
    "ckptlab.format._interp.DcpRows", (int)sizeof(DcpRows), 0, Py_TPFLAGS_DEFAULT, rows_slots,
};
