/* The UDP MAC of docs/wire.md ("UDP MAC"), for whole runs of equal-size datagrams in
 * one call: the receive path verifies a GRO run, the sender signs a GSO batch.
 *
 *   H_r(P) = sum_{i=1..n} c_i * r^(n+1-i)  mod p,  p = 2^61 - 1
 *            (c_i: the payload's 7-byte little-endian chunks, the last zero-padded)
 *   tag    = SipHash-2-4-128(k, header[0:34] || LE64(H_r1(P)) || LE64(H_r2(P)))
 *
 * SipHash-2-4 with a 128-bit output is the reference algorithm (Aumasson and
 * Bernstein, github.com/veorq/SipHash, siphash.c with outlen 16); this file is an
 * independent implementation checked against its published vectors (tests).
 *
 * Python API (buffers are any C-contiguous bytes-like objects):
 *   sign(keys, rows, n, stride)          writes the tag of each row in place
 *   verify_at(keys, rows, stride, idx, out)  out[j] = 1 if row idx[j] (int64)
 *                                        verifies, else 0
 *   verify_one(keys, datagram) -> bool  one datagram (of any size >= 50)
 *   siphash128(key16, data) -> bytes     SipHash-2-4-128, for the tests
 * keys: 32 bytes, k (16) || LE64(r1) || LE64(r2), r1 and r2 in [1, p-1]. Each row is
 * stride bytes: a 34-byte header, stride - 50 payload bytes, a 16-byte tag.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER 34
#define TAG 16
#define P61 ((uint64_t)0x1FFFFFFFFFFFFFFFULL)

static inline uint64_t le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline void put_le64(uint8_t *p, uint64_t v) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                        \
    do {                                                                \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);       \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                          \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                          \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);       \
    } while (0)

/* SipHash-2-4 with a 16-byte output, as the reference siphash() with outlen 16. */
static void siphash128(const uint8_t *key, const uint8_t *in, size_t len, uint8_t *out) {
    uint64_t k0 = le64(key), k1 = le64(key + 8);
    uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
    uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
    const uint8_t *end = in + len - (len % 8);
    uint64_t b = ((uint64_t)len) << 56, m;
    v1 ^= 0xee;
    for (; in != end; in += 8) {
        m = le64(in);
        v3 ^= m; SIPROUND; SIPROUND; v0 ^= m;
    }
    for (size_t i = 0; i < (len & 7); i++)
        b |= ((uint64_t)in[i]) << (8 * i);
    v3 ^= b; SIPROUND; SIPROUND; v0 ^= b;
    v2 ^= 0xee;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    put_le64(out, v0 ^ v1 ^ v2 ^ v3);
    v1 ^= 0xdd;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    put_le64(out + 8, v0 ^ v1 ^ v2 ^ v3);
}

/* x mod p for x < 2^124, partially: the result is < 2^61 + 8 */
static inline uint64_t fold(unsigned __int128 x) {
    uint64_t lo = (uint64_t)x & P61;
    uint64_t hi = (uint64_t)(x >> 61);   /* < 2^63 */
    uint64_t s = lo + (hi & P61) + (hi >> 61);
    return (s & P61) + (s >> 61);
}

static inline uint64_t reduce(uint64_t x) {   /* x < 2^62 -> [0, p) */
    x = (x & P61) + (x >> 61);
    return x >= P61 ? x - P61 : x;
}

static inline uint64_t chunk7(const uint8_t *p) {   /* 7 bytes LE, 8 readable */
    return le64(p) & 0x00FFFFFFFFFFFFFFULL;
}

static inline uint64_t mulmod(uint64_t a, uint64_t b) {   /* a < 2^62, b < 2^61 */
    return reduce(fold((unsigned __int128)a * b));
}

/* H_r1 and H_r2 of one payload of len bytes by Horner's rule, both points in one pass
 * (two independent chains), eight chunks a step:
 * h <- (h + c1) r^8 + c2 r^7 + ... + c8 r (one dependent product a step; the sum is
 * < 2^124), then the chunks left one at a time: h <- (h + c) r. a, b: r^1 .. r^8 mod p
 * of the two points. */
static void poly2(const uint8_t *pl, size_t len, const uint64_t *a, const uint64_t *b,
                  uint64_t *h1_out, uint64_t *h2_out) {
    uint64_t h1 = 0, h2 = 0, c;
    size_t n = (len + 6) / 7, i = 0;
    /* 8-byte loads of 7-byte chunks while 8 bytes are readable in the payload */
    size_t safe = len >= 8 ? (len - 8) / 7 + 1 : 0;
    for (; i + 8 <= safe; i += 8) {
        const uint8_t *q = pl + 7 * i;
        uint64_t c[8];
        for (int j = 0; j < 8; j++)
            c[j] = chunk7(q + 7 * j);
        unsigned __int128 x1 = (unsigned __int128)(h1 + c[0]) * a[7];
        unsigned __int128 x2 = (unsigned __int128)(h2 + c[0]) * b[7];
        for (int j = 1; j < 8; j++) {
            x1 += (unsigned __int128)c[j] * a[7 - j];
            x2 += (unsigned __int128)c[j] * b[7 - j];
        }
        h1 = fold(x1);
        h2 = fold(x2);
    }
    for (; i < n; i++) {   /* the rest, the last one zero-padded */
        size_t k = len - 7 * i < 7 ? len - 7 * i : 7;
        c = 0;
        for (size_t j = 0; j < k; j++)
            c |= ((uint64_t)pl[7 * i + j]) << (8 * j);
        h1 = fold((unsigned __int128)(h1 + c) * a[0]);
        h2 = fold((unsigned __int128)(h2 + c) * b[0]);
    }
    *h1_out = reduce(h1);
    *h2_out = reduce(h2);
}

