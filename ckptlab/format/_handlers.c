/* Two of torch's rebuild handlers (ckptlab.format._pickle._TorchHandlers) in C, for their
 * common case: one call per tensor of a checkpoint, each of which made two objects through
 * two Python __init__ frames and a persistent id check in a third.
 *
 * ``FastHandler(kind, fallback, tensor_type, storage_type=None, storage_types=None,
 * storages=None, storage_order=None)`` is a callable that does what ``fallback`` (the Python
 * method) does, for the arguments it recognises, and calls ``fallback`` with everything
 * else. So it is a drop-in: the same results, the same objects, the same errors (those are
 * all the fallback's), only faster where the case is the common one.
 *
 * - ``kind="fused_v2"``: ``_TorchHandlers.fused_v2(pid, offset, size, stride,
 *   requires_grad)``, where the persistent id is a storage of a class the table has seen
 *   (``storage_types``, by id), with a string key and location and a non-negative int numel,
 *   and the storage is new (made and stored in ``storages``/``storage_order``) or seen with
 *   the same byte size. It returns ``(storage, tensor)``.
 * - ``kind="rebuild_parameter"``: ``_TorchHandlers.rebuild_parameter(data, requires_grad,
 *   hooks, state)`` of a ``tensor_type`` instance and a bool: the tensor, marked.
 *
 * ``slot_build(cls, count, columns)`` and ``slot_columns(objects, cls)`` make many objects
 * of a slotted class from columns, and read them back as columns, in one pass each
 * (ckptlab.format._bulk.build, ckptlab.format._pickle.fields_of).
 *
 * The objects are made as ``tensor_type(...)`` / ``storage_type(...)`` would make them,
 * without their ``__init__``: both are plain slotted classes (object their only base, no
 * ``__dict__``), whose slots are found by name when the handler is made (each must be a
 * writable object slot of that class, and the class must have no other slot), and each
 * object has every slot set before it is returned. The storage class is a frozen
 * dataclass; its instances are set once, here, as its own __init__ would set them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "_handlers.h"

#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX T_OBJECT_EX
#endif
#ifndef Py_READONLY
#define Py_READONLY READONLY
#endif

enum { FUSED_V2, PARAMETER };

/* _pickle._TensorRef's and StorageRef's slots, in the order the code below names them */
static const char *const tensor_names[] = {
    "storage", "storage_offset", "shape", "stride", "requires_grad", "dtype",
    "is_parameter", "subclass", "attrs", "pending",
};
enum { T_STORAGE, T_OFFSET, T_SHAPE, T_STRIDE, T_GRAD, T_DTYPE, T_PARAMETER, T_SUBCLASS,
       T_ATTRS, T_PENDING, T_COUNT };
static const char *const storage_names[] = {
    "key", "storage_type", "dtype", "location", "numel", "nbytes",
};
enum { S_KEY, S_TYPE, S_DTYPE, S_LOCATION, S_NUMEL, S_NBYTES, S_COUNT };

/* A slotted class and where each of its named slots is in an instance. */
#define MAX_SLOTS 32
typedef struct {
    PyTypeObject *type;
    Py_ssize_t count;
    Py_ssize_t offsets[MAX_SLOTS];
} Layout;

#define SLOT(obj, layout, i) (*(PyObject **)((char *)(obj) + (layout)->offsets[i]))

/* Fill ``layout`` for ``type`` and the slot ``names`` (all of its slots, each a writable
 * object slot it defines itself); 0, or -1 with TypeError. ``names`` NULL: its
 * ``__slots__`` (a tuple of at most MAX_SLOTS), in order, whatever ``count``. */
