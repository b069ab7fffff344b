/* ckptlab.format._interp: ckptlab's pickle interpreter, compiled.
 *
 * interpret(data, *, handlers=None, persistent_load=None, build=None, memory_per_byte=...)
 * is ``ckptlab.format._unpickle.interpret(data, ...)`` in C, the way
 * CPython's _pickle.c is pickle.py in C: the whole interface, the same rules (see
 * _unpickle's module docstring), the same results, and the same test suite
 * (tests/format/test_interp.py runs every case against both). It is one loop over the
 * opcodes, one at a time:
 *
 * - the stack is one C array of references; MARK pushes the stack's length on a second array
 *   (the metastack), so "the stack" of an opcode is what lies above the last mark;
 * - the memo is a C array for the dense indices picklers write and a dict for sparse ones;
 *   an entry no GET of the pickle reads (find_memo_reads, before the loop) holds None, and
 *   the dense array keeps a slot only for the entries a GET reads (the memo_reads section);
 * - what the pickle names or builds is made by calling _unpickle's own classes and functions
 *   (Global, Reduced, OpaqueKey, Interpretation, canonical_global) and the caller's handlers
 *   and persistent_load, in the order and with the arguments the Python loop calls them;
 * - every opcode charges the budget what the Python loop charges, at the same opcode, and
 *   every error is a PickleDataError (PickleBudgetError) with ``offset`` the position of the
 *   failing opcode and, where practical, the Python loop's message.
 *
 * Safety: every declared length is checked against the bytes left before anything is read
 * or allocated; nothing recurses (nesting depth is only the length of the two arrays, bounded
 * by the input's length); only CPython's public C API is used.
 *
 * The module also has TorchCore, the hot torch handlers of ckptlab.format._torch_handlers in
 * C (see below), record_type, the immutable records they make, and walk_tensors (_walk.c), the
 * walk of ckptlab.format._pickle_walk in C. Each is one side of a seam whose other side is
 * Python, with one test suite run against both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

/* What the interpreter uses from ckptlab.format._unpickle (bound on the first call: the
 * module may import this one). */
typedef struct {
    int bound;
    PyObject *unpickle;
    PyObject *Global, *Reduced, *OpaqueKey, *Interpretation, *canonical_global, *built_name;
    PyObject *PickleDataError, *PickleBudgetError;
    PyObject *memory_per_byte;  /* interpret's default, as the Python signature binds it */
    PyObject *escape_decode;    /* codecs.escape_decode (protocol 0's STRING) */
    PyObject *int_from_bytes;   /* int.from_bytes (LONG1/LONG4 past 8 bytes) */
    PyObject *int_max, *int_min;  /* 2**64, -2**64: the ints a dict key may be */
    PyObject *s_module, *s_name, *s_qualname, *s_func, *s_state, *s_items, *s_pairs;
    PyObject *s_update, *s_extend, *s_get, *s_strip, *s_rstrip, *s_L;
    PyObject *s_offset, *s_comma, *s_little, *s_signed;
    Py_ssize_t max_int_nbytes, max_key_leaves, max_text_line;
} State;

#define STATE_OBJECTS(X) X(unpickle) X(Global) X(Reduced) X(OpaqueKey) X(Interpretation) \
    X(canonical_global) X(built_name) X(PickleDataError) X(PickleBudgetError) X(memory_per_byte) \
    X(escape_decode) X(int_from_bytes) X(int_max) X(int_min) X(s_module) X(s_name) \
    X(s_qualname) X(s_func) X(s_state) X(s_items) X(s_pairs) X(s_update) X(s_extend) \
    X(s_get) X(s_strip) X(s_rstrip) X(s_L) X(s_offset) X(s_comma) \
    X(s_little) X(s_signed)

static void
unbind(State *st)
{
#define CLEAR(f) Py_CLEAR(st->f);
    STATE_OBJECTS(CLEAR)
#undef CLEAR
    st->bound = 0;
}

static Py_ssize_t
ssize_attr(PyObject *mod, const char *name)
{
    PyObject *v = PyObject_GetAttrString(mod, name);
    if (v == NULL)
        return -1;
    Py_ssize_t out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return out;
}

static int
bind(State *st)
{
    PyObject *mod = PyImport_ImportModule("ckptlab.format._unpickle");
    if (mod == NULL)
        return -1;
    st->unpickle = mod;
#define ATTR(f, name) if ((st->f = PyObject_GetAttrString(mod, name)) == NULL) goto fail;
    ATTR(Global, "Global")
    ATTR(Reduced, "Reduced")
    ATTR(OpaqueKey, "OpaqueKey")
    ATTR(Interpretation, "Interpretation")
    ATTR(canonical_global, "canonical_global")
    ATTR(built_name, "built_name")
    ATTR(PickleDataError, "PickleDataError")
    ATTR(PickleBudgetError, "PickleBudgetError")
    ATTR(memory_per_byte, "MEMORY_PER_BYTE")
#undef ATTR
    if ((st->max_int_nbytes = ssize_attr(mod, "MAX_INT_NBYTES")) < 0 ||
        (st->max_key_leaves = ssize_attr(mod, "MAX_KEY_LEAVES")) < 0 ||
        (st->max_text_line = ssize_attr(mod, "_MAX_TEXT_LINE")) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ImportError, "ckptlab.format._unpickle: a negative limit");
        goto fail;
    }
    PyObject *codecs = PyImport_ImportModule("codecs");
    if (codecs == NULL)
        goto fail;
    st->escape_decode = PyObject_GetAttrString(codecs, "escape_decode");
    Py_DECREF(codecs);
    if (st->escape_decode == NULL)
        goto fail;
    if ((st->int_from_bytes = PyObject_GetAttrString((PyObject *)&PyLong_Type,
                                                     "from_bytes")) == NULL)
        goto fail;
    PyObject *one = PyLong_FromLong(1), *sixty_four = PyLong_FromLong(64);
    if (one != NULL && sixty_four != NULL)
        st->int_max = PyNumber_Lshift(one, sixty_four);
    Py_XDECREF(one);
    Py_XDECREF(sixty_four);
    if (st->int_max == NULL || (st->int_min = PyNumber_Negative(st->int_max)) == NULL)
        goto fail;
#define NAME(f, text) if ((st->f = PyUnicode_InternFromString(text)) == NULL) goto fail;
    NAME(s_module, "module")
    NAME(s_name, "name")
    NAME(s_qualname, "qualname")
    NAME(s_func, "func")
    NAME(s_state, "state")
    NAME(s_items, "items")
    NAME(s_pairs, "pairs")
    NAME(s_update, "update")
    NAME(s_extend, "extend")
    NAME(s_get, "get")
    NAME(s_strip, "strip")
    NAME(s_rstrip, "rstrip")
    NAME(s_L, "L")
    NAME(s_offset, "offset")
    NAME(s_comma, ",")
    NAME(s_little, "little")
    NAME(s_signed, "signed")
#undef NAME
    st->bound = 1;
    return 0;
fail:
    unbind(st);
    return -1;
}

/* -- errors ----------------------------------------------------------------------------- */
static PyObject *
raised(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value != NULL && tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

static void
reraise(PyObject *exc)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
#endif
}

/* -- the machine ------------------------------------------------------------------------ */
typedef struct {
    State *st;
    const unsigned char *p;
    Py_ssize_t n;
    Py_ssize_t pos;
    PyObject *handlers;    /* borrowed; NULL: none */
    PyObject *persistent;  /* borrowed; NULL: none */
    PyObject *build;       /* borrowed; NULL: a BUILD on anything but a Reduced is refused */
    long long budget;      /* never negative: a charge past it fails instead */
    PyObject **stack;      /* owned references */
    Py_ssize_t size, cap;
    Py_ssize_t *marks;     /* the metastack: the stack's length at each open MARK */
    Py_ssize_t nmarks, mcap;
    PyObject **memo;       /* the dense memo's slots, owned references (see slot_of) */
    Py_ssize_t memo_len;   /* dense indices 0..memo_len-1 are stored */
    Py_ssize_t memo_slots, memo_cap;
    Py_ssize_t *rank;      /* read bits before each 512-bit block of read_bits */
    PyObject *sparse;      /* {index: object} for the others, made when first needed */
    PyObject *globals;     /* {(module, name): Global} */
    PyObject *seen;        /* ["module.name", ...] in order of first appearance */
    PyObject *seen_at;     /* [(module, name, offset), ...]: the opcode that first named each */
    PyObject *keycache;    /* {id(tuple): (tuple, key)}, as _unpickle._key keeps it */
    PyObject *hcache;      /* {Global: handler or None}: each global's handler, looked up
                            * once (a dict of handlers is not changed while it runs) */
    int keep_all;          /* find_memo_reads could not follow the pickle: keep every entry */
    unsigned char *read_bits;  /* memo indices below read_nbits a GET reads */
    Py_ssize_t read_nbits;
    PyObject *read_far;    /* {index, ...} read at read_nbits or beyond, or NULL */
    long proto;
} Machine;

static int
fail(Machine *m, const char *format, ...)
{
    va_list va;
    va_start(va, format);
    PyObject *message = PyUnicode_FromFormatV(format, va);
    va_end(va);
    if (message != NULL) {
        PyErr_SetObject(m->st->PickleDataError, message);
        Py_DECREF(message);
    }
    return -1;
}

static PyObject *
commas_ll(State *st, long long v)
{
    PyObject *value = PyLong_FromLongLong(v);
    if (value == NULL)
        return NULL;
    PyObject *text = PyObject_Format(value, st->s_comma);
    Py_DECREF(value);
    return text;
}

static PyObject *
commas_ull(State *st, unsigned long long v)
{
    PyObject *value = PyLong_FromUnsignedLongLong(v);
    if (value == NULL)
        return NULL;
    PyObject *text = PyObject_Format(value, st->s_comma);
    Py_DECREF(value);
    return text;
}

/* "{what} declares {nbytes:,} bytes but only {left:,} are left" */
static int
fail_declares(Machine *m, const char *what, int negative, unsigned long long nbytes)
{
    PyObject *a = negative ? commas_ll(m->st, -(long long)nbytes) : commas_ull(m->st, nbytes);
    PyObject *b = commas_ll(m->st, m->n - m->pos);
    if (a != NULL && b != NULL)
        fail(m, "%s declares %U bytes but only %U are left", what, a, b);
    Py_XDECREF(a);
    Py_XDECREF(b);
    return -1;
}

static PyObject *
over_budget(Machine *m)
{
    PyObject *per_byte = PyObject_GetAttrString(m->st->unpickle, "MEMORY_PER_BYTE");
    PyObject *in = commas_ll(m->st, m->n);
    if (per_byte != NULL && in != NULL) {
        PyObject *message = PyUnicode_FromFormat(
            "the pickle would need more than %S bytes of memory per byte of input (%U bytes "
            "in, budget exceeded); ckptlab refuses it", per_byte, in);
        if (message != NULL) {
            PyErr_SetObject(m->st->PickleBudgetError, message);
            Py_DECREF(message);
        }
    }
    Py_XDECREF(per_byte);
    Py_XDECREF(in);
    return NULL;
}

static int
charge(Machine *m, unsigned long long nbytes)
{
    if (nbytes > (unsigned long long)m->budget) {
        over_budget(m);
        return -1;
    }
    m->budget -= (long long)nbytes;
    return 0;
}

/* type(obj).__name__ */
static PyObject *
type_name(PyObject *obj)
{
    return PyType_GetName(Py_TYPE(obj));
}

static void
opcode_text(char *out, int code)
{
    static const char hex[] = "0123456789abcdef";
    out[0] = '0';
    out[1] = 'x';
    out[2] = hex[(code >> 4) & 15];
    out[3] = hex[code & 15];
    out[4] = '\0';
}

/* -- the stack -------------------------------------------------------------------------- */
static Py_ssize_t
frame_base(const Machine *m)
{
    return m->nmarks ? m->marks[m->nmarks - 1] : 0;
}

/* How many objects "the stack" has: those above the last MARK. */
static Py_ssize_t
stack_len(const Machine *m)
{
    return m->size - frame_base(m);
}

static int
grow(void **array, Py_ssize_t *cap, Py_ssize_t need, size_t item)
{
    if (need <= *cap)
        return 0;
    Py_ssize_t new_cap = *cap < 16 ? 16 : *cap;
    while (new_cap < need)
        new_cap *= 2;
    if ((size_t)new_cap > PY_SSIZE_T_MAX / item) {
        PyErr_NoMemory();
        return -1;
    }
    void *grown = PyMem_Realloc(*array, (size_t)new_cap * item);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = grown;
    *cap = new_cap;
    return 0;
}

/* Push ``obj`` (a new reference, or NULL for an error already set). */
static int
push(Machine *m, PyObject *obj)
{
    if (obj == NULL)
        return -1;
    if (grow((void **)&m->stack, &m->cap, m->size + 1, sizeof(PyObject *)) < 0) {
        Py_DECREF(obj);
        return -1;
    }
    m->stack[m->size++] = obj;
    return 0;
}

/* Drop the objects from stack index ``base`` up. */
static void
truncate_to(Machine *m, Py_ssize_t base)
{
    while (m->size > base) {
        PyObject *obj = m->stack[--m->size];
        Py_DECREF(obj);
    }
}

/* Replace the top of the stack with ``obj`` (a new reference, or NULL for an error). */
static int
replace_top(Machine *m, PyObject *obj)
{
    if (obj == NULL)
        return -1;
    PyObject *old = m->stack[m->size - 1];
    m->stack[m->size - 1] = obj;
    Py_DECREF(old);
    return 0;
}

/* _opcodes._pop_mark: the items since the last MARK are stack[*base:m->size]; the MARK is
 * gone (the caller drops the items with truncate_to). */
static int
pop_mark(Machine *m, int code, Py_ssize_t *base)
{
    if (m->nmarks == 0) {
        char text[8];
        opcode_text(text, code);
        return fail(m, "opcode %s without a MARK", text);
    }
    *base = m->marks[--m->nmarks];
    return 0;
}

