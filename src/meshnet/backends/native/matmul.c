/*
 * Quantized matmul: out[t, r] = W[r] . x[t] for W in any block type of native.h, read
 * from its layout there: each vector lane is one output row, so a block column unpacks
 * for 8 or 16 rows at once and every token's value is a broadcast. No sums across
 * lanes, no fold at the end.
 *
 * The fixed order for Q4_0, Q4_1 and Q8_0, per (row, token) pair and block in order: the block's sum s = q . x
 * as one FMA chain from zero over columns i, 16 + i for i = 0 .. 15 (4-bit) or 0 .. 31
 * (8-bit), with q the integer quants (exact in float32); then acc = fma(d, s, acc) and,
 * for 4-bit blocks, acc = fma(m, sum of x over the block, acc); acc starts at zero.
 * MXFP4 likewise over columns i, 16 + i with q = k 2^24 (k its E2M1 value doubled, an
 * exact float32), then acc = fma(d, s 2^-24, acc), d = 2^(e - 128): no offset term.
 * (Scaling once per block, not every weight, spares the FMA units a multiply per
 * unpacked column.) The K-quants' order and the row-wise types' are given where
 * matmul_tile.h defines their tiles (ktile, ftile). How many pairs run side by side changes with the batch size only
 * to keep the FMA units busy, never that order: results do not depend on the batch
 * size, a row's place in it, the thread split or the vector width.
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "fp4.h"
#include "isa.h"
#include "kscales.h"
#include "native.h"

typedef struct {
    const qmat_t *w;
    const float *x;  /* T * cols */
    const float *xp; /* the unpacked tiles' tokens, see pack_tokens; NULL where unused */
    const float *sx; /* per token, sums of x over each block (4- and 5-bit types) or
                      * each 16 columns (Q6_K), in order; NULL for the other types */
    float *out;      /* T * rows */
    Py_ssize_t T;
} job_t;

/* Tiles of two tokens or more fetch the block this many ahead themselves: they spend
 * long enough on each block that the hardware prefetcher fell behind (4-8 tokens ran
 * 10-15% faster with it). A lone token on 16-lane vectors streams as fast without (its
 * tile reads four groups at once); on 8-lane vectors, two groups at a time, it fetches
 * too (once per group): every layer of the bundled model, one token, one thread, 9.0 ->
 * 7.5 ms when the weights come from memory, not cache. */
#define PREFETCH_BLOCKS 4

/* Batches from this many tokens up take the AVX2 tiles that unpack each group's quants once
 * (matmul_tile.h, unpacked_rows). */
#ifndef AVX2_UNPACK_MIN_T
#define AVX2_UNPACK_MIN_T 16
#endif
#define UNPACK_BLOCKS 64 /* blocks unpacked at a time: 128 KB of a group's quants */
#define UNPACK_TT 6      /* tokens per unpacked tile: 2 x 6 chains, 2 weights, 1 token */

#define WIDE __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw")))

/* dst[c * dst_stride + r] = src[r * src_stride + c] for an 8 x 8 block of floats (the
 * row-wise types' tiles, unpacked a row at a time, turned into columns of rows). */
static inline void transpose8(const float *src, Py_ssize_t src_stride, float *dst,
                              Py_ssize_t dst_stride) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * src_stride);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * dst_stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * dst_stride,
                         _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* AVX2: eight rows per vector, 16 registers: tiles of two row vectors x 4 tokens. */
#define LANES 8
#define VEC __m256
#define IVEC __m256i
#define TARGET
#define SFX _avx2
#define TILE_MAX 4
#define BATCH_RV 2
#define U8(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define S8(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p)))
#define HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define AND15(z) _mm256_and_si256(z, _mm256_set1_epi32(15))
#define SHR4(z) _mm256_srli_epi32(z, 4)
#define CVT _mm256_cvtepi32_ps
#define MUL _mm256_mul_ps
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
#define ZERO _mm256_setzero_ps
#define STORE store_rows8
#define SRL(z, n) _mm256_srl_epi32(z, _mm_cvtsi32_si128(n))
#define SLL(z, n) _mm256_sll_epi32(z, _mm_cvtsi32_si128(n))
#define ANDI(z, k) _mm256_and_si256(z, _mm256_set1_epi32(k))
#define ORI(a, b) _mm256_or_si256(a, b)
#define SUBI(z, k) _mm256_sub_epi32(z, _mm256_set1_epi32(k))
#define ADD _mm256_add_ps
#define FNMA _mm256_fnmadd_ps
#define LOAD _mm256_load_ps
#define OR_AND(a, b, k) _mm256_or_si256(a, _mm256_and_si256(b, _mm256_set1_epi32(k)))
#define FP4_COLUMN(p, lo, hi) fp4_column8(p, &(lo), &(hi))
#define FP4_SCALES(p) fp4_scales8(U8(p))
#define UNPACK_MIN_T AVX2_UNPACK_MIN_T
#define KSCALES kscales_unpack_avx2
#include "matmul_tile.h"

/* AVX-512: sixteen rows per vector (a whole group), 32 registers: batches take tiles
 * of one row vector x up to 12 tokens (fewer unpacked columns per FMA than 2 x 6). */
