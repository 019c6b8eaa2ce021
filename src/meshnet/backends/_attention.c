/*
 * Decode-row attention for the fast backend, AVX2 + FMA, float32.
 *
 * One call serves every decode row of a batch (rows of several sequences, each with
 * its own KV cache): it stores the rows' new keys and values in their caches, then
 * each (row, head) pair attends causally over its sequence's positions. A pair's
 * arithmetic is one fixed sequence of operations (no -ffast-math; explicit
 * intrinsics) whatever else is in the batch, how many rows its sequence sends at once
 * or how pairs are split among threads, so a row's output is bit-identical alone,
 * batched, or replayed among other decode rows.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

typedef struct {
    float *keys, *values; /* [n_kv, capacity, hd] each */
    Py_ssize_t capacity, first, count, row;
} seq_t;

typedef struct {
    const float *q; /* [T, n_heads, hd] */
    float *out;     /* [T, n_heads * hd] */
    int n_heads, n_kv, hd;
} shape_t;

/* q . k over hd (a multiple of 8): one 8-lane FMA chain, then the fixed horizontal sum. */
static inline float dot(const float *q, const float *k, int hd) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < hd; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), acc);
    return hsum256(acc);
}

/* Row ``i`` of sequence ``s``, head ``h``: softmax(q K^T / sqrt(hd)) V over positions
 * 0 .. first + i. ``scores`` has room for every visible position. */
