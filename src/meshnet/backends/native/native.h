/*
 * Native kernels of the fast backend (AVX2 + FMA, float32 activations): what the
 * translation units share. Each kernel runs one fixed sequence of operations per
 * output element whatever the batch or the thread split (no -ffast-math; explicit
 * intrinsics), so a sequence's results are bit-identical alone or batched.
 */
#ifndef MESHNET_NATIVE_H
#define MESHNET_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>

#define QK 32 /* weights per block in every supported block type */

/* The GGUF block types the matmul reads. */
enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

/*
 * A [rows, nb * QK] matrix in row groups of GROUP_ROWS (the last one padded with zero
 * blocks). Per group and block, GROUP_BYTES[type] bytes: the 16 rows' float16 scales d,
 * for Q4_1 their float16 offsets m, then the quants column by column, one byte per row:
 * 16 columns for 4-bit blocks (byte i of a row holds its weights i and 16 + i, low
 * nibble first), 32 for Q8_0. So one load gives a column of 8 or 16 rows.
 */
#define GROUP_ROWS 16
extern const Py_ssize_t GROUP_BYTES[3];
typedef struct {
    const uint8_t *packed; /* ceil(rows / 16) * nb * GROUP_BYTES[type] bytes */
    Py_ssize_t rows, nb;
    int type;
} qmat_t;

/* out[t, r] = W[r] . x[t] for x [T, nb * QK]. Returns -1 when out of memory. */
int qmatmul(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads);

/* The same, bit for bit; allow_wide 0 keeps to AVX2's 8-row vectors even where AVX-512
 * would give 16-row ones (so tests can check that both agree). */
int qmatmul_tiles(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads,
                  int allow_wide);

/* One sequence's rows in a batch, and its cache of one layer. */
typedef struct {
    float *keys, *values; /* [n_kv, capacity, hd] each */
    Py_ssize_t capacity;
    Py_ssize_t first; /* positions before the new rows */
    Py_ssize_t count; /* new rows */
    Py_ssize_t row;   /* the first of them in the batch */
} seq_t;

typedef struct {
    int n_heads, n_kv, hd;
} heads_t;

/* Stores each sequence's new keys/values (k, v [T, n_kv, hd]) in its cache, then
 * out[row] = causal attention of q [T, n_heads, hd]; -1 when out of memory. */
int attend_rows(const heads_t *h, const float *q, const float *k, const float *v, float *out,
                const seq_t *seqs, Py_ssize_t n, int threads);

/* One transformer block's weights. */
typedef struct {
    qmat_t qkv;     /* [q | k | v] rows */
    qmat_t wo;      /* [d, n_heads * hd] */
    qmat_t gate_up; /* [gate | up] rows, 2 * d_ff */
    qmat_t down;    /* [d, d_ff] */
    const float *attn_norm, *ffn_norm; /* [d] */
    float eps;
    heads_t heads;
    Py_ssize_t d, d_ff, rope_pairs; /* rope_pairs: rotated (even, odd) pairs per head */
} block_t;

/* x [T, d] += the block's attention and feed-forward output for T rows at the
 * positions whose rotary tables are cos, sin [T, rope_pairs]; each sequence's new keys
 * and values are stored in its cache. -1 when out of memory: the step is then void
 * (x half updated, keys and values written past the committed positions only). */
int forward_block(const block_t *b, float *x, Py_ssize_t T, const float *cos, const float *sin,
                  const seq_t *seqs, Py_ssize_t n, int threads);

/* Adjacent-pair rotary embedding, in place, of x [T, heads, hd]: the first ``pairs``
 * (even, odd) pairs of each head turned by cos, sin [T, pairs]. */
void rope(float *x, Py_ssize_t T, int heads, int hd, Py_ssize_t pairs, const float *cos,
          const float *sin);

/* act [T, d_ff] = silu(gate) * up for gu [T, 2 * d_ff] = [gate | up]. */
void swiglu(const float *gu, Py_ssize_t T, Py_ssize_t d_ff, float *act, int threads);

/* e^x for every lane: range reduction by ln 2 and a degree-6 polynomial, ~1 ulp; lanes
 * below -87 or above 88 are taken as those limits. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

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

#endif
