/* The state dict entries of a torch pickle, located and decoded in one pass.
 *
 * ckptlab.format._unpickle takes a pickle's runs of state dict entries (a key string, then
 * torch's ~28 opcodes of one ``_rebuild_tensor_v2`` call) a batch at a time
 * (``_Machine.entry_run``). This module does the part of that which is byte work: it walks
 * the entries from a position, each exactly as the regular expression ``_ENTRY_V2`` (after its
 * key) reads it, and returns their columns. It reads the buffer and nothing else: it never
 * touches the interpreter's memo or stack, calls no handler and decides nothing. The caller
 * checks the columns against the memo and the budget and applies the batch, all or nothing,
 * exactly as it does for the entries its expression finds; without this module (no compiler
 * where ckptlab was installed) that expression does the same walk.
 *
 * Every read is bounds-checked against the buffer's length before it is made; an entry that
 * is not exactly the expected bytes ends the walk before it (the entries before it are
 * returned). Memory: a few lists of at most ``limit`` items.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const unsigned char *p;
    Py_ssize_t n;
    Py_ssize_t pos;
} Cursor;

static int
u32(const Cursor *c, Py_ssize_t at, uint32_t *out)
{
    if (at < 0 || at + 4 > c->n)
        return 0;
    *out = (uint32_t)c->p[at] | ((uint32_t)c->p[at + 1] << 8) |
           ((uint32_t)c->p[at + 2] << 16) | ((uint32_t)c->p[at + 3] << 24);
    return 1;
}

/* BINPUT q<1> / LONG_BINPUT r<4>, optional: 1 and the memo index, 0 when absent, -1 on a
 * truncated one */
static int
opt_put(Cursor *c, int64_t *index)
{
    if (c->pos >= c->n)
        return 0;
    if (c->p[c->pos] == 'q') {
        if (c->pos + 2 > c->n)
            return -1;
        *index = c->p[c->pos + 1];
        c->pos += 2;
        return 1;
    }
    if (c->p[c->pos] == 'r') {
        uint32_t v;
        if (!u32(c, c->pos + 1, &v))
            return -1;
        *index = v;
        c->pos += 5;
        return 1;
    }
    return 0;
}

/* BINGET h<1> / LONG_BINGET j<4> */
static int
get(Cursor *c, int64_t *index)
{
    if (c->pos >= c->n)
        return 0;
    if (c->p[c->pos] == 'h') {
        if (c->pos + 2 > c->n)
            return 0;
        *index = c->p[c->pos + 1];
        c->pos += 2;
        return 1;
    }
    if (c->p[c->pos] == 'j') {
        uint32_t v;
        if (!u32(c, c->pos + 1, &v))
            return 0;
        *index = v;
        c->pos += 5;
        return 1;
    }
    return 0;
}

/* BININT1 / BININT2 / BININT: the value and what the interpreter charges for it */
static int
small_int(Cursor *c, int64_t *value, int64_t *charge)
{
    if (c->pos >= c->n)
        return 0;
    unsigned char op = c->p[c->pos];
    if (op == 'K') {
        if (c->pos + 2 > c->n)
            return 0;
        *value = c->p[c->pos + 1];
        *charge = 16;
        c->pos += 2;
        return 1;
    }
    if (op == 'M') {
        if (c->pos + 3 > c->n)
            return 0;
        *value = (int64_t)c->p[c->pos + 1] | ((int64_t)c->p[c->pos + 2] << 8);
        *charge = 48;
        c->pos += 3;
        return 1;
    }
    if (op == 'J') {
        uint32_t v;
        if (!u32(c, c->pos + 1, &v))
            return 0;
        *value = (int32_t)v;
        *charge = 48;
        c->pos += 5;
        return 1;
    }
    return 0;
}

#define MAX_DIMS 64

/* A tuple of ints as ``_TUPLE`` matches it: EMPTY_TUPLE, 1-3 ints and TUPLE1/2/3, or MARK,
 * ints, TUPLE. Returns 1 and the ints (at most MAX_DIMS, each >= 0) with the interpreter's
 * charge; 0 for anything else, a negative int or more than MAX_DIMS ints included. */
static int
int_tuple(Cursor *c, int64_t *values, Py_ssize_t *count, int64_t *charge)
{
    Py_ssize_t k = 0;
    int64_t cost = 0, v, ch;
    if (c->pos >= c->n)
        return 0;
    if (c->p[c->pos] == ')') {
        c->pos += 1;
        *count = 0;
        *charge = 16;
        return 1;
    }
    int marked = c->p[c->pos] == '(';
    if (marked)
        c->pos += 1;
    for (;;) {
        if (c->pos >= c->n)
            return 0;
        unsigned char op = c->p[c->pos];
        if (op != 'K' && op != 'M' && op != 'J')
            break;
        if (k == MAX_DIMS)
            return 0;
        if (!small_int(c, &v, &ch) || v < 0)
            return 0;
        values[k++] = v;
        cost += ch;
        if (!marked && k == 3)
            break;
    }
    if (c->pos >= c->n)
        return 0;
    unsigned char close = c->p[c->pos];
    if (marked ? close != 't' : !(k >= 1 && close == 0x84 + k))
        return 0;
    c->pos += 1;
    *count = k;
    *charge = cost + 72 + 8 * k + (marked ? 88 : 0);
    return 1;
}