/* _opcodes._need */
static int
need(Machine *m, Py_ssize_t k, int code)
{
    Py_ssize_t have = stack_len(m);
    if (have < k) {
        char text[8];
        opcode_text(text, code);
        return fail(m, "opcode %s needs %zd items on the stack, found %zd", text, k, have);
    }
    return 0;
}

/* _opcodes._need for the stack below a MARK just popped (its items from ``base`` up) */
static int
need_below(Machine *m, Py_ssize_t base, Py_ssize_t k, int code)
{
    Py_ssize_t have = base - frame_base(m);
    if (have < k) {
        char text[8];
        opcode_text(text, code);
        return fail(m, "opcode %s needs %zd items on the stack, found %zd", text, k, have);
    }
    return 0;
}

/* -- little-endian integers ------------------------------------------------------------- */
static uint32_t
le32(const unsigned char *q)
{
    return (uint32_t)q[0] | ((uint32_t)q[1] << 8) | ((uint32_t)q[2] << 16) |
           ((uint32_t)q[3] << 24);
}

static uint64_t
le64(const unsigned char *q)
{
    return (uint64_t)le32(q) | ((uint64_t)le32(q + 4) << 32);
}

/* -- the memo --------------------------------------------------------------------------- */
/* _optable.memo_reads: the memo indices the pickle can read, found before it runs: the
 * arguments of every BINGET and LONG_BINGET up to the first STOP, as bits for indices up to
 * the pickle's length and a set beyond. A memo entry no GET reads is stored as None (and
 * charged as before): what only the pickler memoized (a tensor's argument tuple, a
 * persistent id) is freed once used, instead of living, and being walked by the cyclic
 * collector, until the end. Anything the scan cannot follow (a protocol-0 GET, whose text
 * only the loop parses; an unknown opcode; an argument past the end) keeps every entry. */
static int
mark_read(Machine *m, unsigned long long index)
{
    if (index < (unsigned long long)m->read_nbits) {
        m->read_bits[index >> 3] |= (unsigned char)(1u << (index & 7));
        return 0;
    }
    PyObject *key = PyLong_FromUnsignedLongLong(index);
    if (key == NULL || (m->read_far == NULL && (m->read_far = PySet_New(NULL)) == NULL)) {
        Py_XDECREF(key);
        return -1;
    }
    int rc = PySet_Add(m->read_far, key);
    Py_DECREF(key);
    return rc;
}

static int
popcount64(uint64_t x)
{
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_popcountll(x);
#else
    int count = 0;
    for (; x; x &= x - 1)
        count++;
    return count;
#endif
}

/* The rank table: how many read bits precede each 512-bit block (read_bits is padded to
 * whole blocks), so a dense index's slot is a table lookup and at most eight popcounts. */
