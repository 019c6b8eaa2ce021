/*
 * The Python face of the native kernels: argument checks and buffer handling only.
 * Every size is checked against the shapes before any kernel runs, so a bad call
 * raises ValueError and writes nothing.
 */
#include <math.h>
#include <stdlib.h>

#include "isa.h"
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

/* The batch's sequences: (keys, values, first, count, row[, ring[, pages]]) each, keys and
 * values [n_kv, capacity, hd] float32 or float16 (both alike); pages None or the addresses
 * (int64 [2, n_pages]: keys', then values') of the pages holding positions
 * 0 .. n_pages TILE, each [n_kv, TILE, hd] of the keys' type, which the caller keeps alive
 * (kv/pages.py). Holds 3 n views on success (release them), none on error. */
typedef struct {
    seq_t *seqs;
    Py_buffer *views;
    Py_ssize_t n;
} entries_t;

static void release_entries(entries_t *es) {
    for (Py_ssize_t e = 0; e < es->n; e++)
        for (int i = 0; i < 3; i++)
            if (es->views[3 * e + i].obj != NULL) PyBuffer_Release(&es->views[3 * e + i]);
    PyMem_Free(es->seqs);
    PyMem_Free(es->views);
    es->seqs = NULL;
    es->views = NULL;
    es->n = 0;
}

/* 1 for a float16 buffer, 0 for float32, -1 for any other. */
static int cache_type(const Py_buffer *view) {
    const char *f = view->format != NULL ? view->format : "B";
    if (*f == '<' || *f == '=') f++;
    if (!strcmp(f, "e") && view->itemsize == 2) return 1;
    return !strcmp(f, "f") && view->itemsize == 4 ? 0 : -1;
}

static int read_entries(PyObject *obj, Py_ssize_t T, const heads_t *h, entries_t *es) {
    *es = (entries_t){NULL, NULL, 0};
    PyObject *list = PySequence_Fast(obj, "entries must be a sequence");
    if (list == NULL) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(list);
    es->seqs = PyMem_Calloc(n + 1, sizeof(seq_t));
    es->views = PyMem_Calloc(3 * n + 1, sizeof(Py_buffer));
    if (es->seqs == NULL || es->views == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t rows = 0;
    for (Py_ssize_t e = 0; e < n; e++) {
        PyObject *keys, *values, *pages = Py_None;
        Py_ssize_t first, count, row, ring = 0;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(list, e), "OOnnn|nO", &keys, &values,
                              &first, &count, &row, &ring, &pages))
            goto fail;
        Py_buffer *kv = &es->views[3 * e];
        es->n = e + 1; /* from here the entry's views are released on failure */
        const int flags = PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
        if (PyObject_GetBuffer(keys, &kv[0], flags) < 0) goto fail;
        if (PyObject_GetBuffer(values, &kv[1], flags) < 0) goto fail;
        const int half = cache_type(&kv[0]);
        if (half < 0 || cache_type(&kv[1]) != half) {
            PyErr_SetString(PyExc_ValueError,
                            "a cache's keys and values must be float32 or float16 alike");
            goto fail;
        }
        const Py_ssize_t per_position = (Py_ssize_t)h->n_kv * h->hd * (half ? 2 : sizeof(float));
        Py_ssize_t shared = 0;
        if (pages != Py_None) {
            if (PyObject_GetBuffer(pages, &kv[2], PyBUF_C_CONTIGUOUS) < 0) goto fail;
            shared = kv[2].len / (Py_ssize_t)(2 * sizeof(float *)) * ATTENTION_TILE;
            if (kv[2].itemsize != (Py_ssize_t)sizeof(float *) ||
                kv[2].len % (Py_ssize_t)(2 * sizeof(float *)) || ring != 0 || first < shared) {
                PyErr_SetString(PyExc_ValueError, "a sequence's pages do not fit its cache");
                goto fail;
            }
        }
        const Py_ssize_t capacity = kv[0].len / per_position;
        /* a ring that goes round: whole tiles of slots, and room for what the rows read */
        const int round = ring > 0 && first + count > capacity;
        if (kv[1].len != kv[0].len || kv[0].len % per_position || first < 0 || count < 1 ||
            row != rows || row + count > T || (first - shared + count > capacity && !round) ||
            (ring > 0 && (ring != capacity || h->window < 1)) ||
            (round && (capacity % ATTENTION_TILE || count + h->window - 1 > capacity)) ||
            ring < 0) {
            PyErr_SetString(PyExc_ValueError, "a sequence's cache or rows do not fit the batch");
            goto fail;
        }
        const void *const *table = shared ? (const void *const *)kv[2].buf : NULL;
        es->seqs[e] = (seq_t){kv[0].buf, kv[1].buf, capacity, first, count, row, ring, shared,
                              table, half};
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

/* The attention sinks ``obj`` (None, or n_heads finite float32) into view and h->sinks;
 * the view is held (release it) where h->sinks is set. */
static int read_sinks(PyObject *obj, heads_t *h, Py_buffer *view) {
    h->sinks = NULL;
    if (obj == Py_None) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *format = view->format != NULL ? view->format : "B";
    int ok = (!strcmp(format, "f") || !strcmp(format, "<f") || !strcmp(format, "=f")) &&
             view->len == (Py_ssize_t)h->n_heads * (Py_ssize_t)sizeof(float);
    for (int i = 0; ok && i < h->n_heads; i++) ok = isfinite(((const float *)view->buf)[i]);
    if (!ok) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "sinks must be n_heads finite float32 values");
        return -1;
    }
    h->sinks = view->buf;
    return 0;
}

