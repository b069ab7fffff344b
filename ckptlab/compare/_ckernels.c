/* ckptlab.compare._ckernels: the loops of ckptlab.compare._kernels compiled (the same
 * interface and results; tests/compare/test_kernels.py runs one suite against both).
 *
 * Every function takes contiguous float32 ('f') or float64 ('d') elements through the buffer
 * protocol, works in double and releases the GIL while it loops:
 *
 *   moments(x, kind) -> (nan, inf, zeros, finite, lo, hi, total, squares)
 *       counts, the finite range and the float64 sums of the finite elements and of their
 *       squares;
 *   spread(x, kind, mean, lo, hi, counts) -> squares
 *       the sum of (x - mean)**2 over the finite elements, and their histogram added into
 *       ``counts`` (a writable int64 buffer of the bins): bin floor((x - lo) * bins / (hi - lo))
 *       computed in double in that order, x == hi in the last bin (torch.histc's rule);
 *   count16(x, counts)
 *       adds each 16-bit pattern's count into ``counts`` (int64[65536]);
 *   compare(a, b, kind, atol, rtol) -> (n_diff, nan_a, nan_b, max_abs, sa, sb, sd, dot, within)
 *       see ckptlab.compare._kernels.compare.
 *
 * Only CPython's public API is used; nothing is kept between calls. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

static int
elements(Py_buffer *view, int kind, Py_ssize_t *n)
{
    Py_ssize_t size = kind == 'f' ? 4 : kind == 'd' ? 8 : 0;
    if (!size) {
        PyErr_SetString(PyExc_ValueError, "kind must be 'f' (float32) or 'd' (float64)");
        return -1;
    }
    if (view->len % size) {
        PyErr_Format(PyExc_ValueError, "%zd bytes are not whole %zd-byte elements",
                     view->len, size);
        return -1;
    }
    *n = view->len / size;
    return 0;
}

#define AT(buf, kind, i) ((kind) == 'f' ? (double)((const float *)(buf))[i] \
                                        : ((const double *)(buf))[i])

/* The moments of a block of elements of type T: eight lanes of branch-free sums, minima,
 * maxima and zero counts (the compiler packs them into vector instructions), and a check that
 * is NaN when an element is not finite (x * 0 is NaN for NaN and +-inf). A block that fails
 * the check is done again one element at a time. */
typedef struct {
    long long nan, inf, zeros, finite;
    double lo, hi, sum, squares;
} Moments;

#define BLOCK 2048
#define MOMENTS(NAME, T)                                                                  \
static void                                                                               \
NAME(const T *x, Py_ssize_t n, Moments *m)                                                \
{                                                                                         \
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {                               \
        Py_ssize_t len = n - start < BLOCK ? n - start : BLOCK, i = 0;                    \
        const T *b = x + start;                                                           \
        T lo[8], hi[8], check[8];                                                         \
        double sum[8], sq[8];                                                             \
        long long zeros[8];                                                               \
        for (int j = 0; j < 8; j++) {                                                     \
            lo[j] = (T)INFINITY; hi[j] = (T)-INFINITY; check[j] = 0;                      \
            sum[j] = 0.0; sq[j] = 0.0; zeros[j] = 0;                                      \
        }                                                                                 \
        for (; i + 8 <= len; i += 8)                                                      \
            for (int j = 0; j < 8; j++) {                                                 \
                T v = b[i + j];                                                           \
                lo[j] = v < lo[j] ? v : lo[j];                                            \
                hi[j] = v > hi[j] ? v : hi[j];                                            \
                check[j] += v * (T)0;                                                     \
                sum[j] += (double)v;                                                      \
                sq[j] += (double)v * (double)v;                                           \
                zeros[j] += v == (T)0;                                                    \
            }                                                                             \
        T bad = 0;                                                                        \
        for (int j = 0; j < 8; j++)                                                       \
            bad += check[j];                                                              \
        if (bad != bad)  /* a NaN or an infinity: this block one element at a time */     \
            i = 0;                                                                        \
        else {                                                                            \
            for (int j = 0; j < 8; j++) {                                                 \
                m->lo = (double)lo[j] < m->lo ? (double)lo[j] : m->lo;                    \
                m->hi = (double)hi[j] > m->hi ? (double)hi[j] : m->hi;                    \
                m->sum += sum[j];                                                         \
                m->squares += sq[j];                                                      \
                m->zeros += zeros[j];                                                     \
            }                                                                             \
            m->finite += i;                                                               \
        }                                                                                 \
        for (; i < len; i++) {                                                            \
            double v = (double)b[i];                                                      \
            m->zeros += v == 0.0;                                                         \
            if (isfinite(v)) {                                                            \
                m->finite++;                                                              \
                m->lo = v < m->lo ? v : m->lo;                                            \
                m->hi = v > m->hi ? v : m->hi;                                            \
                m->sum += v;                                                              \
                m->squares += v * v;                                                      \
            }                                                                             \
            else if (isnan(v))                                                            \
                m->nan++;                                                                 \
            else                                                                          \
                m->inf++;                                                                 \
        }                                                                                 \
    }                                                                                     \
}
MOMENTS(moments_f_scalar, float)
MOMENTS(moments_d, double)