static int
rank_reads(Machine *m)
{
    Py_ssize_t blocks = m->read_nbits / 512 + 1;
    if ((m->rank = PyMem_Malloc((size_t)blocks * sizeof(Py_ssize_t))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t total = 0;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        m->rank[b] = total;
        for (int k = 0; k < 8; k++)
            total += popcount64(le64(m->read_bits + 64 * b + 8 * k));
    }
    return 0;
}

static int
find_memo_reads(Machine *m)
{
    const unsigned char *p = m->p;
    const Py_ssize_t n = m->n;
    Py_ssize_t pos = 0;
    m->keep_all = 1;
    m->read_nbits = n + 1;
    if ((m->read_bits = PyMem_Calloc((size_t)(m->read_nbits / 512 + 1), 64)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (;;) {
        if (pos >= n)
            return 0;  /* no STOP: keep all */
        int code = p[pos++];
        unsigned long long skip;
        switch (code) {
        case '.':  /* STOP */
            m->keep_all = 0;
            return rank_reads(m);
        case 'h':  /* BINGET */
            if (pos >= n)
                return 0;
            if (mark_read(m, p[pos]) < 0)
                return -1;
            skip = 1;
            break;
        case 'j':  /* LONG_BINGET */
            if (n - pos < 4)
                return 0;
            if (mark_read(m, le32(p + pos)) < 0)
                return -1;
            skip = 4;
            break;
        case 'g':  /* GET: its text is the loop's to parse */
            return 0;
        case '(': case '0': case '1': case '2': case 'N': case 'Q': case 'R': case 'a':
        case 'b': case 'd': case '}': case 'e': case 'l': case ']': case 'o': case 's':
        case 't': case ')': case 'u': case 0x81: case 0x85: case 0x86: case 0x87: case 0x88:
        case 0x89: case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93: case 0x94:
        case 0x97: case 0x98:
            skip = 0;
            break;
        case 'K': case 'q': case 0x80: case 0x82:
            skip = 1;
            break;
        case 'M': case 0x83:
            skip = 2;
            break;
        case 'J': case 'r': case 0x84:
            skip = 4;
            break;
        case 'G': case 0x95:
            skip = 8;
            break;
        case 'U': case 'C': case 0x8c: case 0x8a:  /* a 1-byte length, then the bytes */
            if (pos >= n)
                return 0;
            skip = 1 + (unsigned long long)p[pos];
            break;
        case 'T': case 'B': case 'X': case 0x8b:  /* a 4-byte length */
            if (n - pos < 4)
                return 0;
            skip = 4 + (unsigned long long)le32(p + pos);
            break;
        case 0x8d: case 0x8e: case 0x96:  /* an 8-byte length */
            if (n - pos < 8)
                return 0;
            skip = le64(p + pos);
            if (skip > (unsigned long long)n)
                return 0;
            skip += 8;
            break;
        case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': case 'p':
        case 'c': case 'i': {  /* text lines: one, or two for GLOBAL and INST */
            int lines = code == 'c' || code == 'i' ? 2 : 1;
            Py_ssize_t at = pos;
            while (lines--) {
                const unsigned char *nl = memchr(p + at, '\n', (size_t)(n - at));
                if (nl == NULL)
                    return 0;
                at = (Py_ssize_t)(nl - p) + 1;
            }
            skip = (unsigned long long)(at - pos);
            break;
        }
        default:
            return 0;
        }
        if (skip > (unsigned long long)(n - pos))
            return 0;
        pos += (Py_ssize_t)skip;
    }
}

/* value, or None where the pickle never reads memo index ``index`` (borrowed) */
static PyObject *
kept(Machine *m, Py_ssize_t index, PyObject *value)
{
    if (m->keep_all || index < 0)
        return value;
    if (index < m->read_nbits)
        return m->read_bits[index >> 3] & (1u << (index & 7)) ? value : Py_None;
    return value;  /* (the set's indices are looked up by sparse_put) */
}

static int
sparse_put(Machine *m, PyObject *key, PyObject *value)
{
    if (m->sparse == NULL && (m->sparse = PyDict_New()) == NULL)
        return -1;
    int has = PyDict_Contains(m->sparse, key);
    if (has < 0 || (!has && charge(m, 128) < 0))
        return -1;
    if (!m->keep_all) {
        Py_ssize_t index = PyLong_AsSsize_t(key);
        if (index == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                return -1;
            PyErr_Clear();
            index = PY_SSIZE_T_MAX;  /* past the bits: the set decides */
        }
        if (index < m->read_nbits) {
            value = kept(m, index, value);
        } else {
            int read = m->read_far ? PySet_Contains(m->read_far, key) : 0;
            if (read < 0)
                return -1;
            if (!read)
                value = Py_None;
        }
    }
    return PyDict_SetItem(m->sparse, key, value);
}

static int
is_read(Machine *m, Py_ssize_t index)
{
    return (m->read_bits[index >> 3] >> (index & 7)) & 1;
}

/* The slot of dense memo index ``index``: the index itself when every entry is kept, else
 * the number of read indices before it (-1: no GET reads it, nothing is kept). Dense
 * indices are below the input's length, so within read_bits. */
static Py_ssize_t
slot_of(Machine *m, Py_ssize_t index)
{
    if (m->keep_all)
        return index;
    if (!is_read(m, index))
        return -1;
    const unsigned char *block = m->read_bits + 64 * (index >> 9);
    Py_ssize_t slot = m->rank[index >> 9];
    int bit = (int)(index & 511);
    for (int k = 0; k < bit >> 6; k++)
        slot += popcount64(le64(block + 8 * k));
    uint64_t below = (UINT64_C(1) << (bit & 63)) - 1;
    return slot + popcount64(le64(block + 8 * (bit >> 6)) & below);
}

static int
memo_append(Machine *m, PyObject *value)
{
    if (m->keep_all || is_read(m, m->memo_len)) {  /* its slot is the next one */
        if (grow((void **)&m->memo, &m->memo_cap, m->memo_slots + 1, sizeof(PyObject *)) < 0)
            return -1;
        Py_INCREF(value);
        m->memo[m->memo_slots++] = value;
    }
    m->memo_len++;
    return charge(m, 16);
}

static int
memo_put(Machine *m, Py_ssize_t index, PyObject *value)
{
    if (index == m->memo_len)
        return memo_append(m, value);
    if (index < m->memo_len) {
        Py_ssize_t slot = slot_of(m, index);
        if (slot >= 0) {
            PyObject *old = m->memo[slot];
            Py_INCREF(value);
            m->memo[slot] = value;
            Py_DECREF(old);
        }
        return 0;
    }
    PyObject *key = PyLong_FromSsize_t(index);
    if (key == NULL)
        return -1;
    int rc = sparse_put(m, key, value);
    Py_DECREF(key);
    return rc;
}

/* memo[index] as a new reference (``key`` the index as an int, or NULL to make one). */
static PyObject *
memo_get(Machine *m, Py_ssize_t index, PyObject *key)
{
    if (index >= 0 && index < m->memo_len) {
        Py_ssize_t slot = slot_of(m, index);
        PyObject *value = slot < 0 ? Py_None : m->memo[slot];
        Py_INCREF(value);
        return value;
    }
    PyObject *made = NULL;
    if (key == NULL && (key = made = PyLong_FromSsize_t(index)) == NULL)
        return NULL;
    PyObject *found = m->sparse ? PyDict_GetItemWithError(m->sparse, key) : NULL;
    if (found != NULL)
        Py_INCREF(found);
    else if (!PyErr_Occurred())
        fail(m, "memo index %S was never stored", key);
    Py_XDECREF(made);
    return found;
}

/* -- reading ---------------------------------------------------------------------------- */
/* _Machine.take for a declared length (``negative``: the length is -nbytes): the bytes at
 * the position, which moves past them. */
static const unsigned char *
take(Machine *m, int negative, unsigned long long nbytes, const char *what)
{
    if (negative || nbytes > (unsigned long long)(m->n - m->pos)) {
        fail_declares(m, what, negative, nbytes);
        return NULL;
    }
    const unsigned char *at = m->p + m->pos;
    m->pos += (Py_ssize_t)nbytes;
    return at;
}

/* A signed 32-bit length (BINSTRING, LONG4) */
static const unsigned char *
take_i32(Machine *m, int32_t length, const char *what)
{
    if (length < 0)
        return take(m, 1, (unsigned long long)(-(long long)length), what);
    return take(m, 0, (unsigned long long)length, what);
}

/* _Machine.line: a protocol-0 argument, up to its newline (within max_text_line bytes). */
static int
line_span(Machine *m, const char *what, Py_ssize_t *start, Py_ssize_t *length)
{
    Py_ssize_t limit = m->n - m->pos;
    if (limit > m->st->max_text_line)
        limit = m->st->max_text_line;
    const unsigned char *nl = memchr(m->p + m->pos, '\n', (size_t)limit);
    if (nl == NULL)
        return fail(m, "%s: no newline within %zd bytes", what, m->st->max_text_line);
    *start = m->pos;
    *length = nl - (m->p + m->pos);
    m->pos += *length + 1;
    return 0;
}

static PyObject *
line(Machine *m, const char *what)
{
    Py_ssize_t start = 0, length = 0;
    if (line_span(m, what, &start, &length) < 0)
        return NULL;
    return PyUnicode_DecodeLatin1((const char *)m->p + start, length, NULL);
}

/* _Machine.text_int: a protocol-0 int (INT, LONG, GET, PUT) from its text. */
static PyObject *
text_int(Machine *m, PyObject *text)
{
    State *st = m->st;
    PyObject *stripped = PyObject_CallMethodNoArgs(text, st->s_strip);
    if (stripped == NULL)
        return NULL;
    PyObject *digits = PyObject_CallMethodOneArg(stripped, st->s_rstrip, st->s_L);
    Py_DECREF(stripped);
    if (digits == NULL)
        return NULL;
    PyObject *value = NULL;
    Py_ssize_t length = PyUnicode_GetLength(digits);
    if (length > 2 * st->max_int_nbytes) {
        PyObject *count = commas_ll(st, length);
        if (count != NULL)
            fail(m, "an int of %U digits", count);
        Py_XDECREF(count);
        goto done;
    }
    int hex = length >= 2 && PyUnicode_ReadChar(digits, 0) == '0' &&
              (PyUnicode_ReadChar(digits, 1) == 'x' || PyUnicode_ReadChar(digits, 1) == 'X');
    value = PyLong_FromUnicodeObject(digits, hex ? 0 : 10);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
        PyErr_Clear();
        PyObject *head = PyUnicode_Substring(digits, 0, 40);
        if (head != NULL)
            fail(m, "not an int: %R", head);
        Py_XDECREF(head);
    }
done:
    Py_DECREF(digits);
    return value;
}

/* _Machine.int_from_bytes: LONG1/LONG4's little-endian two's complement. */
static PyObject *
int_from_bytes(Machine *m, const unsigned char *q, Py_ssize_t length)
{
    State *st = m->st;
    if (length > st->max_int_nbytes) {
        PyObject *count = commas_ll(st, length);
        if (count != NULL)
            fail(m, "an int of %U bytes (at most %zd)", count, st->max_int_nbytes);
        Py_XDECREF(count);
        return NULL;
    }
    if (charge(m, 64 + (unsigned long long)length) < 0)
        return NULL;
    if (length <= 8) {
        uint64_t u = 0;
        for (Py_ssize_t i = length - 1; i >= 0; i--)
            u = (u << 8) | q[i];
        if (length > 0 && length < 8 && (q[length - 1] & 0x80))
            u |= ~(uint64_t)0 << (8 * length);  /* sign-extend */
        return PyLong_FromLongLong((long long)u);
    }
    PyObject *raw = PyBytes_FromStringAndSize((const char *)q, length);
    PyObject *args = raw ? PyTuple_Pack(2, raw, st->s_little) : NULL;
    PyObject *kwargs = args ? PyDict_New() : NULL;
    PyObject *value = NULL;
    if (kwargs != NULL && PyDict_SetItem(kwargs, st->s_signed, Py_True) == 0)
        value = PyObject_Call(st->int_from_bytes, args, kwargs);
    Py_XDECREF(raw);
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    return value;
}

/* -- keys ------------------------------------------------------------------------------- */
static int
simple_key(State *st, PyObject *v)
{
    return PyUnicode_CheckExact(v) || PyBytes_CheckExact(v) || PyFloat_CheckExact(v) ||
           PyBool_Check(v) || v == Py_None || Py_TYPE(v) == (PyTypeObject *)st->Global;
}

/* -2**64 < v < 2**64, for an int */
static int
int_in_range(State *st, PyObject *v)
{
    int overflow = 0;
    PyLong_AsLongLongAndOverflow(v, &overflow);
    if (!overflow)
        return PyErr_Occurred() ? -1 : 1;
    int below = PyObject_RichCompareBool(v, st->int_max, Py_LT);
    if (below <= 0)
        return below;
    return PyObject_RichCompareBool(v, st->int_min, Py_GT);
}

static PyObject *
opaque(State *st, PyObject *v)
{
    return PyObject_CallOneArg(st->OpaqueKey, v);
}

/* _unpickle._key: ``v`` if hashing it is cheap and shallow, else an OpaqueKey. */
static PyObject *
key_of(Machine *m, PyObject *v)
{
    State *st = m->st;
    if (simple_key(st, v) || PyFrozenSet_CheckExact(v)) {
        Py_INCREF(v);
        return v;
    }
    if (PyLong_CheckExact(v)) {
        int ok = int_in_range(st, v);
        if (ok < 0)
            return NULL;
        if (ok) {
            Py_INCREF(v);
            return v;
        }
        return opaque(st, v);
    }
    if (!PyTuple_CheckExact(v))
        return opaque(st, v);
    if (m->keycache == NULL && (m->keycache = PyDict_New()) == NULL)
        return NULL;
    PyObject *id = PyLong_FromVoidPtr(v);
    if (id == NULL)
        return NULL;
    PyObject *hit = PyDict_GetItemWithError(m->keycache, id);
    if (hit != NULL && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2 &&
        PyTuple_GET_ITEM(hit, 0) == v) {
        PyObject *result = PyTuple_GET_ITEM(hit, 1);
        Py_INCREF(result);
        Py_DECREF(id);
        return result;
    }
    PyObject *result = NULL, *entry = NULL;
    if (PyErr_Occurred())
        goto done;
    Py_ssize_t count = PyTuple_GET_SIZE(v);
    int ok = count <= st->max_key_leaves;
    for (Py_ssize_t i = 0; ok && i < count; i++) {
        PyObject *item = PyTuple_GET_ITEM(v, i);
        if (simple_key(st, item))
            continue;
        ok = PyLong_CheckExact(item) ? int_in_range(st, item) : 0;
        if (ok < 0)
            goto done;
    }
    if (ok) {
        Py_INCREF(v);
        result = v;
    } else if ((result = opaque(st, v)) == NULL) {
        goto done;
    }
    if ((entry = PyTuple_Pack(2, v, result)) == NULL ||
        PyDict_SetItem(m->keycache, id, entry) < 0)
        Py_CLEAR(result);
done:
    Py_XDECREF(entry);
    Py_DECREF(id);
    return result;
}

/* -- what the pickle names and calls ---------------------------------------------------- */
/* _Machine.global_: one Global per (module, name), as canonical_global names it. */
static PyObject *
global_(Machine *m, PyObject *module, PyObject *name, Py_ssize_t op)
{
    State *st = m->st;
    if (!PyUnicode_CheckExact(module) || !PyUnicode_CheckExact(name)) {
        fail(m, "STACK_GLOBAL of non-strings");
        return NULL;
    }
    PyObject *key = PyObject_CallFunctionObjArgs(st->canonical_global, module, name, NULL);
    if (key == NULL)
        return NULL;
    PyObject *found = NULL;
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
        PyErr_SetString(PyExc_ValueError, "canonical_global gave no (module, name) pair");
        goto done;
    }
    found = PyDict_GetItemWithError(m->globals, key);
    if (found != NULL) {
        Py_INCREF(found);
        goto done;
    }
    if (PyErr_Occurred())
        goto done;
    module = PyTuple_GET_ITEM(key, 0);
    name = PyTuple_GET_ITEM(key, 1);
    Py_ssize_t chars_module = PyObject_Length(module), chars_name = PyObject_Length(name);
    if (chars_module < 0 || chars_name < 0 ||
        charge(m, 320 + 4 * ((unsigned long long)chars_module + chars_name)) < 0)
        goto done;
    found = PyObject_CallFunctionObjArgs(st->Global, module, name, NULL);
    if (found == NULL)
        goto done;
    PyObject *qualified = PyUnicode_FromFormat("%S.%S", module, name);
    PyObject *at = qualified ? Py_BuildValue("(OOn)", module, name, op) : NULL;
    if (at == NULL || PyDict_SetItem(m->globals, key, found) < 0 ||
        PyList_Append(m->seen, qualified) < 0 || PyList_Append(m->seen_at, at) < 0)
        Py_CLEAR(found);
    Py_XDECREF(qualified);
    Py_XDECREF(at);
done:
    Py_DECREF(key);
    return found;
}

/* The handler for ``func`` (a new reference), or NULL: none (no error set) or an error. */
static PyObject *
handler_of(Machine *m, PyObject *func)
{
    State *st = m->st;
    if (m->handlers == NULL)
        return NULL;
    int cached = m->hcache != NULL && PyDict_CheckExact(m->handlers) &&
                 Py_IS_TYPE(func, (PyTypeObject *)st->Global);
    if (cached) {
        PyObject *hit = PyDict_GetItemWithError(m->hcache, func);
        if (hit != NULL)
            return hit == Py_None ? NULL : Py_NewRef(hit);
        if (PyErr_Occurred())
            return NULL;
    }
    PyObject *module = PyObject_GetAttr(func, st->s_module);
    PyObject *name = module ? PyObject_GetAttr(func, st->s_name) : NULL;
    PyObject *key = name ? PyTuple_Pack(2, module, name) : NULL;
    Py_XDECREF(module);
    Py_XDECREF(name);
    if (key == NULL)
        return NULL;
    PyObject *handler;
    if (PyDict_CheckExact(m->handlers)) {
        handler = PyDict_GetItemWithError(m->handlers, key);
        Py_XINCREF(handler);
    } else {
        handler = PyObject_CallMethodOneArg(m->handlers, st->s_get, key);
    }
    Py_DECREF(key);
    if (handler == Py_None)
        Py_CLEAR(handler);
    if (cached && !PyErr_Occurred() &&
        PyDict_SetItem(m->hcache, func, handler ? handler : Py_None) < 0)
        Py_CLEAR(handler);
    return handler;
}

/* "{func.qualname}{rest}" as a PickleDataError (``rest`` a format for the arguments after) */
static int
fail_call(Machine *m, PyObject *func, const char *rest, ...)
{
    PyObject *qualname = PyObject_GetAttr(func, m->st->s_qualname);
    if (qualname == NULL)
        return -1;
    va_list va;
    va_start(va, rest);
    PyObject *tail = PyUnicode_FromFormatV(rest, va);
    va_end(va);
    if (tail != NULL)
        fail(m, "%U%U", qualname, tail);
    Py_DECREF(qualname);
    Py_XDECREF(tail);
    return -1;
}

/* _Machine.call: ``func(*args, **kwargs)`` by its handler, else a Reduced (``kwargs``
 * Py_None where the opcode has none). */
static PyObject *
call(Machine *m, PyObject *func, PyObject *args, PyObject *kwargs)
{
    State *st = m->st;
    PyObject *made = NULL, *handler = NULL, *what;
    int is_global = Py_IS_TYPE(func, (PyTypeObject *)st->Global) ? 1
                                                                   : PyObject_IsInstance(func, st->Global);
    if (is_global < 0)
        return NULL;
    if (!is_global) {
        if ((what = type_name(func)) != NULL)
            fail(m, "call of a %U, not a global", what);
        Py_XDECREF(what);
        return NULL;
    }
    if (!PyTuple_Check(args)) {
        PyObject *qualname = PyObject_GetAttr(func, st->s_qualname);
        what = qualname ? type_name(args) : NULL;
        if (what != NULL)
            fail(m, "call of %U with %U args", qualname, what);
        Py_XDECREF(qualname);
        Py_XDECREF(what);
        return NULL;
    }
    if (charge(m, 320) < 0)
        return NULL;
    handler = handler_of(m, func);
    if (handler != NULL) {
        if (kwargs != Py_None) {
            int truth = PyObject_IsTrue(kwargs);
            if (truth < 0)
                goto done;
            if (truth) {
                fail_call(m, func, " called with keyword arguments");
                goto done;
            }
        }
        PyObject *positional = PyTuple_CheckExact(args) ? Py_NewRef(args)
                                                        : PySequence_Tuple(args);
        if (positional == NULL)
            goto done;
        made = PyObject_Call(handler, positional, NULL);
        Py_DECREF(positional);
        if (made == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
            /* arguments the function does not take: bad data */
            PyObject *exc = raised();
            PyObject *text = exc ? PyObject_Str(exc) : NULL;
            PyObject *head = text ? PyUnicode_Substring(text, 0, 120) : NULL;
            Py_ssize_t count = head ? PyObject_Length(args) : -1;
            if (count >= 0)
                fail_call(m, func, " called with %zd arguments it does not take (%U)", count,
                          head);
            Py_XDECREF(exc);
            Py_XDECREF(text);
            Py_XDECREF(head);
        }
        goto done;
    }
    if (PyErr_Occurred())
        goto done;
    if (kwargs != Py_None && !PyDict_Check(kwargs)) {
        fail_call(m, func, " called with non-dict kwargs");
        goto done;
    }
    made = PyObject_CallFunctionObjArgs(st->Reduced, func, args, kwargs, NULL);
done:
    Py_XDECREF(handler);
    return made;
}

static PyObject *
persistent_load(Machine *m, PyObject *pid)
{
    if (m->persistent == NULL) {
        fail(m, "a persistent id where none is expected");
        return NULL;
    }
    return PyObject_CallOneArg(m->persistent, pid);
}

/* _unpickle._extend: ``target.<attr>.extend(items)``, a Reduced's items or pairs; the list
 * ``items`` itself when the attribute is still the empty tuple a Reduced starts with */
static int
call_extend(State *st, PyObject *target, PyObject *attr, PyObject *items)
{
    PyObject *list = PyObject_GetAttr(target, attr);
    if (list == NULL)
        return -1;
    if (PyTuple_CheckExact(list) && PyTuple_GET_SIZE(list) == 0) {
        Py_DECREF(list);
        return PyObject_SetAttr(target, attr, items);
    }
    PyObject *done = PyObject_CallMethodOneArg(list, st->s_extend, items);
    Py_DECREF(list);
    if (done == NULL)
        return -1;
    Py_DECREF(done);
    return 0;
}

/* _Machine.setitems: ``count`` keys and values, alternating, into ``target``. */
static int
setitems(Machine *m, PyObject *target, PyObject *const *flat, Py_ssize_t count)
{
    State *st = m->st;
    if (count % 2)
        return fail(m, "SETITEMS with an odd number of items");
    if (charge(m, 64 * ((unsigned long long)count / 2 + 1)) < 0)
        return -1;
    if (PyDict_Check(target)) {
        int all_str = 1;
        for (Py_ssize_t i = 0; i < count && all_str; i += 2)
            all_str = PyUnicode_CheckExact(flat[i]);
        if (all_str && PyDict_CheckExact(target)) {  /* a state dict: string keys, as they are */
            for (Py_ssize_t i = 0; i < count; i += 2)
                if (PyDict_SetItem(target, flat[i], flat[i + 1]) < 0)
                    return -1;
            return 0;
        }
        if (all_str) {  /* a dict of another class: its own update() */
            PyObject *pairs = PyList_New(count / 2);
            if (pairs == NULL)
                return -1;
            for (Py_ssize_t i = 0; i < count; i += 2) {
                PyObject *pair = PyTuple_Pack(2, flat[i], flat[i + 1]);
                if (pair == NULL) {
                    Py_DECREF(pairs);
                    return -1;
                }
                PyList_SET_ITEM(pairs, i / 2, pair);
            }
            PyObject *done = PyObject_CallMethodOneArg(target, st->s_update, pairs);
            Py_DECREF(pairs);
            if (done == NULL)
                return -1;
            Py_DECREF(done);
            return 0;
        }
        for (Py_ssize_t i = 0; i < count; i += 2) {
            PyObject *key = key_of(m, flat[i]);
            if (key == NULL)
                return -1;
            int rc = PyObject_SetItem(target, key, flat[i + 1]);
            Py_DECREF(key);
            if (rc < 0)
                return -1;
        }
        return 0;
    }
    int reduced = PyObject_IsInstance(target, st->Reduced);
    if (reduced < 0)
        return -1;
    if (reduced) {  /* its pairs, keys as they are */
        PyObject *pairs = PyList_New(count / 2);
        if (pairs == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < count; i += 2) {
            PyObject *pair = PyTuple_Pack(2, flat[i], flat[i + 1]);
            if (pair == NULL) {
                Py_DECREF(pairs);
                return -1;
            }
            PyList_SET_ITEM(pairs, i / 2, pair);
        }
        int rc = call_extend(st, target, st->s_pairs, pairs);
        Py_DECREF(pairs);
        return rc;
    }
    PyObject *what = type_name(target);
    if (what != NULL)
        fail(m, "SETITEM on a %U", what);
    Py_XDECREF(what);
    return -1;
}

/* _Machine.appends */
static int
appends(Machine *m, PyObject *target, PyObject *const *items, Py_ssize_t count)
{
    State *st = m->st;
    if (charge(m, 16 * (unsigned long long)count + 16) < 0)
        return -1;
    if (PyList_CheckExact(target)) {
        for (Py_ssize_t i = 0; i < count; i++)
            if (PyList_Append(target, items[i]) < 0)
                return -1;
        return 0;
    }
    int reduced = PyObject_IsInstance(target, st->Reduced);
    if (reduced < 0)
        return -1;
    if (reduced) {
        PyObject *list = PyList_New(count);
        if (list == NULL)
            return -1;
        for (Py_ssize_t i = 0; i < count; i++) {
            Py_INCREF(items[i]);
            PyList_SET_ITEM(list, i, items[i]);
        }
        int rc = call_extend(st, target, st->s_items, list);
        Py_DECREF(list);
        return rc;
    }
    PyObject *what = type_name(target);
    if (what != NULL)
        fail(m, "APPEND on a %U", what);
    Py_XDECREF(what);
    return -1;
}

/* _Machine.build */
static int
build(Machine *m, PyObject *target, PyObject *state)
{
    State *st = m->st;
    int reduced = PyObject_IsInstance(target, st->Reduced);
    if (reduced < 0)
        return -1;
    if (!reduced) {
        if (m->build == NULL) {
            PyObject *what = PyObject_CallOneArg(st->built_name, target);
            if (what != NULL)
                fail(m, "BUILD applied to %U, which ckptlab never builds", what);
            Py_XDECREF(what);
            return -1;
        }
        PyObject *args[2] = {target, state};
        PyObject *done = PyObject_Vectorcall(m->build, args, 2, NULL);
        Py_XDECREF(done);
        return done ? 0 : -1;
    }
    PyObject *before = PyObject_GetAttr(target, st->s_state);
    if (before == NULL)
        return -1;
    int twice = before != Py_None;
    Py_DECREF(before);
    if (twice) {
        PyObject *func = PyObject_GetAttr(target, st->s_func);
        PyObject *qualname = func ? PyObject_GetAttr(func, st->s_qualname) : NULL;
        if (qualname != NULL)
            fail(m, "BUILD applied twice to a %S", qualname);
        Py_XDECREF(func);
        Py_XDECREF(qualname);
        return -1;
    }
    return PyObject_SetAttr(target, st->s_state, state);
}

/* _Machine.make_set: the items as set members (keys), charged. */
static PyObject *
make_set(Machine *m, PyObject *const *items, Py_ssize_t count)
{
    if (charge(m, 96 * (unsigned long long)count + 256) < 0)
        return NULL;
    PyObject *keys = PyList_New(count);
    if (keys == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = key_of(m, items[i]);
        if (key == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, key);
    }
    return keys;
}

static PyObject *
tuple_of(PyObject *const *items, Py_ssize_t count)
{
    PyObject *tuple = PyTuple_New(count);
    if (tuple == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(tuple, i, items[i]);
    }
    return tuple;
}

static PyObject *
list_of(PyObject *const *items, Py_ssize_t count)
{
    PyObject *list = PyList_New(count);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_INCREF(items[i]);
        PyList_SET_ITEM(list, i, items[i]);
    }
    return list;
}

