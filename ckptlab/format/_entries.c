/* The state dict entries of a torch pickle, located and decoded in one pass; the plain
 * opcodes of any pickle, many at a time.
 *
 * ckptlab.format._unpickle takes a pickle's runs of state dict entries (a key string, then
 * torch's ~28 opcodes of one ``_rebuild_tensor_v2`` call) a batch at a time
 * (``_Machine.entry_run``). This module does the part of that which is byte work: it walks
 * the entries from a position, each exactly as the regular expression ``_ENTRY_V2`` (after its
 * key) reads it, and returns their columns; it also takes two shapes that expression leaves
 * to the loop: a tensor wrapped in a Parameter, and a storage key read back by BINGET from
 * the BINPUT of an earlier entry of the walk (views of one storage). It reads the buffer and
 * nothing else: it never
 * touches the interpreter's memo or stack, calls no handler and decides nothing. The caller
 * checks the columns against the memo and the budget and applies the batch, all or nothing,
 * exactly as it does for the entries its expression finds; without this module (no compiler
 * where ckptlab was installed) that expression does the same walk, up to those two shapes.
 *
 * A third function, opcodes(), is the interpreter's loop for its opcodes (memo, stack, MARKs,
 * ints, empty containers, tuples, SETITEMS into a dict, OrderedDict(); given the machine, also
 * strings, calls, BUILD, persistent ids and tensor rebuilds, through the machine's own
 * methods): it does them as the loop does, with the same charges, and stops before the first
 * opcode it leaves to the loop (anything that would fail or overrun the budget; an opcode
 * that would read back or change the shared empty OrderedDict, which the loop copies or
 * refuses). A fourth, walk(), is the object walk's first pass (ckptlab.format._pickle._walk).
 * The module also holds ckptlab/format/_handlers.c: FastHandler (torch's two per-tensor
 * handlers in C), slot_build and slot_columns.
 *
 * Every read is bounds-checked against the buffer's length before it is made (positions stay
 * within it: a start past the end is refused); an entry that is not exactly the expected
 * bytes ends the walk before it (the entries before it are returned). Memory: a few lists of
 * at most ``limit`` items (and never more than the buffer has bytes).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_handlers.h"

typedef struct {
    const unsigned char *p;
    Py_ssize_t n;
    Py_ssize_t pos;
} Cursor;

static int
u32(const Cursor *c, Py_ssize_t at, uint32_t *out)
{
    if (at < 0 || at > c->n - 4)
        return 0;
    *out = (uint32_t)c->p[at] | ((uint32_t)c->p[at + 1] << 8) |
           ((uint32_t)c->p[at + 2] << 16) | ((uint32_t)c->p[at + 3] << 24);
    return 1;
}

/* A memo opcode: ``one`` with a 1-byte index or ``four`` with a 4-byte one. 1 and the
 * index, 0 when the byte is neither, -1 when its index is cut off. */
static int
memo_op(Cursor *c, unsigned char one, unsigned char four, int64_t *index)
{
    if (c->pos >= c->n)
        return 0;
    if (c->p[c->pos] == one) {
        if (c->pos + 2 > c->n)
            return -1;
        *index = c->p[c->pos + 1];
        c->pos += 2;
        return 1;
    }
    if (c->p[c->pos] == four) {
        uint32_t v;
        if (!u32(c, c->pos + 1, &v))
            return -1;
        *index = v;
        c->pos += 5;
        return 1;
    }
    return 0;
}

/* BINPUT q<1> / LONG_BINPUT r<4>, optional: 1 and the memo index, 0 when absent, -1 on a
 * truncated one */
static int
opt_put(Cursor *c, int64_t *index)
{
    return memo_op(c, 'q', 'r', index);
}

