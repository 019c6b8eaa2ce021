/*
 * One transformer block for a batch's rows (prompt chunks and decode rows), in one call:
 * RMS norm, Q/K/V (fused or not, biases), per-head Q/K norms, rotary embedding, attention
 * over each sequence's cache, output projection, RMS norm, gate/up, SiLU or GELU gating,
 * down projection, the post-norms where the family has them, both residuals. Every row
 * goes through the same operations whatever the batch, so this stays as repeatable as
 * its parts; it exists because a decode step is too small to pay Python's price for a
 * dozen calls per block.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/*
 * Each calling thread's scratch for forward_block, kept between calls: a decode step
 * runs every block in turn, and a block's scratch freshly allocated each time came from
 * new pages whenever the allocator maps large blocks on their own (memory.settle does,
 * from 1 MB), ~12 ms a 32-row step of the bundled model. Scratch beyond SCRATCH_KEEP
 * bytes (a long prompt chunk's) is released after its call, or with ``keep`` once the
 * forward's last block has run (release_scratch): released after every block, a
 * 100-token prompt of a 1B model faulted its 10 MB in again 16 times, ~15% of the
 * prefill. So a node keeps at most this much per thread between forwards; a thread's
 * scratch is freed when the thread ends.
 */
#define SCRATCH_KEEP ((size_t)4 << 20)

typedef struct {
    void *buf;
    size_t size;
} scratch_t;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_ok;

static void scratch_free(void *p) {
    scratch_t *s = p;
    free(s->buf);
    free(s);
}

static void scratch_init(void) { scratch_key_ok = pthread_key_create(&scratch_key, scratch_free) == 0; }

/* The calling thread's scratch record (NULL when out of memory). */
static scratch_t *scratch_of_thread(void) {
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_key_ok) return NULL;
    scratch_t *s = pthread_getspecific(scratch_key);
    if (s == NULL) {
        s = calloc(1, sizeof(scratch_t));
        if (s == NULL || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    return s;
}

/* At least ``bytes`` of 64-byte aligned scratch for this call (NULL when out of memory);
 * give it back with scratch_release. */
static void *scratch_take(scratch_t *s, size_t bytes) {
    if (s->size < bytes) {
        free(s->buf);
        s->size = 0;
        if (posix_memalign(&s->buf, 64, bytes) != 0) {
            s->buf = NULL;
            return NULL;
        }
        s->size = bytes;
    }
    return s->buf;
}

static void scratch_release(scratch_t *s) {
    if (s->size > SCRATCH_KEEP) {
        free(s->buf);
        s->buf = NULL;
        s->size = 0;
    }
}

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, the squares summed in one 8-lane chain. */
static void rms_norm(const float *x, const float *w, Py_ssize_t T, Py_ssize_t d, float eps,
                     float *out) {
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *row = x + t * d;
        __m256 acc = _mm256_setzero_ps();
        Py_ssize_t c = 0;
        for (; c + 8 <= d; c += 8) {
            const __m256 v = _mm256_loadu_ps(row + c);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum256(acc);
        for (; c < d; c++) ss += row[c] * row[c];
        const float scale = 1.0f / sqrtf(ss / (float)d + eps);
        for (c = 0; c < d; c++) out[t * d + c] = (row[c] * scale) * w[c];
    }
}

void rope(float *x, Py_ssize_t T, int heads, int hd, Py_ssize_t pairs, const float *cos,
          const float *sin, int halves) {
    const Py_ssize_t step = halves ? 1 : 2, other = halves ? pairs : 1;
    for (Py_ssize_t t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            float *v = x + (t * heads + h) * hd;
            for (Py_ssize_t i = 0; i < pairs; i++) {
                const float c = cos[t * pairs + i], s = sin[t * pairs + i];
                float *a = v + step * i, *b = a + other;
                const float first = *a, second = *b;
                *a = first * c - second * s;
                *b = first * s + second * c;
            }
        }
}

/* GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), with
 * tanh(y) = 1 - 2 / (e^2y + 1). */
static inline __m256 gelu256(__m256 g) {
    const __m256 inner = _mm256_mul_ps(
        _mm256_set1_ps(0.7978845608028654f),
        _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f),
                                       _mm256_mul_ps(g, _mm256_mul_ps(g, g)))));
    const __m256 e = exp256(_mm256_add_ps(inner, inner));
    const __m256 tanh = _mm256_sub_ps(
        _mm256_set1_ps(1.0f),
        _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g),
                         _mm256_add_ps(_mm256_set1_ps(1.0f), tanh));
}

