/*
 * Quantized matmul kernels for the fast backend, AVX2 + FMA, float32 activations.
 *
 * out[t, r] = W[r] . x[t] for W in Q4_0, Q4_1 or Q8_0 blocks of 32 weights, read
 * straight from the GGUF's bytes (f16 scales included: as few bytes as the file). Every (r, t) pair runs the same sequence of
 * vector instructions whatever the batch size T or the thread split (no
 * -ffast-math; explicit intrinsics), so results are bit-identical alone or batched.
 * Rows of the batch are processed four at a time so each unpacked weight block is
 * reused from registers; a tail row runs the very same per-row operations.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define QK 32

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* 32 weights of a 4-bit block as four vectors of 8 floats, already times d. */
static inline void unpack_q4(const uint8_t *q, float d, __m256 w[4]) {
    __m128i bytes = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    __m256 vd = _mm256_set1_ps(d);
    w[0] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)));
    w[1] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))));
    w[2] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    w[3] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
}

static inline void unpack_q8(const int8_t *q, float d, __m256 w[4]) {
    __m256 vd = _mm256_set1_ps(d);
    for (int k = 0; k < 4; k++) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(q + 8 * k));
        w[k] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    }
}

/* acc += w . x over one block, four lanes of 8 (the same ops for every row). */
static inline __m256 block_fma(const __m256 w[4], const float *x, __m256 acc) {
    acc = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(x), acc);
    acc = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x + 8), acc);
    acc = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x + 16), acc);
    acc = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x + 24), acc);
    return acc;
}

/* The GGUF block types read here, straight from the file's bytes. */
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
static const Py_ssize_t BLOCK_BYTES[3] = {18, 20, 34};

typedef struct {
    const uint8_t *raw; /* rows * nb blocks as stored in the GGUF */
    const float *x;     /* T * cols */
    const float *sx;    /* T * nb block sums of x (Q4_1) */
    float *out;         /* T * rows */
    Py_ssize_t rows, nb, T;
    int type;
} job_t;

static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/*
 * Every (row, token) pair has one 8-lane accumulator that takes one FMA per 8
 * weights, blocks in order, then the fixed horizontal sum ``hsum256``; Q4 rows add
 * their block offsets ``sum_b m_b * sx_b`` (an FMA chain over the blocks, in order).
 * Everything below only chooses how many pairs run side by side, to hide FMA latency
 * and reuse unpacked weights, and never that order: results do not depend on the
 * batch size, a row's place in it or the thread split.
 */

#define ROW_GROUP 8   /* rows one task covers */
#define TILE_TOKENS 6 /* tokens per register tile of unpacked rows */

static inline __attribute__((always_inline)) void unpack_block(const int type,
                                                               const uint8_t *blk, __m256 w[4]) {
    if (type == Q8_0)
        unpack_q8((const int8_t *)(blk + 2), f16(blk), w);
    else
        unpack_q4(blk + (type == Q4_1 ? 4 : 2), f16(blk), w);
}

/* out[t, r0 + i] = the block offsets of rows r0 .. r0 + n (n <= ROW_GROUP), all tokens:
 * eight rows per vector, so each lane runs the scalar chain of its own row. */
static void group_offsets(const job_t *j, Py_ssize_t r0, int n) {
    const Py_ssize_t nb = j->nb, bb = BLOCK_BYTES[j->type];
    float m[nb][ROW_GROUP] __attribute__((aligned(32)));
    for (Py_ssize_t b = 0; b < nb; b++)
        for (int i = 0; i < ROW_GROUP; i++) {
            const uint8_t *blk = j->raw + ((r0 + (i < n ? i : 0)) * nb + b) * bb;
            m[b][i] = j->type == Q4_1 ? f16(blk + 2) : -8.0f * f16(blk);
        }
    for (Py_ssize_t t = 0; t < j->T; t++) {
        const float *sx = j->sx + t * nb;
        __m256 acc = _mm256_setzero_ps();
        for (Py_ssize_t b = 0; b < nb; b++)
            acc = _mm256_fmadd_ps(_mm256_load_ps(m[b]), _mm256_set1_ps(sx[b]), acc);
        float lanes[ROW_GROUP];
        _mm256_storeu_ps(lanes, acc);
        memcpy(j->out + t * j->rows + r0, lanes, n * sizeof(float));
    }
}

/* Adds the finished sum of (row r, token t) to what ``group_offsets`` left there. */
static inline void finish(const job_t *j, Py_ssize_t r, Py_ssize_t t, __m256 acc) {
    float *o = j->out + t * j->rows + r;
    *o = hsum256(acc) + (j->type == Q8_0 ? 0.0f : *o);
}