#ifdef __SSE2__
/* moments_f with SSE2 (every x86-64 has it): a block's minima, maxima, zero counts, sums
 * and sums of squares four floats at a time (the sums in double, two at a time), eight per
 * step; a block whose NaN check fails (x * 0 is NaN for NaN and +-inf) is done by
 * moments_f_scalar. The same results as moments_f_scalar but for the order of the sums. */
static void
moments_f(const float *x, Py_ssize_t n, Moments *m)
{
    const __m128 zero = _mm_setzero_ps();
    Py_ssize_t start = 0;
    for (; start + BLOCK <= n; start += BLOCK) {
        const float *b = x + start;
        __m128 lo0 = _mm_set1_ps(INFINITY), lo1 = lo0, hi0 = _mm_set1_ps(-INFINITY), hi1 = hi0;
        __m128 check = zero;
        __m128d s0 = _mm_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
        __m128d q0 = s0, q1 = s0, q2 = s0, q3 = s0;
        __m128i zeros = _mm_setzero_si128();
        for (Py_ssize_t i = 0; i < BLOCK; i += 8) {
            __m128 v = _mm_loadu_ps(b + i), w = _mm_loadu_ps(b + i + 4);
            lo0 = _mm_min_ps(lo0, v);
            lo1 = _mm_min_ps(lo1, w);
            hi0 = _mm_max_ps(hi0, v);
            hi1 = _mm_max_ps(hi1, w);
            check = _mm_add_ps(check, _mm_add_ps(_mm_mul_ps(v, zero), _mm_mul_ps(w, zero)));
            zeros = _mm_sub_epi32(zeros, _mm_castps_si128(_mm_cmpeq_ps(v, zero)));
            zeros = _mm_sub_epi32(zeros, _mm_castps_si128(_mm_cmpeq_ps(w, zero)));
            __m128d a = _mm_cvtps_pd(v), c = _mm_cvtps_pd(_mm_movehl_ps(v, v));
            __m128d d = _mm_cvtps_pd(w), e = _mm_cvtps_pd(_mm_movehl_ps(w, w));
            s0 = _mm_add_pd(s0, a);
            s1 = _mm_add_pd(s1, c);
            s2 = _mm_add_pd(s2, d);
            s3 = _mm_add_pd(s3, e);
            q0 = _mm_add_pd(q0, _mm_mul_pd(a, a));
            q1 = _mm_add_pd(q1, _mm_mul_pd(c, c));
            q2 = _mm_add_pd(q2, _mm_mul_pd(d, d));
            q3 = _mm_add_pd(q3, _mm_mul_pd(e, e));
        }
        float f[4];
        _mm_storeu_ps(f, check);
        if (f[0] != f[0] || f[1] != f[1] || f[2] != f[2] || f[3] != f[3]) {
            moments_f_scalar(b, BLOCK, m);  /* a NaN or an infinity in this block */
            continue;
        }
        float l[8], h[8];
        double sum[2], sq[2];
        int32_t z[4];
        _mm_storeu_ps(l, lo0);
        _mm_storeu_ps(l + 4, lo1);
        _mm_storeu_ps(h, hi0);
        _mm_storeu_ps(h + 4, hi1);
        _mm_storeu_pd(sum, _mm_add_pd(_mm_add_pd(s0, s1), _mm_add_pd(s2, s3)));
        _mm_storeu_pd(sq, _mm_add_pd(_mm_add_pd(q0, q1), _mm_add_pd(q2, q3)));
        _mm_storeu_si128((__m128i *)z, zeros);
        for (int j = 0; j < 8; j++) {
            m->lo = (double)l[j] < m->lo ? (double)l[j] : m->lo;
            m->hi = (double)h[j] > m->hi ? (double)h[j] : m->hi;
        }
        m->sum += sum[0] + sum[1];
        m->squares += sq[0] + sq[1];
        m->zeros += (long long)z[0] + z[1] + z[2] + z[3];
        m->finite += BLOCK;
    }
    if (start < n)
        moments_f_scalar(x + start, n - start, m);
}
#else
#define moments_f moments_f_scalar
#endif

