/*
 * The q8 backend's matmul: out[t, r] = W[r] . x[t] with x quantized to 8 bits first, as
 * llama.cpp multiplies a quantized file: each row of x in blocks of 32 (Q8_0 for Q4_0, Q5_0,
 * Q8_0 and MXFP4 weights, Q8_1 for Q4_1 and Q5_1) or super-blocks of 256 (Q8_K for the
 * K-quants), then per
 * block an integer dot product of the weights' quants with the activations' (exact, in
 * any order), and the block results combined in float32 in one fixed order per
 * (row, token) pair, written out where q8_tile.h defines each type's tile. W is in the
 * q8 layout (native.h). Each vector lane is one output row, as in matmul.c, so the AVX2
 * and AVX-512 tiles do the same float operations lane for lane: the same bits, whatever
 * the batch, a row's place in it or the thread split. The activations are quantized as
 * q8_quantize.h says.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fp4.h"
#include "isa.h"
#include "kscales.h"
#include "native.h"
#include "q8_quantize.h"
#include "split.h"

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
    const int16_t *xw; /* Q8_0 in AVX2's batch tiles: [T, cols] the quants widened to
                        * int16, each four as x0, x2, x1, x3 (q8_avx2.h's pairs_tile);
                        * NULL where they are not made (q8matmul_many) */
    float *out;       /* [T, rows] */
    Py_ssize_t T;
} q8job_t;

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
/* Q6_K's sums are added to their accumulators once per sub-block of 16 (spilled, they
 * cost a load and a store there) and its 6-bit unpacking, ~16 operations a sub-block, is
 * shared by every token of a tile: against tiles of 4, tiles of 8 ran Q6_K's 64-token
 * calls 1.14-1.35x and 8-token calls 1.05-1.14x (bench/q8_kernel.py --types Q6_K --isa
 * avx2 --settings hot), the Llama-3.2-1B shape's 4k prefill 1.05x; Q5_K's 0.93-1.06x, so
 * its tiles stay at 4 */
#define K6TILE_MAX 8
#define LDQ(p) _mm256_loadu_si256((const __m256i *)(p))
#define BX(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define BYTES15(z) _mm256_and_si256(z, _mm256_set1_epi8(15))
#define HIGH15(z) _mm256_and_si256(_mm256_srli_epi16(z, 4), _mm256_set1_epi8(15))
#define BMASK(z, k) _mm256_and_si256(z, _mm256_set1_epi8(k))
#define SLLI32 _mm256_slli_epi32
#define SRLI32 _mm256_srli_epi32
#define SRAI32 _mm256_srai_epi32
#define ORI _mm256_or_si256
#define IZERO _mm256_setzero_si256
#define PZERO _mm256_setzero_si256
/* P += w . x for unsigned w (below 64) and signed x, 4 bytes a lane (partial: int16 pairs) */
#define DOTU(P, w, x) _mm256_add_epi16(P, _mm256_maddubs_epi16(w, x))
#define PFLUSH(P) _mm256_madd_epi16(P, _mm256_set1_epi16(1))
#define ADD16 _mm256_add_epi16
#define PSCALE(P, sc) _mm256_madd_epi16(P, _mm256_or_si256(_mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(sc, 16)))
/* I += w . x for signed w (never -128: see quant_layouts) and x, exact in int32 */
#define DOTS(I, w, x) _mm256_add_epi32(I, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(x), _mm256_sign_epi8(w, x)), _mm256_set1_epi16(1)))
#define DOTS_BIAS 0 /* DOTS adds (w + DOTS_BIAS) . x */
/* DOTS with the weights' side made once for a tile's tokens (wp = WPREP(w)): |w| . (x
 * signed by w), exact as DOTS (x is never -128 either); DOTS's |x| is made per token */
#define WPREP(w) _mm256_abs_epi8(w)
#define DOTSW(I, wp, w, x) _mm256_add_epi32(I, _mm256_madd_epi16(_mm256_maddubs_epi16(wp, _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1)))
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
#define LUT16 _mm256_shuffle_epi8
#define FP4_BIASED fp4_biased8()
#define FP4_SCALES(p) fp4_scales8(U8(p))
#define KSCALES kscales_unpack_avx2
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
#define K6TILE_MAX 8
#define LDQ(p) _mm512_loadu_si512((const void *)(p))
#define BX(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define BYTES15(z) _mm512_and_si512(z, _mm512_set1_epi8(15))
#define HIGH15(z) _mm512_and_si512(_mm512_srli_epi16(z, 4), _mm512_set1_epi8(15))
#define BMASK(z, k) _mm512_and_si512(z, _mm512_set1_epi8(k))
#define SLLI32 _mm512_slli_epi32
#define SRLI32 _mm512_srli_epi32
#define SRAI32 _mm512_srai_epi32
#define ORI _mm512_or_si512
#define IZERO _mm512_setzero_si512
#define PZERO _mm512_setzero_si512
#define DOTU(P, w, x) _mm512_dpbusd_epi32(P, w, x)
#define PFLUSH(P) (P)
#define PSCALE(P, sc) _mm512_mullo_epi32(P, sc)
#define DOTS(I, w, x) _mm512_dpbusd_epi32(I, _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80)), x)
#define DOTS_BIAS 128
#define WPREP(w) _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80))
#define DOTSW(I, wp, w, x) _mm512_dpbusd_epi32(I, wp, x)
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
#define LUT16 _mm512_shuffle_epi8
#define FP4_BIASED fp4_biased16()
#define FP4_SCALES(p) fp4_scales16(U8(p))
#define KSCALES kscales_unpack_avx512
#include "q8_tile.h"