/* RG rows x TT tokens (TT <= 3) with each block unpacked in registers: small batches. */
static inline __attribute__((always_inline)) void tile_direct(const job_t *j, const int type,
                                                              Py_ssize_t r0, const int RG,
                                                              Py_ssize_t t0, const int TT) {
    const Py_ssize_t nb = j->nb, cols = nb * QK, bb = BLOCK_BYTES[type];
    const uint8_t *base = j->raw + r0 * nb * bb;
    const float *x = j->x + t0 * cols;
    __m256 acc[ROW_GROUP][3];
    for (int i = 0; i < RG; i++)
        for (int t = 0; t < TT; t++) acc[i][t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < nb; b++)
        for (int i = 0; i < RG; i++) {
            __m256 w[4];
            _mm_prefetch((const char *)(base + (i * nb + b) * bb + 512), _MM_HINT_T0);
            unpack_block(type, base + (i * nb + b) * bb, w);
            for (int t = 0; t < TT; t++) acc[i][t] = block_fma(w, x + t * cols + b * QK, acc[i][t]);
        }
    for (int i = 0; i < RG; i++)
        for (int t = 0; t < TT; t++) finish(j, r0 + i, t0 + t, acc[i][t]);
}

static inline __attribute__((always_inline)) void rows_direct_typed(const job_t *j,
                                                                    const int type,
                                                                    Py_ssize_t r0, int n) {
    int i = 0;
    for (Py_ssize_t t = 0; t < j->T; t += 3) {
        const int tt = (int)(j->T - t < 3 ? j->T - t : 3);
        for (i = 0; i + 2 <= n; i += 2) {
            if (tt == 1) tile_direct(j, type, r0 + i, 2, t, 1);
            else if (tt == 2) tile_direct(j, type, r0 + i, 2, t, 2);
            else tile_direct(j, type, r0 + i, 2, t, 3);
        }
        for (; i < n; i++) {
            if (tt == 1) tile_direct(j, type, r0 + i, 1, t, 1);
            else if (tt == 2) tile_direct(j, type, r0 + i, 1, t, 2);
            else tile_direct(j, type, r0 + i, 1, t, 3);
        }
    }
}

static void rows_direct(const job_t *j, Py_ssize_t r0, int n) {
    switch (j->type) {
    case Q4_0: rows_direct_typed(j, Q4_0, r0, n); break;
    case Q4_1: rows_direct_typed(j, Q4_1, r0, n); break;
    default: rows_direct_typed(j, Q8_0, r0, n); break;
    }
}

/* One row's weights as float32 (each d * q is exact), reused across many tokens. */
static inline __attribute__((always_inline)) void unpack_row_typed(const int type,
                                                                   const uint8_t *row,
                                                                   Py_ssize_t nb, float *w) {
    const Py_ssize_t bb = BLOCK_BYTES[type];
    for (Py_ssize_t b = 0; b < nb; b++) {
        __m256 v[4];
        unpack_block(type, row + b * bb, v);
        for (int k = 0; k < 4; k++) _mm256_store_ps(w + b * QK + 8 * k, v[k]);
    }
}

static void unpack_row(int type, const uint8_t *row, Py_ssize_t nb, float *w) {
    switch (type) {
    case Q4_0: unpack_row_typed(Q4_0, row, nb, w); break;
    case Q4_1: unpack_row_typed(Q4_1, row, nb, w); break;
    default: unpack_row_typed(Q8_0, row, nb, w); break;
    }
}

/* Two unpacked rows (w0, w1) x TT tokens, 2 * TT accumulators in registers. A missing
 * second row is fed the first again and its sums dropped. */
static inline __attribute__((always_inline)) void tile_unpacked(const job_t *j, const float *w0,
                                                                const float *w1, Py_ssize_t r0,
                                                                int nr, Py_ssize_t t0,
                                                                const int TT) {
    const Py_ssize_t cols = j->nb * QK;
    const float *x = j->x + t0 * cols;
    __m256 a[TILE_TOKENS], b[TILE_TOKENS];
    for (int t = 0; t < TT; t++) a[t] = b[t] = _mm256_setzero_ps();
    for (Py_ssize_t c = 0; c < cols; c += 8) {
        const __m256 u = _mm256_load_ps(w0 + c), v = _mm256_load_ps(w1 + c);
        for (int t = 0; t < TT; t++) {
            const __m256 xv = _mm256_loadu_ps(x + t * cols + c);
            a[t] = _mm256_fmadd_ps(u, xv, a[t]);
            b[t] = _mm256_fmadd_ps(v, xv, b[t]);
        }
    }
    for (int t = 0; t < TT; t++) {
        finish(j, r0, t0 + t, a[t]);
        if (nr == 2) finish(j, r0 + 1, t0 + t, b[t]);
    }
}

