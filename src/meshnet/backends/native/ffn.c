/*
 * The gated feed-forward of a block's rows: gate and up projections, the activation,
 * the down projection, biases where the family has them. Dense blocks run it once per
 * step, a mixture of experts once per chosen expert over the rows that chose it; either
 * way each row takes the same operations whatever else is in the batch.
 */
#include <string.h>

#include "native.h"

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

/* gpt-oss's clamped SwiGLU of a gate and up: x = min(g, 7), y = clamp(u, -7, 7),
 * x / (1 + e^(-1.702 x)) (y + 1). */
static inline __m256 swiglu_oai256(__m256 g, __m256 u) {
    const __m256 limit = _mm256_set1_ps(7.0f), one = _mm256_set1_ps(1.0f);
    const __m256 x = _mm256_min_ps(g, limit);
    const __m256 y =
        _mm256_max_ps(_mm256_min_ps(u, limit), _mm256_sub_ps(_mm256_setzero_ps(), limit));
    const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-1.702f), x));
    return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_add_ps(y, one));
}

static inline __m256 activate(__m256 g, __m256 u, int act) {
    if (act == ACT_SWIGLU_OAI) return swiglu_oai256(g, u);
    return _mm256_mul_ps(act == ACT_GELU ? gelu256(g) : silu256(g), u);
}

void glu(const float *gate, const float *up, Py_ssize_t stride, Py_ssize_t T, Py_ssize_t d_ff,
         float *out, int act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T > 1) /* one row: no team */
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *g = gate + t * stride, *u = up + t * stride;
        Py_ssize_t c = 0;
        for (; c + 8 <= d_ff; c += 8)
            _mm256_storeu_ps(out + t * d_ff + c,
                             activate(_mm256_loadu_ps(g + c), _mm256_loadu_ps(u + c), act));
        for (; c < d_ff; c++) { /* the same arithmetic, one lane */
            float gl[8] = {g[c]}, ul[8] = {u[c]};
            _mm256_storeu_ps(gl, activate(_mm256_loadu_ps(gl), _mm256_loadu_ps(ul), act));
            out[t * d_ff + c] = gl[0];
        }
    }
}

void add_into(float *x, const float *y, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) x[i] += y[i];
}

int all_q8(const qmat_t *ws, int n) {
    for (int i = 0; i < n; i++)
        if (!ws[i].q8 || ws[i].nb != ws[0].nb) return 0;
    return 1;
}

/* Adds a bias [n] to each of T rows of ``stride`` floats. */
static void add_rows(float *x, Py_ssize_t T, Py_ssize_t stride, const float *bias, Py_ssize_t n) {
    if (bias != NULL)
        for (Py_ssize_t t = 0; t < T; t++) add_into(x + t * stride, bias, n);
}

int ffn_rows(const ffn_t *f, Py_ssize_t d_ff, int act, const float *h, Py_ssize_t T,
             Py_ssize_t d, float *gu, float *act_buf, float *out, int threads, int wide) {
    if (f->n_gate_up == 1) {
        if (qmatmul(&f->gate_up[0], h, T, gu, threads, wide) < 0) return -1;
        add_rows(gu, T, 2 * d_ff, f->gate_bias, d_ff);
        for (Py_ssize_t t = 0; f->up_bias != NULL && t < T; t++)
            add_into(gu + t * 2 * d_ff + d_ff, f->up_bias, d_ff);
        glu(gu, gu + d_ff, 2 * d_ff, T, d_ff, act_buf, act, threads);
    } else {
        float *gate = gu, *up = gu + T * d_ff;
        if (all_q8(f->gate_up, 2)) {
            const qmat_t *ws[2] = {&f->gate_up[0], &f->gate_up[1]};
            float *outs[2] = {gate, up};
            if (q8matmul_many(ws, 2, h, T, outs, threads, wide) < 0) return -1;
        } else if (qmatmul(&f->gate_up[0], h, T, gate, threads, wide) < 0 ||
                   qmatmul(&f->gate_up[1], h, T, up, threads, wide) < 0) {
            return -1;
        }
        add_rows(gate, T, d_ff, f->gate_bias, d_ff);
        add_rows(up, T, d_ff, f->up_bias, d_ff);
        glu(gate, up, d_ff, T, d_ff, act_buf, act, threads);
    }
    if (qmatmul(&f->down, act_buf, T, out, threads, wide) < 0) return -1;
    add_rows(out, T, d, f->down_bias, d);
    return 0;
}
