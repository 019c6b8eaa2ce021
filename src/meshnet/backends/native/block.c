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
#include <sys/mman.h>

#include "native.h"

/*
 * Each calling thread's scratch for forward_block, kept between calls: a decode step
 * runs every block in turn, and a block's scratch freshly allocated each time came from
 * new pages whenever the allocator maps large blocks on their own (under memory.settle's
 * policy from 8 MB; from 1 MB when this was measured), ~12 ms a 32-row step of the
 * bundled model. Scratch beyond SCRATCH_KEEP
 * bytes (a long prompt chunk's) is released after its call, or with ``keep`` once the
 * forward's last block has run (release_scratch): released after every block, a
 * 100-token prompt of a 1B model faulted its 10 MB in again 16 times, ~15% of the
 * prefill. So a node keeps at most this much per thread between forwards; a thread's
 * scratch is freed when the thread ends. Scratch beyond it is mapped on its own, not
 * taken from the heap: under memory.settle's policy a block under 8 MB freed stays in
 * the heap for the next step, so a 4-8 MB chunk's scratch freed after its forward
 * stayed resident where it lay (tests/unit/test_block_scratch.py).
 */
#define SCRATCH_KEEP ((size_t)4 << 20)

typedef struct {
    void *buf;
    size_t size;
    int mapped; /* buf is a mapping of its own (size > SCRATCH_KEEP), not a heap block */
} scratch_t;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_ok;

static void scratch_drop(scratch_t *s) {
    if (s->mapped)
        munmap(s->buf, s->size);
    else
        free(s->buf);
    s->buf = NULL;
    s->size = 0;
    s->mapped = 0;
}

static void scratch_free(void *p) {
    scratch_drop(p);
    free(p);
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
    if (s->size >= bytes) return s->buf;
    scratch_drop(s);
    if (bytes > SCRATCH_KEEP) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return NULL;
        s->buf = p;
        s->mapped = 1;
    } else if (posix_memalign(&s->buf, 64, bytes) != 0) {
        s->buf = NULL;
        return NULL;
    }
    s->size = bytes;
    return s->buf;
}

static void scratch_release(scratch_t *s) {
    if (s->size > SCRATCH_KEEP) scratch_drop(s);
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

/* The floats of the feed-forward part of forward_block's scratch, after h [T, d]. */
static Py_ssize_t ffn_scratch_floats(const block_t *b, Py_ssize_t T, int threads) {
    const Py_ssize_t moe =
        b->moe == NULL ? 0 : T * b->d + moe_scratch_floats(b->moe, T, b->d, threads);
    return T * (3 * b->d_ff + b->d) + moe;
}

/* out [T, d] = the block's feed-forward of the normed rows h: the dense one, the mixture
 * of experts, or the mixture plus the dense one as its (gated) shared expert. */
static int feed_forward(const block_t *b, const float *h, Py_ssize_t T, float *work, float *out,
                        int threads, int wide) {
    const Py_ssize_t d = b->d;
    float *gu = work, *act = gu + T * 2 * b->d_ff, *dense = act + T * b->d_ff;
    if (b->moe != NULL) {
        float *mixed = dense + T * d;
        if (moe_rows(b->moe, h, T, d, mixed + T * d, mixed, threads, wide) < 0) return -1;
        if (!b->has_dense) {
            memcpy(out, mixed, T * d * sizeof(float));
            return 0;
        }
        if (ffn_rows(&b->dense, b->d_ff, b->act, h, T, d, gu, act, dense, threads, wide) < 0)
            return -1;
        for (Py_ssize_t t = 0; t < T; t++) {
            float *row = dense + t * d;
            if (b->shared_gate != NULL) {
                float dot = 0.0f;
                for (Py_ssize_t c = 0; c < d; c++) dot += h[t * d + c] * b->shared_gate[c];
                const float gate = 1.0f / (1.0f + expf(-dot));
                for (Py_ssize_t c = 0; c < d; c++) row[c] *= gate;
            }
            for (Py_ssize_t c = 0; c < d; c++) out[t * d + c] = mixed[t * d + c] + row[c];
        }
        return 0;
    }
    return ffn_rows(&b->dense, b->d_ff, b->act, h, T, d, gu, act, out, threads, wide);
}

int forward_block(const block_t *b, float *x, Py_ssize_t T, const float *cos, const float *sin,
                  const seq_t *seqs, Py_ssize_t n, int threads, int wide, int keep) {
    const heads_t *hs = &b->heads;
    const Py_ssize_t d = b->d, qw = (Py_ssize_t)hs->n_heads * hs->hd;
    const Py_ssize_t kw = (Py_ssize_t)hs->n_kv * hs->hd, width = qw + 2 * kw;
    /* h | qkv | q | k | v | attn | o, then the feed-forward's scratch and output reuse
     * what follows h */
    const Py_ssize_t front = T * (d + width + qw + 2 * kw + qw + d);
    const Py_ssize_t ffn = T * 2 * d + ffn_scratch_floats(b, T, threads);
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
    if (b->wo_bias != NULL)
        for (Py_ssize_t t = 0; t < T; t++) add_into(o + t * d, b->wo_bias, d);
    if (b->post_attn_norm != NULL) rms_norm(o, b->post_attn_norm, T, d, b->eps, o);
    add_into(x, o, T * d);

    float *out = buf + T * d, *work = out + T * d;
    rms_norm(x, b->ffn_norm, T, d, b->eps, h);
    if (feed_forward(b, h, T, work, out, threads, wide) < 0) goto done;
    if (b->post_ffn_norm != NULL) rms_norm(out, b->post_ffn_norm, T, d, b->eps, out);
    add_into(x, out, T * d);
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
