/*
 * One transformer block for a batch's rows (prompt chunks and decode rows), in one call:
 * RMS norm, fused Q/K/V, rotary embedding, attention over each sequence's cache, output
 * projection, RMS norm, fused gate/up, SwiGLU, down projection, both residuals. Every row
 * goes through the same operations whatever the batch, so this stays as repeatable as
 * its parts; it exists because a decode step is too small to pay Python's price for a
 * dozen calls per block.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

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
          const float *sin) {
    for (Py_ssize_t t = 0; t < T; t++)
        for (int h = 0; h < heads; h++) {
            float *v = x + (t * heads + h) * hd;
            for (Py_ssize_t i = 0; i < pairs; i++) {
                const float c = cos[t * pairs + i], s = sin[t * pairs + i];
                const float even = v[2 * i], odd = v[2 * i + 1];
                v[2 * i] = even * c - odd * s;
                v[2 * i + 1] = even * s + odd * c;
            }
        }
}

void swiglu(const float *gu, Py_ssize_t T, Py_ssize_t d_ff, float *act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *gate = gu + t * 2 * d_ff, *up = gate + d_ff;
        Py_ssize_t c = 0;
        for (; c + 8 <= d_ff; c += 8) {
            const __m256 g = _mm256_loadu_ps(gate + c);
            const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(act + t * d_ff + c, _mm256_mul_ps(silu, _mm256_loadu_ps(up + c)));
        }
        for (; c < d_ff; c++) act[t * d_ff + c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
    }
}

static void add_into(float *x, const float *y, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) x[i] += y[i];
}

int forward_block(const block_t *b, float *x, Py_ssize_t T, const float *cos, const float *sin,
                  const seq_t *seqs, Py_ssize_t n, int threads) {
    const heads_t *hs = &b->heads;
    const Py_ssize_t d = b->d, qw = (Py_ssize_t)hs->n_heads * hs->hd;
    const Py_ssize_t kw = (Py_ssize_t)hs->n_kv * hs->hd, width = qw + 2 * kw;
    /* h | qkv | q | k | v | attn | o, then gate/up and act reuse the front */
    const Py_ssize_t front = T * (d + width + qw + 2 * kw + qw + d);
    const Py_ssize_t ffn = T * (d + 3 * b->d_ff);
    float *buf = malloc((front > ffn ? front : ffn) * sizeof(float) + 32);
    if (buf == NULL) return -1;
    float *h = buf, *qkv = h + T * d, *q = qkv + T * width, *k = q + T * qw, *v = k + T * kw;
    float *attn = v + T * kw, *o = attn + T * qw;
    int status = -1;

    rms_norm(x, b->attn_norm, T, d, b->eps, h);
    if (qmatmul(&b->qkv, h, T, qkv, threads) < 0) goto done;
    for (Py_ssize_t t = 0; t < T; t++) {
        memcpy(q + t * qw, qkv + t * width, qw * sizeof(float));
        memcpy(k + t * kw, qkv + t * width + qw, kw * sizeof(float));
        memcpy(v + t * kw, qkv + t * width + qw + kw, kw * sizeof(float));
    }
    rope(q, T, hs->n_heads, hs->hd, b->rope_pairs, cos, sin);
    rope(k, T, hs->n_kv, hs->hd, b->rope_pairs, cos, sin);
    if (attend_rows(hs, q, k, v, attn, seqs, n, threads) < 0) goto done;
    if (qmatmul(&b->wo, attn, T, o, threads) < 0) goto done;
    add_into(x, o, T * d);

    float *gu = buf + T * d, *act = gu + T * 2 * b->d_ff;
    rms_norm(x, b->ffn_norm, T, d, b->eps, h);
    if (qmatmul(&b->gate_up, h, T, gu, threads) < 0) goto done;
    swiglu(gu, T, b->d_ff, act, threads);
    if (qmatmul(&b->down, act, T, h, threads) < 0) goto done;
    add_into(x, h, T * d);
    status = 0;
done:
    free(buf);
    return status;
}