/* BINGET h<1> / LONG_BINGET j<4>: 1 and the index, else 0 */
static int
get(Cursor *c, int64_t *index)
{
    return memo_op(c, 'h', 'j', index) > 0;
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

/* One tensor as ``_ENTRY_V2`` reads it after its key's BINPUT: from the BINGET of the
 * ``_rebuild_tensor_v2`` global to the BINPUT of its result. */
typedef struct {
    int64_t g[4];                 /* BINGETs: the global, 'storage', the location, the hooks */
    int64_t cls;                  /* BINGET of the storage class */
    int64_t skey_index;           /* the storage key's BINGET, or -1: written out at skey_at */
    Py_ssize_t skey_at, skey_len;
    Py_ssize_t skey_entry;        /* the earlier entry of the walk whose storage key that
                                     BINGET reads, or -1 (set by the walk, not the parse) */
    int64_t skey_put;             /* the memo index its storage key is stored at, or -1 */
    int64_t numel, offset;
    int64_t size_v[MAX_DIMS], stride_v[MAX_DIMS];
    Py_ssize_t nsize, nstride;
    int grad;
    unsigned int mask;            /* bits 1-7: which of the tensor's seven BINPUTs it has;
                                     bits 8-10: its Parameter's three (parameter_tail) */
    unsigned int kinds;           /* 1: a BINPUT among them, 2: a LONG_BINPUT */
    int64_t charged;              /* the interpreter's charges for the ints, the tuples and
                                     the storage key */
    Py_ssize_t last;              /* offset of the last opcode taken */
} Tensor;

/* a BINPUT, optional, storing the next memo index (*next, then advanced) */
#define PUT(bit)                                                        \
    do {                                                                \
        int64_t index_;                                                 \
        Py_ssize_t at_ = c->pos;                                        \
        int got_ = opt_put(c, &index_);                                 \
        if (got_ < 0)                                                   \
            return 0;                                                   \
        if (got_) {                                                     \
            if (index_ != *next)                                        \
                return 0;                                               \
            *next += 1;                                                 \
            t->mask |= (1u << (bit));                                   \
            t->kinds |= c->p[at_] == 'q' ? 1u : 2u;                     \
            t->last = at_;                                              \
        }                                                               \
    } while (0)

#define EXPECT(ch)                                                      \
    do {                                                                \
        if (c->pos >= c->n || c->p[c->pos] != (unsigned char)(ch))      \
            return 0;                                                   \
        c->pos += 1;                                                    \
    } while (0)

/* 1 and the tensor, the cursor after it; 0 when the bytes are not that */
static int
parse_tensor(Cursor *c, int64_t *next, Tensor *t)
{
    int64_t ch;
    Py_ssize_t at;
    t->mask = 0;
    t->kinds = 0;
    t->charged = 0;
    t->skey_index = -1;
    t->skey_at = t->skey_len = 0;
    t->skey_entry = -1;
    t->skey_put = -1;
    if (!get(c, &t->g[0]))                    /* the global */
        return 0;
    EXPECT('(');
    EXPECT('(');
    if (!get(c, &t->g[1]))                    /* 'storage' */
        return 0;
    if (!get(c, &t->cls))                     /* the storage class */
        return 0;
    if (c->pos < c->n && c->p[c->pos] == 'X') {   /* the storage key, written out */
        uint32_t klen;
        if (!u32(c, c->pos + 1, &klen) || klen < 1 || klen > 20)
            return 0;
        t->skey_at = c->pos + 5;
        t->skey_len = (Py_ssize_t)klen;
        if (t->skey_len > c->n - t->skey_at)
            return 0;
        for (Py_ssize_t i = 0; i < t->skey_len; i++)
            if (c->p[t->skey_at + i] < '0' || c->p[t->skey_at + i] > '9')
                return 0;
        c->pos = t->skey_at + t->skey_len;
        t->charged += 96 + 4 * t->skey_len;
    }
    else {                                    /* ... or a BINGET of it */
        if (!get(c, &t->skey_index))
            return 0;
        t->charged += 16;
    }
    PUT(1);
    if (t->mask & 2u)
        t->skey_put = *next - 1;
    if (!get(c, &t->g[2]))                    /* the location */
        return 0;
    if (!small_int(c, &t->numel, &ch))
        return 0;
    t->charged += ch;
    EXPECT('t');
    PUT(2);                                   /* the persistent id */
    EXPECT('Q');
    if (!small_int(c, &t->offset, &ch) || t->offset < 0)
        return 0;
    t->charged += ch;
    if (!int_tuple(c, t->size_v, &t->nsize, &ch))
        return 0;
    t->charged += ch;
    PUT(3);
    if (!int_tuple(c, t->stride_v, &t->nstride, &ch) || t->nstride != t->nsize)
        return 0;
    t->charged += ch;
    PUT(4);
    if (c->pos >= c->n || (c->p[c->pos] != 0x88 && c->p[c->pos] != 0x89))
        return 0;
    t->grad = c->p[c->pos] == 0x88;
    c->pos += 1;
    if (!get(c, &t->g[3]))                    /* OrderedDict */
        return 0;
    EXPECT(')');
    at = c->pos;
    EXPECT('R');
    t->last = at;
    PUT(5);                                   /* the hooks */
    EXPECT('t');
    PUT(6);                                   /* the arguments */
    at = c->pos;
    EXPECT('R');
    t->last = at;
    PUT(7);                                   /* the tensor */
    return 1;
}

/* what ``params`` says of an entry: a Parameter, its requires_grad, its BINPUTs (bits 8-10
 * of the mask, shifted down) */
#define PARAM_IS 0x10u
#define PARAM_GRAD 0x08u

/* A Parameter around the tensor just read (torch writes ``_rebuild_parameter(tensor,
 * requires_grad, OrderedDict())`` as its BINGET before the tensor's and, after the tensor:
 * NEWTRUE/NEWFALSE, the BINGET of ``OrderedDict`` (the tensor's own hooks' one), EMPTY_TUPLE,
 * REDUCE, TUPLE3, REDUCE, each result with an optional BINPUT). 1 and what ``params`` says of
 * it (in *param), the cursor after it; 0 when the bytes are not that. */
static int
parameter_tail(Cursor *c, int64_t *next, Tensor *t, unsigned int *param)
{
    int64_t hooks;
    Py_ssize_t at;
    if (c->pos >= c->n || (c->p[c->pos] != 0x88 && c->p[c->pos] != 0x89))
        return 0;
    *param = PARAM_IS | (c->p[c->pos] == 0x88 ? PARAM_GRAD : 0u);
    c->pos += 1;
    if (!get(c, &hooks) || hooks != t->g[3])
        return 0;
    EXPECT(')');
    at = c->pos;
    EXPECT('R');
    t->last = at;
    PUT(8);                                   /* the Parameter's hooks */
    EXPECT(0x87);                             /* TUPLE3 */
    PUT(9);                                   /* its arguments */
    at = c->pos;
    EXPECT('R');
    t->last = at;
    PUT(10);                                  /* the Parameter */
    *param |= (t->mask >> 8) & 7u;
    t->mask &= 0xFFu;
    /* the loop's charges: the BINGET of _rebuild_parameter, the bool, the BINGET of
     * OrderedDict, EMPTY_TUPLE and its call, TUPLE3, the call (the BINPUTs: the walk's) */
    t->charged += 16 + 16 + 16 + 336 + 96 + 320;
    return 1;
}

static int
append_new(PyObject *list, PyObject *item)
{
    if (item == NULL)
        return -1;
    int r = PyList_Append(list, item);
    Py_DECREF(item);
    return r;
}

/* The columns of a walk, one list per field, and what is shared. */
typedef struct {
    PyObject *keys, *classes, *names, *numels, *offsets, *sizes, *strides, *grads;
    unsigned char *masks, *params;
    Py_ssize_t count, limit, nparams;
    int64_t shared[4];
    int64_t g_param;              /* the BINGET of _rebuild_parameter, alike in every
                                     Parameter; -1 before the first */
    int64_t puts, cost;
} Columns;

static int
columns_init(Columns *k, Py_ssize_t limit)
{
    memset(k, 0, sizeof *k);
    k->limit = limit;
    k->keys = PyList_New(0);
    k->classes = PyList_New(0);
    k->names = PyList_New(0);
    k->numels = PyList_New(0);
    k->offsets = PyList_New(0);
    k->sizes = PyList_New(0);
    k->strides = PyList_New(0);
    k->grads = PyList_New(0);
    k->g_param = -1;
    k->masks = PyMem_Malloc(limit > 0 ? (size_t)limit : 1);
    k->params = PyMem_Calloc(limit > 0 ? (size_t)limit : 1, 1);
    if (!k->keys || !k->classes || !k->names || !k->numels || !k->offsets || !k->sizes ||
        !k->strides || !k->grads)
        return -1;
    if (k->masks == NULL || k->params == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void
columns_free(Columns *k)
{
    PyMem_Free(k->masks);
    PyMem_Free(k->params);
    Py_XDECREF(k->keys);
    Py_XDECREF(k->classes);
    Py_XDECREF(k->names);
    Py_XDECREF(k->numels);
    Py_XDECREF(k->offsets);
    Py_XDECREF(k->sizes);
    Py_XDECREF(k->strides);
    Py_XDECREF(k->grads);
}

/* Whether t's four shared BINGETs are the walk's (the first tensor's). */
static int
same_shared(Columns *k, const Tensor *t)
{
    if (k->count == 0) {
        memcpy(k->shared, t->g, sizeof k->shared);
        return 1;
    }
    return memcmp(k->shared, t->g, sizeof k->shared) == 0;
}

/* The storage key column's item of ``t``: what an earlier entry's key BINPUT stored, a
 * BINGET index, or the key written out (a new reference) */
static PyObject *
storage_key(Columns *k, const Cursor *c, const Tensor *t)
{
    if (t->skey_entry >= 0)
        return Py_NewRef(PyList_GET_ITEM(k->names, t->skey_entry));
    if (t->skey_index >= 0)
        return PyLong_FromLongLong(t->skey_index);
    return PyUnicode_DecodeASCII((const char *)c->p + t->skey_at, t->skey_len, "strict");
}

/* Appends one tensor (``key``: a new reference, or NULL for none) to the columns: -1 on a
 * Python error (the key is released). */
static int
columns_add(Columns *k, const Cursor *c, const Tensor *t, PyObject *key, unsigned int mask)
{
    if (key != NULL && append_new(k->keys, key) < 0)
        return -1;
    if (append_new(k->classes, PyLong_FromLongLong(t->cls)) < 0 ||
        append_new(k->names, storage_key(k, c, t)) < 0 ||
        append_new(k->numels, PyLong_FromLongLong(t->numel)) < 0 ||
        append_new(k->offsets, PyLong_FromLongLong(t->offset)) < 0 ||
        append_new(k->sizes, make_tuple(t->size_v, t->nsize)) < 0 ||
        append_new(k->strides, make_tuple(t->stride_v, t->nstride)) < 0 ||
        PyList_Append(k->grads, t->grad ? Py_True : Py_False) < 0)
        return -1;
    k->masks[k->count] = (unsigned char)mask;
    k->count += 1;
    return 0;
}

/* A BINUNICODE string at ``at`` (its opcode) as the interpreter decodes it: 1 and a new
 * reference with the string's end; 0 when it is not one (or not UTF-8); -1 on an error. */
static int
binunicode(const Cursor *c, Py_ssize_t at, PyObject **out, Py_ssize_t *end, Py_ssize_t *len)
{
    uint32_t length;
    if (at < 0 || at > c->n - 5 || c->p[at] != 'X' || !u32(c, at + 1, &length))
        return 0;
    if ((Py_ssize_t)length > c->n - (at + 5))
        return 0;
    *out = PyUnicode_DecodeUTF8((const char *)c->p + at + 5, (Py_ssize_t)length,
                                "surrogatepass");
    if (*out == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    *end = at + 5 + (Py_ssize_t)length;
    *len = (Py_ssize_t)length;
    return 1;
}

/* The arguments entries() and units() take: the buffer, the start, the most entries (or
 * tensors) and the memo's length. */
typedef struct {
    Py_buffer view;
    Py_ssize_t start, limit;
    long long memo_len;
} Walk;

/* 1 with the arguments (the view to release), the limit cut to what the buffer can hold
 * (an entry or a tensor takes more than 16 bytes), ``*valid`` 0 when they name no walk (a
 * start outside the buffer, a negative limit or memo); 0 with a Python error. ``params``:
 * where entries() takes its flag (whether Parameters may be in the walk; unless told, they
 * may), else NULL. */
static int
walk_args(PyObject *args, Walk *w, int *valid, int *params)
{
    if (params != NULL ?
            !PyArg_ParseTuple(args, "y*nnL|p", &w->view, &w->start, &w->limit, &w->memo_len,
                              params) :
            !PyArg_ParseTuple(args, "y*nnL", &w->view, &w->start, &w->limit, &w->memo_len))
        return 0;
    *valid = w->start >= 0 && w->start <= w->view.len && w->limit >= 0 && w->memo_len >= 0;
    if (w->limit > w->view.len / 16 + 1)
        w->limit = w->view.len / 16 + 1;
    return 1;
}

PyDoc_STRVAR(entries_doc,
"entries(data, pos, limit, memo_len, params=True) -> tuple | None\n\n"
"The state dict entries from ``pos`` (a BINUNICODE key, then its tensor as ``_ENTRY_V2``\n"
"reads it, or, where ``params`` is true, that tensor as a Parameter's), at most ``limit``,\n"
"each BINPUT storing the next\n"
"memo index from ``memo_len`` on: ``(count, end, last, keys, masks, shared, classes,\n"
"storage_keys, numels, offsets, sizes, strides, grads, puts, cost, g_param, params)``.\n"
"``shared`` holds the four BINGET indices every entry has alike (the global, the storage\n"
"tag, the location, the hooks' global), ``classes`` the storage class BINGET of each,\n"
"``storage_keys`` a str (written out) or an int (a BINGET index below ``memo_len``): a\n"
"storage key read back by BINGET from an earlier entry's BINPUT is that entry's item,\n"
"``masks`` a bytes of which of the\n"
"eight BINPUTs each entry has, ``last`` the offset of the last opcode taken and ``cost``\n"
"what the interpreter charges for them all. ``params`` is None when no entry is a\n"
"Parameter, else a bytes, one per entry: 0, or 0x10 for a Parameter, 0x08 for its\n"
"requires_grad and bits 0-2 for which of its three BINPUTs (hooks, arguments, result) it\n"
"has; ``g_param`` the BINGET index of ``_rebuild_parameter`` every Parameter has alike\n"
"(-1: none). None when no entry is there.");

static PyObject *
entries(PyObject *self, PyObject *args)
{
    (void)self;
    Walk w;
    int valid, take_params = 1;
    if (!walk_args(args, &w, &valid, &take_params))
        return NULL;
    Py_ssize_t start = w.start, limit = w.limit;
    long long memo_len = w.memo_len;
    Cursor cur = {(const unsigned char *)w.view.buf, w.view.len, start};
    Cursor *c = &cur;
    Columns k;
    PyObject *result = NULL, *masks = NULL, *params = NULL;
    Py_ssize_t end = start, last = -1;
    int64_t next = memo_len;
    /* for each memo index the walk stores (from memo_len on, at most 11 an entry): the entry
     * whose storage key it holds, else -1; grown as the walk goes */
    int32_t *owner = NULL;
    Py_ssize_t owner_size = 0;
    Tensor tensor, *t = &tensor;
    if (columns_init(&k, limit) < 0)
        goto done;
    if (!valid)
        goto none;
    while (k.count < limit) {
        /* a whole entry is read before anything of it is kept */
        int64_t entry_next = next;
        PyObject *key;
        Py_ssize_t key_end, key_len;
        int got = binunicode(c, end, &key, &key_end, &key_len);
        if (got < 0)
            goto done;
        if (got == 0)
            break;
        c->pos = key_end;
        t->mask = 0;
        t->last = -1;
        /* the key's BINPUT */
        int64_t index;
        int put = opt_put(c, &index);
        unsigned int key_mask = 0, param = 0;
        if (put > 0 && index == next) {
            next += 1;
            key_mask = 1;
        }
        int ok = put >= 0 && !(put > 0 && !key_mask);
        /* a Parameter: the BINGET of _rebuild_parameter, then the tensor's */
        int64_t g_param = -1;
        if (ok && take_params) {
            Py_ssize_t before = c->pos;
            if (!get(c, &g_param) || c->pos >= c->n ||
                (c->p[c->pos] != 'h' && c->p[c->pos] != 'j')) {
                g_param = -1;
                c->pos = before;
            }
        }
        ok = ok && parse_tensor(c, &next, t) && same_shared(&k, t) &&
                 (g_param < 0 || (parameter_tail(c, &next, t, &param) &&
                                  (k.g_param < 0 || k.g_param == g_param)));
        if (ok && t->skey_index >= memo_len) {
            /* a storage key stored by an earlier entry of the walk: its item */
            int64_t at = t->skey_index - memo_len;
            ok = at < entry_next - memo_len && owner[at] >= 0;
            if (ok)
                t->skey_entry = owner[at];
        }
        if (!ok) {
            Py_DECREF(key);
            next = entry_next;
            break;
        }
        if (next - memo_len > owner_size) {
            Py_ssize_t size = owner_size > 32 ? owner_size : 32;
            while (size < next - memo_len)
                size *= 2;
            int32_t *grown = PyMem_Realloc(owner, sizeof(int32_t) * (size_t)size);
            if (grown == NULL) {
                Py_DECREF(key);
                PyErr_NoMemory();
                goto done;
            }
            owner = grown;
            owner_size = size;
        }
        for (int64_t i = entry_next; i < next; i++)
            owner[i - memo_len] = -1;
        if (t->skey_put >= 0)
            owner[t->skey_put - memo_len] = (int32_t)k.count;
        if (param) {
            k.params[k.count] = (unsigned char)param;
            k.g_param = g_param;
            k.nparams += 1;
        }
        if (columns_add(&k, c, t, key, t->mask | key_mask) < 0)
            goto done;
        {
            /* the BINUNICODE key, the BINGET of the global, the tensor's opcodes, a memo
             * slot per BINPUT (the _Machine.entry_run formula, entry by entry) */
            int64_t entry_puts = next - entry_next;
            k.cost += 96 + 16 + 1304 + 16 * entry_puts + 4 * (int64_t)key_len + t->charged;
            k.puts += entry_puts;
        }
        last = t->last;
        end = c->pos;
    }
    if (k.count == 0)
        goto none;
    masks = PyBytes_FromStringAndSize((const char *)k.masks, k.count);
    params = k.nparams ? PyBytes_FromStringAndSize((const char *)k.params, k.count) :
                         Py_NewRef(Py_None);
    if (masks == NULL || params == NULL)
        goto done;
    result = Py_BuildValue("(nnnOO(LLLL)OOOOOOOLLLO)", k.count, end, last, k.keys, masks,
                           (long long)k.shared[0], (long long)k.shared[1],
                           (long long)k.shared[2], (long long)k.shared[3], k.classes, k.names,
                           k.numels, k.offsets, k.sizes, k.strides, k.grads,
                           (long long)k.puts, (long long)k.cost, (long long)k.g_param,
                           params);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(owner);
    Py_XDECREF(masks);
    Py_XDECREF(params);
    columns_free(&k);
    PyBuffer_Release(&w.view);
    return result;
}

PyDoc_STRVAR(units_doc,
"units(data, pos, limit, memo_len) -> tuple | None\n\n"
"An optimizer's state from ``pos``: dicts of tensors under int keys, each as torch pickles\n"
"it (the int, EMPTY_DICT, its BINPUT, MARK, then each key as a BINGET and its tensor as\n"
"``_ENTRY_V2`` reads it after a key without a BINPUT, then SETITEMS), at most ``limit``\n"
"tensors in all, every BINPUT (the dicts' among the tensors') storing the next memo index\n"
"from ``memo_len`` on: ``(count, end, ints, per_unit, key_gets, masks, shared, classes,\n"
"storage_keys, numels, offsets, sizes, strides, grads, puts, cost)``: the units' int keys,\n"
"how many tensors each holds, each tensor's key BINGET index, and the tensors' columns as\n"
"``entries`` gives them (``cost`` covering the ints, dicts, MARKs and SETITEMS too). None\n"
"when no unit is there.");

static PyObject *
units(PyObject *self, PyObject *args)
{
    (void)self;
    Walk w;
    int valid;
    if (!walk_args(args, &w, &valid, NULL))
        return NULL;
    Py_ssize_t start = w.start, limit = w.limit;
    Cursor cur = {(const unsigned char *)w.view.buf, w.view.len, start};
    Cursor *c = &cur;
    Columns k;
    PyObject *result = NULL, *masks = NULL, *ints = PyList_New(0), *per_unit = PyList_New(0),
             *key_gets = PyList_New(0);
    Py_ssize_t end = start, nunits = 0;
    int64_t next = w.memo_len;
    if (columns_init(&k, limit) < 0 || !ints || !per_unit || !key_gets)
        goto done;
    if (!valid)
        goto none;
    for (;;) {
        /* a whole unit is read before anything of it is kept */
        int64_t unit_next = next, value, ch, unit_cost;
        Tensor unit[16];
        int64_t gets[16];
        Py_ssize_t size = 0;
        c->pos = end;
        if (!small_int(c, &value, &ch))
            break;
        unit_cost = ch + 96 + 16 + 88 + 64;    /* the int, EMPTY_DICT, its BINPUT, MARK,
                                                  SETITEMS */
        if (c->pos + 6 > c->n || c->p[c->pos] != '}' || c->p[c->pos + 1] != 'r')
            break;
        {
            uint32_t put;
            if (!u32(c, c->pos + 2, &put) || put != next)
                break;
        }
        next += 1;
        c->pos += 6;
        if (c->pos >= c->n || c->p[c->pos] != '(')
            break;
        c->pos += 1;
        int ok = 1;
        while (c->pos < c->n && c->p[c->pos] != 'u') {
            if (size == 16 || k.count + size >= limit || !get(c, &gets[size]) ||
                !parse_tensor(c, &next, &unit[size])) {
                ok = 0;
                break;
            }
            if (k.count == 0 && size == 0)
                memcpy(k.shared, unit[0].g, sizeof k.shared);
            else if (memcmp(k.shared, unit[size].g, sizeof k.shared) != 0) {
                ok = 0;
                break;
            }
            size += 1;
        }
        if (!ok || size == 0 || c->pos >= c->n) {
            next = unit_next;
            break;
        }
        c->pos += 1;                            /* SETITEMS */
        if (append_new(ints, PyLong_FromLongLong(value)) < 0 ||
            append_new(per_unit, PyLong_FromSsize_t(size)) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < size; i++) {
            if (append_new(key_gets, PyLong_FromLongLong(gets[i])) < 0 ||
                columns_add(&k, c, &unit[i], NULL, unit[i].mask) < 0)
                goto done;
            /* the key's BINGET, the global's, the tensor's opcodes, SETITEMS per pair */
            unit_cost += 16 + 16 + 1304 + 64 + unit[i].charged;
        }
        unit_cost += 16 * (next - unit_next - 1);  /* the tensors' BINPUTs (the dict's is in
                                                      the base) */
        k.puts += next - unit_next - 1;          /* (the tensors' BINPUTs) */
        k.cost += unit_cost;
        nunits += 1;
        end = c->pos;
    }
    if (nunits == 0)
        goto none;
    masks = PyBytes_FromStringAndSize((const char *)k.masks, k.count);
    if (masks == NULL)
        goto done;
    result = Py_BuildValue("(nnOOOO(LLLL)OOOOOOOLL)", nunits, end, ints, per_unit, key_gets,
                           masks, (long long)k.shared[0], (long long)k.shared[1],
                           (long long)k.shared[2], (long long)k.shared[3], k.classes, k.names,
                           k.numels, k.offsets, k.sizes, k.strides, k.grads,
                           (long long)k.puts, (long long)k.cost);
    goto done;
none:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(masks);
    Py_XDECREF(ints);
    Py_XDECREF(per_unit);
    Py_XDECREF(key_gets);
    columns_free(&k);
    PyBuffer_Release(&w.view);
    return result;
}


/* ---------------------------------------------------------------------------------------
 * opcodes(): the interpreter's plain opcodes, many at a time
 *
 * _Machine.run hands each opcode it meets to this first: the opcodes that only move objects
 * (memo, stack, MARKs, ints, bools, empty containers, tuples, SETITEMS into a plain dict and
 * OrderedDict() as the loop's fast path takes it) are done here, exactly as the loop does
 * them, with the same charges; at the first opcode that is anything else, or that would fail
 * or overrun the budget, it stops *before* it and the loop does that one (and says what is
 * wrong, where). A whole pickled nn.Module is mostly such opcodes.
 */

#define STOP_BEFORE() goto stop

/* Pops the list on top of ``meta`` (a new reference); meta must not be empty. */
static PyObject *
meta_pop(PyObject *meta)
{
    Py_ssize_t m = PyList_GET_SIZE(meta);
    PyObject *top = Py_NewRef(PyList_GET_ITEM(meta, m - 1));
    if (PyList_SetSlice(meta, m - 1, m, NULL) < 0) {
        Py_DECREF(top);
        return NULL;
    }
    return top;
}

PyDoc_STRVAR(opcodes_doc,
"opcodes(data, pos, stack, metastack, memo, budget, odict_global, odict_new, fast_global,\n"
"        units, failed[, calls]) -> (pos, stack, budget, last)\n\n"
"The plain opcodes from ``pos`` done as ``_Machine.run`` does them (the same objects pushed\n"
"and stored, the same charges), up to the first it leaves to the loop: where the loop goes\n"
"on, the stack on top (a MARK starts a new one), the budget left and the offset of the last\n"
"opcode done (-1: none). ``odict_global`` /\n"
"``odict_new``: the OrderedDict global and what it makes with no arguments (the loop's fast\n"
"path); ``fast_global``: torch's tensor rebuild, whose BINGET is left to the loop (but\n"
"see ``calls``);\n"
"``units``: whether a SETITEMS before an int is left to the loop (an optimizer state's);\n"
"``failed``: a list whose first item is set to the offset of the opcode an error was\n"
"raised on (an OrderedDict handler's, or no memory), for the loop to report.\n\n"
"An optional twelfth argument, ``calls`` = (machine, call, build, persistent, fused,\n"
"plain_calls, global_type, reduced_type, empty_list_calls[, shared_empty]), lets\n"
"it do the opcodes that call the machine too, through the machine's own methods: a tensor\n"
"rebuild as ``_Machine.tensor_v2`` does it with ``fused`` (from its global's BINGET), REDUCE and\n"
"NEWOBJ (``call(func, args)``, with ``machine.budget`` set before and read after, as the\n"
"loop syncs it), BUILD (``build(target, state)``), BINPERSID (``persistent(pid)``, when it\n"
"is not None) and BINUNICODE (but not a key whose next opcodes are a BINGET of\n"
"``fast_global``: the loop's state dict entries start there). Where ``call`` or ``build``\n"
"has no check that can fail, it is done without them: a global in ``plain_calls`` makes\n"
"what that dict says of ``(func, args)`` (a Reduced), one in ``empty_list_calls`` called\n"
"with one empty list makes what that dict says, a ``_rebuild_parameter`` of a tensor made\n"
"here goes to the machine's batchable ``param_handler``, and a ``reduced_type``'s first\n"
"BUILD sets its ``state``. ``shared_empty`` (when not None) is pushed for an\n"
"``OrderedDict()`` not followed by a MARK or BUILD, and is every tensor's hooks, as the\n"
"loop does with ``_Machine.shared_empty``.");

/* The attribute names the runner and the walk read, interned once (PyInit__entries). */
static PyObject *budget_name, *state_name, *param_global_name, *param_handler_name;
static PyObject *pending_name, *pairs_name, *args_name, *items_name;

/* ``machine.budget = budget`` (before a call that charges it) and back (after). */

static int
budget_out(PyObject *machine, long long budget)
{
    PyObject *value = PyLong_FromLongLong(budget);
    if (value == NULL)
        return -1;
    int done = PyObject_SetAttr(machine, budget_name, value);
    Py_DECREF(value);
    return done;
}

static int
budget_in(PyObject *machine, long long *budget)
{
    PyObject *value = PyObject_GetAttr(machine, budget_name);
    if (value == NULL)
        return -1;
    long long got = PyLong_AsLongLong(value);
    Py_DECREF(value);
    if (got == -1 && PyErr_Occurred())
        return -1;
    *budget = got;
    return 0;
}

/* Whether the opcode at ``at`` (after an ``OrderedDict()``'s REDUCE), past a memo put, is a
 * MARK or a BUILD: the OrderedDict then gets a new dict, not the shared empty one
 * (_unpickle._filled_at_once). */
static int
filled_at_once(const unsigned char *p, Py_ssize_t n, Py_ssize_t at)
{
    if (at < n)
        at += p[at] == 'q' ? 2 : p[at] == 'r' ? 5 : p[at] == 0x94 ? 1 : 0;
    return at >= n || p[at] == '(' || p[at] == 'b';
}

/* torch's tensor rebuild from the BINGET of ``_rebuild_tensor_v2`` at ``pos``, done at once
 * as ``_Machine.tensor_v2`` does it on its fused path (and so as the loop would): the bytes
 * are :c:func:`parse_tensor`'s template with every BINGET reading an index stored before and
 * the BINPUTs (all short or all long, as tensor_v2 takes them) appending in order, the hooks
 * are ``OrderedDict()`` (``shared`` when not NULL), the budget covers it all, and
 * ``fused(pid, offset, size, stride, requires_grad)`` takes it (not None). Then the tensor
 * is pushed, its memo entries appended and its charges taken: 1, with *end after its last
 * opcode and *last that opcode's offset. 0, having changed nothing: the loop does it.
 * -1: an error (raised by ``fused`` or ``odict_new``, or no memory). */
static int
one_tensor(const unsigned char *p, Py_ssize_t n, Py_ssize_t pos, PyObject *stack,
           PyObject *memo, long long *budget, PyObject *odict_global, PyObject *odict_new,
           PyObject *shared, PyObject *fused, Py_ssize_t *end, Py_ssize_t *last)
{
    Cursor c = {p, n, pos};
    Py_ssize_t have = PyList_GET_SIZE(memo);
    int64_t next = have;
    Tensor t;
    if (!parse_tensor(&c, &next, &t))
        return 0;
    if (t.g[1] >= have || t.cls >= have || t.g[2] >= have || t.g[3] >= have ||
        t.skey_index >= have || PyList_GET_ITEM(memo, t.g[3]) != odict_global)
        return 0;
    if (t.kinds == 3)  /* BINPUTs and LONG_BINPUTs: tensor_v2 leaves those to the loop */
        return 0;
    long long count = 0;
    for (unsigned int bit = 1; bit <= 7; bit++)
        count += (t.mask >> bit) & 1u;
    /* the BINGET of the global, then what tensor_v2 charges */
    long long cost = 16 + t.charged + 1304 + 16 * count;
    if (*budget < cost)
        return 0;
    PyObject *key = t.skey_index >= 0 ? Py_NewRef(PyList_GET_ITEM(memo, t.skey_index)) :
        PyUnicode_DecodeASCII((const char *)p + t.skey_at, t.skey_len, NULL);
    PyObject *numel = PyLong_FromLongLong(t.numel);
    PyObject *offset = PyLong_FromLongLong(t.offset);
    PyObject *size = make_tuple(t.size_v, t.nsize);
    PyObject *stride = make_tuple(t.stride_v, t.nstride);
    PyObject *grad = t.grad ? Py_True : Py_False;
    PyObject *pid = NULL, *both = NULL, *hooks = NULL, *args = NULL;
    int done = -1;
    if (key == NULL || numel == NULL || offset == NULL || size == NULL || stride == NULL)
        goto out;
    pid = PyTuple_Pack(5, PyList_GET_ITEM(memo, t.g[1]), PyList_GET_ITEM(memo, t.cls), key,
                       PyList_GET_ITEM(memo, t.g[2]), numel);
    if (pid == NULL)
        goto out;
    both = PyObject_CallFunctionObjArgs(fused, pid, offset, size, stride, grad, NULL);
    if (both == NULL)
        goto out;
    if (both == Py_None) {  /* fused changed nothing: the loop's slow path says the rest */
        done = 0;
        goto out;
    }
    if (!PyTuple_CheckExact(both) || PyTuple_GET_SIZE(both) != 2) {
        PyErr_SetString(PyExc_TypeError, "fused_tensor_v2 returns (storage, tensor) or None");
        goto out;
    }
    hooks = shared != NULL ? Py_NewRef(shared) : PyObject_CallNoArgs(odict_new);
    if (hooks == NULL)
        goto out;
    PyObject *ref = PyTuple_GET_ITEM(both, 0), *result = PyTuple_GET_ITEM(both, 1);
    args = PyTuple_Pack(6, ref, offset, size, stride, grad, hooks);
    if (args == NULL)
        goto out;
    PyObject *values[7] = {key, pid, size, stride, hooks, args, result};
    for (unsigned int bit = 1; bit <= 7; bit++)
        if ((t.mask >> bit) & 1u && PyList_Append(memo, values[bit - 1]) < 0)
            goto out;
    if (PyList_Append(stack, result) < 0)
        goto out;
    *budget -= cost;
    *end = c.pos;
    *last = t.last;
    done = 1;
out:
    Py_XDECREF(key);
    Py_XDECREF(numel);
    Py_XDECREF(offset);
    Py_XDECREF(size);
    Py_XDECREF(stride);
    Py_XDECREF(pid);
    Py_XDECREF(both);
    Py_XDECREF(hooks);
    Py_XDECREF(args);
    return done;
}

/* ``maker(func, args)`` where ``maker`` is ``_unpickle.Reduced`` and its ``__init__`` the
 * one it names ``ckptlab_init`` (not patched): what that __init__ makes (func, args, kwargs
 * None, state None, items [], pairs []), its slots set here without its frame. NULL with no
 * exception: call ``maker`` (another class, another __init__, slots not found). */
static PyObject *
new_reduced(PyObject *maker, PyObject *func, PyObject *args)
{
    static const char *const names[6] = {"func", "args", "kwargs", "state", "items", "pairs"};
    static PyObject *known = NULL;  /* (held: its address is the key of ``at``) */
    static Py_ssize_t at[6];
    if (!PyType_Check(maker))
        return NULL;
    PyObject *dict = ((PyTypeObject *)maker)->tp_dict;
    PyObject *init = PyDict_GetItemString(dict, "__init__");
    if (init == NULL || init != PyDict_GetItemString(dict, "ckptlab_init"))
        return NULL;
    if (maker != known) {
        Py_ssize_t found[6];
        for (int i = 0; i < 6; i++)
            if ((found[i] = slot_offset(maker, names[i])) < 0)
                return NULL;
        memcpy(at, found, sizeof found);
        Py_XSETREF(known, Py_NewRef(maker));
    }
    PyObject *items = PyList_New(0), *pairs = PyList_New(0);
    PyObject *obj = items == NULL || pairs == NULL ? NULL :
        ((PyTypeObject *)maker)->tp_alloc((PyTypeObject *)maker, 0);
    if (obj == NULL) {
        Py_XDECREF(items);
        Py_XDECREF(pairs);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return NULL;
    }
    PyObject *values[6] = {Py_NewRef(func), Py_NewRef(args), Py_NewRef(Py_None),
                           Py_NewRef(Py_None), items, pairs};
    for (int i = 0; i < 6; i++)
        *(PyObject **)((char *)obj + at[i]) = values[i];
    return obj;
}

/* A call that ``_Machine.call`` would make without a check that can fail, made here
 * without it: a global with no handler (in ``plain_calls``: what it makes of ``(func,
 * args)``, a Reduced), or ``_rebuild_parameter`` (``param_global``, its handler
 * ``param_handler`` batchable: it never raises) of a tensor made here by the fused handler
 * (``made_type``), a bool and an empty hooks dict made by ``odict_new``. The budget must
 * hold call()'s 320. 1 with *made (NULL: an error), or 0: call() makes it. */
static int
direct_call(PyObject *func, PyObject *fargs, long long budget, PyObject *plain_calls,
            PyObject *global_type, PyObject *param_global, PyObject *param_handler,
            PyTypeObject *made_type, PyObject *odict_new, PyObject *empty_list_calls,
            PyObject **made)
{
    if (plain_calls == NULL || budget < 320 || !PyTuple_Check(fargs) ||
        Py_TYPE(func) != (PyTypeObject *)global_type)
        return 0;
    if (PyTuple_GET_SIZE(fargs) == 1 && PyList_CheckExact(PyTuple_GET_ITEM(fargs, 0)) &&
        PyList_GET_SIZE(PyTuple_GET_ITEM(fargs, 0)) == 0) {
        /* set([]) and the like: what the handler makes of an empty list, made at once */
        PyObject *empty = PyDict_GetItemWithError(empty_list_calls, func);  /* (borrowed) */
        if (empty != NULL) {
            *made = PyObject_CallNoArgs(empty);
            return 1;
        }
        if (PyErr_Occurred()) {
            *made = NULL;
            return 1;
        }
    }
    if (func == param_global && param_handler != Py_None && made_type != NULL &&
        PyTuple_GET_SIZE(fargs) == 3 &&
        Py_TYPE(PyTuple_GET_ITEM(fargs, 0)) == made_type &&
        PyBool_Check(PyTuple_GET_ITEM(fargs, 1)) &&
        PyType_Check(odict_new) &&
        Py_TYPE(PyTuple_GET_ITEM(fargs, 2)) == (PyTypeObject *)odict_new &&
        PyDict_Check(PyTuple_GET_ITEM(fargs, 2)) &&
        PyDict_GET_SIZE(PyTuple_GET_ITEM(fargs, 2)) == 0) {
        *made = PyObject_Call(param_handler, fargs, NULL);
        return 1;
    }
    PyObject *maker = PyDict_GetItemWithError(plain_calls, func);  /* (borrowed) */
    if (maker == NULL) {
        if (PyErr_Occurred()) {
            *made = NULL;
            return 1;
        }
        return 0;
    }
    *made = new_reduced(maker, func, fargs);
    if (*made == NULL && !PyErr_Occurred())
        *made = PyObject_CallFunctionObjArgs(maker, func, fargs, NULL);
    return 1;
}

/* Whether the opcodes at ``at`` (a string's end) are an optional BINPUT and a BINGET of
 * ``fast_global``: a state dict entry the loop takes at its key (``tensor_entries``). */
static int
entry_follows(const unsigned char *p, Py_ssize_t n, Py_ssize_t at, PyObject *memo,
              PyObject *fast_global)
{
    if (at < n && p[at] == 'q')
        at += 2;
    else if (at < n && p[at] == 'r')
        at += 5;
    Cursor c = {p, n, at};
    int64_t idx;
    return at < n && get(&c, &idx) && idx < PyList_GET_SIZE(memo) &&
           PyList_GET_ITEM(memo, idx) == fast_global;
}

static PyObject *
opcodes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 11 && nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "opcodes() takes 11 or 12 arguments");
        return NULL;
    }
    PyObject *stack = args[2], *meta = args[3], *memo = args[4];
    PyObject *odict_global = args[6], *odict_new = args[7], *fast_global = args[8];
    PyObject *failed = args[10];
    PyObject *machine = NULL, *call = NULL, *build = NULL, *persistent = NULL, *fused = NULL;
    PyObject *plain_calls = NULL, *global_type = NULL, *reduced_type = NULL;
    PyObject *empty_list_calls = NULL;
    PyObject *shared = NULL;   /* the shared empty OrderedDict, or NULL: a new one each */
    PyObject *param_global = NULL, *param_handler = NULL;   /* (strong references) */
    PyTypeObject *made_type = NULL;   /* the type of the tensors the fused handler made */
    if (nargs == 12 && args[11] != Py_None) {
        if (!PyTuple_CheckExact(args[11]) || PyTuple_GET_SIZE(args[11]) < 9 ||
            PyTuple_GET_SIZE(args[11]) > 10 ||
            !PyDict_CheckExact(PyTuple_GET_ITEM(args[11], 5)) ||
            !PyType_Check(PyTuple_GET_ITEM(args[11], 6)) ||
            !PyType_Check(PyTuple_GET_ITEM(args[11], 7)) ||
            !PyDict_CheckExact(PyTuple_GET_ITEM(args[11], 8))) {
            PyErr_SetString(PyExc_TypeError, "opcodes(): calls is (machine, call, build, "
                            "persistent, fused, plain_calls, global_type, reduced_type, "
                            "empty_list_calls[, shared_empty]) or None");
            return NULL;
        }
        machine = PyTuple_GET_ITEM(args[11], 0);
        call = PyTuple_GET_ITEM(args[11], 1);
        build = PyTuple_GET_ITEM(args[11], 2);
        persistent = PyTuple_GET_ITEM(args[11], 3);
        fused = PyTuple_GET_ITEM(args[11], 4);
        plain_calls = PyTuple_GET_ITEM(args[11], 5);
        global_type = PyTuple_GET_ITEM(args[11], 6);
        reduced_type = PyTuple_GET_ITEM(args[11], 7);
        empty_list_calls = PyTuple_GET_ITEM(args[11], 8);
        if (PyTuple_GET_SIZE(args[11]) == 10 && PyTuple_GET_ITEM(args[11], 9) != Py_None)
            shared = PyTuple_GET_ITEM(args[11], 9);
        if (persistent == Py_None)
            persistent = NULL;
        if (fused == Py_None || persistent == NULL)
            fused = NULL;
    }
    if (!PyList_CheckExact(stack) || !PyList_CheckExact(meta) || !PyList_CheckExact(memo) ||
        !PyList_CheckExact(failed) || PyList_GET_SIZE(failed) < 1) {
        PyErr_SetString(PyExc_TypeError,
                        "opcodes(): stack, metastack, memo and failed (one item) are lists");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    long long budget = PyLong_AsLongLong(args[5]);
    if (budget == -1 && PyErr_Occurred())
        return NULL;
    int units = PyObject_IsTrue(args[9]);
    if (units < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t n = view.len;
    Py_ssize_t last = -1;   /* the offset of the last opcode done */
    Py_ssize_t at = pos;    /* ... and of the one being done */
    Py_INCREF(stack);  /* the stack on top: a reference of our own */
    if (pos < 0)
        pos = n;
    if (machine != NULL) {  /* the machine's _rebuild_parameter and its handler, as now */
        param_global = PyObject_GetAttr(machine, param_global_name);
        param_handler = param_global ? PyObject_GetAttr(machine, param_handler_name) : NULL;
        if (param_handler == NULL)
            goto fail;
    }
    while (pos < n) {
        unsigned char code = p[pos];
        at = pos;
        Py_ssize_t size = PyList_GET_SIZE(stack);
        switch (code) {
        case 'h': case 'j': {                               /* BINGET / LONG_BINGET */
            Cursor c = {p, n, pos};
            int64_t idx;
            if (!get(&c, &idx) || budget < 16 || idx >= PyList_GET_SIZE(memo))
                STOP_BEFORE();
            PyObject *value = PyList_GET_ITEM(memo, idx);
            if (shared != NULL && value == shared)  /* the loop says it is shared no more */
                STOP_BEFORE();
            if (value == fast_global) {  /* a tensor: at once, or left to the loop */
                Py_ssize_t end, took;
                int done = fused == NULL ? 0 :
                    one_tensor(p, n, pos, stack, memo, &budget, odict_global, odict_new,
                               shared, fused, &end, &took);
                if (done < 0)
                    goto fail;
                if (done == 0)
                    STOP_BEFORE();
                made_type = Py_TYPE(PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1));
                pos = end;
                at = took;
                break;
            }
            if (PyList_Append(stack, value) < 0)
                goto fail;
            budget -= 16;
            pos = c.pos;
            if (value == odict_global && pos + 2 <= n && p[pos] == ')' && p[pos + 1] == 'R'
                && budget >= 336) {
                /* OrderedDict(): EMPTY_TUPLE and REDUCE at once, and its LONG_BINPUT when
                 * it appends to the memo (as the loop's fast path) */
                PyObject *made = shared != NULL && !filled_at_once(p, n, pos + 2) ?
                    Py_NewRef(shared) : PyObject_CallNoArgs(odict_new);
                if (made == NULL)
                    goto fail;
                Py_ssize_t top = PyList_GET_SIZE(stack) - 1;
                if (PyList_SetItem(stack, top, made) < 0)   /* (steals made) */
                    goto fail;
                budget -= 336;
                at = pos + 1;   /* (the REDUCE) */
                pos += 2;
                c.pos = pos;
                if (pos < n && p[pos] == 'r' && budget >= 16 && opt_put(&c, &idx) > 0 &&
                    idx == PyList_GET_SIZE(memo)) {
                    if (PyList_Append(memo, made) < 0)
                        goto fail;
                    budget -= 16;
                    at = pos;
                    pos = c.pos;
                }
            }
            break;
        }
        case 'q': case 'r': {                               /* BINPUT / LONG_BINPUT */
            Cursor c = {p, n, pos};
            int64_t idx;
            if (opt_put(&c, &idx) <= 0 || size == 0 || budget < 16 ||
                idx != PyList_GET_SIZE(memo))
                STOP_BEFORE();
            if (PyList_Append(memo, PyList_GET_ITEM(stack, size - 1)) < 0)
                goto fail;
            budget -= 16;
            pos = c.pos;
            break;
        }
        case 0x94:                                          /* MEMOIZE */
            if (size == 0 || budget < 16)
                STOP_BEFORE();
            if (PyList_Append(memo, PyList_GET_ITEM(stack, size - 1)) < 0)
                goto fail;
            budget -= 16;
            pos += 1;
            break;
        case '(': {                                         /* MARK */
            if (budget < 88)
                STOP_BEFORE();
            PyObject *fresh = PyList_New(0);
            if (fresh == NULL)
                goto fail;
            if (PyList_Append(meta, stack) < 0) {
                Py_DECREF(fresh);
                goto fail;
            }
            Py_SETREF(stack, fresh);
            budget -= 88;
            pos += 1;
            break;
        }
        case 't': {                                         /* TUPLE */
            if (PyList_GET_SIZE(meta) == 0 || budget < 72 + 8 * (long long)size)
                STOP_BEFORE();
            PyObject *items = PyList_AsTuple(stack);
            if (items == NULL)
                goto fail;
            PyObject *below = meta_pop(meta);
            if (below == NULL) {
                Py_DECREF(items);
                goto fail;
            }
            Py_SETREF(stack, below);
            if (append_new(stack, items) < 0)
                goto fail;
            budget -= 72 + 8 * (long long)size;
            pos += 1;
            break;
        }
        case 0x85: case 0x86: case 0x87: {                  /* TUPLE1 / TUPLE2 / TUPLE3 */
            Py_ssize_t k = code - 0x84;
            if (size < k || budget < 72 + 8 * k)
                STOP_BEFORE();
            PyObject *items = PyTuple_New(k);
            if (items == NULL)
                goto fail;
            for (Py_ssize_t i = 0; i < k; i++)
                PyTuple_SET_ITEM(items, i, Py_NewRef(PyList_GET_ITEM(stack, size - k + i)));
            if (PyList_SetSlice(stack, size - k, size, NULL) < 0) {
                Py_DECREF(items);
                goto fail;
            }
            if (append_new(stack, items) < 0)
                goto fail;
            budget -= 72 + 8 * k;
            pos += 1;
            break;
        }
        case ')': case '}': case ']': case 'N': case 0x88: case 0x89: {
            /* EMPTY_TUPLE, EMPTY_DICT, EMPTY_LIST, NONE, NEWTRUE, NEWFALSE */
            long long cost = code == '}' ? 96 : code == ']' ? 88 : 16;
            if (budget < cost)
                STOP_BEFORE();
            PyObject *made = code == ')' ? PyTuple_New(0) : code == '}' ? PyDict_New() :
                             code == ']' ? PyList_New(0) :
                             Py_NewRef(code == 'N' ? Py_None : code == 0x88 ? Py_True : Py_False);
            if (append_new(stack, made) < 0)
                goto fail;
            budget -= cost;
            pos += 1;
            break;
        }
        case 'K': case 'M': case 'J': {                     /* BININT1 / BININT2 / BININT */
            Cursor c = {p, n, pos};
            int64_t value, cost;
            if (!small_int(&c, &value, &cost) || budget < cost)
                STOP_BEFORE();
            if (append_new(stack, PyLong_FromLongLong(value)) < 0)
                goto fail;
            budget -= cost;
            pos = c.pos;
            break;
        }
        case 'G': {                                         /* BINFLOAT (big-endian) */
            if (pos + 9 > n || budget < 48)
                STOP_BEFORE();
            double d = PyFloat_Unpack8((const char *)p + pos + 1, 0);
            if (d == -1.0 && PyErr_Occurred())
                goto fail;
            if (append_new(stack, PyFloat_FromDouble(d)) < 0)
                goto fail;
            budget -= 48;
            pos += 9;
            break;
        }
        case 'u': {                                         /* SETITEMS into a plain dict */
            Py_ssize_t m = PyList_GET_SIZE(meta);
            if (m == 0 || size % 2)
                STOP_BEFORE();
            PyObject *below = PyList_GET_ITEM(meta, m - 1);
            Py_ssize_t depth = PyList_GET_SIZE(below);
            long long cost = 64 * (long long)(size / 2 + 1);
            if (depth == 0 || budget < cost)
                STOP_BEFORE();
            PyObject *target = PyList_GET_ITEM(below, depth - 1);
            if (!PyDict_CheckExact(target) || target == shared)  /* (the loop copies it) */
                STOP_BEFORE();
            for (Py_ssize_t i = 0; i < size; i += 2)
                if (!PyUnicode_CheckExact(PyList_GET_ITEM(stack, i)))
                    STOP_BEFORE();
            /* an optimizer state's next int: the loop tries its batch after this SETITEMS */
            if (units && pos + 1 < n &&
                (p[pos + 1] == 'K' || p[pos + 1] == 'M' || p[pos + 1] == 'J'))
                STOP_BEFORE();
            for (Py_ssize_t i = 0; i < size; i += 2)
                if (PyDict_SetItem(target, PyList_GET_ITEM(stack, i),
                                   PyList_GET_ITEM(stack, i + 1)) < 0)
                    goto fail;
            below = meta_pop(meta);
            if (below == NULL)
                goto fail;
            Py_SETREF(stack, below);
            budget -= cost;
            pos += 1;
            break;
        }
        case 'R': case 0x81: {                              /* REDUCE / NEWOBJ */
            if (machine == NULL || size < 2)
                STOP_BEFORE();
            PyObject *func = Py_NewRef(PyList_GET_ITEM(stack, size - 2));
            PyObject *fargs = Py_NewRef(PyList_GET_ITEM(stack, size - 1));
            PyObject *made = NULL;
            int direct = direct_call(func, fargs, budget, plain_calls, global_type,
                                     param_global, param_handler, made_type, odict_new,
                                     empty_list_calls, &made);
            if (direct == 0 && budget_out(machine, budget) == 0)  /* through machine.call */
                made = PyObject_CallFunctionObjArgs(call, func, fargs, NULL);
            Py_DECREF(func);
            Py_DECREF(fargs);
            if (made == NULL)
                goto fail;
            if (direct)  /* (what call() charges) */
                budget -= 320;
            if ((!direct && budget_in(machine, &budget) < 0) ||
                PyList_SetSlice(stack, size - 2, size, NULL) < 0) {
                Py_DECREF(made);
                goto fail;
            }
            if (append_new(stack, made) < 0)
                goto fail;
            pos += 1;
            break;
        }
        case 'b': {                                         /* BUILD */
            if (machine == NULL || size < 2 ||
                (shared != NULL && PyList_GET_ITEM(stack, size - 2) == shared))
                STOP_BEFORE();
            PyObject *target = Py_NewRef(PyList_GET_ITEM(stack, size - 2));
            PyObject *state = Py_NewRef(PyList_GET_ITEM(stack, size - 1));
            PyObject *done = NULL;
            if (Py_TYPE(target) == (PyTypeObject *)reduced_type) {
                /* a Reduced's first BUILD: its state set, as _Machine.build sets it */
                PyObject *had = PyObject_GetAttr(target, state_name);
                if (had == Py_None)
                    done = PyObject_SetAttr(target, state_name, state) < 0 ? NULL :
                           Py_NewRef(Py_None);
                else if (had != NULL)  /* built before: build() says so */
                    done = PyObject_CallFunctionObjArgs(build, target, state, NULL);
                Py_XDECREF(had);
            }
            else
                done = PyObject_CallFunctionObjArgs(build, target, state, NULL);
            Py_DECREF(target);
            Py_DECREF(state);
            if (done == NULL)
                goto fail;
            Py_DECREF(done);
            if (PyList_SetSlice(stack, size - 1, size, NULL) < 0)
                goto fail;
            pos += 1;
            break;
        }
        case 'Q': {                                         /* BINPERSID */
            if (persistent == NULL || size == 0 || budget < 160)
                STOP_BEFORE();
            PyObject *pid = Py_NewRef(PyList_GET_ITEM(stack, size - 1));
            PyObject *made = PyObject_CallOneArg(persistent, pid);
            Py_DECREF(pid);
            if (made == NULL)
                goto fail;
            if (PyList_SetItem(stack, size - 1, made) < 0)  /* (steals made) */
                goto fail;
            budget -= 160;
            pos += 1;
            break;
        }
        case 'X': {                                         /* BINUNICODE */
            Cursor c = {p, n, pos};
            uint32_t length;
            if (machine == NULL || !u32(&c, pos + 1, &length) ||
                (Py_ssize_t)length > n - pos - 5 || budget < 96 + 4 * (long long)length)
                STOP_BEFORE();
            Py_ssize_t end = pos + 5 + (Py_ssize_t)length;
            if (fast_global != Py_None && entry_follows(p, n, end, memo, fast_global))
                STOP_BEFORE();
            PyObject *text = PyUnicode_DecodeUTF8((const char *)p + pos + 5,
                                                  (Py_ssize_t)length, "surrogatepass");
            if (text == NULL) {  /* the loop raises it, at this opcode */
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                    goto fail;
                PyErr_Clear();
                STOP_BEFORE();
            }
            if (append_new(stack, text) < 0)
                goto fail;
            budget -= 96 + 4 * (long long)length;
            pos = end;
            break;
        }
        default:
            STOP_BEFORE();
        }
        last = at;
    }
stop:
    result = Py_BuildValue("(nOLn)", pos, stack, budget, last);
fail:
    if (result == NULL) {  /* the opcode it failed on, for the loop's error offset */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyObject *where = PyLong_FromSsize_t(at);
        if (where == NULL || PyList_SetItem(failed, 0, where) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, traceback);
    }
    Py_DECREF(stack);
    PyBuffer_Release(&view);
    Py_XDECREF(param_global);
    Py_XDECREF(param_handler);
    return result;
}

/* -- the object walk (``_pickle._walk``'s first pass) ------------------------------------ */

#define WALK_MAX_FRAMES 1024

typedef struct {
    PyObject *obj;        /* the container (a strong reference) */
    PyObject *dict;       /* the dict whose items are walked with PyDict_Next, or NULL */
    PyObject *iter;       /* ... or an iterator of (key, value) pairs, or NULL: a sequence */
    Py_ssize_t at;        /* PyDict_Next's position, or the sequence's next index */
} Frame;

typedef struct {
    PyObject *dense, *composite, *reduced;    /* _TensorRef, _CompositeRef, Reduced */
    PyObject *children, *path_key;            /* _children(obj), _path_key(key) */
    /* where a Reduced's state, pairs, args and items and a dense tensor's pending flag are
     * (slot_offset; -1: read as attributes) */
    Py_ssize_t state_at, pairs_at, args_at, items_at, pending_at;
} WalkTypes;

/* A set of objects by address (the containers the walk entered): open addressing, at most
 * half full. */
typedef struct {
    uintptr_t *slots;
    size_t mask;
    size_t used;
} PtrSet;

/* Add ``obj``: 1 added, 0 there already, -1 no memory (raised). */
static int
ptrset_add(PtrSet *set, const void *obj)
{
    if (2 * (set->used + 1) > set->mask + 1) {
        size_t size = set->slots == NULL ? 1024 : 2 * (set->mask + 1);
        uintptr_t *grown = PyMem_Calloc(size, sizeof(uintptr_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        for (size_t i = 0; set->slots != NULL && i <= set->mask; i++) {
            uintptr_t key = set->slots[i];
            if (key == 0)
                continue;
            size_t at = (size_t)((key >> 4) * 0x9E3779B97F4A7C15ull) & (size - 1);
            while (grown[at] != 0)
                at = (at + 1) & (size - 1);
            grown[at] = key;
        }
        PyMem_Free(set->slots);
        set->slots = grown;
        set->mask = size - 1;
    }
    uintptr_t key = (uintptr_t)obj;
    size_t at = (size_t)((key >> 4) * 0x9E3779B97F4A7C15ull) & set->mask;
    while (set->slots[at] != 0) {
        if (set->slots[at] == key)
            return 0;
        at = (at + 1) & set->mask;
    }
    set->slots[at] = key;
    set->used += 1;
    return 1;
}

/* A slot of ``obj`` if it is exactly ``type`` and the slot is at ``at`` and set (borrowed),
 * else NULL: read it as an attribute. */
static PyObject *
slot_of(PyObject *obj, PyObject *type, Py_ssize_t at)
{
    if (at < 0 || Py_TYPE(obj) != (PyTypeObject *)type)
        return NULL;
    return *(PyObject **)((char *)obj + at);
}

/* 0 a plain value, 1 a tensor (a _TensorRef or _CompositeRef), 2 a container (dict, list,
 * tuple, set, frozenset, Reduced): what ``_walk_kind`` says of its type */
static int
walk_kind(const WalkTypes *w, PyObject *value)
{
    PyTypeObject *tp = Py_TYPE(value);
    if (tp == &PyUnicode_Type || tp == &PyLong_Type || tp == &PyBool_Type ||
        tp == &PyFloat_Type || value == Py_None || tp == &PyBytes_Type)
        return 0;
    if (PyObject_TypeCheck(value, (PyTypeObject *)w->dense) ||
        PyObject_TypeCheck(value, (PyTypeObject *)w->composite))
        return 1;
    if (PyDict_Check(value) || PyList_Check(value) || PyTuple_Check(value) ||
        PyAnySet_Check(value) || PyObject_TypeCheck(value, (PyTypeObject *)w->reduced))
        return 2;
    return 0;
}

/* a path element: a str or an int of 64 bits as it is, anything else through _path_key */
static PyObject *
walk_key(const WalkTypes *w, PyObject *key)
{
    if (PyUnicode_CheckExact(key))
        return Py_NewRef(key);
    if (PyLong_CheckExact(key)) {
        int overflow;
        (void)PyLong_AsLongLongAndOverflow(key, &overflow);
        if (!overflow)
            return Py_NewRef(key);
    }
    return PyObject_CallOneArg(w->path_key, key);
}

/* 1 when ``obj`` (a Reduced) is an object built from its __dict__ alone: state an exact
 * dict, no pairs, args or items (its children are the state's items); 0 if not; -1 error */
static int
plain_reduced(const WalkTypes *w, PyObject *obj, PyObject **state)
{
    int plain = 0;
    PyObject *st = slot_of(obj, w->reduced, w->state_at);
    st = st != NULL ? Py_NewRef(st) : PyObject_GetAttr(obj, state_name);
    if (st == NULL)
        return -1;
    if (PyDict_CheckExact(st)) {
        plain = 1;
        PyObject *names[3] = {pairs_name, args_name, items_name};
        Py_ssize_t at[3] = {w->pairs_at, w->args_at, w->items_at};
        for (int i = 0; i < 3 && plain == 1; i++) {
            PyObject *v = slot_of(obj, w->reduced, at[i]);
            v = v != NULL ? Py_NewRef(v) : PyObject_GetAttr(obj, names[i]);
            if (v == NULL) {
                plain = -1;
                break;
            }
            int full = PyObject_IsTrue(v);
            Py_DECREF(v);
            plain = full < 0 ? -1 : full ? 0 : 1;
        }
    }
    if (plain == 1)
        *state = st;
    else
        Py_DECREF(st);
    return plain;
}

/* the frame of container ``obj``: 0, or -1 with an error */
static int
frame_open(const WalkTypes *w, Frame *f, PyObject *obj)
{
    f->obj = Py_NewRef(obj);
    f->dict = f->iter = NULL;
    f->at = 0;
    if (PyDict_CheckExact(obj)) {
        f->dict = Py_NewRef(obj);
        return 0;
    }
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj))
        return 0;
    if (PyObject_TypeCheck(obj, (PyTypeObject *)w->reduced)) {
        PyObject *state;
        int plain = plain_reduced(w, obj, &state);
        if (plain < 0)
            return -1;
        if (plain) {
            f->dict = state;
            return 0;
        }
    }
    PyObject *children = PyObject_CallOneArg(w->children, obj);
    if (children == NULL)
        return -1;
    f->iter = PyObject_GetIter(children);
    Py_DECREF(children);
    return f->iter == NULL ? -1 : 0;
}

static void
frame_close(Frame *f)
{
    Py_CLEAR(f->obj);
    Py_CLEAR(f->dict);
    Py_CLEAR(f->iter);
}

/* the frame's next (key, value), borrowed unless *owned: 1, 0 at its end, -1 error */
static int
frame_next(Frame *f, PyObject **key, PyObject **value, PyObject **owned)
{
    *owned = NULL;
    if (f->dict != NULL)
        return PyDict_Next(f->dict, &f->at, key, value);
    if (f->iter == NULL) {  /* a list or a tuple: its index and item */
        Py_ssize_t size = PyList_Check(f->obj) ? PyList_GET_SIZE(f->obj) :
                                                 PyTuple_GET_SIZE(f->obj);
        if (f->at >= size)
            return 0;
        PyObject *index = PyLong_FromSsize_t(f->at);
        if (index == NULL)
            return -1;
        *value = PyList_Check(f->obj) ? PyList_GET_ITEM(f->obj, f->at) :
                                        PyTuple_GET_ITEM(f->obj, f->at);
        f->at += 1;
        *key = *owned = index;
        return 1;
    }
    PyObject *pair = PyIter_Next(f->iter);
    if (pair == NULL)
        return PyErr_Occurred() ? -1 : 0;
    if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "walk(): children gives (key, value) pairs");
        return -1;
    }
    *key = PyTuple_GET_ITEM(pair, 0);
    *value = PyTuple_GET_ITEM(pair, 1);
    *owned = pair;
    return 1;
}