/* -- strings ---------------------------------------------------------------------------- */
/* A string opcode's payload: decoded, pushed, charged 96 + 4 bytes per payload byte. */
static int
push_text(Machine *m, const unsigned char *q, Py_ssize_t length, const char *errors)
{
    if (push(m, PyUnicode_DecodeUTF8((const char *)q, length, errors)) < 0)
        return -1;
    return charge(m, 96 + 4 * (unsigned long long)length);
}

/* STRING: protocol 0's quoted Python 2 str */
static int
op_string(Machine *m)
{
    Py_ssize_t start = 0, length = 0;
    if (line_span(m, "STRING", &start, &length) < 0)
        return -1;
    const unsigned char *q = m->p + start;
    while (length > 0 && q[length - 1] == '\r')
        length--;
    if (length < 2 || q[0] != q[length - 1] || (q[0] != '\'' && q[0] != '"'))
        return fail(m, "STRING is not quoted");
    PyObject *inner = PyBytes_FromStringAndSize((const char *)q + 1, length - 2);
    if (inner == NULL)
        return -1;
    PyObject *decoded = PyObject_CallOneArg(m->st->escape_decode, inner);
    Py_DECREF(inner);
    if (decoded == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError))
            return -1;
        PyObject *exc = raised();
        fail(m, "STRING with a bad escape: %S", exc);
        Py_XDECREF(exc);
        return -1;
    }
    PyObject *raw = PyTuple_Check(decoded) && PyTuple_GET_SIZE(decoded) > 0
                    ? PyTuple_GET_ITEM(decoded, 0) : NULL;
    int rc = -1;
    if (raw == NULL || !PyBytes_Check(raw))
        PyErr_SetString(PyExc_TypeError, "codecs.escape_decode gave no bytes");
    else
        rc = push_text(m, (const unsigned char *)PyBytes_AS_STRING(raw), PyBytes_GET_SIZE(raw),
                       "surrogateescape");
    Py_DECREF(decoded);
    return rc;
}

/* INT (a bool as 00/01), LONG, FLOAT: protocol 0's numbers */
static int
op_text_number(Machine *m, int code)
{
    PyObject *text = line(m, code == 'I' ? "INT" : code == 'L' ? "LONG" : "FLOAT");
    if (text == NULL)
        return -1;
    PyObject *value = NULL;
    Py_ssize_t charged = 48;
    if (code == 'I') {
        PyObject *stripped = PyObject_CallMethodNoArgs(text, m->st->s_strip);
        Py_DECREF(text);
        if ((text = stripped) == NULL)
            return -1;
        if (PyUnicode_CompareWithASCIIString(text, "01") == 0)
            value = Py_NewRef(Py_True);
        else if (PyUnicode_CompareWithASCIIString(text, "00") == 0)
            value = Py_NewRef(Py_False);
        else
            value = text_int(m, text);
        charged = 64 + PyUnicode_GetLength(text);
    } else if (code == 'L') {
        value = text_int(m, text);
        charged = 64 + PyUnicode_GetLength(text);
    } else {
        value = PyFloat_FromString(text);
        if (value == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
            PyErr_Clear();
            PyObject *head = PyUnicode_Substring(text, 0, 40);
            if (head != NULL)
                fail(m, "not a float: %R", head);
            Py_XDECREF(head);
        }
    }
    Py_DECREF(text);
    if (push(m, value) < 0)
        return -1;
    return charge(m, (unsigned long long)charged);
}

/* _unpickle._position, then interpret's handling of it: an error of the loop (a
 * PickleDataError, a UnicodeDecodeError, a RecursionError, a MemoryError) as a
 * PickleDataError whose ``offset`` is ``op``; any other exception as it is. */
static PyObject *
positioned(Machine *m, Py_ssize_t op)
{
    State *st = m->st;
    PyObject *exc = raised();
    if (exc == NULL)
        return NULL;
    PyObject *error = NULL;
    if (PyErr_GivenExceptionMatches(exc, st->PickleDataError)) {
        error = Py_NewRef(exc);
    } else if (PyErr_GivenExceptionMatches(exc, PyExc_UnicodeDecodeError)) {
        PyObject *reason = PyObject_GetAttrString(exc, "reason");
        PyObject *start = reason ? PyObject_GetAttrString(exc, "start") : NULL;
        PyObject *message = start ? PyUnicode_FromFormat(
            "a string is not valid UTF-8: %S at byte %S", reason, start) : NULL;
        if (message != NULL)
            error = PyObject_CallOneArg(st->PickleDataError, message);
        Py_XDECREF(reason);
        Py_XDECREF(start);
        Py_XDECREF(message);
    } else if (PyErr_GivenExceptionMatches(exc, PyExc_RecursionError)) {
        PyObject *message = PyUnicode_FromString("objects nested too deeply");
        if (message != NULL)
            error = PyObject_CallOneArg(st->PickleDataError, message);
        Py_XDECREF(message);
    } else if (PyErr_GivenExceptionMatches(exc, PyExc_MemoryError)) {
        PyObject *message = PyUnicode_FromString("out of memory interpreting the pickle");
        if (message != NULL)
            error = PyObject_CallOneArg(st->PickleBudgetError, message);
        Py_XDECREF(message);
    } else {
        reraise(exc);
        return NULL;
    }
    Py_DECREF(exc);
    if (error == NULL)
        return NULL;
    PyObject *offset = PyLong_FromSsize_t(op);
    int rc = offset ? PyObject_SetAttr(error, st->s_offset, offset) : -1;
    if (rc == 0)
        rc = PyObject_SetAttrString(error, "named", m->seen_at);
    Py_XDECREF(offset);
    if (rc < 0) {
        Py_DECREF(error);
        return NULL;
    }
    PyException_SetCause(error, NULL);  /* raise ... from None */
    reraise(error);
    return NULL;
}