static void attend_pair(const shape_t *sh, const seq_t *s, Py_ssize_t i, int h, float *scores) {
    const int hd = sh->hd, kv = h / (sh->n_heads / sh->n_kv);
    const Py_ssize_t visible = s->first + i + 1, row = s->row + i;
    const float *q = sh->q + (row * sh->n_heads + h) * hd;
    const float *keys = s->keys + kv * s->capacity * hd;
    const float *values = s->values + kv * s->capacity * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    float top = -INFINITY;
    for (Py_ssize_t j = 0; j < visible; j++) {
        scores[j] = dot(q, keys + j * hd, hd) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    float total = 0.0f;
    for (Py_ssize_t j = 0; j < visible; j++) {
        scores[j] = expf(scores[j] - top);
        total += scores[j];
    }
    float *out = sh->out + row * sh->n_heads * hd + h * hd;
    for (int c = 0; c < hd; c += 8) _mm256_storeu_ps(out + c, _mm256_setzero_ps());
    for (Py_ssize_t j = 0; j < visible; j++) {
        const __m256 p = _mm256_set1_ps(scores[j] / total);
        const float *v = values + j * hd;
        for (int c = 0; c < hd; c += 8)
            _mm256_storeu_ps(out + c, _mm256_fmadd_ps(p, _mm256_loadu_ps(v + c),
                                                      _mm256_loadu_ps(out + c)));
    }
}

/* Copies the sequence's new rows of k and v ([T, n_kv, hd]) to positions first .. */
static void store_rows(const seq_t *s, const float *k, const float *v, int n_kv, int hd) {
    for (Py_ssize_t i = 0; i < s->count; i++)
        for (int h = 0; h < n_kv; h++) {
            const Py_ssize_t src = ((s->row + i) * n_kv + h) * hd;
            const Py_ssize_t dst = (h * s->capacity + s->first + i) * hd;
            memcpy(s->keys + dst, k + src, hd * sizeof(float));
            memcpy(s->values + dst, v + src, hd * sizeof(float));
        }
}

static int fill_sequences(PyObject *entries, Py_ssize_t n, seq_t *seqs, Py_buffer *views,
                          Py_ssize_t T, int n_kv, int hd) {
    /* entries: a sequence of (keys, values, first, count, row) */
    for (Py_ssize_t e = 0; e < n; e++) {
        PyObject *item = PySequence_Fast_GET_ITEM(entries, e);
        PyObject *keys, *values;
        Py_ssize_t first, count, row;
        if (!PyArg_ParseTuple(item, "OOnnn", &keys, &values, &first, &count, &row)) return -1;
        if (PyObject_GetBuffer(keys, &views[2 * e], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        if (PyObject_GetBuffer(values, &views[2 * e + 1], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) <
            0) {
            PyBuffer_Release(&views[2 * e]);
            return -1;
        }
        const Py_ssize_t per_position = (Py_ssize_t)n_kv * hd * sizeof(float);
        const Py_ssize_t capacity = views[2 * e].len / per_position;
        if (views[2 * e + 1].len != views[2 * e].len || views[2 * e].len % per_position ||
            first < 0 || count < 1 || row < 0 || row + count > T || first + count > capacity) {
            PyBuffer_Release(&views[2 * e]);
            PyBuffer_Release(&views[2 * e + 1]);
            PyErr_SetString(PyExc_ValueError, "a sequence's cache or rows do not fit the batch");
            return -1;
        }
        seqs[e] = (seq_t){views[2 * e].buf, views[2 * e + 1].buf, capacity, first, count, row};
    }
    return 0;
}

static PyObject *attend(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, out;
    PyObject *entries_obj;
    Py_ssize_t T;
    int n_heads, n_kv, hd, threads;
    if (!PyArg_ParseTuple(args, "y*y*y*w*Oniiii", &q, &k, &v, &out, &entries_obj, &T, &n_heads,
                          &n_kv, &hd, &threads))
        return NULL;
    PyObject *result = NULL, *entries = NULL;
    seq_t *seqs = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t n = 0, held = 0;
    const Py_ssize_t qbytes = T * n_heads * hd * (Py_ssize_t)sizeof(float);
    const Py_ssize_t kbytes = T * n_kv * hd * (Py_ssize_t)sizeof(float);
    if (T < 0 || n_heads < 1 || n_kv < 1 || n_heads % n_kv || hd < 8 || hd % 8 ||
        q.len != qbytes || out.len != qbytes || k.len != kbytes || v.len != kbytes) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    entries = PySequence_Fast(entries_obj, "entries must be a sequence");
    if (entries == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(entries);
    seqs = PyMem_Calloc(n ? n : 1, sizeof(seq_t));
    views = PyMem_Calloc(n ? 2 * n : 1, sizeof(Py_buffer));
    if (seqs == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (fill_sequences(entries, n, seqs, views, T, n_kv, hd) < 0) {
        for (Py_ssize_t e = 0; e < n && views[2 * e].obj != NULL; e++) {
            PyBuffer_Release(&views[2 * e]);
            PyBuffer_Release(&views[2 * e + 1]);
        }
        goto done;
    }
    held = n;
    /* (row, head) pairs in batch order, so threads split them the same way every time
     * (not that it matters for the results) */
    Py_ssize_t pairs = 0, longest = 0;
    for (Py_ssize_t e = 0; e < n; e++) {
        pairs += seqs[e].count * n_heads;
        longest = seqs[e].first + seqs[e].count > longest ? seqs[e].first + seqs[e].count : longest;
    }
    Py_ssize_t *pair = PyMem_Malloc((pairs ? 2 * pairs : 1) * sizeof(Py_ssize_t));
    if (pair == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t e = 0, p = 0; e < n; e++)
        for (Py_ssize_t i = 0; i < seqs[e].count * n_heads; i++, p++) {
            pair[2 * p] = e; /* the sequence, and the pair's index among its pairs */
            pair[2 * p + 1] = i;
        }
    shape_t sh = {q.buf, out.buf, n_heads, n_kv, hd};
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t e = 0; e < n; e++) store_rows(&seqs[e], k.buf, v.buf, n_kv, hd);
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc((longest ? longest : 1) * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (Py_ssize_t p = 0; p < pairs; p++) {
            if (scores == NULL) continue;
            const Py_ssize_t local = pair[2 * p + 1];
            attend_pair(&sh, &seqs[pair[2 * p]], local / n_heads, (int)(local % n_heads), scores);
        }
        free(scores);
    }
    Py_END_ALLOW_THREADS
    PyMem_Free(pair);
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t e = 0; e < held; e++) {
        PyBuffer_Release(&views[2 * e]);
        PyBuffer_Release(&views[2 * e + 1]);
    }
    PyMem_Free(seqs);
    PyMem_Free(views);
    Py_XDECREF(entries);
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS,
     "attend(q, k, v, out, entries, T, n_heads, n_kv, head_dim, threads): store each\n"
     "entry's new keys/values and attend its rows; entries are (keys, values, first,\n"
     "count, row) with keys/values [n_kv, capacity, head_dim] float32"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attention",
                                    "AVX2 decode-row attention", -1, methods};

PyMODINIT_FUNC PyInit__attention(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        PyErr_SetString(PyExc_ImportError, "this CPU lacks AVX2/FMA");
        return NULL;
    }
    return PyModule_Create(&module);
}