static int
layout_of(PyObject *type, const char *const *names, Py_ssize_t count, Layout *layout)
{
    if (!PyType_Check(type)) {
        PyErr_Format(PyExc_TypeError, "%R is not a class", type);
        return -1;
    }
    PyTypeObject *t = (PyTypeObject *)type;
    PyObject *slots = t->tp_base != &PyBaseObject_Type || t->tp_dictoffset != 0 ||
        !(t->tp_flags & Py_TPFLAGS_HEAPTYPE) ? NULL : PyDict_GetItemString(t->tp_dict,
                                                                           "__slots__");
    Py_ssize_t have = slots != NULL && PyTuple_Check(slots) ? PyTuple_GET_SIZE(slots) : -1;
    if (names == NULL && have <= MAX_SLOTS)
        count = have;
    if (have != count || count < 0) {
        PyErr_Format(PyExc_TypeError, "%R is not a plain class with %zd slots", type, count);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        const char *name = names != NULL ? names[i] :
            PyUnicode_Check(PyTuple_GET_ITEM(slots, i)) ?
            PyUnicode_AsUTF8(PyTuple_GET_ITEM(slots, i)) : NULL;
        if (name == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "%R has a slot name that is not a str", type);
            return -1;
        }
        PyObject *d = PyObject_GetAttrString(type, name);
        if (d == NULL)
            return -1;
        int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                 PyDescr_TYPE(d) == t;
        PyMemberDef *m = ok ? ((PyMemberDescrObject *)d)->d_member : NULL;
        ok = ok && m->type == Py_T_OBJECT_EX && !(m->flags & Py_READONLY);
        Py_DECREF(d);
        if (!ok) {
            PyErr_Format(PyExc_TypeError, "%R.%s is not one of its slots", type, name);
            return -1;
        }
        layout->offsets[i] = m->offset;
        for (Py_ssize_t k = 0; k < i; k++)
            if (layout->offsets[k] == m->offset) {  /* (two names of one slot) */
                PyErr_Format(PyExc_TypeError, "%R.%s is another name of a slot", type, name);
                return -1;
            }
    }
    layout->type = (PyTypeObject *)Py_NewRef(type);
    layout->count = count;
    return 0;
}

Py_ssize_t
slot_offset(PyObject *type, const char *name)
{
    if (!PyType_Check(type))
        return -1;
    PyObject *d = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, name);  /* borrowed */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type) ||
        PyDescr_TYPE(d) != (PyTypeObject *)type)
        return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    return m->type == Py_T_OBJECT_EX ? m->offset : -1;
}

/* An instance of the layout's class with every slot set to ``values`` (new references). */
static PyObject *
instance(const Layout *layout, PyObject *const *values)
{
    PyObject *obj = layout->type->tp_alloc(layout->type, 0);
    if (obj == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < layout->count; i++)
        SLOT(obj, layout, i) = Py_NewRef(values[i]);
    return obj;
}

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    int kind;
    PyObject *fallback;
    Layout tensor;
    Layout storage;           /* fused_v2: */
    PyObject *storage_types;  /* {id(class): (class, dtype, itemsize)} */
    PyObject *storages;       /* {key: storage} */
    PyObject *storage_order;  /* [key, ...] in the order they were first seen */
} Handler;

/* _TorchHandlers.fused_v2, taken: 1 with *out, 0 (nothing changed: the fallback says), -1 */
static int
fused_v2(Handler *h, PyObject *const *args, Py_ssize_t nargs, PyObject **out)
{
    if (nargs != 5 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 5)
        return 0;
    PyObject *pid = args[0];
    PyObject *tag = PyTuple_GET_ITEM(pid, 0), *cls = PyTuple_GET_ITEM(pid, 1);
    PyObject *key = PyTuple_GET_ITEM(pid, 2), *location = PyTuple_GET_ITEM(pid, 3);
    PyObject *numel = PyTuple_GET_ITEM(pid, 4);
    if (!PyUnicode_CheckExact(tag) || PyUnicode_CompareWithASCIIString(tag, "storage") != 0 ||
        !PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(location) ||
        !PyLong_CheckExact(numel))
        return 0;
    int overflow;
    long long count = PyLong_AsLongLongAndOverflow(numel, &overflow);
    if (count == -1 && PyErr_Occurred())
        return -1;
    if (overflow != 0 || count < 0)
        return 0;
    PyObject *id = PyLong_FromVoidPtr(cls);
    if (id == NULL)
        return -1;
    PyObject *known = PyDict_GetItemWithError(h->storage_types, id);  /* (borrowed) */
    Py_DECREF(id);
    if (known == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(known) || PyTuple_GET_SIZE(known) < 3 ||
        PyTuple_GET_ITEM(known, 0) != cls || !PyLong_CheckExact(PyTuple_GET_ITEM(known, 2)))
        return 0;
    /* (held from here: an allocation may run a collection, and a finalizer anything) */
    PyObject *nbytes = PyNumber_Multiply(numel, PyTuple_GET_ITEM(known, 2));
    if (nbytes == NULL)
        return -1;
    Py_INCREF(known);
    PyObject *ref = PyDict_GetItemWithError(h->storages, key), *dtype = NULL;
    Py_XINCREF(ref);
    int done = -1;
    if (ref == NULL) {
        if (PyErr_Occurred())
            goto out;
        PyObject *name = PyObject_GetAttrString(cls, "name");
        if (name == NULL)
            goto out;
        PyObject *fields[S_COUNT] = {key, name, PyTuple_GET_ITEM(known, 1), location, numel,
                                     nbytes};
        ref = instance(&h->storage, fields);
        Py_DECREF(name);
        if (ref == NULL || PyDict_SetItem(h->storages, key, ref) < 0 ||
            PyList_Append(h->storage_order, key) < 0)
            goto out;
    }
    else if (Py_TYPE(ref) != h->storage.type || SLOT(ref, &h->storage, S_NBYTES) == NULL ||
             SLOT(ref, &h->storage, S_DTYPE) == NULL) {  /* (the method says what is wrong) */
        done = 0;
        goto out;
    }
    else {
        int differ = PyObject_RichCompareBool(SLOT(ref, &h->storage, S_NBYTES), nbytes, Py_NE);
        if (differ != 0) {
            done = differ < 0 ? -1 : 0;
            goto out;
        }
    }
    dtype = Py_NewRef(SLOT(ref, &h->storage, S_DTYPE));
    PyObject *fields[T_COUNT] = {ref, args[1], args[2], args[3], args[4], dtype, Py_False,
                                 Py_None, Py_None, Py_False};
    PyObject *tensor = instance(&h->tensor, fields);
    if (tensor == NULL)
        goto out;
    *out = PyTuple_Pack(2, ref, tensor);
    Py_DECREF(tensor);
    done = *out == NULL ? -1 : 1;
out:
    Py_DECREF(nbytes);
    Py_DECREF(known);
    Py_XDECREF(ref);
    Py_XDECREF(dtype);
    return done;
}