/* -- the loop --------------------------------------------------------------------------- */
static PyObject *
run(Machine *m)
{
    State *st = m->st;
    const unsigned char *p = m->p;
    const Py_ssize_t n = m->n;
    Py_ssize_t op = 0, base = 0;
    const unsigned char *q;
    PyObject *obj, *a, *b;

    for (;;) {
        if (m->pos >= n) {
            fail(m, "the pickle ends without a STOP opcode");
            goto error;
        }
        op = m->pos;
        int code = p[m->pos++];
        switch (code) {
        /* -- ints, floats, None, bools -- */
        case 'K':  /* BININT1 */
            if (m->pos >= n) {
                fail(m, "BININT1 without its value");
                goto error;
            }
            if (push(m, PyLong_FromLong(p[m->pos])) < 0 || charge(m, 16) < 0)
                goto error;
            m->pos += 1;
            break;
        case 'M':  /* BININT2 */
            if (n - m->pos < 2) {
                fail(m, "BININT2 without its value");
                goto error;
            }
            if (push(m, PyLong_FromLong(p[m->pos] | (p[m->pos + 1] << 8))) < 0 ||
                charge(m, 48) < 0)
                goto error;
            m->pos += 2;
            break;
        case 'J':  /* BININT */
            if (n - m->pos < 4) {
                fail(m, "BININT without its value");
                goto error;
            }
            if (push(m, PyLong_FromLong((int32_t)le32(p + m->pos))) < 0 || charge(m, 48) < 0)
                goto error;
            m->pos += 4;
            break;
        case 0x8a:  /* LONG1 */
        case 0x8b:  /* LONG4 */
            if (code == 0x8a) {
                if ((q = take(m, 0, 1, "LONG1")) == NULL || (q = take(m, 0, q[0], "LONG1")) == NULL)
                    goto error;
            } else if ((q = take(m, 0, 4, "LONG4")) == NULL ||
                       (q = take_i32(m, (int32_t)le32(q), "LONG4")) == NULL) {
                goto error;
            }
            if (push(m, int_from_bytes(m, q, m->p + m->pos - q)) < 0)
                goto error;
            break;
        case 'I':  /* INT */
        case 'L':  /* LONG */
        case 'F':  /* FLOAT */
            if (op_text_number(m, code) < 0)
                goto error;
            break;
        case 'G':  /* BINFLOAT */
        {
            if ((q = take(m, 0, 8, "BINFLOAT")) == NULL)
                goto error;
            double value = PyFloat_Unpack8((const char *)q, 0);
            if ((value == -1.0 && PyErr_Occurred()) || push(m, PyFloat_FromDouble(value)) < 0 ||
                charge(m, 48) < 0)
                goto error;
            break;
        }
        case 'N':  /* NONE */
            if (push(m, Py_NewRef(Py_None)) < 0 || charge(m, 16) < 0)
                goto error;
            break;
        case 0x88:  /* NEWTRUE */
        case 0x89:  /* NEWFALSE */
            if (push(m, Py_NewRef(code == 0x88 ? Py_True : Py_False)) < 0 || charge(m, 16) < 0)
                goto error;
            break;

        /* -- strings and bytes -- */
        case 'X':  /* BINUNICODE */
        {
            if (n - m->pos < 4) {
                fail(m, "BINUNICODE without its length");
                goto error;
            }
            uint32_t length = le32(p + m->pos);
            m->pos += 4;
            if ((q = take(m, 0, length, "BINUNICODE")) == NULL ||
                push_text(m, q, (Py_ssize_t)length, "surrogatepass") < 0)
                goto error;
            break;
        }
        case 0x8c:  /* SHORT_BINUNICODE */
            if ((q = take(m, 0, 1, "SHORT_BINUNICODE")) == NULL ||
                (q = take(m, 0, q[0], "SHORT_BINUNICODE")) == NULL ||
                push_text(m, q, m->p + m->pos - q, "surrogatepass") < 0)
                goto error;
            break;
        case 0x8d:  /* BINUNICODE8 */
            if ((q = take(m, 0, 8, "BINUNICODE8")) == NULL ||
                (q = take(m, 0, le64(q), "BINUNICODE8")) == NULL ||
                push_text(m, q, m->p + m->pos - q, "surrogatepass") < 0)
                goto error;
            break;
        case 'U':  /* SHORT_BINSTRING */
        case 'T':  /* BINSTRING (Python 2 str) */
            if (code == 'U') {
                if ((q = take(m, 0, 1, "SHORT_BINSTRING")) == NULL ||
                    (q = take(m, 0, q[0], "BINSTRING")) == NULL)
                    goto error;
            } else if ((q = take(m, 0, 4, "BINSTRING")) == NULL ||
                       (q = take_i32(m, (int32_t)le32(q), "BINSTRING")) == NULL) {
                goto error;
            }
            if (push_text(m, q, m->p + m->pos - q, "surrogateescape") < 0)
                goto error;
            break;
        case 'S':  /* STRING (protocol 0, quoted) */
            if (op_string(m) < 0)
                goto error;
            break;
        case 'V':  /* UNICODE (protocol 0) */
        {
            Py_ssize_t start = 0, length = 0;
            if (line_span(m, "UNICODE", &start, &length) < 0 ||
                push(m, PyUnicode_DecodeRawUnicodeEscape((const char *)p + start, length,
                                                         NULL)) < 0 ||
                charge(m, 96 + 4 * (unsigned long long)length) < 0)
                goto error;
            break;
        }
        case 'C':  /* SHORT_BINBYTES */
        case 'B':  /* BINBYTES */
        case 0x8e:  /* BINBYTES8 */
        case 0x96:  /* BYTEARRAY8 */
        {
            if (code == 'C')
                q = take(m, 0, 1, "SHORT_BINBYTES");
            else if (code == 'B')
                q = take(m, 0, 4, "BINBYTES");
            else
                q = take(m, 0, 8, "BINBYTES8");
            if (q == NULL)
                goto error;
            unsigned long long length = code == 'C' ? q[0] : code == 'B' ? le32(q) : le64(q);
            if ((q = take(m, 0, length, "bytes payload")) == NULL)
                goto error;
            obj = code == 0x96 ? PyByteArray_FromStringAndSize((const char *)q, (Py_ssize_t)length)
                               : PyBytes_FromStringAndSize((const char *)q, (Py_ssize_t)length);
            if (push(m, obj) < 0 || charge(m, 80 + length) < 0)
                goto error;
            break;
        }

        /* -- containers -- */
        case ')':  /* EMPTY_TUPLE */
            if (push(m, PyTuple_New(0)) < 0 || charge(m, 16) < 0)
                goto error;
            break;
        case ']':  /* EMPTY_LIST */
            if (push(m, PyList_New(0)) < 0 || charge(m, 88) < 0)
                goto error;
            break;
        case '}':  /* EMPTY_DICT */
            if (push(m, PyDict_New()) < 0 || charge(m, 96) < 0)
                goto error;
            break;
        case 0x8f:  /* EMPTY_SET */
            if (push(m, PySet_New(NULL)) < 0 || charge(m, 256) < 0)
                goto error;
            break;
        case '(':  /* MARK */
            if (grow((void **)&m->marks, &m->mcap, m->nmarks + 1, sizeof(Py_ssize_t)) < 0)
                goto error;
            m->marks[m->nmarks++] = m->size;
            if (charge(m, 88) < 0)
                goto error;
            break;
        case 't':  /* TUPLE */
            if (m->nmarks == 0) {
                fail(m, "TUPLE without a MARK");
                goto error;
            }
            base = m->marks[--m->nmarks];
            obj = tuple_of(m->stack + base, m->size - base);
            truncate_to(m, base);
            if (push(m, obj) < 0 || charge(m, 72 + 8 * (unsigned long long)PyTuple_GET_SIZE(obj)) < 0)
                goto error;
            break;
        case 0x85:  /* TUPLE1 */
        case 0x86:  /* TUPLE2 */
        case 0x87:  /* TUPLE3 */
        {
            Py_ssize_t k = code - 0x84;
            if (stack_len(m) < k) {
                fail(m, "TUPLE%zd with %zd items on the stack", k, stack_len(m));
                goto error;
            }
            obj = tuple_of(m->stack + m->size - k, k);
            truncate_to(m, m->size - k);
            if (push(m, obj) < 0 || charge(m, 72 + 8 * (unsigned long long)k) < 0)
                goto error;
            break;
        }
        case 'l':  /* LIST */
            if (pop_mark(m, code, &base) < 0)
                goto error;
            obj = list_of(m->stack + base, m->size - base);
            truncate_to(m, base);
            if (push(m, obj) < 0)
                goto error;
            break;
        case 'd':  /* DICT */
            if (pop_mark(m, code, &base) < 0 || charge(m, 96) < 0)
                goto error;
            if ((obj = PyDict_New()) == NULL)
                goto error;
            if (setitems(m, obj, m->stack + base, m->size - base) < 0) {
                Py_DECREF(obj);
                goto error;
            }
            truncate_to(m, base);
            if (push(m, obj) < 0)
                goto error;
            break;
        case 0x91:  /* FROZENSET */
            if (pop_mark(m, code, &base) < 0 ||
                (a = make_set(m, m->stack + base, m->size - base)) == NULL)
                goto error;
            obj = PyFrozenSet_New(a);
            Py_DECREF(a);
            truncate_to(m, base);
            if (push(m, obj) < 0)
                goto error;
            break;
        case 0x90:  /* ADDITEMS */
        {
            if (pop_mark(m, code, &base) < 0 || need_below(m, base, 1, code) < 0)
                goto error;
            obj = m->stack[base - 1];
            if (!Py_IS_TYPE(obj, &PySet_Type)) {
                PyObject *what = type_name(obj);
                if (what != NULL)
                    fail(m, "ADDITEMS on a %U", what);
                Py_XDECREF(what);
                goto error;
            }
            if ((a = make_set(m, m->stack + base, m->size - base)) == NULL)
                goto error;
            int rc = 0;
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a) && rc == 0; i++)
                rc = PySet_Add(obj, PyList_GET_ITEM(a, i));
            Py_DECREF(a);
            truncate_to(m, base);
            if (rc < 0)
                goto error;
            break;
        }
        case 'a':  /* APPEND */
            if (need(m, 2, code) < 0 ||
                appends(m, m->stack[m->size - 2], m->stack + m->size - 1, 1) < 0)
                goto error;
            truncate_to(m, m->size - 1);
            break;
        case 'e':  /* APPENDS */
            if (pop_mark(m, code, &base) < 0 || need_below(m, base, 1, code) < 0 ||
                appends(m, m->stack[base - 1], m->stack + base, m->size - base) < 0)
                goto error;
            truncate_to(m, base);
            break;
        case 's':  /* SETITEM */
            if (need(m, 3, code) < 0 ||
                setitems(m, m->stack[m->size - 3], m->stack + m->size - 2, 2) < 0)
                goto error;
            truncate_to(m, m->size - 2);
            break;
        case 'u':  /* SETITEMS */
            if (m->nmarks == 0) {
                fail(m, "SETITEMS without a MARK");
                goto error;
            }
            base = m->marks[--m->nmarks];
            if (base == frame_base(m)) {
                fail(m, "SETITEMS with nothing to set items on");
                goto error;
            }
            if (setitems(m, m->stack[base - 1], m->stack + base, m->size - base) < 0)
                goto error;
            truncate_to(m, base);
            break;

        /* -- the stack and the memo -- */
        case '0':  /* POP */
            if (stack_len(m) > 0)
                truncate_to(m, m->size - 1);
            else if (pop_mark(m, code, &base) < 0)
                goto error;
            break;
        case '1':  /* POP_MARK */
            if (pop_mark(m, code, &base) < 0)
                goto error;
            truncate_to(m, base);
            break;
        case '2':  /* DUP */
            if (need(m, 1, code) < 0 || push(m, Py_NewRef(m->stack[m->size - 1])) < 0 ||
                charge(m, 16) < 0)
                goto error;
            break;
        case 'q':  /* BINPUT */
        case 'r':  /* LONG_BINPUT */
        {
            Py_ssize_t index;
            if (code == 'q') {
                if (m->pos >= n) {
                    fail(m, "BINPUT without its index");
                    goto error;
                }
                index = p[m->pos++];
            } else {
                if (n - m->pos < 4) {
                    fail(m, "LONG_BINPUT without its index");
                    goto error;
                }
                index = (Py_ssize_t)le32(p + m->pos);
                m->pos += 4;
            }
            if (stack_len(m) == 0) {
                fail(m, code == 'q' ? "BINPUT with an empty stack"
                                    : "LONG_BINPUT with an empty stack");
                goto error;
            }
            if (memo_put(m, index, m->stack[m->size - 1]) < 0)
                goto error;
            break;
        }
        case 0x94:  /* MEMOIZE */
            if (stack_len(m) == 0) {
                fail(m, "MEMOIZE with an empty stack");
                goto error;
            }
            if (memo_append(m, m->stack[m->size - 1]) < 0)
                goto error;
            break;
        case 'h':  /* BINGET */
        case 'j':  /* LONG_BINGET */
        {
            Py_ssize_t index;
            if (code == 'h') {
                if (m->pos >= n) {
                    fail(m, "BINGET without its index");
                    goto error;
                }
                index = p[m->pos++];
            } else {
                if (n - m->pos < 4) {
                    fail(m, "LONG_BINGET without its index");
                    goto error;
                }
                index = (Py_ssize_t)le32(p + m->pos);
                m->pos += 4;
            }
            if (push(m, memo_get(m, index, NULL)) < 0 || charge(m, 16) < 0)
                goto error;
            break;
        }
        case 'g':  /* GET (protocol 0) */
        case 'p':  /* PUT (protocol 0) */
        {
            if ((a = line(m, code == 'g' ? "GET" : "PUT")) == NULL)
                goto error;
            b = text_int(m, a);
            Py_DECREF(a);
            if (b == NULL)
                goto error;
            int overflow = 0;
            long long index = PyLong_AsLongLongAndOverflow(b, &overflow);
            int rc;
            if (code == 'g') {  /* a negative index was never stored (PUT refuses them) */
                rc = push(m, memo_get(m, overflow || index < 0 ? -1 : (Py_ssize_t)index, b));
                if (rc == 0)
                    rc = charge(m, 16);
            } else if ((rc = need(m, 1, code)) < 0) {
            } else if (overflow < 0 || (!overflow && index < 0)) {
                rc = fail(m, "negative PUT index");
            } else if (!overflow && index <= PY_SSIZE_T_MAX) {
                rc = memo_put(m, (Py_ssize_t)index, m->stack[m->size - 1]);
            } else {
                rc = sparse_put(m, b, m->stack[m->size - 1]);
            }
            Py_DECREF(b);
            if (rc < 0)
                goto error;
            break;
        }

        /* -- globals, calls, persistent ids -- */
        case 'c':  /* GLOBAL */
        {
            if ((a = line(m, "GLOBAL module")) == NULL)
                goto error;
            if ((b = line(m, "GLOBAL name")) == NULL) {
                Py_DECREF(a);
                goto error;
            }
            obj = global_(m, a, b, op);
            Py_DECREF(a);
            Py_DECREF(b);
            if (push(m, obj) < 0 || charge(m, 16) < 0)
                goto error;
            break;
        }
        case 0x93:  /* STACK_GLOBAL */
            if (need(m, 2, code) < 0)
                goto error;
            obj = global_(m, m->stack[m->size - 2], m->stack[m->size - 1], op);
            truncate_to(m, m->size - 2);
            if (push(m, obj) < 0)
                goto error;
            break;
        case 'R':  /* REDUCE */
        case 0x81:  /* NEWOBJ */
            if (code == 'R' && stack_len(m) < 2) {
                fail(m, "REDUCE with fewer than two items on the stack");
                goto error;
            }
            if (need(m, 2, code) < 0)
                goto error;
            obj = call(m, m->stack[m->size - 2], m->stack[m->size - 1], Py_None);
            truncate_to(m, m->size - 1);
            if (replace_top(m, obj) < 0)
                goto error;
            break;
        case 0x92:  /* NEWOBJ_EX */
            if (need(m, 3, code) < 0)
                goto error;
            obj = call(m, m->stack[m->size - 3], m->stack[m->size - 2], m->stack[m->size - 1]);
            truncate_to(m, m->size - 2);
            if (replace_top(m, obj) < 0)
                goto error;
            break;
        case 'o':  /* OBJ: MARK cls args... OBJ */
            if (pop_mark(m, code, &base) < 0)
                goto error;
            if (m->size == base) {
                fail(m, "OBJ without a class");
                goto error;
            }
            if ((a = tuple_of(m->stack + base + 1, m->size - base - 1)) == NULL)
                goto error;
            obj = call(m, m->stack[base], a, Py_None);
            Py_DECREF(a);
            truncate_to(m, base);
            if (push(m, obj) < 0)
                goto error;
            break;
        case 'i':  /* INST: MARK args... INST module\nname\n */
        {
            if ((a = line(m, "INST module")) == NULL)
                goto error;
            if ((b = line(m, "INST name")) == NULL) {
                Py_DECREF(a);
                goto error;
            }
            PyObject *func = pop_mark(m, code, &base) < 0 ? NULL : global_(m, a, b, op);
            Py_DECREF(a);
            Py_DECREF(b);
            if (func == NULL)
                goto error;
            a = tuple_of(m->stack + base, m->size - base);
            obj = a ? call(m, func, a, Py_None) : NULL;
            Py_DECREF(func);
            Py_XDECREF(a);
            truncate_to(m, base);
            if (push(m, obj) < 0)
                goto error;
            break;
        }
        case 'b':  /* BUILD */
            if (need(m, 2, code) < 0 ||
                build(m, m->stack[m->size - 2], m->stack[m->size - 1]) < 0)
                goto error;
            truncate_to(m, m->size - 1);
            break;
        case 'Q':  /* BINPERSID */
            if (stack_len(m) == 0) {
                fail(m, "BINPERSID with an empty stack");
                goto error;
            }
            if (replace_top(m, persistent_load(m, m->stack[m->size - 1])) < 0 ||
                charge(m, 160) < 0)
                goto error;
            break;
        case 'P':  /* PERSID (protocol 0) */
            if ((a = line(m, "PERSID")) == NULL)
                goto error;
            obj = persistent_load(m, a);
            Py_DECREF(a);
            if (push(m, obj) < 0 || charge(m, 160) < 0)
                goto error;
            break;

        /* -- framing and the end -- */
        case 0x80:  /* PROTO */
            if ((q = take(m, 0, 1, "PROTO")) == NULL)
                goto error;
            m->proto = q[0];
            if (m->proto > 5) {
                fail(m, "unsupported pickle protocol %ld", m->proto);
                goto error;
            }
            break;
        case 0x95:  /* FRAME: a buffering hint; check the length and read straight on */
        {
            if ((q = take(m, 0, 8, "FRAME")) == NULL)
                goto error;
            uint64_t length = le64(q);
            if (length > (uint64_t)(n - m->pos)) {
                PyObject *x = commas_ull(st, length), *y = commas_ll(st, n - m->pos);
                if (x != NULL && y != NULL)
                    fail(m, "FRAME of %U bytes with %U bytes left", x, y);
                Py_XDECREF(x);
                Py_XDECREF(y);
                goto error;
            }
            break;
        }
        case '.':  /* STOP */
        {
            if (stack_len(m) != 1 || m->nmarks) {
                fail(m, "STOP with %zd objects on the stack and %zd open MARKs", stack_len(m),
                     m->nmarks);
                goto error;
            }
            PyObject *protocol = PyLong_FromLong(m->proto);
            PyObject *end = protocol ? PyLong_FromSsize_t(m->pos) : NULL;
            PyObject *result = end ? PyObject_CallFunctionObjArgs(
                st->Interpretation, m->stack[0], protocol, m->seen, end, m->seen_at, NULL) : NULL;
            Py_XDECREF(protocol);
            Py_XDECREF(end);
            if (result == NULL)
                goto error;
            return result;
        }

        /* -- refused -- */
        case 0x82:  /* EXT1 */
        case 0x83:  /* EXT2 */
        case 0x84:  /* EXT4 */
            fail(m, "EXT opcode: extension codes name globals through Python's process-wide "
                    "copyreg registry; ckptlab never consults it");
            goto error;
        case 0x97:  /* NEXT_BUFFER */
        case 0x98:  /* READONLY_BUFFER */
            fail(m, "out-of-band buffers (protocol 5) are not used by checkpoints");
            goto error;
        default:
        {
            char text[8];
            opcode_text(text, code);
            fail(m, "unknown opcode %s", text);
            goto error;
        }
        }
    }