/* Two unpacked rows against every token: tiles of six, then one tile of the rest. */
static void tokens_unpacked(const job_t *j, const float *w0, const float *w1, Py_ssize_t r0,
                            int nr) {
    Py_ssize_t t = 0;
    for (; t + TILE_TOKENS <= j->T; t += TILE_TOKENS)
        tile_unpacked(j, w0, w1, r0, nr, t, TILE_TOKENS);
    switch (j->T - t) {
    case 5: tile_unpacked(j, w0, w1, r0, nr, t, 5); break;
    case 4: tile_unpacked(j, w0, w1, r0, nr, t, 4); break;
    case 3: tile_unpacked(j, w0, w1, r0, nr, t, 3); break;
    case 2: tile_unpacked(j, w0, w1, r0, nr, t, 2); break;
    case 1: tile_unpacked(j, w0, w1, r0, nr, t, 1); break;
    default: break;
    }
}

/* Rows [r0, r0 + n) for every token of the batch; n <= ROW_GROUP. ``scratch`` holds two
 * unpacked rows (NULL: unpack in registers whatever the batch). */
static void row_group(const job_t *j, Py_ssize_t r0, int n, float *scratch) {
    if (j->type != Q8_0) group_offsets(j, r0, n);
    if (j->T < 4 || scratch == NULL) {
        rows_direct(j, r0, n);
        return;
    }
    const Py_ssize_t cols = j->nb * QK, bb = BLOCK_BYTES[j->type];
    for (int i = 0; i < n; i += 2) {
        const int nr = n - i < 2 ? 1 : 2;
        unpack_row(j->type, j->raw + (r0 + i) * j->nb * bb, j->nb, scratch);
        if (nr == 2) unpack_row(j->type, j->raw + (r0 + i + 1) * j->nb * bb, j->nb, scratch + cols);
        tokens_unpacked(j, scratch, nr == 2 ? scratch + cols : scratch, r0 + i, nr);
    }
}

static PyObject *matmul(PyObject *self, PyObject *args) {
    Py_buffer raw, x, sx, out;
    Py_ssize_t rows, nb, T;
    int type, threads;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnii", &raw, &x, &sx, &out, &rows, &nb, &T, &type,
                          &threads))
        return NULL;
    PyObject *result = NULL;
    if (type < Q4_0 || type > Q8_0 || rows < 0 || nb < 0 || T < 0 ||
        raw.len < rows * nb * BLOCK_BYTES[type < 0 || type > 2 ? 0 : type] ||
        x.len < (Py_ssize_t)(T * nb * QK * sizeof(float)) ||
        out.len < (Py_ssize_t)(T * rows * sizeof(float)) ||
        (type != Q8_0 && sx.len < (Py_ssize_t)(T * nb * sizeof(float)))) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    job_t j = {raw.buf, x.buf, sx.buf, out.buf, rows, nb, T, type};
    const Py_ssize_t groups = (rows + ROW_GROUP - 1) / ROW_GROUP;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel num_threads(threads)
    {
        float *scratch = T >= 4 ? aligned_alloc(32, 2 * nb * QK * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (Py_ssize_t g = 0; g < groups; g++) {
            Py_ssize_t r0 = g * ROW_GROUP;
            row_group(&j, r0, (int)(rows - r0 < ROW_GROUP ? rows - r0 : ROW_GROUP), scratch);
        }
        free(scratch);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&raw);
    PyBuffer_Release(&x);
    PyBuffer_Release(&sx);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"matmul", matmul, METH_VARARGS,
     "matmul(raw, x, sx, out, rows, nb, T, type, threads): out[t, r] = W[r] . x[t],\n"
     "W as GGUF blocks (type 0 Q4_0, 1 Q4_1, 2 Q8_0)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qkernels",
                                    "AVX2 quantized matmul kernels", -1, methods};

PyMODINIT_FUNC PyInit__qkernels(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c")) {
        PyErr_SetString(PyExc_ImportError, "this CPU lacks AVX2/FMA/F16C");
        return NULL;
    }
    return PyModule_Create(&module);
}