/* _TorchHandlers.rebuild_parameter(data, requires_grad, hooks, state) of a tensor and a
 * bool: 1 with *out, 0 (the fallback says) */
static int
parameter(Handler *h, PyObject *const *args, Py_ssize_t nargs, PyObject **out)
{
    if (nargs < 2 || nargs > 4 || Py_TYPE(args[0]) != h->tensor.type || !PyBool_Check(args[1]))
        return 0;
    PyObject *data = args[0];  /* (its slots may be unset: a tensor made without __init__) */
    Py_XSETREF(SLOT(data, &h->tensor, T_GRAD), Py_NewRef(args[1]));
    Py_XSETREF(SLOT(data, &h->tensor, T_PARAMETER), Py_NewRef(Py_True));
    if (nargs == 4 && args[3] != Py_None)
        Py_XSETREF(SLOT(data, &h->tensor, T_ATTRS), Py_NewRef(args[3]));
    *out = Py_NewRef(data);
    return 1;
}

static PyObject *
handler_call(PyObject *callable, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Handler *h = (Handler *)callable;
    if (kwnames == NULL) {
        Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
        PyObject *out = NULL;
        int taken = h->kind == FUSED_V2 ? fused_v2(h, args, nargs, &out) :
                                           parameter(h, args, nargs, &out);
        if (taken != 0)
            return out;  /* (NULL: an error) */
    }
    return PyObject_Vectorcall(h->fallback, args, nargsf, kwnames);
}

static PyObject *
handler_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"kind", "fallback", "tensor_type", "storage_type",
                               "storage_types", "storages", "storage_order", NULL};
    const char *kind;
    PyObject *fallback, *tensor_type, *storage_type = Py_None, *storage_types = Py_None;
    PyObject *storages = Py_None, *storage_order = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "sOO|OOOO:FastHandler", keywords, &kind,
                                     &fallback, &tensor_type, &storage_type, &storage_types,
                                     &storages, &storage_order))
        return NULL;
    int which;
    if (strcmp(kind, "fused_v2") == 0)
        which = FUSED_V2;
    else if (strcmp(kind, "rebuild_parameter") == 0)
        which = PARAMETER;
    else {
        PyErr_Format(PyExc_ValueError, "FastHandler: no handler %s", kind);
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "FastHandler: the fallback is not callable");
        return NULL;
    }
    if (which == FUSED_V2 &&
        (!PyDict_CheckExact(storage_types) || !PyDict_CheckExact(storages) ||
         !PyList_CheckExact(storage_order))) {
        PyErr_SetString(PyExc_TypeError, "FastHandler: fused_v2 takes the storage class, the "
                                         "storage_types and storages dicts and the "
                                         "storage_order list");
        return NULL;
    }
    Handler *h = (Handler *)type->tp_alloc(type, 0);
    if (h == NULL)
        return NULL;
    h->vectorcall = handler_call;
    h->kind = which;
    h->fallback = Py_NewRef(fallback);
    if (layout_of(tensor_type, tensor_names, T_COUNT, &h->tensor) < 0 ||
        (which == FUSED_V2 &&
         layout_of(storage_type, storage_names, S_COUNT, &h->storage) < 0)) {
        Py_DECREF(h);
        return NULL;
    }
    if (which == FUSED_V2) {
        h->storage_types = Py_NewRef(storage_types);
        h->storages = Py_NewRef(storages);
        h->storage_order = Py_NewRef(storage_order);
    }
    return (PyObject *)h;
}