static PyObject *attend(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, out, sinks;
    PyObject *entries, *sinks_obj = Py_None;
    Py_ssize_t T;
    heads_t h = {0, 0, 0, 0.0f, 0.0f, 0, NULL};
    int threads;
    float scale = -1.0f;
    if (!PyArg_ParseTuple(args, "y*y*y*w*Oniiii|ffnO", &q, &k, &v, &out, &entries, &T,
                          &h.n_heads, &h.n_kv, &h.hd, &threads, &scale, &h.softcap, &h.window,
                          &sinks_obj))
        return NULL;
    h.scale = scale < 0 ? 1.0f / sqrtf((float)h.hd) : scale;
    PyObject *result = NULL;
    entries_t es = {NULL, NULL, 0};
    if (check_heads(&h) < 0 || read_sinks(sinks_obj, &h, &sinks) < 0) goto done;
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
    if (h.sinks != NULL) PyBuffer_Release(&sinks);
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
    return result;
}

/* Buffers held for a handle's lifetime: the views keep the arrays alive. */
typedef struct {
    Py_buffer *views;
    int held, capacity;
} holder_t;

static void release_views(holder_t *hold) {
    for (int i = 0; i < hold->held; i++) PyBuffer_Release(&hold->views[i]);
    PyMem_Free(hold->views);
    hold->views = NULL;
    hold->held = 0;
}

/* A view of obj held by ``hold``, or NULL with an exception set. */
static Py_buffer *hold_view(PyObject *obj, holder_t *hold) {
    if (hold->held == hold->capacity) {
        PyErr_SetString(PyExc_ValueError, "too many arrays for one handle");
        return NULL;
    }
    Py_buffer *v = &hold->views[hold->held];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    hold->held++;
    return v;
}

/* (packed, rows, nb, type) */
static int read_matrix(PyObject *spec, holder_t *hold, qmat_t *w) {
    PyObject *packed;
    int code;
    if (!PyTuple_Check(spec) || !PyArg_ParseTuple(spec, "Onni", &packed, &w->rows, &w->nb, &code))
        return -1;
    Py_buffer *v = hold_view(packed, hold);
    if (v == NULL) return -1;
    w->packed = v->buf;
    return check_matrix(w, code, v);
}

/* A tuple of 1 or ``most`` matrices into ws, their count into n; with ``optional``, the
 * empty tuple too (n 0). */
static int read_parts(PyObject *parts, int most, int optional, holder_t *hold, qmat_t *ws,
                      int *n) {
    const Py_ssize_t size = PyTuple_Check(parts) ? PyTuple_GET_SIZE(parts) : -1;
    if (size != 1 && size != most && !(optional && size == 0)) {
        PyErr_SetString(PyExc_ValueError, "a projection is one fused matrix or all its parts");
        return -1;
    }
    *n = (int)size;
    for (int i = 0; i < *n; i++)
        if (read_matrix(PyTuple_GET_ITEM(parts, i), hold, &ws[i]) < 0) return -1;
    return 0;
}

