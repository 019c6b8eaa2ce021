/*
 * The q8 backend's matmul: out[t, r] = W[r] . x[t] with x quantized to 8 bits first, as
 * llama.cpp multiplies a quantized file: each row of x in blocks of 32 (Q8_0 for Q4_0, Q5_0
 * and Q8_0 weights, Q8_1 for Q4_1 and Q5_1) or super-blocks of 256 (Q8_K for the
 * K-quants), then per
 * block an integer dot product of the weights' quants with the activations' (exact, in
 * any order), and the block results combined in float32 in one fixed order per
 * (row, token) pair, written out where q8_tile.h defines each type's tile. W is in the
 * q8 layout (native.h). Each vector lane is one output row, as in matmul.c, so the AVX2
 * and AVX-512 tiles do the same float operations lane for lane: the same bits, whatever
 * the batch, a row's place in it or the thread split.
 *
 * The activations are quantized as ggml's x86 code does: Q8_0/Q8_1 d = amax / 127 (kept
 * as float16), q = round-half-even(x * (127 / amax)), Q8_1's s = float16(d * sum q);
 * Q8_K (quantize_row_q8_K_ref) d = max / -127 for the value of largest magnitude,
 * q = min(127, round-half-even(x * (-127 / max))), with the sums of each 16 quants.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* One matmul's activations as 8-bit blocks. */
typedef struct {
    const qmat_t *w;
    const int8_t *xq; /* [T, cols] the quants */
    const float *xd;  /* [T, units] each block's (Q8_0, Q8_1) or super-block's (Q8_K) d */
    const float *xs;  /* [T, nb] Q8_1's s (Q4_1, Q5_1); NULL for the other types */
    const int32_t *xb; /* Q4_0, Q5_0, Q8_0: [T, nb] sum of each block's quants; Q4_K, Q5_K:
                        * [T, supers * 4] the sums of sub-blocks 2 i and 2 i + 1 (32 quants
                        * each) as int16 pairs (low half first); Q6_K: [T, supers * 8]
                        * likewise for its sub-blocks of 16. NULL for Q4_1, Q5_1. */
    float *out;       /* [T, rows] */
    Py_ssize_t T;
} q8job_t;

static float f16_round(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

static int32_t int16_pair(int32_t lo, int32_t hi) {
    return (int32_t)(((uint32_t)(uint16_t)(int16_t)lo) | ((uint32_t)(uint16_t)(int16_t)hi << 16));
}

/* Blocks of 32 of one row: quants q, per block d (float16-rounded), s and the sum of q. */
static void quantize_q8_0(const float *x, Py_ssize_t nb, int8_t *q, float *d, float *s,
                          int32_t *sums) {
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *v = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float dd = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QK; i++) {
            const int qi = (int)nearbyintf(v[i] * id);
            q[b * QK + i] = (int8_t)qi;
            sum += qi;
        }
        d[b] = f16_round(dd);
        if (s != NULL) s[b] = f16_round(dd * (float)sum);
        if (sums != NULL) sums[b] = sum;
    }
}

/* Super-blocks of 256 of one row (Q8_K): quants, d, and the sums of each ``width`` (16 or
 * 32) quants packed in int16 pairs (see q8job_t). */
static void quantize_q8_k(const float *x, Py_ssize_t supers, int width, int8_t *q, float *d,
                          int32_t *pairs) {
    const int pieces = QK_K / width;
    for (Py_ssize_t sb = 0; sb < supers; sb++) {
        const float *v = x + sb * QK_K;
        int8_t *qs = q + sb * QK_K;
        float amax = 0.0f, max = 0.0f;
        for (int i = 0; i < QK_K; i++)
            if (fabsf(v[i]) > amax) {
                amax = fabsf(v[i]);
                max = v[i];
            }
        int32_t sums[16] = {0};
        if (amax == 0.0f) {
            memset(qs, 0, QK_K);
            d[sb] = 0.0f;
        } else {
            const float iscale = -127.0f / max;
            for (int i = 0; i < QK_K; i++) {
                const int qi = (int)nearbyintf(iscale * v[i]);
                qs[i] = (int8_t)(qi < 127 ? qi : 127);
                sums[i / width] += qs[i];
            }
            d[sb] = 1.0f / iscale;
        }
        for (int k = 0; k < pieces; k += 2)
            pairs[sb * (pieces / 2) + k / 2] = int16_pair(sums[k], sums[k + 1]);
    }
}



#define Q8_AHEAD 4 /* blocks a tile fetches ahead (see matmul.c's PREFETCH_BLOCKS) */
#define WIDE_Q8 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw,avx512vnni")))

/* AVX2: eight rows per vector; the 8-bit products go through maddubs (pairs into int16,
 * kept below 2^15 by how many are summed) and madd (int16 pairs into int32). */