#define LANES 16
#define VEC __m512
#define IVEC __m512i
#define TARGET WIDE
#define SFX _avx512
#define TILE_MAX 12
#define BATCH_RV 1
#define U8(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define S8(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))
#define HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define AND15(z) _mm512_and_si512(z, _mm512_set1_epi32(15))
#define SHR4(z) _mm512_srli_epi32(z, 4)
#define CVT _mm512_cvtepi32_ps
#define MUL _mm512_mul_ps
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#define ZERO _mm512_setzero_ps
#define STORE store_rows16
#define SRL(z, n) _mm512_srl_epi32(z, _mm_cvtsi32_si128(n))
#define SLL(z, n) _mm512_sll_epi32(z, _mm_cvtsi32_si128(n))
#define ANDI(z, k) _mm512_and_si512(z, _mm512_set1_epi32(k))
#define ORI(a, b) _mm512_or_si512(a, b)
#define SUBI(z, k) _mm512_sub_epi32(z, _mm512_set1_epi32(k))
#define ADD _mm512_add_ps
#define FNMA _mm512_fnmadd_ps
#define LOAD _mm512_load_ps
#define OR_AND(a, b, k) _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi32(k), 0xF8)
#define FP4_COLUMN(p, lo, hi) fp4_column16(p, &(lo), &(hi))
#define FP4_SCALES(p) fp4_scales16(U8(p))
#define UNPACK_MIN_T 0 /* its in-register tiles of 12 tokens unpack little per FMA */
#define KSCALES kscales_unpack_avx512
#include "matmul_tile.h"

/* Per token, the sums of x over each piece of ``width`` columns, in order (the offsets
 * multiply them: 4-bit blocks' m, the K-quants' mins, Q6_K's -32). */
static void piece_sums(const float *x, Py_ssize_t T, Py_ssize_t cols, int width, float *sx) {
    const Py_ssize_t pieces = cols / width;
    for (Py_ssize_t t = 0; t < T; t++)
        for (Py_ssize_t b = 0; b < pieces; b++) {
            const float *v = x + t * cols + b * width;
            float s = 0.0f;
            for (int i = 0; i < width; i++) s += v[i];
            sx[t * pieces + b] = s;
        }
}

/* The tokens of each unpacked tile (UNPACK_TT wide, as even as unpacked_rows makes them)
 * rearranged so that one block's values lie in FMA chain order, a column's tokens side
 * by side: tile at t0 of width TT, block b, chain step k, token t at
 * xp[t0 * cols + (b * QK + k) * TT + t]. Its broadcasts then have constant offsets. */
static void pack_tokens(const float *x, Py_ssize_t T, Py_ssize_t nb, int in_order, float *xp) {
    const Py_ssize_t cols = nb * QK, tiles = (T + UNPACK_TT - 1) / UNPACK_TT;
    Py_ssize_t t0 = 0;
    for (Py_ssize_t i = 0; i < tiles; i++) {
        const int width = (int)(T / tiles + (i < T % tiles));
        for (Py_ssize_t b = 0; b < nb; b++)
            for (int k = 0; k < QK; k++) {
                const int c = in_order ? k : (k % 2 ? QK / 2 + k / 2 : k / 2);
                for (int t = 0; t < width; t++)
                    xp[t0 * cols + (b * QK + k) * width + t] = x[(t0 + t) * cols + b * QK + c];
            }
        t0 += width;
    }
}

int qmatmul(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads, int wide) {
    if (w->q8) return q8matmul(w, x, T, out, threads, wide);
    float *sx = NULL;
    const int type = w->type;
    if (type != Q8_0 && type != MXFP4 && (IS_BLOCKWISE(type) || IS_KQUANT(type))) {
        const int width = type == Q6_K ? 16 : QK;
        sx = malloc((T * w->nb * (QK / width) + 1) * sizeof(float));
        if (sx == NULL) return -1;
        piece_sums(x, T, w->nb * QK, width, sx);
    }
    const int isa512 = wide && wide_isa_selected();
    const int lanes = isa512 ? 16 : 8;
    /* The AVX2 batches' unpacked tiles: their tokens packed, and per thread the unpacked
     * quants and sums. */
    float *scratch = NULL, *xp = NULL;
    Py_ssize_t per_thread = 0;
    if (!isa512 && T >= AVX2_UNPACK_MIN_T && IS_BLOCKWISE(type)) {
        per_thread = (UNPACK_BLOCKS * QK + T) * GROUP_ROWS;
        scratch = aligned_alloc(64, (size_t)threads * per_thread * sizeof(float));
        xp = malloc(T * w->nb * QK * sizeof(float));
        if (scratch == NULL || xp == NULL) {
            free(scratch);
            free(xp);
            free(sx);
            return -1;
        }
        pack_tokens(x, T, w->nb, type == Q8_0, xp);
    }
    const job_t j = {w, x, xp, sx, out, T};
    /* Threads take whole tiles of row vectors (four for a lone token, else two), a few
     * at a time as they come free: on a shared machine one core may run slower. */
    const Py_ssize_t vectors = (w->rows + lanes - 1) / lanes, unit = T == 1 ? 4 : 2;
    const Py_ssize_t units = (vectors + unit - 1) / unit;
#pragma omp parallel num_threads(threads)
    {
        float *mine = scratch == NULL ? NULL : scratch + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 2)
        for (Py_ssize_t u = 0; u < units; u++) {
            const Py_ssize_t v0 = u * unit, v1 = v0 + unit < vectors ? v0 + unit : vectors;
            if (isa512) rows_avx512(&j, v0, v1, mine);
            else rows_avx2(&j, v0, v1, mine);
        }
    }
    free(scratch);
    free(xp);
    free(sx);
    return 0;
}
