/*
 * Attention for every row of a batch (rows of several sequences, each with its own KV
 * cache) in one call. Each (row, head) pair attends causally over its
 * sequence's positions with one fixed sequence of operations, whatever else is in the
 * batch, how many rows its sequence sends at once or how pairs are split among
 * threads: a row's output is bit-identical alone, batched, or replayed.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* Four keys' dot products with q over hd (a multiple of 8): per key one 8-lane FMA chain,
 * then the fixed horizontal sum; four chains side by side only to hide FMA latency. */
static inline void dot4(const float *q, const float *k, int hd, float *scores) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < hd; c += 8) {
        const __m256 qv = _mm256_loadu_ps(q + c);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + c), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + hd + c), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 2 * hd + c), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + 3 * hd + c), a3);
    }
    scores[0] = hsum256(a0);
    scores[1] = hsum256(a1);
    scores[2] = hsum256(a2);
    scores[3] = hsum256(a3);
}

static inline float dot(const float *q, const float *k, int hd) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < hd; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(k + c), acc);
    return hsum256(acc);
}

/* scores[0 .. n) <- their softmax weights: e^(s - max) in 8-lane chunks (each lane's
 * result its own), their total summed lane j % 8 then folded, each weight e / total.
 * A ``sink`` (NULL: none) is one more logit with no weight of its own: it joins the max
 * after the scores, and e^(sink - max) the folded total (llama.cpp's order). */
static void softmax(float *scores, Py_ssize_t n, const float *sink) {
    float top = -INFINITY;
    for (Py_ssize_t j = 0; j < n; j++) top = scores[j] > top ? scores[j] : top;
    if (sink != NULL && *sink > top) top = *sink;
    const __m256 vtop = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    for (Py_ssize_t j = 0; j < n; j += 8) {
        float lanes[8] = {0};
        const int m = n - j < 8 ? (int)(n - j) : 8;
        memcpy(lanes, scores + j, m * sizeof(float));
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(lanes), vtop));
        if (m < 8) { /* lanes past the end add nothing */
            _mm256_storeu_ps(lanes, e);
            memset(lanes + m, 0, (8 - m) * sizeof(float));
            e = _mm256_loadu_ps(lanes);
        }
        total = _mm256_add_ps(total, e);
        _mm256_storeu_ps(lanes, e);
        memcpy(scores + j, lanes, m * sizeof(float));
    }
    float sum = hsum256(total);
    if (sink != NULL) sum = sum + expf(*sink - top);
    for (Py_ssize_t j = 0; j < n; j++) scores[j] = scores[j] / sum;
}

/* Row ``i`` of sequence ``s``, head ``h``: softmax of its scores (q . k * scale, soft-capped
 * when the family says so; with the head's sink where there are sinks) times V over its
 * visible positions (0 .. first + i, or the last ``window`` of them), each output element
 * one FMA chain over the positions in order. ``scores`` has room for every visible
 * position. */
static void attend_pair(const heads_t *sh, const float *qs, float *outs, const seq_t *s,
                        Py_ssize_t i, int h, float *scores) {
    const int hd = sh->hd, kv = h / (sh->n_heads / sh->n_kv);
    const Py_ssize_t end = s->first + i + 1, row = s->row + i;
    const Py_ssize_t start = sh->window > 0 && end > sh->window ? end - sh->window : 0;
    const Py_ssize_t visible = end - start;
    const float *q = qs + (row * sh->n_heads + h) * hd;
    const float *keys = s->keys + (kv * s->capacity + start) * hd;
    const float *values = s->values + (kv * s->capacity + start) * hd;
    const float scale = sh->scale, cap = sh->softcap;
    Py_ssize_t j = 0;
    for (; j + 4 <= visible; j += 4) dot4(q, keys + j * hd, hd, scores + j);
    for (; j < visible; j++) scores[j] = dot(q, keys + j * hd, hd);
    for (j = 0; j < visible; j++) scores[j] = scores[j] * scale;
    if (cap > 0)
        for (j = 0; j < visible; j++) scores[j] = cap * tanhf(scores[j] / cap);
    softmax(scores, visible, sh->sinks != NULL ? sh->sinks + h : NULL);
    float *out = outs + (row * sh->n_heads + h) * hd;
    for (int c0 = 0; c0 < hd; c0 += 64) { /* up to eight 8-lane chains in registers */
        const int width = hd - c0 < 64 ? (hd - c0) / 8 : 8;
        __m256 acc[8];
        for (int k = 0; k < width; k++) acc[k] = _mm256_setzero_ps();
        for (j = 0; j < visible; j++) {
            const __m256 p = _mm256_set1_ps(scores[j]);
            const float *v = values + j * hd + c0;
            for (int k = 0; k < width; k++)
                acc[k] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * k), acc[k]);
        }
        for (int k = 0; k < width; k++) _mm256_storeu_ps(out + c0 + 8 * k, acc[k]);
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

int attend_rows(const heads_t *h, const float *q, const float *k, const float *v, float *out,
                const seq_t *seqs, Py_ssize_t n, int threads) {
    Py_ssize_t pairs = 0, longest = 1;
    for (Py_ssize_t e = 0; e < n; e++) {
        pairs += seqs[e].count * h->n_heads;
        if (seqs[e].first + seqs[e].count > longest) longest = seqs[e].first + seqs[e].count;
    }
    /* each pair: its sequence, and its index among that sequence's pairs */
    Py_ssize_t *pair = malloc((2 * pairs + 1) * sizeof(Py_ssize_t));
    if (pair == NULL) return -1;
    for (Py_ssize_t e = 0, p = 0; e < n; e++)
        for (Py_ssize_t i = 0; i < seqs[e].count * h->n_heads; i++, p++) {
            pair[2 * p] = e;
            pair[2 * p + 1] = i;
        }
    for (Py_ssize_t e = 0; e < n; e++) store_rows(&seqs[e], k, v, h->n_kv, h->hd);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(longest * sizeof(float));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (Py_ssize_t p = 0; p < pairs; p++) {
            if (scores == NULL) continue;
            const Py_ssize_t local = pair[2 * p + 1];
            attend_pair(h, q, out, &seqs[pair[2 * p]], local / h->n_heads,
                        (int)(local % h->n_heads), scores);
        }
        free(scores);
    }
    free(pair);
    return failed ? -1 : 0;
}