/* ids[from:to] into ``holds`` */
static int
mark_ids(PyObject *holds, PyObject *const *ids, Py_ssize_t from, Py_ssize_t to)
{
    for (Py_ssize_t i = from; i < to; i++) {
        PyObject *id = PyLong_FromVoidPtr(ids[i]);
        if (id == NULL || PySet_Add(holds, id) < 0) {
            Py_XDECREF(id);
            return -1;
        }
        Py_DECREF(id);
    }
    return 0;
}

PyDoc_STRVAR(walk_doc,
"walk(root, dense, composite, reduced, children, path_key, max_depth, too_deep)\n"
"    -> (found, holds)\n\n"
"``_pickle._walk``'s first pass over a container ``root``: every tensor (``dense`` or\n"
"``composite`` instance; a ``dense`` one whose ``pending`` is true left out) with its path,\n"
"depth first in container order, each container entered once; and the ids of the containers\n"
"on the way to a tensor. Exact dicts, lists and tuples and the ``reduced`` objects built\n"
"from a plain dict are walked here, any other container through ``children(obj)`` (pairs);\n"
"path elements other than str and 64-bit ints go through ``path_key``. Deeper than\n"
"``max_depth`` containers it raises ``too_deep()``.");

static PyObject *
walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "walk() takes 8 arguments");
        return NULL;
    }
    PyObject *root = args[0];
    WalkTypes w = {args[1], args[2], args[3], args[4], args[5],
                   slot_offset(args[3], "state"), slot_offset(args[3], "pairs"),
                   slot_offset(args[3], "args"), slot_offset(args[3], "items"),
                   slot_offset(args[1], "pending")};
    PyObject *too_deep = args[7];
    if (!PyType_Check(w.dense) || !PyType_Check(w.composite) || !PyType_Check(w.reduced)) {
        PyErr_SetString(PyExc_TypeError, "walk(): dense, composite and reduced are types");
        return NULL;
    }
    Py_ssize_t max_depth = PyLong_AsSsize_t(args[6]);
    if (max_depth == -1 && PyErr_Occurred())
        return NULL;
    if (max_depth < 1 || max_depth > WALK_MAX_FRAMES) {
        PyErr_SetString(PyExc_ValueError, "walk(): max_depth is 1 to 1024");
        return NULL;
    }
    PyObject *found = PyList_New(0), *holds = PySet_New(NULL);
    PtrSet seen = {NULL, 0, 0};
    PyObject *path = PyList_New(0);
    PyObject *result = NULL;
    Frame *frames = PyMem_Calloc(WALK_MAX_FRAMES, sizeof(Frame));
    PyObject **ids = PyMem_Calloc(WALK_MAX_FRAMES, sizeof(PyObject *));
    Py_ssize_t depth = 0, marked = 0;
    if (found == NULL || holds == NULL || path == NULL)
        goto done;
    if (frames == NULL || ids == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (ptrset_add(&seen, root) < 0)
        goto done;
    if (frame_open(&w, &frames[0], root) < 0)
        goto done;
    ids[0] = root;
    depth = 1;
    while (depth > 0) {
        Frame *top = &frames[depth - 1];
        PyObject *key, *value, *owned;
        int got = frame_next(top, &key, &value, &owned);
        if (got < 0)
            goto done;
        if (got == 0) {  /* this container is done */
            frame_close(top);
            depth -= 1;
            if (marked > depth)
                marked = depth;
            Py_ssize_t len = PyList_GET_SIZE(path);
            if (len > 0 && PyList_SetSlice(path, len - 1, len, NULL) < 0)
                goto done;
            continue;
        }
        Py_INCREF(key);
        Py_INCREF(value);
        Py_XDECREF(owned);
        int kind = walk_kind(&w, value);
        int failed = 0;
        if (kind == 1) {
            int pending = 0;
            if (PyObject_TypeCheck(value, (PyTypeObject *)w.dense)) {
                PyObject *flag = slot_of(value, w.dense, w.pending_at);
                flag = flag != NULL ? Py_NewRef(flag) : PyObject_GetAttr(value, pending_name);
                pending = flag == NULL ? -1 : PyObject_IsTrue(flag);
                Py_XDECREF(flag);
            }
            if (pending < 0)
                failed = 1;
            else if (!pending) {
                Py_ssize_t len = PyList_GET_SIZE(path);
                PyObject *where = PyTuple_New(len + 1);
                PyObject *last = walk_key(&w, key);
                PyObject *pair = NULL;
                if (where != NULL && last != NULL) {
                    for (Py_ssize_t i = 0; i < len; i++)
                        PyTuple_SET_ITEM(where, i, Py_NewRef(PyList_GET_ITEM(path, i)));
                    PyTuple_SET_ITEM(where, len, last);
                    last = NULL;
                    pair = PyTuple_Pack(2, where, value);
                }
                Py_XDECREF(where);
                Py_XDECREF(last);
                if (pair == NULL || append_new(found, pair) < 0)
                    failed = 1;
                else if (marked < depth) {
                    if (mark_ids(holds, ids, marked, depth) < 0)
                        failed = 1;
                    marked = depth;
                }
            }
        }
        else if (kind == 2) {
            /* (an empty container holds no tensor: a module's many hook dicts) */
            int fresh = PyObject_IsTrue(value);    /* 1: entered now, 0: not, -1: error */
            if (fresh > 0)
                fresh = ptrset_add(&seen, value);
            if (fresh < 0)
                failed = 1;
            else if (fresh == 1) {
                if (depth >= max_depth) {
                    PyObject *exc = PyObject_CallNoArgs(too_deep);
                    if (exc != NULL) {
                        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                        Py_DECREF(exc);
                    }
                    failed = 1;
                }
                else {
                    PyObject *step = walk_key(&w, key);
                    if (step == NULL || append_new(path, step) < 0)
                        failed = 1;
                    else if (frame_open(&w, &frames[depth], value) < 0) {
                        frame_close(&frames[depth]);
                        failed = 1;
                    }
                    else
                        ids[depth++] = value;
                }
            }
        }
        Py_DECREF(key);
        Py_DECREF(value);
        if (failed)
            goto done;
    }
    result = PyTuple_Pack(2, found, holds);
done:
    for (Py_ssize_t i = 0; frames != NULL && i < depth; i++)
        frame_close(&frames[i]);
    PyMem_Free(frames);
    PyMem_Free(ids);
    Py_XDECREF(found);
    Py_XDECREF(holds);
    PyMem_Free(seen.slots);
    Py_XDECREF(path);
    return result;
}

static PyMethodDef methods[] = {
    {"entries", entries, METH_VARARGS, entries_doc},
    {"units", units, METH_VARARGS, units_doc},
    {"opcodes", (PyCFunction)(void (*)(void))opcodes, METH_FASTCALL, opcodes_doc},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
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
    struct { PyObject **slot; const char *text; } names[] = {
        {&budget_name, "budget"}, {&state_name, "state"},
        {&param_global_name, "param_global"}, {&param_handler_name, "param_handler"},
        {&pending_name, "pending"}, {&pairs_name, "pairs"}, {&args_name, "args"},
        {&items_name, "items"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].slot == NULL &&
            (*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL)
            return NULL;
    PyObject *made = PyModule_Create(&module);
    if (made != NULL && handlers_add(made) < 0)
        Py_CLEAR(made);
    return made;
}