static inline __m256 silu256(__m256 g) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

void glu(const float *gate, const float *up, Py_ssize_t stride, Py_ssize_t T, Py_ssize_t d_ff,
         float *act, int gelu, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T > 1) /* one row: no team */
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *g = gate + t * stride, *u = up + t * stride;
        Py_ssize_t c = 0;
        for (; c + 8 <= d_ff; c += 8) {
            const __m256 x = _mm256_loadu_ps(g + c);
            const __m256 a = gelu ? gelu256(x) : silu256(x);
            _mm256_storeu_ps(act + t * d_ff + c, _mm256_mul_ps(a, _mm256_loadu_ps(u + c)));
        }
        for (; c < d_ff; c++) { /* the same arithmetic, one lane */
            float lanes[8] = {g[c]};
            const __m256 x = _mm256_loadu_ps(lanes);
            _mm256_storeu_ps(lanes, gelu ? gelu256(x) : silu256(x));
            act[t * d_ff + c] = lanes[0] * u[c];
        }
    }
}

static void add_into(float *x, const float *y, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) x[i] += y[i];
}

/* Whether the n matrices are all in the q8 layout (then of one width: they share an
 * input), so q8matmul_many can take them together. */
static int all_q8(const qmat_t *ws, int n) {
    for (int i = 0; i < n; i++)
        if (!ws[i].q8 || ws[i].nb != ws[0].nb) return 0;
    return 1;
}

/* q, k, v [T, heads, hd] from the block's Q/K/V projection of h, biases added. */
static int project_qkv(const block_t *b, const float *h, Py_ssize_t T, float *qkv, float *q,
                       float *k, float *v, int threads, int wide) {
    const heads_t *hs = &b->heads;
    const Py_ssize_t qw = (Py_ssize_t)hs->n_heads * hs->hd, kw = (Py_ssize_t)hs->n_kv * hs->hd;
    const Py_ssize_t width = qw + 2 * kw;
    if (b->n_qkv == 1) {
        if (qmatmul(&b->qkv[0], h, T, qkv, threads, wide) < 0) return -1;
        for (Py_ssize_t t = 0; t < T; t++) {
            memcpy(q + t * qw, qkv + t * width, qw * sizeof(float));
            memcpy(k + t * kw, qkv + t * width + qw, kw * sizeof(float));
            memcpy(v + t * kw, qkv + t * width + qw + kw, kw * sizeof(float));
        }
    } else if (all_q8(b->qkv, 3)) { /* one quantization of h, one parallel region */
        const qmat_t *ws[3] = {&b->qkv[0], &b->qkv[1], &b->qkv[2]};
        float *outs[3] = {q, k, v};
        if (q8matmul_many(ws, 3, h, T, outs, threads, wide) < 0) return -1;
    } else if (qmatmul(&b->qkv[0], h, T, q, threads, wide) < 0 ||
               qmatmul(&b->qkv[1], h, T, k, threads, wide) < 0 ||
               qmatmul(&b->qkv[2], h, T, v, threads, wide) < 0) {
        return -1;
    }
    if (b->qkv_bias != NULL)
        for (Py_ssize_t t = 0; t < T; t++) {
            add_into(q + t * qw, b->qkv_bias, qw);
            add_into(k + t * kw, b->qkv_bias + qw, kw);
            add_into(v + t * kw, b->qkv_bias + qw + kw, kw);
        }
    return 0;
}