static int
handler_traverse(Handler *h, visitproc visit, void *arg)
{
    Py_VISIT(h->fallback);
    Py_VISIT(h->tensor.type);
    Py_VISIT(h->storage.type);
    Py_VISIT(h->storage_types);
    Py_VISIT(h->storages);
    Py_VISIT(h->storage_order);
    return 0;
}

static int
handler_clear(Handler *h)
{
    Py_CLEAR(h->fallback);
    Py_CLEAR(h->tensor.type);
    Py_CLEAR(h->storage.type);
    Py_CLEAR(h->storage_types);
    Py_CLEAR(h->storages);
    Py_CLEAR(h->storage_order);
    return 0;
}

static void
handler_dealloc(Handler *h)
{
    PyObject_GC_UnTrack(h);
    handler_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyObject *
handler_fallback(Handler *h, void *closure)
{
    (void)closure;
    return Py_NewRef(h->fallback);
}

/* what the interpreter asks of a Parameter handler before it takes Parameters in batches:
 * whether it never raises for a tensor of the batch, a bool and an empty hooks dict */
static PyObject *
handler_batchable(Handler *h, void *closure)
{
    (void)closure;
    return PyBool_FromLong(h->kind == PARAMETER);
}

static PyGetSetDef handler_getset[] = {
    {"fallback", (getter)handler_fallback, NULL, "The Python handler it stands for.", NULL},
    {"ckptlab_batchable", (getter)handler_batchable, NULL,
     "True for rebuild_parameter (it never raises for a tensor and a bool).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HandlerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "ckptlab.format._entries.FastHandler",
    .tp_doc = PyDoc_STR(
        "FastHandler(kind, fallback, tensor_type, storage_type=None, storage_types=None, "
        "storages=None, storage_order=None)\n--\n\n"
        "A torch rebuild handler of ckptlab's scan in C for its common case ('fused_v2' or "
        "'rebuild_parameter'), ``fallback`` for every other call: the same results."),
    .tp_basicsize = sizeof(Handler),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Handler, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = handler_new,
    .tp_traverse = (traverseproc)handler_traverse,
    .tp_clear = (inquiry)handler_clear,
    .tp_dealloc = (destructor)handler_dealloc,
    .tp_getset = handler_getset,
};

/* -- many objects of a slotted class at once (ckptlab.format._bulk) ---------------------- */

PyDoc_STRVAR(slot_build_doc,
"slot_build(cls, count, columns) -> list\n--\n\n"
"``count`` instances of the plain slotted class ``cls`` (object its only base, no\n"
"``__dict__``; a slotted dataclass), slot ``i`` of object ``j`` set to ``columns[i][j]``:\n"
"one column per slot, in ``__slots__`` order, each a list or tuple of at least ``count``\n"
"items or an iterator giving them (``itertools.repeat(value)``). No ``__init__`` runs.");

static PyObject *
slot_build(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3 || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "slot_build(cls, count, columns: tuple)");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    Layout layout;
    if (count < 0 || layout_of(args[0], NULL, 0, &layout) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "slot_build: a negative count");
        return NULL;
    }
    PyObject *columns = args[2], *out = NULL;
    PyObject *iters[MAX_SLOTS] = {NULL};
    if (PyTuple_GET_SIZE(columns) != layout.count) {
        PyErr_Format(PyExc_TypeError, "slot_build: %zd columns for %zd slots",
                     PyTuple_GET_SIZE(columns), layout.count);
        goto done;
    }
    for (Py_ssize_t i = 0; i < layout.count; i++) {
        PyObject *column = PyTuple_GET_ITEM(columns, i);
        if (PyList_Check(column) || PyTuple_Check(column)) {
            if (PySequence_Fast_GET_SIZE(column) < count) {
                PyErr_Format(PyExc_ValueError, "slot_build: a column of %zd values for %zd "
                             "objects", PySequence_Fast_GET_SIZE(column), count);
                goto done;
            }
        }
        else if ((iters[i] = PyObject_GetIter(column)) == NULL)
            goto done;
    }
    out = PyList_New(count);
    if (out == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *obj = layout.type->tp_alloc(layout.type, 0);
        if (obj == NULL)
            goto fail;
        PyList_SET_ITEM(out, j, obj);
        for (Py_ssize_t i = 0; i < layout.count; i++) {
            PyObject *value;
            if (iters[i] == NULL) {  /* (a list may have shrunk: a value's __del__) */
                PyObject *column = PyTuple_GET_ITEM(columns, i);
                if (j >= PySequence_Fast_GET_SIZE(column)) {
                    PyErr_SetString(PyExc_ValueError, "slot_build: a column got shorter");
                    goto fail;
                }
                value = Py_NewRef(PySequence_Fast_GET_ITEM(column, j));
            }
            else if ((value = PyIter_Next(iters[i])) == NULL) {
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "slot_build: a column of fewer than %zd "
                                 "values", count);
                goto fail;
            }
            SLOT(obj, &layout, i) = value;
        }
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (Py_ssize_t i = 0; i < MAX_SLOTS; i++)
        Py_XDECREF(iters[i]);
    Py_DECREF(layout.type);
    return out;
}

