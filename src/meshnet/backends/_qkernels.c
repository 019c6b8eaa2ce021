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

static void row_kernel(const job_t *j, Py_ssize_t r) {
    const Py_ssize_t nb = j->nb, cols = nb * QK, rows = j->rows, bb = BLOCK_BYTES[j->type];
    const uint8_t *row = j->raw + r * nb * bb;
    for (Py_ssize_t t = 0; t < j->T; t += 4) {
        int n = (int)(j->T - t < 4 ? j->T - t : 4);
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                         _mm256_setzero_ps()};
        float offset[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (Py_ssize_t b = 0; b < nb; b++) {
            const uint8_t *blk = row + b * bb;
            __m256 w[4];
            if (j->type == Q8_0) {
                unpack_q8((const int8_t *)(blk + 2), f16(blk), w);
            } else if (j->type == Q4_1) {
                unpack_q4(blk + 4, f16(blk), w);
                float m = f16(blk + 2);
                for (int k = 0; k < n; k++) offset[k] += m * j->sx[(t + k) * nb + b];
            } else { /* Q4_0: w = d * (q - 8) = d * q + (-8 d) */
                float d = f16(blk);
                unpack_q4(blk + 2, d, w);
                for (int k = 0; k < n; k++) offset[k] += (-8.0f * d) * j->sx[(t + k) * nb + b];
            }
            for (int k = 0; k < n; k++)
                acc[k] = block_fma(w, j->x + (t + k) * cols + b * QK, acc[k]);
        }
        for (int k = 0; k < n; k++) j->out[(t + k) * rows + r] = hsum256(acc[k]) + offset[k];
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
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for schedule(static) num_threads(threads)
    for (Py_ssize_t r = 0; r < rows; r++) row_kernel(&j, r);
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