static int cpu_has_vnni(void) { return __builtin_cpu_supports("avx512vnni"); }

/* One input's rows quantized for every matmul that shares it: Q8_0 blocks of 32 (with
 * Q8_1's s and the quants' sums, so Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 all take them) where
 * ``blocks``, Q8_K super-blocks (with the sums of 32 and of 16 quants as asked) where a
 * K-quant takes them, the blocks' quants widened to int16 pairs too where ``pairs`` (a
 * Q8_0 matrix in AVX2's batch tiles). One allocation, ``buf``; NULL when out of memory. */
typedef struct {
    void *buf;
    int8_t *bq, *kq;       /* [T, cols] the quants of the blocks of 32, of the super-blocks */
    float *bd, *bs, *kd;   /* [T, nb] d and s of the blocks; [T, supers] d of the supers */
    int32_t *bsum;         /* [T, nb] the blocks' sums of quants */
    int32_t *k32, *k16;    /* [T, supers * 4], [T, supers * 8] the Q8_K sums' int16 pairs */
    int16_t *bw;           /* [T, cols] bq widened, each four as x0, x2, x1, x3 (q8job_t) */
} q8input_t;

static void *quantize_input(const float *x, Py_ssize_t T, Py_ssize_t nb, int blocks, int k32,
                            int k16, int pairs, q8input_t *in) {
    const Py_ssize_t cols = nb * QK, supers = nb / (QK_K / QK);
    const int kq = k32 || k16;
    const size_t floats = T * ((blocks ? 2 * nb : 0) + (kq ? supers : 0));
    const size_t ints = T * ((blocks ? nb : 0) + (k32 ? 4 * supers : 0) + (k16 ? 8 * supers : 0));
    const size_t bytes = (floats + ints) * 4 + T * cols * (blocks + kq + 2 * pairs) + 64;
    uint8_t *buf = malloc(bytes);
    if (buf == NULL) return NULL;
    memset(in, 0, sizeof(*in));
    in->buf = buf;
    float *f = (float *)buf;
    if (blocks) {
        in->bd = f;
        in->bs = f + T * nb;
        f += 2 * T * nb;
    }
    if (kq) {
        in->kd = f;
        f += T * supers;
    }
    int32_t *i = (int32_t *)f;
    if (blocks) {
        in->bsum = i;
        i += T * nb;
    }
    if (k32) {
        in->k32 = i;
        i += T * 4 * supers;
    }
    if (k16) {
        in->k16 = i;
        i += T * 8 * supers;
    }
    if (pairs) {
        in->bw = (int16_t *)i;
        i += T * cols / 2;
    }
    int8_t *q = (int8_t *)i;
    if (blocks) {
        in->bq = q;
        q += T * cols;
    }
    if (kq) in->kq = q;
    for (Py_ssize_t t = 0; t < T; t++) {
        if (blocks)
            quantize_q8_0(x + t * cols, nb, in->bq + t * cols, in->bd + t * nb, in->bs + t * nb,
                          in->bsum + t * nb);
        if (pairs) widen_pairs(in->bq + t * cols, cols, in->bw + t * cols);
        if (kq)
            quantize_q8_k(x + t * cols, supers, in->kq + t * cols, in->kd + t * supers,
                          k32 ? in->k32 + t * 4 * supers : NULL,
                          k16 ? in->k16 + t * 8 * supers : NULL);
    }
    return buf;
}

/* Matrix w's job on the quantized input. */
static q8job_t job_of(const qmat_t *w, const q8input_t *in, float *out, Py_ssize_t T) {
    const int q8_1 = w->type == Q4_1 || w->type == Q5_1; /* weights with an offset m */
    if (IS_KQUANT(w->type))
        return (q8job_t){w, in->kq, in->kd, NULL, w->type == Q6_K ? in->k16 : in->k32, NULL, out, T};
    return (q8job_t){w,   in->bq, in->bd, q8_1 ? in->bs : NULL, q8_1 ? NULL : in->bsum,
                     w->type == Q8_0 ? in->bw : NULL, out, T};
}

#define MANY_MAX 4 /* matrices one q8matmul_many takes */
/* Most tokens whose Q8_0 activations are widened for AVX2's pairs_tile (q8_avx2.h): a
 * decode step's streams and short prompts; a long prompt keeps the shared tiles rather
 * than hold 2 more bytes per activation (b=16, 64 ran ~1.06x with them). */
#define PAIRS_MAX_T 64

