/* walk_tensors: ckptlab.format._pickle_walk._walk_tensors compiled (the same results, the same
 * order, the same errors); part of the ckptlab.format._interp extension.
 *
 * walk_tensors(root, kinds, walk_kind, pending_type, children, path_key, max_depth, too_deep)
 *   -> (found, holds_tensor)
 *
 * Depth first from root (a container) in container order; each container is entered once.
 * found: [(path, tensor), ...]; holds_tensor: {id(container), ...} of every container on the
 * way to a tensor. The rules that decide a value's kind and a rare container's children
 * stay in Python and are passed in: kinds ({type: 0 leaf | 1 tensor | 2 container}, filled
 * by walk_kind(type)), children(obj) (an iterator of (key, value) for anything but a dict, a
 * list, a tuple and a Reduced built from a dict alone), path_key(key) (a path element),
 * too_deep() (the exception past max_depth). Dicts, lists, tuples and modules' Reduced
 * objects, nearly every container of a real checkpoint, are walked here without a call.
 *
 * Public C API only. Nothing found is changed; the containers are kept alive by the root.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { LEAF = 0, TENSOR = 1, CONTAINER = 2 };
enum { F_DICT, F_SEQ, F_ITER };

typedef struct {
    int how;
    PyObject *obj;   /* strong: the dict, list or tuple walked, or the iterator */
    Py_ssize_t pos;
} Frame;

typedef struct {
    PyObject *kinds, *walk_kind, *pending_type, *children, *path_key, *too_deep;
    PyObject *s_state, *s_pairs, *s_args, *s_items, *s_pending;
    PyObject *reduced_type;   /* the type of a Reduced (found by its attributes) or NULL */
    Frame *frames;
    PyObject **path;          /* strong: the path element of each frame but the root's */
    PyObject **ids;           /* strong: id() of each frame's container */
    Py_ssize_t depth, cap, marked, max_depth;
    PyObject *found, *holds, *seen;
} Walk;

/* kinds[type(value)], filling it by walk_kind(type) when missing; -1 on error */
static int
kind_of(Walk *w, PyObject *value)
{
    PyObject *type = (PyObject *)Py_TYPE(value);
    PyObject *kind = PyDict_GetItemWithError(w->kinds, type);
    if (kind == NULL) {
        if (PyErr_Occurred())
            return -1;
        kind = PyObject_CallOneArg(w->walk_kind, type);
        if (kind == NULL)
            return -1;
        long k = PyLong_AsLong(kind);
        Py_DECREF(kind);
        return k == -1 && PyErr_Occurred() ? -1 : (int)k;
    }
    long k = PyLong_AsLong(kind);
    return k == -1 && PyErr_Occurred() ? -1 : (int)k;
}

/* A Reduced built from a dict alone (``type(state) is dict and not (pairs or args or
 * items)``): its state dict (borrowed from a new reference the caller releases), else NULL
 * with no error. -1 on error. */
static int
plain_state(Walk *w, PyObject *obj, PyObject **state)
{
    *state = NULL;
    PyObject *st = PyObject_GetAttr(obj, w->s_state);
    if (st == NULL)
        return -1;
    if (!PyDict_CheckExact(st)) {
        Py_DECREF(st);
        return 0;
    }
    PyObject *names[3] = {w->s_pairs, w->s_args, w->s_items};
    for (int i = 0; i < 3; i++) {
        PyObject *v = PyObject_GetAttr(obj, names[i]);
        int truth = v == NULL ? -1 : PyObject_IsTrue(v);
        Py_XDECREF(v);
        if (truth != 0) {
            Py_DECREF(st);
            return truth < 0 ? -1 : 0;
        }
    }
    *state = st;
    return 0;
}