static PyObject *
moments(PyObject *self, PyObject *args)
{
    Py_buffer view;
    int kind;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*C:moments", &view, &kind))
        return NULL;
    if (elements(&view, kind, &n) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Moments m = {0, 0, 0, 0, INFINITY, -INFINITY, 0.0, 0.0};
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        moments_f((const float *)view.buf, n, &m);
    else
        moments_d((const double *)view.buf, n, &m);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("LLLLdddd", m.nan, m.inf, m.zeros, m.finite, m.lo, m.hi, m.sum,
                         m.squares);
}

/* The squares around the mean and the histogram, in blocks of three simple loops that the
 * compiler vectorizes: the squares on eight lanes (with the NaN check of MOMENTS: a block
 * holding a NaN or an infinity has its squares summed again one element at a time), the bin
 * of each element with torch.histc's arithmetic (a correctly rounded division; NaN and
 * elements outside [lo, hi] get -1), then the increments, into four rows of counts taken in
 * turn so that runs of one bin do not wait on each other. */
#define SPREAD(NAME, T)                                                                   \
static double                                                                             \
NAME(const T *x, Py_ssize_t n, double mean, double lo, double hi, int64_t *counts,        \
     Py_ssize_t bins, int64_t *rows)                                                      \
{                                                                                         \
    const double width = hi > lo ? hi - lo : 1.0, nb = (double)bins;  /* lo == hi: bin 0 */\
    double total = 0.0;                                                                   \
    int32_t bin[BLOCK];                                                                   \
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {                               \
        Py_ssize_t len = n - start < BLOCK ? n - start : BLOCK, i = 0;                    \
        const T *b = x + start;                                                           \
        double sq[8] = {0.0}, part = 0.0;                                                 \
        for (; i + 8 <= len; i += 8)                                                      \
            for (int j = 0; j < 8; j++) {                                                 \
                double d = (double)b[i + j] - mean;                                       \
                sq[j] += d * d;                                                           \
            }                                                                             \
        for (int j = 0; j < 8; j++)                                                       \
            part += sq[j];                                                                \
        if (!isfinite(part))  /* a NaN or an infinity (or an overflow): element by element */ \
            i = 0, part = 0.0;                                                            \
        for (; i < len; i++)                                                              \
            if (isfinite((double)b[i])) {                                                 \
                double d = (double)b[i] - mean;                                           \
                part += d * d;                                                            \
            }                                                                             \
        total += part;                                                                    \
        for (i = 0; i < len; i++) {  /* NaN, below lo: -1; hi and above: bins */          \
            double q = (((double)b[i] - lo) * nb) / width;                                \
            q = (double)b[i] >= lo ? q : -1.0;  /* (q can round to -0.0 below lo) */    \
            q = q < nb ? q : nb;                                                          \
            bin[i] = (int32_t)q;                                                          \
        }                                                                                 \
        for (i = 0; i < len; i++) {                                                       \
            int32_t pos = bin[i];                                                         \
            if ((uint32_t)pos < (uint32_t)bins)  /* (NaN, below lo: -1) */                \
                rows[(i & 3) * bins + pos]++;                                             \
            else if (pos == bins && (double)b[i] <= hi)  /* hi: the last bin */           \
                rows[(i & 3) * bins + bins - 1]++;                                        \
        }                                                                                 \
    }                                                                                     \
    for (int j = 0; j < 4; j++)                                                           \
        for (Py_ssize_t k = 0; k < bins; k++)                                             \
            counts[k] += rows[j * bins + k];                                              \
    return total;                                                                         \
}
SPREAD(spread_f, float)
SPREAD(spread_d, double)

static PyObject *
spread(PyObject *self, PyObject *args)
{
    Py_buffer view, out;
    int kind;
    double mean, lo, hi;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*Cdddw*:spread", &view, &kind, &mean, &lo, &hi, &out))
        return NULL;
    if (elements(&view, kind, &n) < 0 || out.len % 8 || out.len == 0 || out.len > 8 << 20) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError,
                            "counts must be an int64 buffer of 1 to 2**20 bins");
        PyBuffer_Release(&view);
        PyBuffer_Release(&out);
        return NULL;
    }
    const Py_ssize_t bins = out.len / 8;
    int64_t *rows = PyMem_Calloc((size_t)(4 * bins), sizeof(int64_t));
    if (!rows) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    double squares;
    Py_BEGIN_ALLOW_THREADS
    if (kind == 'f')
        squares = spread_f((const float *)view.buf, n, mean, lo, hi, out.buf, bins, rows);
    else
        squares = spread_d((const double *)view.buf, n, mean, lo, hi, out.buf, bins, rows);
    Py_END_ALLOW_THREADS
    PyMem_Free(rows);
    PyBuffer_Release(&view);
    PyBuffer_Release(&out);
    return PyFloat_FromDouble(squares);
}