/* A float32 array of ``size`` values, or NULL for None when ``optional``. */
static int read_vector(PyObject *obj, Py_ssize_t size, int optional, holder_t *hold,
                       const float **out) {
    *out = NULL;
    if (obj == Py_None && optional) return 0;
    Py_buffer *v = hold_view(obj, hold);
    if (v == NULL) return -1;
    if (v->len != size * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a norm, bias or gate vector does not fit the block");
        return -1;
    }
    *out = v->buf;
    return 0;
}

/* A feed-forward's matrices [d_ff, d] (gate/up) and [d, d_ff] (down) against its widths. */
static int ffn_fits(const ffn_t *f, Py_ssize_t d, Py_ssize_t d_ff) {
    int ok = f->down.rows == d && f->down.nb * QK == d_ff;
    for (int i = 0; i < f->n_gate_up; i++)
        ok = ok && f->gate_up[i].nb * QK == d &&
             f->gate_up[i].rows == (f->n_gate_up == 1 ? 2 * d_ff : d_ff);
    return ok;
}

/* A mixture of experts held for the blocks that use it. */
typedef struct {
    moe_t m;
    ffn_t *ffns;
    holder_t hold;
} held_experts_t;

static const char *EXPERTS_CAPSULE = "meshnet.native.experts";

static void release_experts(held_experts_t *he) {
    free((void *)he->m.router_lanes);
    release_views(&he->hold);
    PyMem_Free(he->ffns);
    PyMem_Free(he);
}

static void free_experts(PyObject *capsule) {
    held_experts_t *he = PyCapsule_GetPointer(capsule, EXPERTS_CAPSULE);
    if (he != NULL) release_experts(he);
}