/* Push the frame that walks obj's children. */
static int
push(Walk *w, PyObject *obj, PyObject *key)
{
    if (w->depth >= w->max_depth) {
        PyObject *error = PyObject_CallNoArgs(w->too_deep);
        if (error != NULL) {
            PyErr_SetObject((PyObject *)Py_TYPE(error), error);
            Py_DECREF(error);
        }
        return -1;
    }
    if (w->depth == w->cap) {
        Py_ssize_t cap = w->cap ? 2 * w->cap : 32;
        Frame *frames = PyMem_Realloc(w->frames, cap * sizeof(Frame));
        if (frames == NULL)
            return PyErr_NoMemory(), -1;
        w->frames = frames;
        PyObject **path = PyMem_Realloc(w->path, cap * sizeof(PyObject *));
        if (path == NULL)
            return PyErr_NoMemory(), -1;
        w->path = path;
        PyObject **ids = PyMem_Realloc(w->ids, cap * sizeof(PyObject *));
        if (ids == NULL)
            return PyErr_NoMemory(), -1;
        w->ids = ids;
        w->cap = cap;
    }
    PyObject *id = PyLong_FromVoidPtr(obj);
    if (id == NULL)
        return -1;
    PyObject *element = NULL;  /* path_key(key): a str key is its own element */
    if (key != NULL && (element = PyUnicode_CheckExact(key) ? Py_NewRef(key)
                                  : PyObject_CallOneArg(w->path_key, key)) == NULL) {
        Py_DECREF(id);
        return -1;
    }
    Frame *f = &w->frames[w->depth];
    f->pos = 0;
    if (PyDict_CheckExact(obj) || PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        f->how = PyDict_CheckExact(obj) ? F_DICT : F_SEQ;
        f->obj = Py_NewRef(obj);
    } else {
        PyObject *state = NULL;
        if (w->reduced_type != NULL && Py_IS_TYPE(obj, (PyTypeObject *)w->reduced_type) &&
            plain_state(w, obj, &state) < 0)
            goto fail;
        if (state != NULL) {
            f->how = F_DICT;
            f->obj = state;  /* the new reference plain_state made */
        } else {
            f->how = F_ITER;
            PyObject *it = PyObject_CallOneArg(w->children, obj);
            f->obj = it ? PyObject_GetIter(it) : NULL;
            Py_XDECREF(it);
            if (f->obj == NULL)
                goto fail;
        }
    }
    w->ids[w->depth] = id;
    w->path[w->depth] = element;  /* NULL for the root */
    w->depth++;
    return 0;
fail:
    Py_DECREF(id);
    Py_XDECREF(element);
    return -1;
}

static void
pop(Walk *w)
{
    w->depth--;
    Py_DECREF(w->frames[w->depth].obj);
    Py_DECREF(w->ids[w->depth]);
    Py_XDECREF(w->path[w->depth]);
    if (w->marked > w->depth)
        w->marked = w->depth;
}

/* The next (key, value) of the top frame: 1 with borrowed-or-owned refs in *key, *value
 * (*owned says which), 0 at its end, -1 on error. */
static int
next_child(Walk *w, PyObject **key, PyObject **value, PyObject **owned)
{
    Frame *f = &w->frames[w->depth - 1];
    *owned = NULL;
    switch (f->how) {
    case F_DICT:
        return PyDict_Next(f->obj, &f->pos, key, value) ? 1 : 0;
    case F_SEQ: {
        Py_ssize_t n = PyList_CheckExact(f->obj) ? PyList_GET_SIZE(f->obj)
                                                  : PyTuple_GET_SIZE(f->obj);
        if (f->pos >= n)
            return 0;
        *value = PyList_CheckExact(f->obj) ? PyList_GET_ITEM(f->obj, f->pos)
                                           : PyTuple_GET_ITEM(f->obj, f->pos);
        *key = *owned = PyLong_FromSsize_t(f->pos);
        f->pos++;
        return *key ? 1 : -1;
    }
    default: {
        PyObject *pair = PyIter_Next(f->obj);
        if (pair == NULL)
            return PyErr_Occurred() ? -1 : 0;
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "children() must give (key, value) pairs");
            return -1;
        }
        *key = PyTuple_GET_ITEM(pair, 0);
        *value = PyTuple_GET_ITEM(pair, 1);
        *owned = pair;
        return 1;
    }
    }
}