static PyObject *
count16(PyObject *self, PyObject *args)
{
    Py_buffer view, out;
    if (!PyArg_ParseTuple(args, "y*w*:count16", &view, &out))
        return NULL;
    if (view.len % 2 || out.len != 65536 * 8) {
        PyErr_SetString(PyExc_ValueError,
                        "count16 takes whole 16-bit elements and an int64[65536] buffer");
        PyBuffer_Release(&view);
        PyBuffer_Release(&out);
        return NULL;
    }
    const uint16_t *x = (const uint16_t *)view.buf;
    int64_t *counts = (int64_t *)out.buf;
    const Py_ssize_t n = view.len / 2;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        counts[x[i]]++;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyObject *
compare(PyObject *self, PyObject *args)
{
    Py_buffer va, vb;
    int kind;
    double atol, rtol;
    Py_ssize_t n, nb_;
    if (!PyArg_ParseTuple(args, "y*y*Cdd:compare", &va, &vb, &kind, &atol, &rtol))
        return NULL;
    if (elements(&va, kind, &n) < 0 || elements(&vb, kind, &nb_) < 0 || n != nb_) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a and b hold different numbers of elements");
        PyBuffer_Release(&va);
        PyBuffer_Release(&vb);
        return NULL;
    }
    long long n_diff = 0, nan_a = 0, nan_b = 0;
    double max_abs = 0.0, sa = 0.0, sb = 0.0, sd = 0.0, dot = 0.0;
    int within = 1;
    const void *pa = va.buf, *pb = vb.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        double a = AT(pa, kind, i), b = AT(pb, kind, i);
        int na = isnan(a), nb = isnan(b);
        int equal = a == b || (na && nb);
        n_diff += !equal;
        nan_a += na;
        nan_b += nb;
        if (na || nb) {
            within &= equal;
            continue;
        }
        double delta = equal ? 0.0 : a - b;  /* equal infinities differ by 0 */
        double mag = fabs(delta);
        max_abs = mag > max_abs ? mag : max_abs;
        sa += a * a;
        sb += b * b;
        sd += delta * delta;
        dot += a * b;
        if (!equal && !(isfinite(a) && isfinite(b) && fabs(a - b) <= atol + rtol * fabs(b)))
            within = 0;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&va);
    PyBuffer_Release(&vb);
    return Py_BuildValue("LLLdddddO", n_diff, nan_a, nan_b, max_abs, sa, sb, sd, dot,
                         within ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"moments", moments, METH_VARARGS, "Counts, finite range and sum of x."},
    {"spread", spread, METH_VARARGS, "Squares around the mean and the histogram of x."},
    {"count16", count16, METH_VARARGS, "Counts of each 16-bit pattern of x."},
    {"compare", compare, METH_VARARGS, "Differences between a and b, element by element."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "ckptlab.compare._ckernels",
    "The loops of ckptlab.compare._kernels, compiled.", -1, methods,
};

PyMODINIT_FUNC
PyInit__ckernels(void)
{
    return PyModule_Create(&module_def);
}