/* Tokens [t0, t0 + n) of job j: its rows, the activations and outputs of those tokens. */
static q8job_t job_tokens(const q8job_t *j, Py_ssize_t t0, Py_ssize_t n) {
    const qmat_t *w = j->w;
    const Py_ssize_t supers = w->nb / (QK_K / QK);
    const int k = IS_KQUANT(w->type);
    q8job_t part = *j;
    part.xq += t0 * w->nb * QK;
    part.xd += t0 * (k ? supers : w->nb);
    if (part.xs != NULL) part.xs += t0 * w->nb;
    if (part.xb != NULL) part.xb += t0 * (!k ? w->nb : w->type == Q6_K ? 8 * supers : 4 * supers);
    if (part.xw != NULL) part.xw += t0 * w->nb * QK;
    part.out += t0 * w->rows;
    part.T = n;
    return part;
}

/* Tokens a block of a long batch: each row vector runs every token of a block before
 * the next (the rows' weights meet the block's activations while they are in L2, about
 * 192 KB of them), not every token of the batch (at 16,384 tokens 10-34 MB of them,
 * read again from memory for every row vector: one thread, Q5_0 2048x640 and Q6_K
 * 640x2048 ran 87 and 88 GMAC/s; in calls of 256 tokens 108 and 120). A multiple of 12. */
static Py_ssize_t token_block(Py_ssize_t cols) {
    const Py_ssize_t t = (192 << 10) / cols / 12 * 12;
    return t < 48 ? 48 : t > 1008 ? 1008 : t;
}

int q8matmul_many(const qmat_t *const *ws, int n, const float *x, Py_ssize_t T,
                  float *const *outs, int threads, int wide) {
    if (n < 1 || n > MANY_MAX) return -1;
    if (threads < 1) threads = 1;
    const int isa512 = wide && wide_isa_selected() && cpu_has_vnni();
    int blocks = 0, k32 = 0, k16 = 0, pairs = 0;
    for (int i = 0; i < n; i++) {
        if (ws[i]->nb != ws[0]->nb) return -1;
        blocks |= !IS_KQUANT(ws[i]->type);
        k16 |= ws[i]->type == Q6_K;
        k32 |= ws[i]->type == Q4_K || ws[i]->type == Q5_K;
        pairs |= ws[i]->type == Q8_0 && !isa512 && T >= 2 && T <= PAIRS_MAX_T;
    }
    q8input_t in;
    if (quantize_input(x, T, ws[0]->nb, blocks, k32, k16, pairs, &in) == NULL) return -1;
    const int lanes = isa512 ? 16 : 8;
    const Py_ssize_t unit = T == 1 ? 4 : 2;
    /* a long batch in blocks of tokens, each block's units split among the threads as
     * split.h says; a thread goes on to the next block without waiting for the others */
    const Py_ssize_t per = T >= 2 * token_block(ws[0]->nb * QK) ? token_block(ws[0]->nb * QK) : T;
    const Py_ssize_t sets = (T + per - 1) / per;
    q8job_t jobs[MANY_MAX];
    Py_ssize_t vectors[MANY_MAX], first[MANY_MAX + 1] = {0}; /* each matrix's first unit */
    for (int i = 0; i < n; i++) {
        jobs[i] = job_of(ws[i], &in, outs[i], T);
        vectors[i] = (ws[i]->rows + lanes - 1) / lanes;
        first[i + 1] = first[i] + (vectors[i] + unit - 1) / unit;
    }
    if (threads == 1) { /* a mixture's experts each on a thread of their own: no team */
        for (Py_ssize_t s = 0; s < sets; s++)
            for (int i = 0; i < n; i++) {
                const Py_ssize_t t0 = s * per;
                const q8job_t job = job_tokens(&jobs[i], t0, T - t0 < per ? T - t0 : per);
                if (isa512) q8rows_avx512(&job, 0, vectors[i]);
                else q8rows_avx2(&job, 0, vectors[i]);
            }
        free(in.buf);
        return 0;
    }
    /* one team for all the matrices, their units in one sequence split as split.h says */
    split_run_t *runs = split_runs_many(first[n], threads, sets);
    if (runs == NULL) {
        free(in.buf);
        return -1;
    }
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num();
        for (Py_ssize_t s = 0; s < sets; s++) {
            const Py_ssize_t t0 = s * per, count = T - t0 < per ? T - t0 : per;
            for (int64_t u; (u = split_next(runs + s * threads, threads, me)) >= 0;) {
                int i = 0;
                while (u >= first[i + 1]) i++;
                const Py_ssize_t v0 = (u - first[i]) * unit;
                const Py_ssize_t v1 = v0 + unit < vectors[i] ? v0 + unit : vectors[i];
                const q8job_t job = sets == 1 ? jobs[i] : job_tokens(&jobs[i], t0, count);
                if (isa512) q8rows_avx512(&job, v0, v1);
                else q8rows_avx2(&job, v0, v1);
            }
        }
    }
    free(runs);
    free(in.buf);
    return 0;
}

int q8matmul(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads, int wide) {
    return q8matmul_many(&w, 1, x, T, &out, threads, wide);
}
