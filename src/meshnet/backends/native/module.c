/*
 * The Python face of the native kernels: argument checks and buffer handling only.
 * Every size is checked against the shapes before any kernel runs, so a bad call
 * raises ValueError and writes nothing.
 */
#include <math.h>
#include <stdlib.h>

#include "native.h"

/* None, or MemoryError where a kernel ran out of memory. */
static PyObject *kernel_result(int status) {
    return status < 0 ? PyErr_NoMemory() : Py_NewRef(Py_None);
}

/* The matrix's type from its code (a type, Q8_LAYOUT or'ed in for the q8 layout), then its
 * buffer against its shape. */
static int check_matrix(qmat_t *w, int code, const Py_buffer *packed) {
    if (qmat_set_type(w, code) < 0) {
        PyErr_SetString(PyExc_ValueError, "unknown type code, or no q8 kernel for the type");
        return -1;
    }
    const Py_ssize_t bytes = qmat_bytes(w->type, w->rows, w->nb);
    if (bytes < 0 || packed->len != bytes) {
        PyErr_SetString(PyExc_ValueError, "a matrix's buffer does not match its shape");
        return -1;
    }
    return 0;
}

static PyObject *matmul(PyObject *self, PyObject *args) {
    Py_buffer packed, x, out;
    qmat_t w;
    Py_ssize_t T;
    int code, threads, wide = 1;
    if (!PyArg_ParseTuple(args, "y*y*w*nnnii|p", &packed, &x, &out, &w.rows, &w.nb, &T, &code,
                          &threads, &wide))
        return NULL;
    PyObject *result = NULL;
    w.packed = packed.buf;
    if (check_matrix(&w, code, &packed) < 0) goto done;
    if (T < 0 || x.len != T * w.nb * QK * (Py_ssize_t)sizeof(float) ||
        out.len != T * w.rows * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qmatmul(&w, x.buf, T, out.buf, threads, wide);
    Py_END_ALLOW_THREADS
    result = kernel_result(status);
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *rows(PyObject *self, PyObject *args) {
    Py_buffer packed, ids, out;
    qmat_t w;
    int code;
    if (!PyArg_ParseTuple(args, "y*y*w*nni", &packed, &ids, &out, &w.rows, &w.nb, &code))
        return NULL;
    PyObject *result = NULL;
    w.packed = packed.buf;
    if (check_matrix(&w, code, &packed) < 0) goto done;
    const Py_ssize_t n = ids.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *id = ids.buf;
    if (ids.len % (Py_ssize_t)sizeof(int64_t) ||
        out.len != n * w.nb * QK * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (id[i] < 0 || id[i] >= w.rows) {
            PyErr_SetString(PyExc_ValueError, "a row id is out of range");
            goto done;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) qmat_row(&w, id[i], (float *)out.buf + i * w.nb * QK);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

/* The batch's sequences: (keys, values, first, count, row) each, keys and values
 * [n_kv, capacity, hd] float32. Holds 2 n views on success (release them), none on error. */
typedef struct {
    seq_t *seqs;
    Py_buffer *views;
    Py_ssize_t n;
} entries_t;

static void release_entries(entries_t *es) {
    for (Py_ssize_t e = 0; e < es->n; e++) {
        PyBuffer_Release(&es->views[2 * e]);
        PyBuffer_Release(&es->views[2 * e + 1]);
    }
    PyMem_Free(es->seqs);
    PyMem_Free(es->views);
    es->seqs = NULL;
    es->views = NULL;
    es->n = 0;
}

static int read_entries(PyObject *obj, Py_ssize_t T, const heads_t *h, entries_t *es) {
    *es = (entries_t){NULL, NULL, 0};
    PyObject *list = PySequence_Fast(obj, "entries must be a sequence");
    if (list == NULL) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(list);
    es->seqs = PyMem_Calloc(n + 1, sizeof(seq_t));
    es->views = PyMem_Calloc(2 * n + 1, sizeof(Py_buffer));
    if (es->seqs == NULL || es->views == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    const Py_ssize_t per_position = (Py_ssize_t)h->n_kv * h->hd * sizeof(float);
    Py_ssize_t rows = 0;
    for (Py_ssize_t e = 0; e < n; e++) {
        PyObject *keys, *values;
        Py_ssize_t first, count, row;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(list, e), "OOnnn", &keys, &values, &first,
                              &count, &row))
            goto fail;
        Py_buffer *kv = &es->views[2 * e];
        if (PyObject_GetBuffer(keys, &kv[0], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto fail;
        if (PyObject_GetBuffer(values, &kv[1], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&kv[0]);
            goto fail;
        }
        es->n = e + 1;
        const Py_ssize_t capacity = kv[0].len / per_position;
        if (kv[1].len != kv[0].len || kv[0].len % per_position || first < 0 || count < 1 ||
            row != rows || row + count > T || first + count > capacity) {
            PyErr_SetString(PyExc_ValueError, "a sequence's cache or rows do not fit the batch");
            goto fail;
        }
        es->seqs[e] = (seq_t){kv[0].buf, kv[1].buf, capacity, first, count, row};
        rows += count;
    }
    if (rows != T) {
        PyErr_SetString(PyExc_ValueError, "the sequences' rows do not cover the batch");
        goto fail;
    }
    Py_DECREF(list);
    return 0;
fail:
    Py_DECREF(list);
    release_entries(es);
    return -1;
}

static int check_heads(const heads_t *h) {
    if (h->n_heads < 1 || h->n_kv < 1 || h->n_heads % h->n_kv || h->hd < 8 || h->hd % 8) {
        PyErr_SetString(PyExc_ValueError, "heads must be whole groups of a multiple of 8");
        return -1;
    }
    if (!(h->scale > 0) || !(h->softcap >= 0) || h->window < 0) {
        PyErr_SetString(PyExc_ValueError, "attention scale, soft-cap or window out of range");
        return -1;
    }
    return 0;
}

static PyObject *attend(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, out;
    PyObject *entries;
    Py_ssize_t T;
    heads_t h = {0, 0, 0, 0.0f, 0.0f, 0};
    int threads;
    float scale = -1.0f;
    if (!PyArg_ParseTuple(args, "y*y*y*w*Oniiii|ffn", &q, &k, &v, &out, &entries, &T, &h.n_heads,
                          &h.n_kv, &h.hd, &threads, &scale, &h.softcap, &h.window))
        return NULL;
    h.scale = scale < 0 ? 1.0f / sqrtf((float)h.hd) : scale;
    PyObject *result = NULL;
    entries_t es = {NULL, NULL, 0};
    if (check_heads(&h) < 0) goto done;
    const Py_ssize_t qbytes = T * h.n_heads * h.hd * (Py_ssize_t)sizeof(float);
    const Py_ssize_t kbytes = T * h.n_kv * h.hd * (Py_ssize_t)sizeof(float);
    if (T < 0 || q.len != qbytes || out.len != qbytes || k.len != kbytes || v.len != kbytes) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    if (read_entries(entries, T, &h, &es) < 0) goto done;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = attend_rows(&h, q.buf, k.buf, v.buf, out.buf, es.seqs, es.n, threads);
    Py_END_ALLOW_THREADS
    result = kernel_result(status);
done:
    release_entries(&es);
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
    return result;
}

/* A block's weights held for forward_block: the views keep the arrays alive. */
#define BLOCK_VIEWS 14
typedef struct {
    block_t b;
    Py_buffer views[BLOCK_VIEWS];
    int held;
} held_block_t;

static const char *BLOCK_CAPSULE = "meshnet.native.block";

static void release_block(held_block_t *hb) {
    for (int i = 0; i < hb->held; i++) PyBuffer_Release(&hb->views[i]);
    PyMem_Free(hb);
}

static void free_block(PyObject *capsule) {
    held_block_t *hb = PyCapsule_GetPointer(capsule, BLOCK_CAPSULE);
    if (hb != NULL) release_block(hb);
}

/* (packed, rows, nb, type) */
static int read_matrix(PyObject *spec, held_block_t *hb, qmat_t *w) {
    PyObject *packed;
    int code;
    if (!PyArg_ParseTuple(spec, "Onni", &packed, &w->rows, &w->nb, &code)) return -1;
    Py_buffer *v = &hb->views[hb->held];
    if (PyObject_GetBuffer(packed, v, PyBUF_C_CONTIGUOUS) < 0) return -1;
    hb->held++;
    w->packed = v->buf;
    return check_matrix(w, code, v);
}

/* A tuple of 1 or ``most`` matrices into ws; their count into n. */
static int read_parts(PyObject *parts, int most, held_block_t *hb, qmat_t *ws, int *n) {
    if (!PyTuple_Check(parts) || (PyTuple_GET_SIZE(parts) != 1 && PyTuple_GET_SIZE(parts) != most)) {
        PyErr_SetString(PyExc_ValueError, "a projection is one fused matrix or all its parts");
        return -1;
    }
    *n = (int)PyTuple_GET_SIZE(parts);
    for (int i = 0; i < *n; i++)
        if (read_matrix(PyTuple_GET_ITEM(parts, i), hb, &ws[i]) < 0) return -1;
    return 0;
}

/* A float32 vector of ``size`` values, or NULL for None when ``optional``. */
static int read_vector(PyObject *obj, Py_ssize_t size, int optional, held_block_t *hb,
                       const float **out) {
    *out = NULL;
    if (obj == Py_None && optional) return 0;
    Py_buffer *v = &hb->views[hb->held];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS) < 0) return -1;
    hb->held++;
    if (v->len != size * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a norm or bias vector does not fit the block");
        return -1;
    }
    *out = v->buf;
    return 0;
}

/* Every matrix's shape against the block's widths. */
static int check_block_shapes(const block_t *b) {
    const heads_t *h = &b->heads;
    const Py_ssize_t qw = (Py_ssize_t)h->n_heads * h->hd, kw = (Py_ssize_t)h->n_kv * h->hd;
    const Py_ssize_t qkv_rows[3] = {qw, kw, kw};
    int ok = b->d >= 1 && b->d_ff >= 1 && b->rope_pairs >= 0 && 2 * b->rope_pairs <= h->hd &&
             b->wo.rows == b->d && b->wo.nb * QK == qw && b->down.rows == b->d &&
             b->down.nb * QK == b->d_ff;
    for (int i = 0; i < b->n_qkv; i++)
        ok = ok && b->qkv[i].nb * QK == b->d &&
             b->qkv[i].rows == (b->n_qkv == 1 ? qw + 2 * kw : qkv_rows[i]);
    for (int i = 0; i < b->n_gate_up; i++)
        ok = ok && b->gate_up[i].nb * QK == b->d &&
             b->gate_up[i].rows == (b->n_gate_up == 1 ? 2 * b->d_ff : b->d_ff);
    if (!ok) PyErr_SetString(PyExc_ValueError, "the block's matrices do not fit its shape");
    return ok ? 0 : -1;
}

static PyObject *block(PyObject *self, PyObject *args) {
    PyObject *qkv, *wo, *gate_up, *down, *vec[7];
    held_block_t *hb = PyMem_Calloc(1, sizeof(held_block_t));
    if (hb == NULL) return PyErr_NoMemory();
    block_t *b = &hb->b;
    heads_t *h = &b->heads;
    if (!PyArg_ParseTuple(args, "OOOO(OOOOOOO)fiiinnn(ppffn)", &qkv, &wo, &gate_up, &down,
                          &vec[0], &vec[1], &vec[2], &vec[3], &vec[4], &vec[5], &vec[6],
                          &b->eps, &h->n_heads, &h->n_kv, &h->hd, &b->d, &b->d_ff,
                          &b->rope_pairs, &b->rope_halves, &b->gelu, &h->scale, &h->softcap,
                          &h->window))
        goto fail;
    if (read_parts(qkv, 3, hb, b->qkv, &b->n_qkv) < 0 || read_matrix(wo, hb, &b->wo) < 0 ||
        read_parts(gate_up, 2, hb, b->gate_up, &b->n_gate_up) < 0 ||
        read_matrix(down, hb, &b->down) < 0)
        goto fail;
    if (check_heads(h) < 0 || check_block_shapes(b) < 0) goto fail;
    const Py_ssize_t qkv_width = (Py_ssize_t)(h->n_heads + 2 * h->n_kv) * h->hd;
    const Py_ssize_t sizes[7] = {b->d, b->d, qkv_width, h->hd, h->hd, b->d, b->d};
    const float **slots[7] = {&b->attn_norm, &b->ffn_norm,     &b->qkv_bias,     &b->q_norm,
                              &b->k_norm,    &b->post_attn_norm, &b->post_ffn_norm};
    for (int i = 0; i < 7; i++)
        if (read_vector(vec[i], sizes[i], i >= 2, hb, slots[i]) < 0) goto fail;
    if ((b->q_norm == NULL) != (b->k_norm == NULL)) {
        PyErr_SetString(PyExc_ValueError, "queries and keys are normalised together or not");
        goto fail;
    }
    PyObject *capsule = PyCapsule_New(hb, BLOCK_CAPSULE, free_block);
    if (capsule == NULL) goto fail;
    return capsule;
fail:
    release_block(hb);
    return NULL;
}

static PyObject *py_release_scratch(PyObject *self, PyObject *unused) {
    release_scratch();
    Py_RETURN_NONE;
}

static PyObject *run_block(PyObject *self, PyObject *args) {
    PyObject *capsule, *entries;
    Py_buffer x, cos, sin;
    int threads, wide = 1, keep = 0;
    if (!PyArg_ParseTuple(args, "Ow*y*y*Oi|pp", &capsule, &x, &cos, &sin, &entries, &threads,
                          &wide, &keep))
        return NULL;
    PyObject *result = NULL;
    entries_t es = {NULL, NULL, 0};
    held_block_t *hb = PyCapsule_GetPointer(capsule, BLOCK_CAPSULE);
    if (hb == NULL) goto done;
    const block_t *b = &hb->b;
    const Py_ssize_t row_bytes = b->d * (Py_ssize_t)sizeof(float);
    const Py_ssize_t T = x.len / row_bytes;
    const Py_ssize_t table = T * b->rope_pairs * (Py_ssize_t)sizeof(float);
    if (x.len % row_bytes || cos.len != table || sin.len != table) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    if (read_entries(entries, T, &b->heads, &es) < 0) goto done;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = forward_block(b, x.buf, T, cos.buf, sin.buf, es.seqs, es.n, threads, wide, keep);
    Py_END_ALLOW_THREADS
    result = kernel_result(status);
done:
    release_entries(&es);
    PyBuffer_Release(&x);
    PyBuffer_Release(&cos);
    PyBuffer_Release(&sin);
    return result;
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
    Py_buffer x, cos, sin;
    Py_ssize_t T, pairs;
    int heads, hd, halves = 0;
    if (!PyArg_ParseTuple(args, "w*y*y*niin|p", &x, &cos, &sin, &T, &heads, &hd, &pairs, &halves))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t table = T * pairs * (Py_ssize_t)sizeof(float);
    if (T < 0 || heads < 1 || hd < 1 || pairs < 0 || 2 * pairs > hd ||
        x.len != T * heads * hd * (Py_ssize_t)sizeof(float) || cos.len != table ||
        sin.len != table) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    rope(x.buf, T, heads, hd, pairs, cos.buf, sin.buf, halves);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&cos);
    PyBuffer_Release(&sin);
    return result;
}

static PyObject *py_glu(PyObject *self, PyObject *args) {
    Py_buffer gu, act;
    Py_ssize_t T, d_ff;
    int threads, gelu = 0;
    if (!PyArg_ParseTuple(args, "y*w*nni|p", &gu, &act, &T, &d_ff, &threads, &gelu)) return NULL;
    PyObject *result = NULL;
    if (T < 0 || d_ff < 0 || gu.len != 2 * T * d_ff * (Py_ssize_t)sizeof(float) ||
        act.len != T * d_ff * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "buffer sizes do not match the shapes");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    const float *gate = gu.buf;
    glu(gate, gate + d_ff, 2 * d_ff, T, d_ff, act.buf, gelu, threads);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&gu);
    PyBuffer_Release(&act);
    return result;
}

static PyObject *isa(PyObject *self, PyObject *unused) { return PyUnicode_FromString(isa_name()); }

static PyMethodDef methods[] = {
    {"isa", isa, METH_NOARGS,
     "isa(): the matmul's vectors in this process, \"avx512\" or \"avx2\" (MESHNET_ISA=avx2\n"
     "at import keeps an AVX-512 CPU to the AVX2 kernels; unset or auto: the widest)"},
    {"matmul", matmul, METH_VARARGS,
     "matmul(packed, x, out, rows, nb, T, type, threads, wide=True): out[t, r] =\n"
     "W[r] . x[t], W in the layout of its type (0 Q4_0, 1 Q4_1, 2 Q8_0, 3 Q4_K, 4 Q5_K,\n"
     "5 Q6_K, 6 Q2_K, 7 Q3_K, 8 Q5_0, 9 Q5_1, 10 F16, 11 BF16, 12 F32; see native.h;\n"
     "+32: the q8 layout, multiplied with 8-bit activations); wide=False keeps to AVX2\n"
     "vectors (the same bits)"},
    {"rows", rows, METH_VARARGS,
     "rows(packed, ids, out, rows, nb, type): out[i] = row ids[i] of the matrix as float32\n"
     "(ids int64), as gguf-py dequantizes it"},
    {"attend", attend, METH_VARARGS,
     "attend(q, k, v, out, entries, T, n_heads, n_kv, head_dim, threads, scale=1/sqrt(hd),\n"
     "softcap=0, window=0): store each entry's new keys/values and attend its rows;\n"
     "entries are (keys, values, first, count, row) with keys/values [n_kv, capacity,\n"
     "head_dim] float32, rows in order"},
    {"block", block, METH_VARARGS,
     "block(qkv, wo, gate_up, down, (attn_norm, ffn_norm, qkv_bias, q_norm, k_norm,\n"
     "post_attn_norm, post_ffn_norm), eps, n_heads, n_kv, head_dim, d, d_ff, rope_pairs,\n"
     "(rope_halves, gelu, attn_scale, softcap, window)): a handle on one block's weights;\n"
     "each matrix (packed, rows, nb, type), qkv and gate_up tuples of one fused matrix or\n"
     "their parts, the vectors after ffn_norm None where the family has none"},
    {"run_block", run_block, METH_VARARGS,
     "run_block(block, x, cos, sin, entries, threads, wide=True, keep=False): x [T, d] +=\n"
     "the block's output for T rows, prompt or decode (entries as for attend); wide=False\n"
     "keeps its matmuls to AVX2 vectors (the same bits); keep=True holds this thread's\n"
     "scratch, however large, for the next block (release_scratch gives it back)"},
    {"release_scratch", py_release_scratch, METH_NOARGS,
     "release_scratch(): give back this thread's block scratch past what a decode step\n"
     "keeps (after run_block(..., keep=True) of a forward's last block)"},
    {"rope", py_rope, METH_VARARGS,
     "rope(x, cos, sin, T, heads, head_dim, pairs, halves=False): rotary embedding of\n"
     "x [T, heads, head_dim] in place, cos/sin [T, pairs]; pairs (2i, 2i+1) or (i, i+pairs)"},
    {"glu", py_glu, METH_VARARGS,
     "glu(gate_up, out, T, d_ff, threads, gelu=False): out [T, d_ff] = silu(gate) * up\n"
     "(gelu(gate) * up), gate_up [T, 2 d_ff] = [gate | up]"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native",
                                    "AVX2 and AVX-512 kernels of the fast backend", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c")) {
        PyErr_SetString(PyExc_ImportError, "this CPU lacks AVX2/FMA/F16C");
        return NULL;
    }
    /* Like OMP_NUM_THREADS, a process-wide setting of the library, read once: it reaches
     * every process a mesh starts, so AVX2 kernels can be measured on an AVX-512 host. */
    const char *wanted = getenv("MESHNET_ISA");
    if (select_isa(wanted) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "MESHNET_ISA=%s: expected avx2, avx512 (where the CPU has it) or auto",
                     wanted);
        return NULL;
    }
    return PyModule_Create(&module);
}