error:
    return positioned(m, op);
}

static void
machine_clear(Machine *m)
{
    truncate_to(m, 0);
    PyMem_Free(m->stack);
    PyMem_Free(m->marks);
    for (Py_ssize_t i = 0; i < m->memo_slots; i++)
        Py_DECREF(m->memo[i]);
    PyMem_Free(m->memo);
    PyMem_Free(m->rank);
    Py_XDECREF(m->sparse);
    Py_XDECREF(m->globals);
    Py_XDECREF(m->hcache);
    Py_XDECREF(m->seen);
    Py_XDECREF(m->seen_at);
    Py_XDECREF(m->keycache);
    PyMem_Free(m->read_bits);
    Py_XDECREF(m->read_far);
}

/* max(MEMORY_FLOOR, memory_per_byte * n), as a C long long (clamped: no pickle can charge
 * anywhere near 2**63 bytes). */
static int
initial_budget(State *st, PyObject *memory_per_byte, Py_ssize_t n, long long *out)
{
    PyObject *floor = PyObject_GetAttrString(st->unpickle, "MEMORY_FLOOR");
    PyObject *count = floor ? PyLong_FromSsize_t(n) : NULL;
    PyObject *product = count ? PyNumber_Multiply(memory_per_byte, count) : NULL;
    PyObject *budget = NULL;
    if (product != NULL) {
        int larger = PyObject_RichCompareBool(product, floor, Py_GT);
        if (larger >= 0)
            budget = Py_NewRef(larger ? product : floor);
    }
    Py_XDECREF(floor);
    Py_XDECREF(count);
    Py_XDECREF(product);
    if (budget == NULL)
        return -1;
    int rc = 0;
    if (PyFloat_Check(budget)) {
        double value = PyFloat_AS_DOUBLE(budget);
        *out = value >= 9.2e18 ? LLONG_MAX : value < 0 ? 0 : (long long)value;
    } else {
        PyObject *whole = PyNumber_Index(budget);
        int overflow = 0;
        long long value = whole ? PyLong_AsLongLongAndOverflow(whole, &overflow) : -1;
        Py_XDECREF(whole);
        if (whole == NULL || (value == -1 && PyErr_Occurred()))
            rc = -1;
        else
            *out = overflow > 0 ? LLONG_MAX : overflow < 0 || value < 0 ? 0 : value;
    }
    Py_DECREF(budget);
    return rc;
}

static PyObject *
interpret(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"data", "handlers", "persistent_load", "build",
                               "memory_per_byte", NULL};
    PyObject *data, *handlers = Py_None, *persistent = Py_None, *build_other = Py_None;
    PyObject *memory_per_byte = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|$OOOO:interpret", keywords, &data,
                                     &handlers, &persistent, &build_other, &memory_per_byte))
        return NULL;
    State *st = PyModule_GetState(module);
    if (st == NULL || (!st->bound && bind(st) < 0))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Machine m;
    memset(&m, 0, sizeof(m));
    m.st = st;
    m.p = view.buf;
    m.n = view.len;
    PyObject *result = NULL;
    int truthy = handlers == Py_None ? 0 : PyObject_IsTrue(handlers);
    if (truthy < 0)
        goto done;
    m.handlers = truthy ? handlers : NULL;  /* handlers or {} */
    m.persistent = persistent == Py_None ? NULL : persistent;
    m.build = build_other == Py_None ? NULL : build_other;
    if (initial_budget(st, memory_per_byte ? memory_per_byte : st->memory_per_byte, m.n,
                       &m.budget) < 0 ||
        (m.globals = PyDict_New()) == NULL || (m.seen = PyList_New(0)) == NULL ||
        (m.seen_at = PyList_New(0)) == NULL ||
        (m.hcache = PyDict_New()) == NULL || find_memo_reads(&m) < 0)
        goto done;
    result = run(&m);
done:
    machine_clear(&m);
    PyBuffer_Release(&view);
    return result;
}

/* -- the module ------------------------------------------------------------------------- */
static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    State *st = PyModule_GetState(module);
    if (st == NULL)
        return 0;
#define VISIT(f) Py_VISIT(st->f);
    STATE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int
module_clear(PyObject *module)
{
    State *st = PyModule_GetState(module);
    if (st != NULL)
        unbind(st);
    return 0;
}

static void
module_free(void *module)
{
    module_clear((PyObject *)module);
}

PyDoc_STRVAR(interpret_doc,
"interpret(data, *, handlers=None, persistent_load=None, build=None, memory_per_byte=64)\n"
"--\n\n"
"ckptlab.format._unpickle.interpret(data, ...), compiled: the same\n"
"Interpretation, handler calls, memo, budget and errors (PickleDataError with .offset).");


/* ---------------------------------------------------------------------------------------
 * record_type(qualname, fields, defaults=(), namespace=None): an immutable record class whose instances
 * hold only values that cannot lead back to them (str, int, bool, None, tuples of those,
 * other records): a heap type made with PyType_FromSpec WITHOUT Py_TPFLAGS_HAVE_GC, so the
 * cyclic collector never tracks nor walks its instances. Fields are read-only members;
 * the constructor takes them by position or keyword (the last len(defaults) optional);
 * ==, hash and repr are those of the tuple of fields (equal only to the same class);
 * instances pickle and copy as the class called with the fields. ckptlab/format/_records.py
 * has the Python class of the same interface, used where this extension is not built.
 */
#include <structmember.h>

static PyObject *s_fields_key, *s_defaults_key;

static Py_ssize_t
record_len_of(PyTypeObject *type)
{
    return (type->tp_basicsize - (Py_ssize_t)sizeof(PyObject)) / (Py_ssize_t)sizeof(PyObject *);
}

static Py_ssize_t
record_len(PyObject *self)
{
    return record_len_of(Py_TYPE(self));
}

#define RECORD_ITEMS(self) ((PyObject **)((char *)(self) + sizeof(PyObject)))

static PyObject *
record_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    /* the class attributes record_type set (public attribute lookups, cached by type) */
    PyObject *fields = PyObject_GetAttr((PyObject *)type, s_fields_key);
    PyObject *defaults = fields ? PyObject_GetAttr((PyObject *)type, s_defaults_key) : NULL;
    if (defaults == NULL || !PyTuple_Check(fields) || !PyTuple_Check(defaults) ||
        PyTuple_GET_SIZE(fields) != record_len_of(type) ||
        PyTuple_GET_SIZE(defaults) > PyTuple_GET_SIZE(fields)) {
        if (defaults == NULL && !PyErr_ExceptionMatches(PyExc_AttributeError)) {
            Py_XDECREF(fields);
            return NULL;
        }
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "not a record type");
        Py_XDECREF(fields);
        Py_XDECREF(defaults);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(fields), nd = PyTuple_GET_SIZE(defaults);
    Py_ssize_t given = PyTuple_GET_SIZE(args);
    if (given > n) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments, %zd given", type->tp_name, n,
                     given);
        return NULL;
    }
    PyObject *self = type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    PyObject **items = RECORD_ITEMS(self);
    for (Py_ssize_t i = 0; i < given; i++)
        items[i] = Py_NewRef(PyTuple_GET_ITEM(args, i));
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        Py_ssize_t pos = 0, used = 0;
        PyObject *key, *value;
        for (Py_ssize_t i = given; i < n; i++) {
            value = PyDict_GetItemWithError(kwargs, PyTuple_GET_ITEM(fields, i));
            if (value != NULL) {
                items[i] = Py_NewRef(value);
                used++;
            } else if (PyErr_Occurred()) {
                goto fail;
            }
        }
        if (used != PyDict_GET_SIZE(kwargs)) {
            while (PyDict_Next(kwargs, &pos, &key, &value)) {
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected or repeated keyword "
                             "argument %R", type->tp_name, key);
                goto fail;
            }
        }
    }
    for (Py_ssize_t i = given; i < n; i++) {
        if (items[i] != NULL)
            continue;
        if (i < n - nd) {
            PyErr_Format(PyExc_TypeError, "%s() missing argument %R", type->tp_name,
                         PyTuple_GET_ITEM(fields, i));
            goto fail;
        }
        items[i] = Py_NewRef(PyTuple_GET_ITEM(defaults, i - (n - nd)));
    }
    Py_DECREF(fields);
    Py_DECREF(defaults);
    return self;
fail:
    Py_DECREF(self);
    Py_DECREF(fields);
    Py_DECREF(defaults);
    return NULL;
}

static void
record_dealloc(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    Py_ssize_t n = record_len(self);
    PyObject **items = RECORD_ITEMS(self);
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(items[i]);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyObject *
record_tuple(PyObject *self)
{
    Py_ssize_t n = record_len(self);
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    PyObject **items = RECORD_ITEMS(self);
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(out, i, Py_NewRef(items[i] ? items[i] : Py_None));
    return out;
}

static PyObject *
record_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || Py_TYPE(a) != Py_TYPE(b))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *ta = record_tuple(a), *tb = ta ? record_tuple(b) : NULL;
    PyObject *out = tb ? PyObject_RichCompare(ta, tb, op) : NULL;
    Py_XDECREF(ta);
    Py_XDECREF(tb);
    return out;
}

static Py_hash_t
record_hash(PyObject *self)
{
    PyObject *t = record_tuple(self);
    if (t == NULL)
        return -1;
    Py_hash_t h = PyObject_Hash(t);
    Py_DECREF(t);
    return h;
}

static PyObject *
record_repr(PyObject *self)
{
    PyObject *fields = PyObject_GetAttr((PyObject *)Py_TYPE(self), s_fields_key);
    if (fields == NULL)
        return NULL;
    if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != record_len(self)) {
        Py_DECREF(fields);
        PyErr_SetString(PyExc_TypeError, "not a record type");
        return NULL;
    }
    int rc = Py_ReprEnter(self);
    if (rc != 0) {
        Py_DECREF(fields);
        return rc > 0 ? PyUnicode_FromString("...") : NULL;
    }
    PyObject *parts = PyList_New(0), *out = NULL;
    PyObject **items = RECORD_ITEMS(self);
    for (Py_ssize_t i = 0; parts && i < PyTuple_GET_SIZE(fields); i++) {
        PyObject *part = PyUnicode_FromFormat("%U=%R", PyTuple_GET_ITEM(fields, i), items[i]);
        if (part == NULL || PyList_Append(parts, part) < 0)
            Py_CLEAR(parts);
        Py_XDECREF(part);
    }
    PyObject *sep = parts ? PyUnicode_FromString(", ") : NULL;
    PyObject *joined = sep ? PyUnicode_Join(sep, parts) : NULL;
    PyObject *type_name = joined ? PyType_GetName(Py_TYPE(self)) : NULL;
    if (type_name != NULL)
        out = PyUnicode_FromFormat("%U(%U)", type_name, joined);
    Py_XDECREF(type_name);
    Py_XDECREF(sep);
    Py_XDECREF(joined);
    Py_XDECREF(parts);
    Py_DECREF(fields);
    Py_ReprLeave(self);
    return out;
}

static PyObject *
record_reduce(PyObject *self, PyObject *unused)
{
    (void)unused;
    PyObject *t = record_tuple(self);
    return t ? Py_BuildValue("(ON)", (PyObject *)Py_TYPE(self), t) : NULL;
}