PyDoc_STRVAR(slot_columns_doc,
"slot_columns(objects, cls) -> tuple[list, ...]\n--\n\n"
"The slots of ``objects`` (a list or tuple of instances of exactly ``cls``, a plain slotted\n"
"class), one list per slot in ``__slots__`` order: ``[o.slot for o in objects]`` each,\n"
"in one pass. TypeError for an object of another class; AttributeError for a slot unset.");

static PyObject *
slot_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2 || !(PyList_Check(args[0]) || PyTuple_Check(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "slot_columns(objects: list | tuple, cls)");
        return NULL;
    }
    Layout layout;
    if (layout_of(args[1], NULL, 0, &layout) < 0)
        return NULL;
    /* the objects held here, copied before anything is allocated: a list could shrink
     * under a collection an allocation runs (a finalizer that empties it) */
    Py_ssize_t count = PySequence_Fast_GET_SIZE(args[0]);
    PyObject **objects = PyMem_Malloc((count > 0 ? count : 1) * sizeof(PyObject *));
    if (objects == NULL) {
        Py_DECREF(layout.type);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t j = 0; j < count; j++)
        objects[j] = Py_NewRef(PySequence_Fast_GET_ITEM(args[0], j));
    PyObject *out = PyTuple_New(layout.count);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < layout.count; i++) {
        PyObject *column = PyList_New(count);
        if (column == NULL)
            goto fail;
        PyTuple_SET_ITEM(out, i, column);
    }
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *obj = objects[j];
        if (Py_TYPE(obj) != layout.type) {
            PyErr_Format(PyExc_TypeError, "slot_columns: a %s among %s objects",
                         Py_TYPE(obj)->tp_name, layout.type->tp_name);
            goto fail;
        }
        for (Py_ssize_t i = 0; i < layout.count; i++) {
            PyObject *value = SLOT(obj, &layout, i);
            if (value == NULL) {
                PyErr_Format(PyExc_AttributeError, "slot_columns: a %s with a slot unset",
                             layout.type->tp_name);
                goto fail;
            }
            PyList_SET_ITEM(PyTuple_GET_ITEM(out, i), j, Py_NewRef(value));
        }
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (Py_ssize_t j = 0; j < count; j++)
        Py_DECREF(objects[j]);
    PyMem_Free(objects);
    Py_DECREF(layout.type);
    return out;
}

static PyMethodDef slot_methods[] = {
    {"slot_build", (PyCFunction)(void (*)(void))slot_build, METH_FASTCALL, slot_build_doc},
    {"slot_columns", (PyCFunction)(void (*)(void))slot_columns, METH_FASTCALL,
     slot_columns_doc},
    {NULL, NULL, 0, NULL},
};

int
handlers_add(PyObject *module)
{
    if (PyType_Ready(&HandlerType) < 0 || PyModule_AddFunctions(module, slot_methods) < 0)
        return -1;
    return PyModule_AddObjectRef(module, "FastHandler", (PyObject *)&HandlerType);
}