#define LANES 8
#define VEC __m256
#define IVEC __m256i
#define TARGET
#define SFX _avx2
#define TILE_MAX 4
#define KTILE_MAX 4
#define LDQ(p) _mm256_loadu_si256((const __m256i *)(p))
#define BX(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define BYTES15(z) _mm256_and_si256(z, _mm256_set1_epi8(15))
#define HIGH15(z) _mm256_and_si256(_mm256_srli_epi16(z, 4), _mm256_set1_epi8(15))
#define BMASK(z, k) _mm256_and_si256(z, _mm256_set1_epi8(k))
#define SLLI32 _mm256_slli_epi32
#define SRLI32 _mm256_srli_epi32
#define ORI _mm256_or_si256
#define IZERO _mm256_setzero_si256
#define PZERO _mm256_setzero_si256
/* P += w . x for unsigned w (below 64) and signed x, 4 bytes a lane (partial: int16 pairs) */
#define DOTU(P, w, x) _mm256_add_epi16(P, _mm256_maddubs_epi16(w, x))
#define PFLUSH(P) _mm256_madd_epi16(P, _mm256_set1_epi16(1))
#define PSCALE(P, sc) _mm256_madd_epi16(P, _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16)))
/* I += w . x for signed w (never -128: see quant_layouts) and x, exact in int32 */
#define DOTS(I, w, x) _mm256_add_epi32(I, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x)), _mm256_set1_epi16(1)))
#define DOTS_BIAS 0 /* DOTS adds (w + DOTS_BIAS) . x */
#define MADD16 _mm256_madd_epi16
#define ADDI _mm256_add_epi32
#define SUBI _mm256_sub_epi32
#define MULLO _mm256_mullo_epi32
#define SET1I _mm256_set1_epi32
#define U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define S8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define CVT _mm256_cvtepi32_ps
#define MUL _mm256_mul_ps
#define FMA _mm256_fmadd_ps
#define FNMA _mm256_fnmadd_ps
#define SET1 _mm256_set1_ps
#define ZERO _mm256_setzero_ps
#define STORE store_rows8
#include "q8_tile.h"

/* AVX-512 with VNNI: sixteen rows per vector, vpdpbusd sums four 8-bit products into each
 * int32 lane exactly. */
#define LANES 16
#define VEC __m512
#define IVEC __m512i
#define TARGET WIDE_Q8
#define SFX _avx512
#define TILE_MAX 12
#define KTILE_MAX 8
#define LDQ(p) _mm512_loadu_si512((const void *)(p))
#define BX(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define BYTES15(z) _mm512_and_si512(z, _mm512_set1_epi8(15))
#define HIGH15(z) _mm512_and_si512(_mm512_srli_epi16(z, 4), _mm512_set1_epi8(15))
#define BMASK(z, k) _mm512_and_si512(z, _mm512_set1_epi8(k))
#define SLLI32 _mm512_slli_epi32
#define SRLI32 _mm512_srli_epi32
#define ORI _mm512_or_si512
#define IZERO _mm512_setzero_si512
#define PZERO _mm512_setzero_si512
#define DOTU(P, w, x) _mm512_dpbusd_epi32(P, w, x)
#define PFLUSH(P) (P)
#define PSCALE(P, sc) _mm512_mullo_epi32(P, sc)
#define DOTS(I, w, x) _mm512_dpbusd_epi32(I, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), x)
#define DOTS_BIAS 128
#define MADD16 _mm512_madd_epi16
#define ADDI _mm512_add_epi32
#define SUBI _mm512_sub_epi32
#define MULLO _mm512_mullo_epi32
#define SET1I _mm512_set1_epi32
#define U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define S8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define CVT _mm512_cvtepi32_ps
#define MUL _mm512_mul_ps
#define FMA _mm512_fmadd_ps
#define FNMA _mm512_fnmadd_ps
#define SET1 _mm512_set1_ps
#define ZERO _mm512_setzero_ps
#define STORE store_rows16
#include "q8_tile.h"

static int cpu_has_vnni(void) { return __builtin_cpu_supports("avx512vnni"); }

/* The activations' arrays for one matmul, in one allocation; NULL when out of memory. */
static void *quantize_rows(const qmat_t *w, const float *x, Py_ssize_t T, q8job_t *j) {
    const Py_ssize_t nb = w->nb, cols = nb * QK, supers = nb / (QK_K / QK);
    const int kq = IS_KQUANT(w->type), width = w->type == Q6_K ? 16 : 32;
    const Py_ssize_t units = kq ? supers : nb, pairs = kq ? supers * (QK_K / width / 2) : nb;
    const size_t bytes = T * cols + T * (units + nb) * sizeof(float) + T * pairs * 4 + 64;
    uint8_t *buf = malloc(bytes);
    if (buf == NULL) return NULL;
    float *xd = (float *)buf, *xs = xd + T * units;
    int32_t *xb = (int32_t *)(xs + T * nb);
    int8_t *xq = (int8_t *)(xb + T * pairs);
    const int q8_1 = w->type == Q4_1 || w->type == Q5_1; /* weights with an offset m */
    for (Py_ssize_t t = 0; t < T; t++) {
        if (kq)
            quantize_q8_k(x + t * cols, supers, width, xq + t * cols, xd + t * units,
                          xb + t * pairs);
        else
            quantize_q8_0(x + t * cols, nb, xq + t * cols, xd + t * nb,
                          q8_1 ? xs + t * nb : NULL, q8_1 ? NULL : xb + t * nb);
    }
    j->xq = xq;
    j->xd = xd;
    j->xs = q8_1 ? xs : NULL;
    j->xb = q8_1 ? NULL : xb;
    return buf;
}

int q8matmul(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads, int wide) {
    q8job_t j = {w, NULL, NULL, NULL, NULL, out, T};
    void *buf = quantize_rows(w, x, T, &j);
    if (buf == NULL) return -1;
    const int isa512 = wide && wide_isa_selected() && cpu_has_vnni();
    const int lanes = isa512 ? 16 : 8;
    const Py_ssize_t vectors = (w->rows + lanes - 1) / lanes, unit = T == 1 ? 4 : 2;
    const Py_ssize_t units = (vectors + unit - 1) / unit;
#pragma omp parallel for schedule(dynamic, 2) num_threads(threads)
    for (Py_ssize_t u = 0; u < units; u++) {
        const Py_ssize_t v0 = u * unit, v1 = v0 + unit < vectors ? v0 + unit : vectors;
        if (isa512) q8rows_avx512(&j, v0, v1);
        else q8rows_avx2(&j, v0, v1);
    }
    free(buf);
    return 0;
}