static PyMethodDef record_methods[] = {
    {"__reduce__", record_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyObject *
record_type(PyObject *module, PyObject *args)
{
    (void)module;
    const char *qualname;
    PyObject *fields, *defaults = NULL, *namespace = NULL;
    if (!PyArg_ParseTuple(args, "sO!|O!O!:record_type", &qualname, &PyTuple_Type, &fields,
                          &PyTuple_Type, &defaults, &PyDict_Type, &namespace))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(fields);
    if (defaults == NULL)
        defaults = PyTuple_New(0);
    else
        Py_INCREF(defaults);
    if (defaults == NULL)
        return NULL;
    if (n < 1 || n > 64 || PyTuple_GET_SIZE(defaults) > n) {
        PyErr_SetString(PyExc_ValueError, "record_type: 1 to 64 fields, no more defaults");
        Py_DECREF(defaults);
        return NULL;
    }
    /* the spec's strings and members live as long as the process (a few types, made at
     * import) */
    PyMemberDef *members = PyMem_Calloc(n + 1, sizeof(PyMemberDef));
    char *name = PyMem_Malloc(strlen(qualname) + 1);
    if (members == NULL || name == NULL) {
        PyMem_Free(members);
        PyMem_Free(name);
        Py_DECREF(defaults);
        return PyErr_NoMemory();
    }
    strcpy(name, qualname);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *f = PyTuple_GET_ITEM(fields, i);
        const char *text = PyUnicode_Check(f) ? PyUnicode_AsUTF8(f) : NULL;
        char *copy = text ? PyMem_Malloc(strlen(text) + 1) : NULL;
        if (copy == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "record_type: fields are strings");
            Py_DECREF(defaults);
            return NULL;
        }
        strcpy(copy, text);
        members[i] = (PyMemberDef){copy, T_OBJECT_EX,
                                   (Py_ssize_t)(sizeof(PyObject) + i * sizeof(PyObject *)),
                                   READONLY, NULL};
    }
    PyType_Slot slots[] = {
        {Py_tp_new, record_new},
        {Py_tp_dealloc, record_dealloc},
        {Py_tp_richcompare, record_richcompare},
        {Py_tp_hash, record_hash},
        {Py_tp_repr, record_repr},
        {Py_tp_members, members},
        {Py_tp_methods, record_methods},
        {0, NULL},
    };
    PyType_Spec spec = {name, (int)(sizeof(PyObject) + n * sizeof(PyObject *)), 0,
                        Py_TPFLAGS_DEFAULT, slots};  /* no Py_TPFLAGS_HAVE_GC */
    PyObject *type = PyType_FromSpec(&spec);
    if (type == NULL ||
        PyObject_SetAttr(type, s_fields_key, fields) < 0 ||
        PyObject_SetAttr(type, s_defaults_key, defaults) < 0 ||
        PyObject_SetAttrString(type, "__match_args__", fields) < 0)
        Py_CLEAR(type);
    if (type != NULL && namespace != NULL) {  /* properties, a docstring: set on the class */
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(namespace, &pos, &key, &value))
            if (PyObject_SetAttr(type, key, value) < 0) {
                Py_CLEAR(type);
                break;
            }
    }
    if (type != NULL)
        PyType_Modified((PyTypeObject *)type);
    Py_DECREF(defaults);
    return type;
}

/* ---------------------------------------------------------------------------------------
 * TorchCore(fallback, storage_ref, tensor_ref, storage_dtypes): the hot torch handlers of
 * ckptlab.format._torch_handlers._TorchHandlers compiled, as _pickle.c pairs pickle.py: the
 * persistent-id reader, _rebuild_tensor_v2, _rebuild_parameter and OrderedDict(), one call
 * each per tensor (or module) saved.
 *
 * ``fallback`` is the _TorchHandlers instance these stand in for (the reference
 * implementation); the core shares its storage table (``fallback.storages``, a dict, and
 * ``fallback.storage_order``, a list: the same objects). ``storage_ref`` and ``tensor_ref``
 * are the StorageRef and _TensorRef record classes; ``storage_dtypes`` is
 * {storage class name: (dtype, itemsize)}.
 *
 * Each method does in C only what its Python namesake does on the common path, with the same
 * checks, and gives the same result (equal records, the same StorageRef for a key seen
 * before, the storage table updated the same way). Anything else (odd types, negative
 * numbers, a key declared twice with different sizes, keyword arguments, ...) is
 * ``getattr(fallback, name)(*args, **kwargs)``: whatever that returns or raises, so every
 * error and odd case stays defined in one place, the Python method.
 */
#define CORE_KNOWN 8

typedef struct {
    PyObject_HEAD
    PyObject *fallback;     /* the _TorchHandlers instance */
    PyObject *storages;     /* fallback.storages: {key: StorageRef} (the same dict) */
    PyObject *order;        /* fallback.storage_order: [key, ...] (the same list) */
    PyObject *storage_ref;  /* the StorageRef class */
    PyObject *tensor_ref;   /* the _TensorRef class */
    PyObject *dtypes;       /* {storage class name: (dtype, itemsize)}: a checked copy */
    PyObject *global_type;  /* _unpickle.Global */
    /* storage classes seen, by identity (the interpreter makes one Global per name; a pickle
     * names one to three): the Global and its (dtype, itemsize), both held */
    PyObject *known[CORE_KNOWN][2];
    int nknown;
} TorchCore;

/* the names the core looks up: made once, at import */
#define CORE_NAMES(X) X(storages) X(storage_order) X(module) X(name) X(dtype) X(nbytes) \
    X(storage) X(storage_offset) X(shape) X(stride) X(subclass) X(attrs) X(persistent_load) \
    X(rebuild_v2) X(rebuild_parameter) X(ordered_dict) X(make_set) X(make_frozenset)
#define CORE_NAME_FIELD(f) PyObject *f;
static struct { CORE_NAMES(CORE_NAME_FIELD) } core_names;
#undef CORE_NAME_FIELD

static int
core_names_init(void)
{
#define CORE_NAME_INIT(f) \
    if (core_names.f == NULL && (core_names.f = PyUnicode_InternFromString(#f)) == NULL) \
        return -1;
    CORE_NAMES(CORE_NAME_INIT)
#undef CORE_NAME_INIT
    return 0;
}

/* ``getattr(self.fallback, name)(*args, **kwargs)`` (a vectorcall's arguments) */
static PyObject *
core_fallback(TorchCore *self, PyObject *name, PyObject *const *args, Py_ssize_t nargs,
              PyObject *kwnames)
{
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    Py_ssize_t total = 1 + nargs + nkw;
    PyObject *small[16], **stack = small;
    if (total > (Py_ssize_t)(sizeof(small) / sizeof(small[0]))) {
        stack = PyMem_New(PyObject *, total);
        if (stack == NULL)
            return PyErr_NoMemory();
    }
    stack[0] = self->fallback;
    for (Py_ssize_t i = 0; i < nargs + nkw; i++)
        stack[1 + i] = args[i];
    PyObject *out = PyObject_VectorcallMethod(name, stack, (size_t)(1 + nargs),
                                              nkw ? kwnames : NULL);
    if (stack != small)
        PyMem_Free(stack);
    return out;
}

/* ``type(v) is int and v >= 0`` */
static int
nonnegative_int(PyObject *v)
{
    if (!PyLong_CheckExact(v))
        return 0;
    int overflow;
    long long value = PyLong_AsLongLongAndOverflow(v, &overflow);
    return overflow > 0 || (overflow == 0 && value >= 0);
}

/* a tuple of non-negative ints (``len`` checked by the caller) */
static int
nonnegative_ints(PyObject *tuple)
{
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++)
        if (!nonnegative_int(PyTuple_GET_ITEM(tuple, i)))
            return 0;
    return 1;
}

/* ``getattr(obj, name)`` (a new reference), or NULL: an error, or (``*missing`` set, no
 * error) an AttributeError, for the caller to leave to the fallback */
static PyObject *
attr_or_missing(PyObject *obj, PyObject *name, int *missing)
{
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        *missing = 1;
    }
    return value;
}

/* The (dtype, itemsize) of a storage class (borrowed), or NULL: an error, or (no error)
 * not a storage class the fast path takes. Mirrors persistent_load's check:
 * ``isinstance(t, Global) and t.module in ("torch", "torch.storage") and t.name in
 * STORAGE_DTYPE``, for a Global (exactly) with str module and name. */
static PyObject *
core_storage_type(TorchCore *self, PyObject *storage_type)
{
    if (!Py_IS_TYPE(storage_type, (PyTypeObject *)self->global_type))
        return NULL;
    for (int i = 0; i < self->nknown; i++)
        if (self->known[i][0] == storage_type)
            return self->known[i][1];
    PyObject *entry = NULL;
    int missing = 0;
    PyObject *module = attr_or_missing(storage_type, core_names.module, &missing);
    PyObject *name = module ? attr_or_missing(storage_type, core_names.name, &missing) : NULL;
    if (name != NULL && PyUnicode_CheckExact(module) && PyUnicode_CheckExact(name) &&
        (PyUnicode_CompareWithASCIIString(module, "torch") == 0 ||
         PyUnicode_CompareWithASCIIString(module, "torch.storage") == 0)) {
        entry = PyDict_GetItemWithError(self->dtypes, name);
        if (entry != NULL && self->nknown < CORE_KNOWN) {  /* (past that: looked up anew) */
            self->known[self->nknown][0] = Py_NewRef(storage_type);
            self->known[self->nknown][1] = Py_NewRef(entry);
            self->nknown++;
        }
    }
    Py_XDECREF(module);
    Py_XDECREF(name);
    return entry;
}

PyDoc_STRVAR(core_persistent_load_doc,
"persistent_load(pid): _TorchHandlers.persistent_load (torch.save's\n"
"('storage', storage_type, key, location, numel) ids).");

static PyObject *
core_persistent_load(PyObject *op, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames)
{
    TorchCore *self = (TorchCore *)op;
    if (nargs != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)))
        goto fallback;
    PyObject *pid = args[0];
    if (!PyTuple_CheckExact(pid) || PyTuple_GET_SIZE(pid) != 5)
        goto fallback;
    PyObject *tag = PyTuple_GET_ITEM(pid, 0), *storage_type = PyTuple_GET_ITEM(pid, 1);
    PyObject *key = PyTuple_GET_ITEM(pid, 2), *location = PyTuple_GET_ITEM(pid, 3);
    PyObject *numel = PyTuple_GET_ITEM(pid, 4);
    if (!PyUnicode_CheckExact(tag) || PyUnicode_CompareWithASCIIString(tag, "storage") != 0 ||
        !PyUnicode_CheckExact(key) || !PyUnicode_CheckExact(location) ||
        !PyLong_CheckExact(numel))
        goto fallback;
    PyObject *entry = core_storage_type(self, storage_type);
    if (entry == NULL) {
        if (PyErr_Occurred())
            return NULL;
        goto fallback;
    }
    Py_ssize_t count = PyLong_AsSsize_t(numel);
    if (count == -1 && PyErr_Occurred()) {  /* past Py_ssize_t: the Python ints do it */
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return NULL;
        PyErr_Clear();
        goto fallback;
    }
    /* (itemsize: checked to be 1 to 2**16 when the core was made) */
    Py_ssize_t itemsize = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
    if (count < 0 || count > PY_SSIZE_T_MAX / itemsize)
        goto fallback;
    Py_ssize_t nbytes = count * itemsize;
    PyObject *ref = PyDict_GetItemWithError(self->storages, key);
    if (ref == NULL) {
        if (PyErr_Occurred())
            return NULL;
        /* StorageRef(key, storage_type.name, dtype, location, numel, nbytes) */
        PyObject *name = PyObject_GetAttr(storage_type, core_names.name);
        PyObject *size = name ? PyLong_FromSsize_t(nbytes) : NULL;
        PyObject *made = NULL;
        if (size != NULL) {
            PyObject *fields[6] = {key, name, PyTuple_GET_ITEM(entry, 0), location, numel,
                                   size};
            made = PyObject_Vectorcall(self->storage_ref, fields, 6, NULL);
        }
        Py_XDECREF(name);
        Py_XDECREF(size);
        if (made != NULL && (PyDict_SetItem(self->storages, key, made) < 0 ||
                             PyList_Append(self->order, key) < 0))
            Py_CLEAR(made);
        return made;
    }
    if (Py_IS_TYPE(ref, (PyTypeObject *)self->storage_ref)) {
        /* a storage seen before (or another class over the same bytes): the same ref when
         * the byte sizes agree */
        Py_INCREF(ref);  /* (the attribute lookup may run code) */
        int missing = 0;
        PyObject *held = attr_or_missing(ref, core_names.nbytes, &missing);
        int same = 0;
        if (held != NULL && PyLong_CheckExact(held)) {
            Py_ssize_t value = PyLong_AsSsize_t(held);
            if (value == -1 && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                    Py_DECREF(held);
                    Py_DECREF(ref);
                    return NULL;
                }
                PyErr_Clear();
            } else {
                same = value == nbytes;
            }
        }
        int failed = held == NULL && !missing;
        Py_XDECREF(held);
        if (same)
            return ref;
        Py_DECREF(ref);
        if (failed)
            return NULL;
    }
fallback:
    return core_fallback(self, core_names.persistent_load, args, nargs, kwnames);
}

PyDoc_STRVAR(core_rebuild_v2_doc,
"rebuild_v2(storage, storage_offset, size, stride, requires_grad=False, *rest):\n"
"_TorchHandlers.rebuild_v2 (torch._utils._rebuild_tensor_v2).");