int forward_block(const block_t *b, float *x, Py_ssize_t T, const float *cos, const float *sin,
                  const seq_t *seqs, Py_ssize_t n, int threads, int wide, int keep) {
    const heads_t *hs = &b->heads;
    const Py_ssize_t d = b->d, qw = (Py_ssize_t)hs->n_heads * hs->hd;
    const Py_ssize_t kw = (Py_ssize_t)hs->n_kv * hs->hd, width = qw + 2 * kw;
    /* h | qkv | q | k | v | attn | o, then gate/up and act reuse the front */
    const Py_ssize_t front = T * (d + width + qw + 2 * kw + qw + d);
    const Py_ssize_t ffn = T * (d + 3 * b->d_ff);
    scratch_t *scratch = scratch_of_thread();
    if (scratch == NULL) return -1;
    float *buf = scratch_take(scratch, (front > ffn ? front : ffn) * sizeof(float) + 32);
    if (buf == NULL) return -1;
    float *h = buf, *qkv = h + T * d, *q = qkv + T * width, *k = q + T * qw, *v = k + T * kw;
    float *attn = v + T * kw, *o = attn + T * qw;
    int status = -1;

    rms_norm(x, b->attn_norm, T, d, b->eps, h);
    if (project_qkv(b, h, T, qkv, q, k, v, threads, wide) < 0) goto done;
    if (b->q_norm != NULL) { /* each head its own row */
        rms_norm(q, b->q_norm, T * hs->n_heads, hs->hd, b->eps, q);
        rms_norm(k, b->k_norm, T * hs->n_kv, hs->hd, b->eps, k);
    }
    rope(q, T, hs->n_heads, hs->hd, b->rope_pairs, cos, sin, b->rope_halves);
    rope(k, T, hs->n_kv, hs->hd, b->rope_pairs, cos, sin, b->rope_halves);
    if (attend_rows(hs, q, k, v, attn, seqs, n, threads) < 0) goto done;
    if (qmatmul(&b->wo, attn, T, o, threads, wide) < 0) goto done;
    if (b->post_attn_norm != NULL) rms_norm(o, b->post_attn_norm, T, d, b->eps, o);
    add_into(x, o, T * d);

    float *gu = buf + T * d, *act = gu + T * 2 * b->d_ff;
    rms_norm(x, b->ffn_norm, T, d, b->eps, h);
    if (b->n_gate_up == 1) {
        if (qmatmul(&b->gate_up[0], h, T, gu, threads, wide) < 0) goto done;
        glu(gu, gu + b->d_ff, 2 * b->d_ff, T, b->d_ff, act, b->gelu, threads);
    } else {
        float *gate = gu, *up = gu + T * b->d_ff;
        if (all_q8(b->gate_up, 2)) {
            const qmat_t *ws[2] = {&b->gate_up[0], &b->gate_up[1]};
            float *outs[2] = {gate, up};
            if (q8matmul_many(ws, 2, h, T, outs, threads, wide) < 0) goto done;
        } else if (qmatmul(&b->gate_up[0], h, T, gate, threads, wide) < 0 ||
                   qmatmul(&b->gate_up[1], h, T, up, threads, wide) < 0) {
            goto done;
        }
        glu(gate, up, b->d_ff, T, b->d_ff, act, b->gelu, threads);
    }
    if (qmatmul(&b->down, act, T, h, threads, wide) < 0) goto done;
    if (b->post_ffn_norm != NULL) rms_norm(h, b->post_ffn_norm, T, d, b->eps, h);
    add_into(x, h, T * d);
    status = 0;
done:
    if (!keep) scratch_release(scratch);
    return status;
}

void release_scratch(void) {
    pthread_once(&scratch_once, scratch_init);
    if (!scratch_key_ok) return;
    scratch_t *s = pthread_getspecific(scratch_key);
    if (s != NULL) scratch_release(s);
}