static void powers(uint64_t r, uint64_t *rp) {   /* rp[j] = r^(j+1) mod p, j < 8 */
    rp[0] = r;
    for (int j = 1; j < 8; j++)
        rp[j] = mulmod(rp[j - 1], r);
}

static void tag_of(const uint8_t *keys, const uint64_t *rp1, const uint64_t *rp2,
                   const uint8_t *row, size_t stride, uint8_t *out) {
    uint8_t msg[HEADER + 16];
    uint64_t h1, h2;
    poly2(row + HEADER, stride - HEADER - TAG, rp1, rp2, &h1, &h2);
    memcpy(msg, row, HEADER);
    put_le64(msg + HEADER, h1);
    put_le64(msg + HEADER + 8, h2);
    siphash128(keys, msg, sizeof msg, out);
}

/* 1 if the row's last 16 bytes are its tag; every byte is compared (no early exit) */
static int verify_row(const uint8_t *keys, const uint64_t *rp1, const uint64_t *rp2,
                      const uint8_t *row, size_t stride) {
    uint8_t t[TAG], d = 0;
    tag_of(keys, rp1, rp2, row, stride, t);
    for (int j = 0; j < TAG; j++)
        d |= t[j] ^ row[stride - TAG + j];
    return d == 0;
}

static void key_powers(const uint8_t *keys, uint64_t *rp1, uint64_t *rp2) {
    powers(le64(keys + 16), rp1);
    powers(le64(keys + 24), rp2);
}

static int check_rows(Py_buffer *keys, Py_buffer *rows, Py_ssize_t n, Py_ssize_t stride) {
    if (keys->len != 32) {
        PyErr_SetString(PyExc_ValueError, "keys must be 32 bytes");
        return -1;
    }
    if (stride < HEADER + TAG || n < 0 || (n && rows->len / n < stride)
            || rows->len < n * stride) {
        PyErr_SetString(PyExc_ValueError, "rows shorter than n * stride, or stride < 50");
        return -1;
    }
    return 0;
}

static PyObject *py_sign(PyObject *self, PyObject *args) {
    Py_buffer keys, rows;
    Py_ssize_t n, stride;
    if (!PyArg_ParseTuple(args, "y*w*nn", &keys, &rows, &n, &stride))
        return NULL;
    if (check_rows(&keys, &rows, n, stride) == 0) {
        uint8_t *base = rows.buf;
        uint64_t rp1[8], rp2[8];
        key_powers(keys.buf, rp1, rp2);
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t *row = base + i * stride;
            tag_of(keys.buf, rp1, rp2, row, (size_t)stride, row + stride - TAG);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&rows);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_verify_at(PyObject *self, PyObject *args) {
    Py_buffer keys, rows, idx, out;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "y*y*ny*w*", &keys, &rows, &stride, &idx, &out))
        return NULL;
    Py_ssize_t m = idx.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t n = stride > 0 ? rows.len / stride : 0;
    if (check_rows(&keys, &rows, n, stride) == 0) {
        const int64_t *at = idx.buf;
        int bad = out.len < m;
        for (Py_ssize_t i = 0; i < m && !bad; i++)
            bad = at[i] < 0 || at[i] >= n;
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "an index outside the rows, or out too short");
        } else {
            const uint8_t *base = rows.buf;
            uint8_t *ok = out.buf;
            uint64_t rp1[8], rp2[8];
            key_powers(keys.buf, rp1, rp2);
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < m; i++)
                ok[i] = (uint8_t)verify_row(keys.buf, rp1, rp2, base + at[i] * stride,
                                            (size_t)stride);
            Py_END_ALLOW_THREADS
        }
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&out);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_verify_one(PyObject *self, PyObject *args) {
    Py_buffer keys, row;
    int ok = 0;
    if (!PyArg_ParseTuple(args, "y*y*", &keys, &row))
        return NULL;
    if (keys.len != 32) {
        PyErr_SetString(PyExc_ValueError, "keys must be 32 bytes");
    } else if (row.len >= HEADER + TAG) {
        uint64_t rp1[8], rp2[8];
        key_powers(keys.buf, rp1, rp2);
        ok = verify_row(keys.buf, rp1, rp2, row.buf, (size_t)row.len);
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&row);
    if (PyErr_Occurred())
        return NULL;
    return PyBool_FromLong(ok);
}

static PyObject *py_siphash128(PyObject *self, PyObject *args) {
    Py_buffer key, data;
    uint8_t out[16];
    if (!PyArg_ParseTuple(args, "y*y*", &key, &data))
        return NULL;
    if (key.len != 16) {
        PyBuffer_Release(&key);
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "key must be 16 bytes");
        return NULL;
    }
    siphash128(key.buf, data.buf, (size_t)data.len, out);
    PyBuffer_Release(&key);
    PyBuffer_Release(&data);
    return PyBytes_FromStringAndSize((const char *)out, 16);
}

static PyMethodDef methods[] = {
    {"sign", py_sign, METH_VARARGS, "sign(keys, rows, n, stride): write each row's tag"},
    {"verify_at", py_verify_at, METH_VARARGS,
     "verify_at(keys, rows, stride, idx, out): out[j] = 1 if row idx[j] verifies "
     "(idx: int64, native order)"},
    {"verify_one", py_verify_one, METH_VARARGS,
     "verify_one(keys, datagram) -> bool: does the datagram's tag verify"},
    {"siphash128", py_siphash128, METH_VARARGS, "SipHash-2-4-128(key16, data) -> 16 bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_udpmac",
                                    "The UDP MAC of docs/wire.md, over runs of datagrams.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__udpmac(void) { return PyModule_Create(&module); }
