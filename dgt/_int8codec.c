/* The int8 block codec of docs/wire.md ("Block codings") in one pass per block, for
 * dgt.codec: the same bits as its torch path, fewer passes over memory.
 *
 *   a = max |x|            (NaN if any x is NaN)
 *   s = a / 127            (f32 division, sent as the block's scale)
 *   r = min(127 / a, FLT_MAX)
 *   q = round_half_even(x * r)     (f32 multiply, in -127..127)
 *   decode: x' = (float) q * s     (one f32 multiply)
 *
 * Each step is one IEEE single-precision operation, as torch's kernels do them, so a
 * block codes and decodes to the same bits on either path (tests/test_int8codec.py
 * compares them). Built without -ffast-math and with -ffp-contract=off: no fused
 * multiply-add, no reassociation. A block whose a is not finite gets q = 0 (the wire
 * leaves its q unspecified: its scale is not finite, so it decodes non-finite).
 *
 * Python API (buffers: anything with the buffer protocol, e.g. numpy arrays; 2-D,
 * rows may be strided, elements contiguous):
 *   encode(blocks, out, decoded, error)
 *                                 blocks (m, E) float32; out (m, 4 + E) uint8, written;
 *                                 decoded (m, E) float32 or None: x' of every block;
 *                                 error (m, E) float32 or None: x - x'. Either may be
 *                                 blocks itself, not both one array
 *   decode(rows, out)             rows (m, 4 + E) uint8; out (m, E) float32, written
 * Both raise ValueError on shapes or formats that do not fit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LEVELS 127.0f
#define ROUNDER 12582912.0f   /* 1.5 * 2^23 */

typedef struct {
    Py_buffer view;
    int held;
} buf2d;

static void release(buf2d *b) {
    if (b->held) {
        PyBuffer_Release(&b->view);
        b->held = 0;
    }
}

/* A 2-D buffer of `itemsize`-byte items whose rows may be strided but whose items are
 * contiguous; `writable` asks for a writable one. */
static int get2d(PyObject *obj, buf2d *b, Py_ssize_t itemsize, int writable,
                 const char *name) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) < 0)
        return -1;
    b->held = 1;
    if (b->view.ndim != 2 || b->view.itemsize != itemsize ||
        b->view.strides[1] != itemsize) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be 2-D with contiguous %zd-byte items", name, itemsize);
        release(b);
        return -1;
    }
    return 0;
}

#if defined(__SSE2__)
#include <emmintrin.h>
#define LANES 16   /* values per SSE2 step of the encoder */
#else
#define LANES 0
#endif

/* max |x| of a block, NaN if any x is NaN (what torch.amax of |x| gives). */
static inline float row_absmax(const float *x, Py_ssize_t e) {
    float a = 0.0f;
    int nan = 0;
    Py_ssize_t j = 0;
#if LANES
    const __m128 mag = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128 m0 = _mm_setzero_ps(), m1 = m0, un = m0;
    for (; j + 8 <= e; j += 8) {
        __m128 v0 = _mm_and_ps(_mm_loadu_ps(x + j), mag);
        __m128 v1 = _mm_and_ps(_mm_loadu_ps(x + j + 4), mag);
        un = _mm_or_ps(un, _mm_or_ps(_mm_cmpunord_ps(v0, v0), _mm_cmpunord_ps(v1, v1)));
        m0 = _mm_max_ps(m0, v0);   /* NaN lanes are caught by un */
        m1 = _mm_max_ps(m1, v1);
    }
    float lanes[4];
    _mm_storeu_ps(lanes, _mm_max_ps(m0, m1));
    for (int k = 0; k < 4; k++)
        a = lanes[k] > a ? lanes[k] : a;
    nan = _mm_movemask_ps(un) != 0;
#endif
    for (; j < e; j++) {
        float v = fabsf(x[j]);
        nan |= v != v;
        a = v > a ? v : a;
    }
    return nan ? NAN : a;
}

/* One block: q (its payload after the scale), and where asked its decoded values
 * (dec) and its coding error x - dec (err). dec or err may be x itself (each value is
 * read before it is written), not each other. */