static PyObject *
core_rebuild_v2(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    TorchCore *self = (TorchCore *)op;
    if (nargs < 4 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)))
        goto fallback;
    /* a seventh argument, torch's tensor metadata (the conjugate / negative bits), unless
     * None or an empty dict: Python's */
    if (nargs > 6 && args[6] != Py_None &&
        !(PyDict_CheckExact(args[6]) && PyDict_GET_SIZE(args[6]) == 0))
        goto fallback;
    /* rebuild_v2's inline check: storage a StorageRef (exactly); size and stride tuples
     * (exactly) of one length, at most 64, of non-negative ints; offset a non-negative int;
     * requires_grad True or False. Arguments past the seventh are ignored, as *rest is. */
    PyObject *storage = args[0], *offset = args[1], *size = args[2], *stride = args[3];
    PyObject *requires_grad = nargs > 4 ? args[4] : Py_False;
    if (!Py_IS_TYPE(storage, (PyTypeObject *)self->storage_ref) ||
        !PyTuple_CheckExact(size) || !PyTuple_CheckExact(stride) ||
        PyTuple_GET_SIZE(size) != PyTuple_GET_SIZE(stride) || PyTuple_GET_SIZE(size) > 64 ||
        !nonnegative_int(offset) || (requires_grad != Py_True && requires_grad != Py_False) ||
        !nonnegative_ints(size) || !nonnegative_ints(stride))
        goto fallback;
    int missing = 0;
    PyObject *dtype = attr_or_missing(storage, core_names.dtype, &missing);
    if (dtype == NULL) {
        if (missing)
            goto fallback;
        return NULL;
    }
    /* _TensorRef(storage, offset, size, stride, requires_grad, storage.dtype) */
    PyObject *fields[6] = {storage, offset, size, stride, requires_grad, dtype};
    PyObject *made = PyObject_Vectorcall(self->tensor_ref, fields, 6, NULL);
    Py_DECREF(dtype);
    return made;
fallback:
    return core_fallback(self, core_names.rebuild_v2, args, nargs, kwnames);
}

PyDoc_STRVAR(core_rebuild_parameter_doc,
"rebuild_parameter(data, requires_grad=False, hooks=None, state=None, *rest):\n"
"_TorchHandlers.rebuild_parameter (torch._utils._rebuild_parameter[_with_state]).");

static PyObject *
core_rebuild_parameter(PyObject *op, PyObject *const *args, Py_ssize_t nargs,
                       PyObject *kwnames)
{
    TorchCore *self = (TorchCore *)op;
    if (nargs < 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)))
        goto fallback;
    /* a tensor record (exactly), requires_grad True or False (the Python method's
     * bool(requires_grad) of anything else is left to it), no state: the record with
     * requires_grad and is_parameter=True */
    PyObject *data = args[0];
    PyObject *requires_grad = nargs > 1 ? args[1] : Py_False;
    PyObject *state = nargs > 3 ? args[3] : Py_None;
    if (!Py_IS_TYPE(data, (PyTypeObject *)self->tensor_ref) || state != Py_None ||
        (requires_grad != Py_True && requires_grad != Py_False))
        goto fallback;
    {   /* a tensor with the conjugate / negative bits (its metadata): Python's, which keeps
         * them */
        PyObject *metadata = PyObject_GetAttrString(data, "metadata");
        int bits = metadata == NULL ? -1 : PyObject_IsTrue(metadata);
        Py_XDECREF(metadata);
        if (bits < 0)
            return NULL;
        if (bits)
            goto fallback;
    }
    PyObject *names[7] = {core_names.storage, core_names.storage_offset, core_names.shape,
                          core_names.stride, core_names.dtype, core_names.subclass,
                          core_names.attrs};
    PyObject *values[7] = {NULL};
    PyObject *made = NULL;
    int missing = 0, i;
    for (i = 0; i < 7; i++)
        if ((values[i] = attr_or_missing(data, names[i], &missing)) == NULL)
            break;
    if (i == 7) {
        /* _TensorRef(storage, storage_offset, shape, stride, requires_grad, dtype,
         *            is_parameter=True, subclass, attrs) */
        PyObject *fields[9] = {values[0], values[1], values[2], values[3], requires_grad,
                               values[4], Py_True, values[5], values[6]};
        made = PyObject_Vectorcall(self->tensor_ref, fields, 9, NULL);
    }
    for (int j = 0; j < 7; j++)
        Py_XDECREF(values[j]);
    if (i == 7 || !missing)
        return made;
fallback:
    return core_fallback(self, core_names.rebuild_parameter, args, nargs, kwnames);
}

PyDoc_STRVAR(core_ordered_dict_doc,
"ordered_dict(items=None): _TorchHandlers.ordered_dict (collections.OrderedDict()).");

static PyObject *
core_ordered_dict(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    if ((kwnames == NULL || !PyTuple_GET_SIZE(kwnames)) && nargs <= 1) {
        PyObject *items = nargs == 1 ? args[0] : Py_None;
        /* OrderedDict() or OrderedDict(None / () / []): an empty dict (PyDict_New: one the
         * collector does not track) */
        if (items == Py_None || (PyTuple_CheckExact(items) && PyTuple_GET_SIZE(items) == 0) ||
            (PyList_CheckExact(items) && PyList_GET_SIZE(items) == 0))
            return PyDict_New();
    }
    return core_fallback((TorchCore *)op, core_names.ordered_dict, args, nargs, kwnames);
}

/* make_set / make_frozenset: a list or tuple of plain members (str, int, float, bool,
 * bytes: _TorchHandlers._set_of keeps them as they are) made a set at once; anything else
 * (other members become OpaqueKeys; not a list or tuple: refused) to the fallback */
static PyObject *
core_set_of(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
            int frozen)
{
    if ((kwnames == NULL || !PyTuple_GET_SIZE(kwnames)) && nargs <= 1) {
        PyObject *items = nargs == 1 ? args[0] : NULL;
        if (items == NULL)
            return frozen ? PyFrozenSet_New(NULL) : PySet_New(NULL);
        if (PyList_CheckExact(items) || PyTuple_CheckExact(items)) {
            Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
            PyObject **item = PySequence_Fast_ITEMS(items);
            int plain = 1;
            for (Py_ssize_t i = 0; plain && i < n; i++) {
                PyTypeObject *t = Py_TYPE(item[i]);
                plain = t == &PyUnicode_Type || t == &PyLong_Type || t == &PyFloat_Type ||
                        t == &PyBool_Type || t == &PyBytes_Type;
            }
            if (plain)
                return frozen ? PyFrozenSet_New(items) : PySet_New(items);
        }
    }
    return core_fallback((TorchCore *)op, frozen ? core_names.make_frozenset
                                                 : core_names.make_set, args, nargs, kwnames);
}

static PyObject *
core_make_set(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return core_set_of(op, args, nargs, kwnames, 0);
}

static PyObject *
core_make_frozenset(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return core_set_of(op, args, nargs, kwnames, 1);
}

static PyObject *
core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"fallback", "storage_ref", "tensor_ref", "storage_dtypes",
                               NULL};
    PyObject *fallback, *storage_ref, *tensor_ref, *storage_dtypes;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!O!:TorchCore", keywords, &fallback,
                                     &PyType_Type, &storage_ref, &PyType_Type, &tensor_ref,
                                     &PyDict_Type, &storage_dtypes))
        return NULL;
    PyObject *module = PyType_GetModule(type);
    State *st = module ? PyModule_GetState(module) : NULL;
    if (st == NULL || (!st->bound && bind(st) < 0))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    TorchCore *self = alloc ? (TorchCore *)alloc(type, 0) : NULL;
    if (self == NULL)
        return NULL;
    self->fallback = Py_NewRef(fallback);
    self->storage_ref = Py_NewRef(storage_ref);
    self->tensor_ref = Py_NewRef(tensor_ref);
    self->global_type = Py_NewRef(st->Global);
    if ((self->storages = PyObject_GetAttr(fallback, core_names.storages)) == NULL ||
        (self->order = PyObject_GetAttr(fallback, core_names.storage_order)) == NULL ||
        (self->dtypes = PyDict_New()) == NULL)
        goto fail;
    if (!PyDict_CheckExact(self->storages) || !PyList_CheckExact(self->order)) {
        PyErr_SetString(PyExc_TypeError, "TorchCore: fallback.storages is not a dict or "
                        "fallback.storage_order not a list");
        goto fail;
    }
    Py_ssize_t pos = 0;
    PyObject *name, *entry;
    while (PyDict_Next(storage_dtypes, &pos, &name, &entry)) {
        long long itemsize = 0;
        if (PyUnicode_CheckExact(name) && PyTuple_CheckExact(entry) &&
            PyTuple_GET_SIZE(entry) == 2 && PyUnicode_CheckExact(PyTuple_GET_ITEM(entry, 0)) &&
            PyLong_CheckExact(PyTuple_GET_ITEM(entry, 1))) {
            int overflow;
            itemsize = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(entry, 1), &overflow);
            if (overflow)
                itemsize = 0;
        }
        if (itemsize < 1 || itemsize > (1 << 16)) {
            PyErr_Format(PyExc_TypeError, "TorchCore: storage_dtypes[%R] is not a (dtype, "
                         "itemsize) pair with itemsize 1 to 65536", name);
            goto fail;
        }
        if (PyDict_SetItem(self->dtypes, name, entry) < 0)
            goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

static int
core_traverse(PyObject *op, visitproc visit, void *arg)
{
    TorchCore *self = (TorchCore *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->fallback);
    Py_VISIT(self->storages);
    Py_VISIT(self->order);
    Py_VISIT(self->storage_ref);
    Py_VISIT(self->tensor_ref);
    Py_VISIT(self->dtypes);
    Py_VISIT(self->global_type);
    for (int i = 0; i < self->nknown; i++) {
        Py_VISIT(self->known[i][0]);
        Py_VISIT(self->known[i][1]);
    }
    return 0;
}

static int
core_clear(PyObject *op)
{
    TorchCore *self = (TorchCore *)op;
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->storages);
    Py_CLEAR(self->order);
    Py_CLEAR(self->storage_ref);
    Py_CLEAR(self->tensor_ref);
    Py_CLEAR(self->dtypes);
    Py_CLEAR(self->global_type);
    for (; self->nknown > 0; self->nknown--) {
        Py_CLEAR(self->known[self->nknown - 1][0]);
        Py_CLEAR(self->known[self->nknown - 1][1]);
    }
    return 0;
}

static void
core_dealloc(PyObject *op)
{
    PyTypeObject *type = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    core_clear(op);
    freefunc release = (freefunc)PyType_GetSlot(type, Py_tp_free);
    release(op);
    Py_DECREF(type);
}

static PyMethodDef core_methods[] = {
    {"persistent_load", (PyCFunction)(void (*)(void))core_persistent_load,
     METH_FASTCALL | METH_KEYWORDS, core_persistent_load_doc},
    {"rebuild_v2", (PyCFunction)(void (*)(void))core_rebuild_v2,
     METH_FASTCALL | METH_KEYWORDS, core_rebuild_v2_doc},
    {"rebuild_parameter", (PyCFunction)(void (*)(void))core_rebuild_parameter,
     METH_FASTCALL | METH_KEYWORDS, core_rebuild_parameter_doc},
    {"ordered_dict", (PyCFunction)(void (*)(void))core_ordered_dict,
     METH_FASTCALL | METH_KEYWORDS, core_ordered_dict_doc},
    {"make_set", (PyCFunction)(void (*)(void))core_make_set, METH_FASTCALL | METH_KEYWORDS,
     "_TorchHandlers.make_set, compiled"},
    {"make_frozenset", (PyCFunction)(void (*)(void))core_make_frozenset,
     METH_FASTCALL | METH_KEYWORDS, "_TorchHandlers.make_frozenset, compiled"},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(core_doc,
"TorchCore(fallback, storage_ref, tensor_ref, storage_dtypes)\n"
"--\n\n"
"The hot handlers of ckptlab.format._torch_handlers._TorchHandlers (persistent_load,\n"
"rebuild_v2, rebuild_parameter, ordered_dict), compiled: the same results, sharing\n"
"fallback's storage table; any input off their common path is fallback's method of the\n"
"same name.");

static PyType_Slot core_slots[] = {
    {Py_tp_new, core_new},
    {Py_tp_dealloc, core_dealloc},
    {Py_tp_traverse, core_traverse},
    {Py_tp_clear, core_clear},
    {Py_tp_methods, core_methods},
    {Py_tp_doc, (void *)core_doc},
    {0, NULL},
};

static PyType_Spec core_spec = {
    "ckptlab.format._interp.TorchCore", (int)sizeof(TorchCore), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, core_slots,
};

/* _walk.c */
PyObject *ckptlab_walk_tensors(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
/* ckptlab/dcp/_rows.c */
extern PyType_Spec ckptlab_dcp_rows_spec;

static PyMethodDef methods[] = {
    {"interpret", (PyCFunction)(void (*)(void))interpret, METH_VARARGS | METH_KEYWORDS,
     interpret_doc},
    {"walk_tensors", (PyCFunction)(void (*)(void))ckptlab_walk_tensors, METH_FASTCALL,
     "walk_tensors(root, kinds, walk_kind, pending_type, reduced_type, children, path_key, "
     "max_depth, too_deep): ckptlab.format._pickle_walk._walk_tensors compiled (_walk.c)"},
    {"record_type", record_type, METH_VARARGS,
     "record_type(qualname, fields, defaults=(), namespace=None): an immutable record class "
     "(namespace: extra class attributes, e.g. properties) not tracked by the "
     "cyclic garbage collector"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_interp",
    .m_doc = "ckptlab's pickle interpreter (ckptlab.format._opcodes' loop), compiled.",
    .m_size = sizeof(State),
    .m_methods = methods,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__interp(void)
{
    if (s_fields_key == NULL && (s_fields_key = PyUnicode_InternFromString("_fields")) == NULL)
        return NULL;
    if (s_defaults_key == NULL &&
        (s_defaults_key = PyUnicode_InternFromString("_field_defaults")) == NULL)
        return NULL;
    if (core_names_init() < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    memset(PyModule_GetState(module), 0, sizeof(State));
    PyObject *core = PyType_FromModuleAndSpec(module, &core_spec, NULL);
    if (core == NULL || PyModule_AddObjectRef(module, "TorchCore", core) < 0) {
        Py_XDECREF(core);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(core);
    PyObject *rows = PyType_FromModuleAndSpec(module, &ckptlab_dcp_rows_spec, NULL);
    if (rows == NULL || PyModule_AddObjectRef(module, "DcpRows", rows) < 0) {
        Py_XDECREF(rows);
        Py_DECREF(module);
        return NULL;
    }
    Py_DECREF(rows);
    return module;
}
