/* The UDP MAC of docs/wire.md ("UDP MAC"), for whole runs of equal-size datagrams in
 * one call: the receive path verifies a GRO run, the sender signs a GSO batch.
 *
 *   NH_j(P) = sum_i ((m_2i + k_{2i+4j}) mod 2^32) * ((m_2i+1 + k_{2i+1+4j}) mod 2^32)
 *             mod 2^64, j = 0..3   (m: P's little-endian 32-bit words, P zero-padded
 *             to a multiple of 8 bytes; k: the NH key's little-endian 32-bit words)
 *   tag     = SipHash-2-4-128(k_prf, header[0:34] || LE64(NH_0) || ... || LE64(NH_3))
 *
 * NH with four Toeplitz-shifted keys is the hash of UMAC (Black, Halevi, Krawczyk,
 * Krovetz, Rogaway, CRYPTO '99; RFC 4418). SipHash-2-4 with a 128-bit output is the
 * reference algorithm (Aumasson and Bernstein, github.com/veorq/SipHash, siphash.c with
 * outlen 16); this file is an independent implementation checked against its
 * published vectors and against transport/udpmac.py (tests/test_udpmac.py).
 *
 * Python API (buffers are any C-contiguous bytes-like objects):
 *   sign(keys, rows, n, stride)          writes the tag of each row in place
 *   verify(keys, rows, stride, idx, out) out[j] = 1 if row idx[j] verifies, else 0
 *                                        (idx: int64 array, or None: every row)
 *   verify_one(keys, datagram) -> bool   one datagram (of any size >= 50)
 *   siphash128(key16, data) -> bytes     SipHash-2-4-128, for the tests
 * keys: k_prf (16 bytes) || the NH key (at least the padded payload + 48 bytes). Each
 * row is stride bytes: a 34-byte header, stride - 50 payload bytes, a 16-byte tag.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define HEADER 34
#define TAG 16
#define NH_SHIFT 48   /* the fourth pass reads the NH key 48 bytes further */

static inline Py_ssize_t pad8(Py_ssize_t n) { return (n + 7) & ~(Py_ssize_t)7; }

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

static inline uint32_t le32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

#define NH_STEP(m0, m1, q)                                                          \
    do {                                                                            \
        s0 += (uint64_t)(uint32_t)(m0 + le32(q)) * (uint32_t)(m1 + le32(q + 4));    \
        s1 += (uint64_t)(uint32_t)(m0 + le32(q + 16)) * (uint32_t)(m1 + le32(q + 20)); \
        s2 += (uint64_t)(uint32_t)(m0 + le32(q + 32)) * (uint32_t)(m1 + le32(q + 36)); \
        s3 += (uint64_t)(uint32_t)(m0 + le32(q + 48)) * (uint32_t)(m1 + le32(q + 52)); \
    } while (0)

/* NH_0..NH_3 of one payload of len bytes (zero-padded to a multiple of 8 bytes) under
 * the NH key k (>= pad8(len) + 48 bytes): the four passes in one loop. */
static void nh4(const uint8_t *pl, size_t len, const uint8_t *k, uint64_t *out) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t full = len & ~(size_t)7, i;
    for (i = 0; i < full; i += 8) {
        uint32_t m0 = le32(pl + i), m1 = le32(pl + i + 4);
        NH_STEP(m0, m1, k + i);
    }
    if (len > full) {   /* the last 1..7 bytes, zero-padded to 8 */
        uint8_t last[8] = {0};
        memcpy(last, pl + full, len - full);
        uint32_t m0 = le32(last), m1 = le32(last + 4);
        NH_STEP(m0, m1, k + full);
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

static void tag_of(const uint8_t *keys, const uint8_t *row, size_t stride, uint8_t *out) {
    uint8_t msg[HEADER + 32];
    uint64_t h[4];
    nh4(row + HEADER, stride - HEADER - TAG, keys + 16, h);
    memcpy(msg, row, HEADER);
    for (int j = 0; j < 4; j++)
        put_le64(msg + HEADER + 8 * j, h[j]);
    siphash128(keys, msg, sizeof msg, out);
}

/* 1 if the row's last 16 bytes are its tag; every byte is compared (no early exit) */
static int verify_row(const uint8_t *keys, const uint8_t *row, size_t stride) {
    uint8_t t[TAG], d = 0;
    tag_of(keys, row, stride, t);
    for (int j = 0; j < TAG; j++)
        d |= t[j] ^ row[stride - TAG + j];
    return d == 0;
}

static int check_rows(Py_buffer *keys, Py_buffer *rows, Py_ssize_t n, Py_ssize_t stride) {
    if (stride < HEADER + TAG || n < 0 || (n && rows->len / n < stride)
            || rows->len < n * stride) {
        PyErr_SetString(PyExc_ValueError, "rows shorter than n * stride, or stride < 50");
        return -1;
    }
    if (keys->len < 16 + pad8(stride - HEADER - TAG) + NH_SHIFT) {
        PyErr_SetString(PyExc_ValueError, "keys shorter than 16 + the padded payload + 48");
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
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++) {
            uint8_t *row = base + i * stride;
            tag_of(keys.buf, row, (size_t)stride, row + stride - TAG);
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&rows);
    if (PyErr_Occurred())
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *py_verify(PyObject *self, PyObject *args) {
    Py_buffer keys, rows, idx = {0}, out;
    Py_ssize_t stride;
    PyObject *idx_obj;
    if (!PyArg_ParseTuple(args, "y*y*nOw*", &keys, &rows, &stride, &idx_obj, &out))
        return NULL;
    int all = idx_obj == Py_None;
    if (!all && PyObject_GetBuffer(idx_obj, &idx, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&keys);
        PyBuffer_Release(&rows);
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t n = stride > 0 ? rows.len / stride : 0;
    Py_ssize_t m = all ? n : idx.len / (Py_ssize_t)sizeof(int64_t);
    if (check_rows(&keys, &rows, n, stride) == 0) {
        const int64_t *at = all ? NULL : idx.buf;
        int bad = out.len < m;
        for (Py_ssize_t i = 0; at && i < m && !bad; i++)
            bad = at[i] < 0 || at[i] >= n;
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "an index outside the rows, or out too short");
        } else {
            const uint8_t *base = rows.buf;
            uint8_t *ok = out.buf;
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < m; i++)
                ok[i] = (uint8_t)verify_row(keys.buf, base + (at ? at[i] : i) * stride,
                                            (size_t)stride);
            Py_END_ALLOW_THREADS
        }
    }
    PyBuffer_Release(&keys);
    PyBuffer_Release(&rows);
    if (!all)
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
    if (row.len >= HEADER + TAG && check_rows(&keys, &row, 1, row.len) == 0)
        ok = verify_row(keys.buf, row.buf, (size_t)row.len);
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
    {"verify", py_verify, METH_VARARGS,
     "verify(keys, rows, stride, idx, out): out[j] = 1 if row idx[j] verifies "
     "(idx: int64 in native order, or None for every row)"},
    {"verify_one", py_verify_one, METH_VARARGS,
     "verify_one(keys, datagram) -> bool: does the datagram's tag verify"},
    {"siphash128", py_siphash128, METH_VARARGS, "SipHash-2-4-128(key16, data) -> 16 bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_udpmac",
                                    "The UDP MAC of docs/wire.md, over runs of datagrams.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__udpmac(void) { return PyModule_Create(&module); }