static PyObject *
make_tuple(const int64_t *values, Py_ssize_t count)
{
    PyObject *t = PyTuple_New(count);
    if (t == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *v = PyLong_FromLongLong(values[i]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* the memo index expected of a BINPUT: each one stores the next index */
#define PUT(bit)                                                        \
    do {                                                                \
        int got_ = opt_put(&c, &index);                                 \
        if (got_ < 0)                                                   \
            goto stop;                                                  \
        if (got_) {                                                     \
            if (index != next)                                          \
                goto stop;                                              \
            next++;                                                     \
            mask |= (1u << (bit));                                      \
            last = at_op;                                               \
        }                                                               \
    } while (0)

#define EXPECT(ch)                                                      \
    do {                                                                \
        if (c.pos >= c.n || c.p[c.pos] != (unsigned char)(ch))          \
            goto stop;                                                  \
        c.pos += 1;                                                     \
    } while (0)

static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return -1;
    int r = PyList_Append(list, item);
    Py_DECREF(item);
    return r;
}

PyDoc_STRVAR(entries_doc,
"entries(data, pos, limit, memo_len) -> tuple | None\n\n"
"The state dict entries from ``pos`` (a BINUNICODE key, then its tensor as ``_ENTRY_V2``\n"
"reads it), at most ``limit``, each BINPUT storing the next memo index from ``memo_len``\n"
"on: ``(count, end, last, keys, masks, shared, classes, storage_keys, numels, offsets,\n"
"sizes, strides, grads, puts, cost)``. ``shared`` holds the four BINGET indices every entry\n"
"has alike (the global, the storage tag, the location, the hooks' global), ``classes`` the\n"
"storage class BINGET of each, ``storage_keys`` a str (written out) or an int (a BINGET\n"
"index), ``masks`` a bytes of which of the eight BINPUTs each entry has, ``last`` the\n"
"offset of the last opcode taken and ``cost`` what the interpreter charges for them all.\n"
"None when no entry is there.");

static PyObject *
entries(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer view;
    Py_ssize_t start, limit;
    long long memo_len;
    if (!PyArg_ParseTuple(args, "y*nnL", &view, &start, &limit, &memo_len))
        return NULL;
    Cursor c = {(const unsigned char *)view.buf, view.len, start};
    PyObject *keys = PyList_New(0), *classes = PyList_New(0), *skeys = PyList_New(0),
             *numels = PyList_New(0), *offsets = PyList_New(0), *sizes = PyList_New(0),
             *strides = PyList_New(0), *grads = PyList_New(0), *result = NULL;
    PyObject *masks = NULL;
    unsigned char *maskbuf = NULL;
    int64_t shared[4] = {-1, -1, -1, -1};
    int64_t next = memo_len, cost = 0, puts = 0;
    Py_ssize_t count = 0, end = start, last_op = -1;
    int64_t size_v[MAX_DIMS], stride_v[MAX_DIMS];
    if (!keys || !classes || !skeys || !numels || !offsets || !sizes || !strides || !grads)
        goto done;
    if (start < 0 || limit < 0 || memo_len < 0)
        goto none;
    maskbuf = PyMem_Malloc(limit > 0 ? (size_t)limit : 1);
    if (maskbuf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    while (count < limit) {
        /* everything of one entry is read into locals first; only a whole entry is kept */
        Py_ssize_t at_op, last = -1;
        int64_t index, entry_next = next, g[4], cls, skey_index = -1, numel, offset;
        int64_t ch, entry_cost, charged = 0;
        Py_ssize_t nsize, nstride, key_at, key_len, skey_at = 0, skey_len = 0;
        unsigned int mask = 0;
        int grad;
        uint32_t length;
        next = entry_next;
        c.pos = end;
        /* the key: BINUNICODE */
        if (c.pos + 5 > c.n || c.p[c.pos] != 'X' || !u32(&c, c.pos + 1, &length))
            goto stop;
        key_at = c.pos + 5;
        key_len = (Py_ssize_t)length;
        if (key_len > c.n - key_at)
            goto stop;
        c.pos = key_at + key_len;
        at_op = c.pos;
        PUT(0);                                   /* the key's BINPUT */
        if (!get(&c, &g[0]))                      /* the global */
            goto stop;
        EXPECT('(');
        EXPECT('(');
        if (!get(&c, &g[1]))                      /* 'storage' */
            goto stop;
        if (!get(&c, &cls))                       /* the storage class */
            goto stop;
        if (c.pos < c.n && c.p[c.pos] == 'X') {   /* the storage key, written out */
            uint32_t klen;
            if (!u32(&c, c.pos + 1, &klen) || klen < 1 || klen > 20)
                goto stop;
            skey_at = c.pos + 5;
            skey_len = (Py_ssize_t)klen;
            if (skey_len > c.n - skey_at)
                goto stop;
            for (Py_ssize_t i = 0; i < skey_len; i++)
                if (c.p[skey_at + i] < '0' || c.p[skey_at + i] > '9')
                    goto stop;
            c.pos = skey_at + skey_len;
            charged += 96 + 4 * skey_len;
        }
        else {                                    /* ... or a BINGET of it */
            if (!get(&c, &skey_index))
                goto stop;
            charged += 16;
        }
        at_op = c.pos;
        PUT(1);
        if (!get(&c, &g[2]))                      /* the location */
            goto stop;
        if (!small_int(&c, &numel, &ch))
            goto stop;
        charged += ch;
        EXPECT('t');
        at_op = c.pos;
        PUT(2);                                   /* the persistent id */
        EXPECT('Q');
        if (!small_int(&c, &offset, &ch) || offset < 0)
            goto stop;
        charged += ch;
        if (!int_tuple(&c, size_v, &nsize, &ch))
            goto stop;
        charged += ch;
        at_op = c.pos;
        PUT(3);
        if (!int_tuple(&c, stride_v, &nstride, &ch) || nstride != nsize)
            goto stop;
        charged += ch;
        at_op = c.pos;
        PUT(4);
        if (c.pos >= c.n || (c.p[c.pos] != 0x88 && c.p[c.pos] != 0x89))
            goto stop;
        grad = c.p[c.pos] == 0x88;
        c.pos += 1;
        if (!get(&c, &g[3]))                      /* OrderedDict */
            goto stop;
        EXPECT(')');
        at_op = c.pos;
        EXPECT('R');
        last = at_op;
        at_op = c.pos;
        PUT(5);                                   /* the hooks */
        EXPECT('t');
        at_op = c.pos;
        PUT(6);                                   /* the arguments */
        at_op = c.pos;
        EXPECT('R');
        last = at_op;
        at_op = c.pos;
        PUT(7);                                   /* the tensor */
        /* the same four BINGETs in every entry */
        if (count == 0)
            memcpy(shared, g, sizeof shared);
        else if (memcmp(shared, g, sizeof shared) != 0)
            goto stop;
        /* the key, as BINUNICODE decodes it */
        PyObject *key = PyUnicode_DecodeUTF8((const char *)c.p + key_at, key_len,
                                             "surrogatepass");
        if (key == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                goto done;
            PyErr_Clear();
            goto stop;
        }
        if (append_new(keys, key) < 0)
            goto done;
        if (append_new(classes, PyLong_FromLongLong(cls)) < 0)
            goto done;
        if (append_new(skeys, skey_index >= 0 ? PyLong_FromLongLong(skey_index) :
                       PyUnicode_DecodeASCII((const char *)c.p + skey_at, skey_len,
                                             "strict")) < 0)
            goto done;
        if (append_new(numels, PyLong_FromLongLong(numel)) < 0 ||
            append_new(offsets, PyLong_FromLongLong(offset)) < 0 ||
            append_new(sizes, make_tuple(size_v, nsize)) < 0 ||
            append_new(strides, make_tuple(stride_v, nstride)) < 0)
            goto done;
        if (PyList_Append(grads, grad ? Py_True : Py_False) < 0)
            goto done;
        maskbuf[count] = (unsigned char)mask;
        {
            int64_t entry_puts = next - entry_next;
            /* BINUNICODE key, BINGET of the global, the tensor's opcodes, a memo slot per
             * BINPUT (the _Machine.entry_run formula, entry by entry) */
            entry_cost = 96 + 16 + 1304 + 16 * entry_puts + 4 * (int64_t)key_len + charged;
            cost += entry_cost;
            puts += entry_puts;
        }
        last_op = last;
        count += 1;
        end = c.pos;
        continue;
    stop:
        next = entry_next;
        break;
    }
    if (count == 0)
        goto none;
    masks = PyBytes_FromStringAndSize((const char *)maskbuf, count);
    if (masks == NULL)
        goto done;
    result = Py_BuildValue("(nnnOO(LLLL)OOOOOOOLL)", count, end, last_op, keys, masks,
                           (long long)shared[0], (long long)shared[1], (long long)shared[2],
                           (long long)shared[3], classes, skeys, numels, offsets, sizes,
                           strides, grads, (long long)puts, (long long)cost);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(maskbuf);
    Py_XDECREF(masks);
    Py_XDECREF(keys);
    Py_XDECREF(classes);
    Py_XDECREF(skeys);
    Py_XDECREF(numels);
    Py_XDECREF(offsets);
    Py_XDECREF(sizes);
    Py_XDECREF(strides);
    Py_XDECREF(grads);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"entries", entries, METH_VARARGS, entries_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_entries",
    "The state dict entries of a torch pickle, located and decoded in one pass (see "
    "ckptlab.format._unpickle).", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__entries(void)
{
    return PyModule_Create(&module);
}