static inline void encode_row(const float *x, int8_t *q, float *dec, float *err,
                              Py_ssize_t e, float *scale) {
    float a = row_absmax(x, e);
    float s = a / LEVELS;
    *scale = s;
    if (!isfinite(a)) {   /* unspecified q on the wire: 0; decodes non-finite */
        for (Py_ssize_t j = 0; j < e; j++) {
            float xj = x[j], d = 0.0f * s;
            q[j] = 0;
            if (err) err[j] = xj - d;
            if (dec) dec[j] = d;
        }
        return;
    }
    float r = LEVELS / a;   /* a = 0: +inf, clamped */
    if (r > FLT_MAX) r = FLT_MAX;
    Py_ssize_t j = 0;
#if LANES
    /* the same IEEE steps as the scalar loop below, four values an instruction */
    const __m128 vr = _mm_set1_ps(r), vs = _mm_set1_ps(s), rnd = _mm_set1_ps(ROUNDER);
    for (; j + LANES <= e; j += LANES) {
        __m128 xv[4];
        __m128i qi[4];
        for (int k = 0; k < 4; k++) {
            xv[k] = _mm_loadu_ps(x + j + 4 * k);
            __m128 y = _mm_sub_ps(_mm_add_ps(_mm_mul_ps(xv[k], vr), rnd), rnd);
            qi[k] = _mm_cvttps_epi32(y);   /* y is integral: exact */
        }
        __m128i q16a = _mm_packs_epi32(qi[0], qi[1]), q16b = _mm_packs_epi32(qi[2], qi[3]);
        _mm_storeu_si128((__m128i *) (q + j), _mm_packs_epi16(q16a, q16b));
        for (int k = 0; k < 4; k++) {
            __m128 d = _mm_mul_ps(_mm_cvtepi32_ps(qi[k]), vs);
            if (err) _mm_storeu_ps(err + j + 4 * k, _mm_sub_ps(xv[k], d));
            if (dec) _mm_storeu_ps(dec + j + 4 * k, d);
        }
    }
#endif
    for (; j < e; j++) {
        /* |x r| <= 127 (+ one rounding): adding and taking away 1.5 * 2^23 rounds it
         * to an integer, half to even, in the default rounding mode */
        float xj = x[j];
        float y = (xj * r + ROUNDER) - ROUNDER;
        int8_t v = (int8_t) y;
        float d = (float) v * s;
        q[j] = v;
        if (err) err[j] = xj - d;
        if (dec) dec[j] = d;
    }
}

static float *row_of(buf2d *b, Py_ssize_t i) {
    return b->held ? (float *) ((char *) b->view.buf + i * b->view.strides[0]) : NULL;
}

static PyObject *py_encode(PyObject *self, PyObject *args) {
    PyObject *bo, *oo, *dobj, *eobj;
    if (!PyArg_ParseTuple(args, "OOOO", &bo, &oo, &dobj, &eobj))
        return NULL;
    buf2d bl = {0}, out = {0}, dec = {0}, err = {0};
    if (get2d(bo, &bl, 4, 0, "blocks") < 0 || get2d(oo, &out, 1, 1, "out") < 0)
        goto fail;
    if (dobj != Py_None && get2d(dobj, &dec, 4, 1, "decoded") < 0)
        goto fail;
    if (eobj != Py_None && get2d(eobj, &err, 4, 1, "error") < 0)
        goto fail;
    Py_ssize_t m = bl.view.shape[0], e = bl.view.shape[1];
    if (out.view.shape[0] != m || out.view.shape[1] != 4 + e ||
        (dec.held && (dec.view.shape[0] != m || dec.view.shape[1] != e)) ||
        (err.held && (err.view.shape[0] != m || err.view.shape[1] != e))) {
        PyErr_SetString(PyExc_ValueError,
                        "encode: out must be (m, 4 + E), decoded and error (m, E)");
        goto fail;
    }
    if (dec.held && err.held && dec.view.buf == err.view.buf) {
        PyErr_SetString(PyExc_ValueError, "encode: decoded and error must not be one array");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m; i++) {
        const float *x = (const float *) ((const char *) bl.view.buf + i * bl.view.strides[0]);
        uint8_t *row = (uint8_t *) out.view.buf + i * out.view.strides[0];
        float s;
        encode_row(x, (int8_t *) (row + 4), row_of(&dec, i), row_of(&err, i), e, &s);
        memcpy(row, &s, 4);   /* little-endian hosts only (setup.py builds it there) */
    }
    Py_END_ALLOW_THREADS
    release(&bl); release(&out); release(&dec); release(&err);
    Py_RETURN_NONE;
fail:
    release(&bl); release(&out); release(&dec); release(&err);
    return NULL;
}

static PyObject *py_decode(PyObject *self, PyObject *args) {
    PyObject *ro, *oo;
    if (!PyArg_ParseTuple(args, "OO", &ro, &oo))
        return NULL;
    buf2d rows = {0}, out = {0};
    if (get2d(ro, &rows, 1, 0, "rows") < 0 || get2d(oo, &out, 4, 1, "out") < 0)
        goto fail;
    Py_ssize_t m = out.view.shape[0], e = out.view.shape[1];
    if (rows.view.shape[0] != m || rows.view.shape[1] != 4 + e) {
        PyErr_SetString(PyExc_ValueError, "decode: rows must be (m, 4 + E) for out (m, E)");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m; i++) {
        const uint8_t *row = (const uint8_t *) rows.view.buf + i * rows.view.strides[0];
        const int8_t *q = (const int8_t *) (row + 4);
        float *d = (float *) ((char *) out.view.buf + i * out.view.strides[0]);
        float s;
        memcpy(&s, row, 4);
        for (Py_ssize_t j = 0; j < e; j++)
            d[j] = (float) q[j] * s;
    }
    Py_END_ALLOW_THREADS
    release(&rows); release(&out);
    Py_RETURN_NONE;
fail:
    release(&rows); release(&out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"encode", py_encode, METH_VARARGS,
     "encode(blocks, out, decoded, error): int8 payloads"},
    {"decode", py_decode, METH_VARARGS, "decode(rows, out): int8 payloads to float32"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8codec",
                                    "int8 block codec, one pass per block", -1, methods};

PyMODINIT_FUNC PyInit__int8codec(void) { return PyModule_Create(&module); }