/* found.append(((*path, key_text), value)) and every container on the way marked */
static int
found_tensor(Walk *w, PyObject *key, PyObject *value)
{
    PyObject *element = PyUnicode_CheckExact(key) ? Py_NewRef(key)
                                                 : PyObject_CallOneArg(w->path_key, key);
    if (element == NULL)
        return -1;
    Py_ssize_t n = w->depth - 1;  /* path elements: every frame but the root's */
    PyObject *path = PyTuple_New(n + 1);
    if (path == NULL) {
        Py_DECREF(element);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(path, i, Py_NewRef(w->path[i + 1]));
    PyTuple_SET_ITEM(path, n, element);
    PyObject *pair = PyTuple_Pack(2, path, value);
    Py_DECREF(path);
    if (pair == NULL)
        return -1;
    int rc = PyList_Append(w->found, pair);
    Py_DECREF(pair);
    if (rc < 0)
        return -1;
    for (; w->marked < w->depth; w->marked++)
        if (PySet_Add(w->holds, w->ids[w->marked]) < 0)
            return -1;
    return 0;
}

/* 1 when value is a tensor the walk lists (not a pending one), 0 if not, -1 on error */
static int
listed(Walk *w, PyObject *value)
{
    if (!Py_IS_TYPE(value, (PyTypeObject *)w->pending_type))
        return 1;
    PyObject *pending = PyObject_GetAttr(value, w->s_pending);
    int truth = pending == NULL ? -1 : PyObject_IsTrue(pending);
    Py_XDECREF(pending);
    return truth < 0 ? -1 : !truth;
}

static int
walk(Walk *w, PyObject *root)
{
    if (push(w, root, NULL) < 0)
        return -1;
    PyObject *id = w->ids[0];
    if (PySet_Add(w->seen, id) < 0)
        return -1;
    while (w->depth > 0) {
        PyObject *key, *value, *owned;
        int more = next_child(w, &key, &value, &owned);
        if (more < 0)
            return -1;
        if (more == 0) {
            pop(w);
            continue;
        }
        int kind = kind_of(w, value);
        int rc = 0;
        if (kind < 0) {
            rc = -1;
        } else if (kind == TENSOR) {
            int yes = listed(w, value);
            rc = yes < 0 ? -1 : yes ? found_tensor(w, key, value) : 0;
        } else if (kind == CONTAINER) {
            int truth = PyObject_IsTrue(value);
            if (truth < 0) {
                rc = -1;
            } else if (truth) {
                PyObject *vid = PyLong_FromVoidPtr(value);
                int known = vid == NULL ? -1 : PySet_Contains(w->seen, vid);
                if (known == 0)
                    known = PySet_Add(w->seen, vid) < 0 ? -1 : 0;
                Py_XDECREF(vid);
                if (known < 0)
                    rc = -1;
                else if (!known)
                    rc = push(w, value, key);
            }
        }
        Py_XDECREF(owned);
        if (rc < 0)
            return -1;
    }
    return 0;
}

PyObject *
ckptlab_walk_tensors(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "walk_tensors(root, kinds, walk_kind, pending_type, "
                        "reduced_type, children, path_key, max_depth, too_deep)");
        return NULL;
    }
    Walk w;
    memset(&w, 0, sizeof(w));
    if (!PyDict_Check(args[1]) || !PyType_Check(args[3]) ||
        (args[4] != Py_None && !PyType_Check(args[4]))) {
        PyErr_SetString(PyExc_TypeError, "walk_tensors: kinds must be a dict, pending_type "
                        "and reduced_type types");
        return NULL;
    }
    w.kinds = args[1];
    w.walk_kind = args[2];
    w.pending_type = args[3];
    w.reduced_type = args[4] == Py_None ? NULL : args[4];
    w.children = args[5];
    w.path_key = args[6];
    w.max_depth = PyLong_AsSsize_t(args[7]);
    w.too_deep = args[8];
    if (w.max_depth == -1 && PyErr_Occurred())
        return NULL;
    PyObject *result = NULL;
    if ((w.s_state = PyUnicode_InternFromString("state")) == NULL ||
        (w.s_pairs = PyUnicode_InternFromString("pairs")) == NULL ||
        (w.s_args = PyUnicode_InternFromString("args")) == NULL ||
        (w.s_items = PyUnicode_InternFromString("items")) == NULL ||
        (w.s_pending = PyUnicode_InternFromString("pending")) == NULL ||
        (w.found = PyList_New(0)) == NULL || (w.holds = PySet_New(NULL)) == NULL ||
        (w.seen = PySet_New(NULL)) == NULL)
        goto done;
    if (walk(&w, args[0]) == 0)
        result = PyTuple_Pack(2, w.found, w.holds);
done:
    while (w.depth > 0)
        pop(&w);
    PyMem_Free(w.frames);
    PyMem_Free(w.path);
    PyMem_Free(w.ids);
    Py_XDECREF(w.s_state);
    Py_XDECREF(w.s_pairs);
    Py_XDECREF(w.s_args);
    Py_XDECREF(w.s_items);
    Py_XDECREF(w.s_pending);
    Py_XDECREF(w.found);
    Py_XDECREF(w.holds);
    Py_XDECREF(w.seen);
    return result;
}