static PyObject *experts(PyObject *self, PyObject *args) {
    PyObject *router, *router_bias, *gate_ups, *downs, *bias[3];
    Py_ssize_t d;
    held_experts_t *he = PyMem_Calloc(1, sizeof(held_experts_t));
    if (he == NULL) return PyErr_NoMemory();
    moe_t *m = &he->m;
    if (!PyArg_ParseTuple(args, "OOO!O!(OOO)nniiii", &router, &router_bias, &PyTuple_Type,
                          &gate_ups, &PyTuple_Type, &downs, &bias[0], &bias[1], &bias[2], &d,
                          &m->d_ff, &m->n_used, &m->gating, &m->normalize, &m->act))
        goto fail;
    const Py_ssize_t E = PyTuple_GET_SIZE(gate_ups);
    if (E < 1 || E > 4096 || PyTuple_GET_SIZE(downs) != E || m->n_used < 1 || m->n_used > E ||
        d < 1 || m->d_ff < 1 || m->gating < 0 || m->gating > 1 || m->act < 0 ||
        m->act > ACT_SWIGLU_OAI) {
        PyErr_SetString(PyExc_ValueError, "the experts' counts, widths or rules are out of range");
        goto fail;
    }
    m->n_experts = (int)E;
    he->hold.capacity = (int)(3 * E + 5);
    he->hold.views = PyMem_Calloc((size_t)he->hold.capacity, sizeof(Py_buffer));
    he->ffns = PyMem_Calloc((size_t)E, sizeof(ffn_t));
    if (he->hold.views == NULL || he->ffns == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    m->experts = he->ffns;
    const float *biases[3];
    if (read_matrix(router, &he->hold, &m->router) < 0 ||
        read_vector(router_bias, E, 1, &he->hold, &m->router_bias) < 0 ||
        read_vector(bias[0], E * m->d_ff, 1, &he->hold, &biases[0]) < 0 ||
        read_vector(bias[1], E * m->d_ff, 1, &he->hold, &biases[1]) < 0 ||
        read_vector(bias[2], E * d, 1, &he->hold, &biases[2]) < 0)
        goto fail;
    if (m->router.rows != E || m->router.nb * QK != d || (biases[0] == NULL) != (biases[1] == NULL)) {
        PyErr_SetString(PyExc_ValueError, "the router or the experts' biases do not fit");
        goto fail;
    }
    m->router_lanes = router_lanes(&m->router); /* NULL: the general matmul routes */
    for (Py_ssize_t e = 0; e < E; e++) {
        ffn_t *f = &he->ffns[e];
        if (read_parts(PyTuple_GET_ITEM(gate_ups, e), 2, 0, &he->hold, f->gate_up,
                       &f->n_gate_up) < 0 ||
            read_matrix(PyTuple_GET_ITEM(downs, e), &he->hold, &f->down) < 0)
            goto fail;
        if (!ffn_fits(f, d, m->d_ff)) {
            PyErr_SetString(PyExc_ValueError, "an expert's matrices do not fit its widths");
            goto fail;
        }
        f->gate_bias = biases[0] == NULL ? NULL : biases[0] + e * m->d_ff;
        f->up_bias = biases[1] == NULL ? NULL : biases[1] + e * m->d_ff;
        f->down_bias = biases[2] == NULL ? NULL : biases[2] + e * d;
    }
    PyObject *capsule = PyCapsule_New(he, EXPERTS_CAPSULE, free_experts);
    if (capsule == NULL) goto fail;
    return capsule;
fail:
    release_experts(he);
    return NULL;
}

/* A block's weights held for forward_block, and the experts it uses. */
#define BLOCK_VIEWS 20
typedef struct {
    block_t b;
    Py_buffer views[BLOCK_VIEWS];
    holder_t hold;
    PyObject *experts; /* the experts capsule, or NULL */
} held_block_t;

static const char *BLOCK_CAPSULE = "meshnet.native.block";

static void release_block(held_block_t *hb) {
    for (int i = 0; i < hb->hold.held; i++) PyBuffer_Release(&hb->views[i]);
    Py_XDECREF(hb->experts);
    PyMem_Free(hb);
}

static void free_block(PyObject *capsule) {
    held_block_t *hb = PyCapsule_GetPointer(capsule, BLOCK_CAPSULE);
    if (hb != NULL) release_block(hb);
}

/* Every matrix's shape against the block's widths. */
static int check_block_shapes(const block_t *b) {
    const heads_t *h = &b->heads;
    const Py_ssize_t qw = (Py_ssize_t)h->n_heads * h->hd, kw = (Py_ssize_t)h->n_kv * h->hd;
    const Py_ssize_t qkv_rows[3] = {qw, kw, kw};
    int ok = b->d >= 1 && b->rope_pairs >= 0 && 2 * b->rope_pairs <= h->hd &&
             b->wo.rows == b->d && b->wo.nb * QK == qw && (b->has_dense || b->moe != NULL) &&
             (!b->has_dense || (b->d_ff >= 1 && ffn_fits(&b->dense, b->d, b->d_ff))) &&
             (b->moe == NULL || b->moe->router.nb * QK == b->d) &&
             (b->shared_gate == NULL || (b->has_dense && b->moe != NULL));
    for (int i = 0; i < b->n_qkv; i++)
        ok = ok && b->qkv[i].nb * QK == b->d &&
             b->qkv[i].rows == (b->n_qkv == 1 ? qw + 2 * kw : qkv_rows[i]);
    if (!ok) PyErr_SetString(PyExc_ValueError, "the block's matrices do not fit its shape");
    return ok ? 0 : -1;
}

static PyObject *block(PyObject *self, PyObject *args) {
    PyObject *qkv, *wo, *gate_up, *down, *vec[10], *moe = Py_None;
    held_block_t *hb = PyMem_Calloc(1, sizeof(held_block_t));
    if (hb == NULL) return PyErr_NoMemory();
    hb->hold.views = hb->views;
    hb->hold.capacity = BLOCK_VIEWS;
    block_t *b = &hb->b;
    heads_t *h = &b->heads;
    if (!PyArg_ParseTuple(args, "OOOO(OOOOOOOOOO)fiiinnn(piffn)|O", &qkv, &wo, &gate_up, &down,
                          &vec[0], &vec[1], &vec[2], &vec[3], &vec[4], &vec[5], &vec[6], &vec[7],
                          &vec[8], &vec[9], &b->eps, &h->n_heads, &h->n_kv, &h->hd, &b->d,
                          &b->d_ff, &b->rope_pairs, &b->rope_halves, &b->act, &h->scale,
                          &h->softcap, &h->window, &moe))
        goto fail;
    if (moe != Py_None) {
        held_experts_t *he = PyCapsule_GetPointer(moe, EXPERTS_CAPSULE);
        if (he == NULL) goto fail;
        b->moe = &he->m;
        hb->experts = Py_NewRef(moe);
    }
    if (read_parts(qkv, 3, 0, &hb->hold, b->qkv, &b->n_qkv) < 0 ||
        read_matrix(wo, &hb->hold, &b->wo) < 0 ||
        read_parts(gate_up, 2, 1, &hb->hold, b->dense.gate_up, &b->dense.n_gate_up) < 0)
        goto fail;
    b->has_dense = b->dense.n_gate_up > 0;
    if (b->has_dense ? read_matrix(down, &hb->hold, &b->dense.down) < 0 : down != Py_None) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a down projection without gate and up");
        goto fail;
    }
    if (b->act < 0 || b->act > ACT_SWIGLU_OAI) {
        PyErr_SetString(PyExc_ValueError, "unknown activation");
        goto fail;
    }
    const Py_ssize_t qkv_width = (Py_ssize_t)(h->n_heads + 2 * h->n_kv) * h->hd;
    const Py_ssize_t sizes[10] = {b->d, b->d, qkv_width, h->hd, h->hd, b->d, b->d,
                                  b->d, h->n_heads, b->d};
    const float **slots[10] = {&b->attn_norm,      &b->ffn_norm,      &b->qkv_bias,
                               &b->q_norm,         &b->k_norm,        &b->post_attn_norm,
                               &b->post_ffn_norm,  &b->wo_bias,       &h->sinks,
                               &b->shared_gate};
    for (int i = 0; i < 10; i++)
        if (read_vector(vec[i], sizes[i], i >= 2, &hb->hold, slots[i]) < 0) goto fail;
    if (check_heads(h) < 0 || check_block_shapes(b) < 0) goto fail;
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
    if (!PyArg_ParseTuple(args, "y*w*nni|i", &gu, &act, &T, &d_ff, &threads, &gelu)) return NULL;
    if (gelu < 0 || gelu > ACT_SWIGLU_OAI) {
        PyErr_SetString(PyExc_ValueError, "unknown activation");
        return NULL;
    }
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
     "softcap=0, window=0, sinks=None): store each entry's new keys/values and attend its\n"
     "rows; entries are (keys, values, first, count, row[, ring]) with keys/values [n_kv,\n"
     "capacity, head_dim] float32, rows in order, ring > 0 (= capacity, a multiple of 64 where\n"
     "it goes round) for a windowed layer's ring (position p in slot p % ring); sinks: n_heads\n"
     "float32 attention sinks, or None"},
    {"experts", experts, METH_VARARGS,
     "experts(router, router_bias, gate_ups, downs, (gate_bias, up_bias, down_bias), d, d_ff,\n"
     "n_used, gating, normalize, act): a handle on a layer's mixture of experts; gate_ups a\n"
     "tuple per expert of its fused [gate | up] matrix or both, downs its down matrices,\n"
     "the biases [n_experts, width] float32 or None; gating 0 softmax, 1 softmax of the\n"
     "chosen; act 0 SiLU, 1 GELU, 2 gpt-oss's clamped SwiGLU"},
    {"block", block, METH_VARARGS,
     "block(qkv, wo, gate_up, down, (attn_norm, ffn_norm, qkv_bias, q_norm, k_norm,\n"
     "post_attn_norm, post_ffn_norm, wo_bias, sinks, shared_gate), eps, n_heads, n_kv,\n"
     "head_dim, d, d_ff, rope_pairs, (rope_halves, act, attn_scale, softcap, window),\n"
     "experts=None): a handle on one block's weights; each matrix (packed, rows, nb, type),\n"
     "qkv and gate_up tuples of one fused matrix or their parts (gate_up () and down None\n"
     "where a mixture of experts has no dense part), the vectors after ffn_norm None where\n"
     "the family has none; experts a handle from experts()"},
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
     "glu(gate_up, out, T, d_ff, threads, act=0): out [T, d_ff] = silu(gate) * up (act 1:\n"
     "gelu(gate) * up; 2: gpt-oss's clamped SwiGLU), gate_up [T, 2 d_ff] = [gate | up]"},
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
