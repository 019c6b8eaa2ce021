/*
 * Quantized matmul: out[t, r] = W[r] . x[t] for W in Q4_0, Q4_1 or Q8_0 blocks of 32
 * weights, the quants read straight from the GGUF's bytes and the block scales (and
 * offsets) from float32 copies. How many (row, token) pairs share registers changes
 * with the batch size only to keep the FMA units busy (see "Every (row, token) pair").
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

const Py_ssize_t BLOCK_BYTES[3] = {18, 20, 34};

/*
 * Unpacking uses only in-lane byte shuffles of the block broadcast to both 128-bit
 * halves (cheap on every AVX2 core), never the cross-lane widening moves.
 * Shuffle selectors: 32-bit lane i takes byte i (SEL_LO) or byte 8 + i (SEL_HI), as its
 * low byte (4-bit blocks) or as its top byte (8-bit blocks: an arithmetic shift then
 * sign-extends it).
 */
#define Z -1
#define LOW(a, b, c, d) a, Z, Z, Z, b, Z, Z, Z, c, Z, Z, Z, d, Z, Z, Z
#define TOP(a, b, c, d) Z, Z, Z, a, Z, Z, Z, b, Z, Z, Z, c, Z, Z, Z, d

/* 32 weights of a 4-bit block as four vectors of 8 floats, already times d. */
static inline void unpack_q4(const uint8_t *q, const float *d, __m256 w[4]) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    const __m256i lo = _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(LOW(0, 1, 2, 3), LOW(4, 5, 6, 7)));
    const __m256i hi =
        _mm256_shuffle_epi8(bytes, _mm256_setr_epi8(LOW(8, 9, 10, 11), LOW(12, 13, 14, 15)));
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    const __m256 vd = _mm256_broadcast_ss(d);
    w[0] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(lo, nibble)));
    w[1] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_and_si256(hi, nibble)));
    w[2] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)));
    w[3] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)));
}

static inline void unpack_q8(const int8_t *q, const float *d, __m256 w[4]) {
    const __m256 vd = _mm256_broadcast_ss(d);
    const __m256i sel_lo = _mm256_setr_epi8(TOP(0, 1, 2, 3), TOP(4, 5, 6, 7));
    const __m256i sel_hi = _mm256_setr_epi8(TOP(8, 9, 10, 11), TOP(12, 13, 14, 15));
    for (int h = 0; h < 2; h++) {
        const __m256i bytes =
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
        const __m256i a = _mm256_srai_epi32(_mm256_shuffle_epi8(bytes, sel_lo), 24);
        const __m256i b = _mm256_srai_epi32(_mm256_shuffle_epi8(bytes, sel_hi), 24);
        w[2 * h] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(a));
        w[2 * h + 1] = _mm256_mul_ps(vd, _mm256_cvtepi32_ps(b));
    }
}
#undef LOW
#undef TOP
#undef Z

/* A float16 scale or offset of a block, as float32 (exactly). A batch of under four
 * tokens reads each block once, so reading scales from the block's own bytes saves
 * memory traffic (a fifth of it); larger batches unpack each row once and read the
 * float32 copies, which is faster there. The values are the same. */
static inline float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

typedef struct {
    const qmat_t *w;
    int isa512;      /* AVX-512 (F, VL, DQ) may be used */
    int wide;        /* AVX-512VL register tiles for batches of 4 tokens or more */
    const float *x;  /* T * cols */
    const float *sx; /* T * nb block sums of x (Q4 only) */
    float *out;      /* T * rows */
    Py_ssize_t T;
} job_t;

/*
 * Every (row, token) pair has four 8-lane accumulators, one per eighth k of a block
 * (weights 8k .. 8k + 7 of every block), each taking one FMA per block, blocks in
 * order; ``fold`` then adds them in a fixed order, and Q4 rows add their block offsets
 * ``sum_b m_b * sx_b`` (an FMA chain over the blocks, in order). Everything below only
 * chooses how many pairs run side by side, to hide FMA latency and reuse unpacked
 * weights, and never that order: results do not depend on the batch size, a row's place
 * in it or the thread split.
 */

#define ROW_GROUP 8   /* rows one task covers */
#define TILE_TOKENS 6 /* tokens per register tile of unpacked rows (AVX2) */
#define WIDE_TOKENS 3 /* the same with AVX-512VL's 32 registers */
#ifndef DIRECT_TOKENS
#define DIRECT_TOKENS 16 /* with AVX-512, batches up to this unpack blocks in registers */
#endif
#define WIDE __attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq")))

static inline float fold(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    return hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* Block b of row r, unpacked. */
static inline __attribute__((always_inline)) void unpack_block(const job_t *j, const int type,
                                                               Py_ssize_t r, Py_ssize_t b,
                                                               __m256 w[4]) {
    const uint8_t *blk = j->w->raw + (r * j->w->nb + b) * BLOCK_BYTES[type];
    const float d = j->T < 4 ? f16(blk) : j->w->d[r * j->w->nb + b]; /* see f16() */
    _mm_prefetch((const char *)blk + 256, _MM_HINT_T0);
    if (type == Q8_0)
        unpack_q8((const int8_t *)(blk + 2), &d, w);
    else
        unpack_q4(blk + (type == Q4_1 ? 4 : 2), &d, w);
}

/* out[t, r0 + i] = the block offsets of rows r0 .. r0 + n (n <= ROW_GROUP), all tokens:
 * eight rows per vector, so each lane runs the scalar chain of its own row. ``m`` has
 * room for nb * ROW_GROUP floats (32-byte aligned). */
static void group_offsets(const job_t *j, Py_ssize_t r0, int n, float *m) {
    const Py_ssize_t nb = j->w->nb;
    const Py_ssize_t bb = BLOCK_BYTES[j->w->type];
    for (int i = 0; i < ROW_GROUP; i++) {
        const Py_ssize_t r = r0 + (i < n ? i : 0);
        const uint8_t *row = j->w->raw + r * nb * bb;
        for (Py_ssize_t b = 0; b < nb; b++)
            m[b * ROW_GROUP + i] = j->T >= 4                ? j->w->m[r * nb + b]
                                   : j->w->type == Q4_1 ? f16(row + b * bb + 2)
                                                        : -8.0f * f16(row + b * bb);
    }
    for (Py_ssize_t t = 0; t < j->T; t++) {
        const float *sx = j->sx + t * nb;
        __m256 acc = _mm256_setzero_ps();
        for (Py_ssize_t b = 0; b < nb; b++)
            acc = _mm256_fmadd_ps(_mm256_load_ps(m + b * ROW_GROUP), _mm256_set1_ps(sx[b]), acc);
        float lanes[ROW_GROUP];
        _mm256_storeu_ps(lanes, acc);
        memcpy(j->out + t * j->w->rows + r0, lanes, n * sizeof(float));
    }
}

/* Adds the folded sums of (row r, token t) to what ``group_offsets`` left there. */
static inline void finish(const job_t *j, Py_ssize_t r, Py_ssize_t t, float sum) {
    float *o = j->out + t * j->w->rows + r;
    *o = sum + (j->w->type == Q8_0 ? 0.0f : *o);
}

/* RG rows x TT tokens (RG * TT <= 2), each block unpacked in registers: small batches. */
static inline __attribute__((always_inline)) void tile_direct(const job_t *j, const int type,
                                                              Py_ssize_t r0, const int RG,
                                                              Py_ssize_t t0, const int TT) {
    const Py_ssize_t nb = j->w->nb, cols = nb * QK;
    const float *x = j->x + t0 * cols;
    __m256 acc[2][2][4];
    for (int i = 0; i < RG; i++)
        for (int t = 0; t < TT; t++)
            for (int k = 0; k < 4; k++) acc[i][t][k] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < nb; b++)
        for (int i = 0; i < RG; i++) {
            __m256 w[4];
            unpack_block(j, type, r0 + i, b, w);
            for (int t = 0; t < TT; t++)
                for (int k = 0; k < 4; k++)
                    acc[i][t][k] = _mm256_fmadd_ps(
                        w[k], _mm256_loadu_ps(x + t * cols + b * QK + 8 * k), acc[i][t][k]);
        }
    for (int i = 0; i < RG; i++)
        for (int t = 0; t < TT; t++)
            finish(j, r0 + i, t0 + t, fold(acc[i][t][0], acc[i][t][1], acc[i][t][2], acc[i][t][3]));
}

static inline __attribute__((always_inline)) void rows_direct_typed(const job_t *j,
                                                                    const int type,
                                                                    Py_ssize_t r0, int n) {
    Py_ssize_t t = 0;
    for (; t + 2 <= j->T; t += 2)
        for (int i = 0; i < n; i++) tile_direct(j, type, r0 + i, 1, t, 2);
    if (t < j->T) {
        int i = 0;
        for (; i + 2 <= n; i += 2) tile_direct(j, type, r0 + i, 2, t, 1);
        if (i < n) tile_direct(j, type, r0 + i, 1, t, 1);
    }
}

/*
 * With AVX-512 a block unpacks into two 16-lane vectors, eighths 0-1 and 2-3: lane for
 * lane the operations of unpack_block and tile_direct (one FMA per lane per block, the
 * halves folded as the four eighths), in half the instructions.
 */
static inline __attribute__((always_inline)) WIDE void unpack_block16(const job_t *j,
                                                                      const int type,
                                                                      Py_ssize_t r, Py_ssize_t b,
                                                                      __m512 w[2]) {
    const uint8_t *blk = j->w->raw + (r * j->w->nb + b) * BLOCK_BYTES[type];
    const __m512 vd = _mm512_set1_ps(j->T < 4 ? f16(blk) : j->w->d[r * j->w->nb + b]);
    _mm_prefetch((const char *)blk + 256, _MM_HINT_T0);
    if (type == Q8_0) {
        const __m128i *q = (const __m128i *)(blk + 2);
        w[0] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))));
        w[1] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))));
    } else {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2)));
        const __m512i z = _mm512_cvtepu8_epi32(bytes);
        w[0] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_and_si512(z, _mm512_set1_epi32(0x0F))));
        w[1] = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_srli_epi32(z, 4)));
    }
}

static inline __attribute__((always_inline)) WIDE void tile_direct16(const job_t *j,
                                                                     const int type,
                                                                     Py_ssize_t r0, const int RG,
                                                                     Py_ssize_t t0,
                                                                     const int TT) {
    const Py_ssize_t nb = j->w->nb, cols = nb * QK;
    const float *x = j->x + t0 * cols;
    __m512 acc[4][4][2]; /* [row][token][half]: RG * TT <= 8 */
    for (int i = 0; i < RG; i++)
        for (int t = 0; t < TT; t++) acc[i][t][0] = acc[i][t][1] = _mm512_setzero_ps();
    for (Py_ssize_t b = 0; b < nb; b++)
        for (int i = 0; i < RG; i++) {
            __m512 w[2];
            unpack_block16(j, type, r0 + i, b, w);
            for (int t = 0; t < TT; t++)
                for (int h = 0; h < 2; h++)
                    acc[i][t][h] = _mm512_fmadd_ps(
                        w[h], _mm512_loadu_ps(x + t * cols + b * QK + 16 * h), acc[i][t][h]);
        }
    for (int i = 0; i < RG; i++)
        for (int t = 0; t < TT; t++) {
            const __m512 lo = acc[i][t][0], hi = acc[i][t][1];
            finish(j, r0 + i, t0 + t,
                   fold(_mm512_castps512_ps256(lo), _mm512_extractf32x8_ps(lo, 1),
                        _mm512_castps512_ps256(hi), _mm512_extractf32x8_ps(hi, 1)));
        }
}

static inline __attribute__((always_inline)) WIDE void rows_direct16_typed(const job_t *j,
                                                                           const int type,
                                                                           Py_ssize_t r0, int n) {
    Py_ssize_t t = 0;
    for (; t + 4 <= j->T; t += 4) {
        int i = 0;
        for (; i + 2 <= n; i += 2) tile_direct16(j, type, r0 + i, 2, t, 4);
        if (i < n) tile_direct16(j, type, r0 + i, 1, t, 4);
    }
    for (; t + 2 <= j->T; t += 2) {
        int i = 0;
        for (; i + 2 <= n; i += 2) tile_direct16(j, type, r0 + i, 2, t, 2);
        if (i < n) tile_direct16(j, type, r0 + i, 1, t, 2);
    }
    if (t < j->T) {
        int i = 0;
        for (; i + 4 <= n; i += 4) tile_direct16(j, type, r0 + i, 4, t, 1);
        for (; i < n; i++) tile_direct16(j, type, r0 + i, 1, t, 1);
    }
}

static WIDE void rows_direct16(const job_t *j, Py_ssize_t r0, int n) {
    switch (j->w->type) {
    case Q4_0: rows_direct16_typed(j, Q4_0, r0, n); break;
    case Q4_1: rows_direct16_typed(j, Q4_1, r0, n); break;
    default: rows_direct16_typed(j, Q8_0, r0, n); break;
    }
}

static void rows_direct(const job_t *j, Py_ssize_t r0, int n) {
    if (j->isa512) {
        rows_direct16(j, r0, n);
        return;
    }
    switch (j->w->type) {
    case Q4_0: rows_direct_typed(j, Q4_0, r0, n); break;
    case Q4_1: rows_direct_typed(j, Q4_1, r0, n); break;
    default: rows_direct_typed(j, Q8_0, r0, n); break;
    }
}

/*
 * Large batches unpack each row once and multiply it with every token from memory. Rows
 * and tokens are laid out "by eighth": for each k the k-th eight weights of every block,
 * blocks in order, so one accumulator's whole chain reads one contiguous run.
 */

/* One row's weights as float32 (each d * q is exact), by eighth. */
static inline __attribute__((always_inline)) void unpack_row_typed(const job_t *j,
                                                                   const int type, Py_ssize_t r,
                                                                   float *w) {
    const Py_ssize_t nb = j->w->nb;
    for (Py_ssize_t b = 0; b < nb; b++) {
        __m256 v[4];
        unpack_block(j, type, r, b, v);
        for (int k = 0; k < 4; k++) _mm256_store_ps(w + (k * nb + b) * 8, v[k]);
    }
}

static void unpack_row(const job_t *j, Py_ssize_t r, float *w) {
    switch (j->w->type) {
    case Q4_0: unpack_row_typed(j, Q4_0, r, w); break;
    case Q4_1: unpack_row_typed(j, Q4_1, r, w); break;
    default: unpack_row_typed(j, Q8_0, r, w); break;
    }
}

/* The batch's tokens by eighth, [T, cols]. */
static void tokens_by_eighth(const job_t *j, float *xe) {
    const Py_ssize_t nb = j->w->nb, cols = nb * QK;
    for (Py_ssize_t t = 0; t < j->T; t++)
        for (Py_ssize_t b = 0; b < nb; b++)
            for (int k = 0; k < 4; k++)
                memcpy(xe + t * cols + (k * nb + b) * 8, j->x + t * cols + b * QK + 8 * k,
                       8 * sizeof(float));
}

/* Two unpacked rows (w0, w1) x TT tokens, one eighth at a time with 2 * TT accumulators in
 * registers. A missing second row is fed the first again and its sums dropped. */
static inline __attribute__((always_inline)) void tile_unpacked(const job_t *j, const float *xe,
                                                                const float *w0,
                                                                const float *w1, Py_ssize_t r0,
                                                                int nr, Py_ssize_t t0,
                                                                const int TT) {
    const Py_ssize_t run = j->w->nb * 8, cols = j->w->nb * QK;
    const float *x = xe + t0 * cols;
    __m256 part[4][2][TILE_TOKENS];
    for (int k = 0; k < 4; k++) {
        __m256 a[TILE_TOKENS], b[TILE_TOKENS];
        for (int t = 0; t < TT; t++) a[t] = b[t] = _mm256_setzero_ps();
        const Py_ssize_t off = k * run;
        for (Py_ssize_t c = off; c < off + run; c += 8) {
            const __m256 u = _mm256_load_ps(w0 + c), v = _mm256_load_ps(w1 + c);
            for (int t = 0; t < TT; t++) {
                const __m256 xv = _mm256_loadu_ps(x + t * cols + c);
                a[t] = _mm256_fmadd_ps(u, xv, a[t]);
                b[t] = _mm256_fmadd_ps(v, xv, b[t]);
            }
        }
        for (int t = 0; t < TT; t++) {
            part[k][0][t] = a[t];
            part[k][1][t] = b[t];
        }
    }
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < TT; t++)
            finish(j, r0 + i, t0 + t, fold(part[0][i][t], part[1][i][t], part[2][i][t], part[3][i][t]));
}

/* Two unpacked rows against every token: as few tiles as six tokens allow, their widths
 * as even as possible (8 tokens: 4 + 4, not 6 + 2: a narrow tile is latency-bound). */
static void tokens_unpacked(const job_t *j, const float *xe, const float *w0, const float *w1,
                            Py_ssize_t r0, int nr) {
    const Py_ssize_t tiles = (j->T + TILE_TOKENS - 1) / TILE_TOKENS;
    Py_ssize_t t = 0;
    for (Py_ssize_t i = 0; i < tiles; i++) {
        const int width = (int)(j->T / tiles + (i < j->T % tiles));
        switch (width) {
        case 6: tile_unpacked(j, xe, w0, w1, r0, nr, t, 6); break;
        case 5: tile_unpacked(j, xe, w0, w1, r0, nr, t, 5); break;
        case 4: tile_unpacked(j, xe, w0, w1, r0, nr, t, 4); break;
        case 3: tile_unpacked(j, xe, w0, w1, r0, nr, t, 3); break;
        case 2: tile_unpacked(j, xe, w0, w1, r0, nr, t, 2); break;
        default: tile_unpacked(j, xe, w0, w1, r0, nr, t, 1); break;
        }
        t += width;
    }
}

/*
 * Where AVX-512VL is there, its 32 vector registers (still used 8 lanes at a time: the
 * very same operations) hold two rows x three tokens x four eighths, so one pass over
 * the blocks serves every eighth and the sums fold straight from registers.
 */

static inline __attribute__((always_inline)) WIDE void tile_wide(const job_t *j, const float *w0,
                                                                 const float *w1, Py_ssize_t r0,
                                                                 int nr, Py_ssize_t t0,
                                                                 const int TT) {
    const Py_ssize_t nb = j->w->nb, cols = nb * QK;
    const float *x = j->x + t0 * cols;
    __m256 a[WIDE_TOKENS][4], b[WIDE_TOKENS][4];
    for (int t = 0; t < TT; t++)
        for (int k = 0; k < 4; k++) a[t][k] = b[t][k] = _mm256_setzero_ps();
    for (Py_ssize_t blk = 0; blk < nb; blk++)
        for (int k = 0; k < 4; k++) {
            const __m256 u = _mm256_load_ps(w0 + (k * nb + blk) * 8);
            const __m256 v = _mm256_load_ps(w1 + (k * nb + blk) * 8);
            for (int t = 0; t < TT; t++) {
                __m256 xv = _mm256_loadu_ps(x + t * cols + blk * QK + 8 * k);
                __asm__("" : "+v"(xv)); /* one load for both rows, not one folded into each */
                a[t][k] = _mm256_fmadd_ps(u, xv, a[t][k]);
                b[t][k] = _mm256_fmadd_ps(v, xv, b[t][k]);
            }
        }
    for (int t = 0; t < TT; t++) {
        finish(j, r0, t0 + t, fold(a[t][0], a[t][1], a[t][2], a[t][3]));
        if (nr == 2) finish(j, r0 + 1, t0 + t, fold(b[t][0], b[t][1], b[t][2], b[t][3]));
    }
}

/* Rows [r0, r0 + n), unpacked in ``w`` (n rows), against every token: tiles of tokens
 * outside, row pairs inside, so a tile's tokens stay in L1 while the rows pass by. */
static WIDE void rows_wide(const job_t *j, const float *w, Py_ssize_t r0, int n) {
    const Py_ssize_t cols = j->w->nb * QK, tiles = (j->T + WIDE_TOKENS - 1) / WIDE_TOKENS;
    Py_ssize_t t = 0;
    for (Py_ssize_t i = 0; i < tiles; i++) {
        const int width = (int)(j->T / tiles + (i < j->T % tiles));
        for (int r = 0; r < n; r += 2) {
            const int nr = n - r < 2 ? 1 : 2;
            const float *w0 = w + r * cols, *w1 = nr == 2 ? w0 + cols : w0;
            if (width == 3) tile_wide(j, w0, w1, r0 + r, nr, t, 3);
            else if (width == 2) tile_wide(j, w0, w1, r0 + r, nr, t, 2);
            else tile_wide(j, w0, w1, r0 + r, nr, t, 1);
        }
        t += width;
    }
}

/* Rows [r0, r0 + n) for every token of the batch; n <= ROW_GROUP. ``scratch`` holds
 * the offsets' tile, and for batches whose rows are unpacked once ROW_GROUP unpacked
 * rows, met by register tiles of tokens: the wide ones (all n rows unpacked first) or,
 * with ``xe`` (the tokens by eighth), the AVX2 ones (two rows at a time). */
static void row_group(const job_t *j, Py_ssize_t r0, int n, const float *xe, float *scratch) {
    if (j->w->type != Q8_0) group_offsets(j, r0, n, scratch);
    if (!j->wide && xe == NULL) { /* a small batch (or no memory for xe) */
        rows_direct(j, r0, n);
        return;
    }
    const Py_ssize_t cols = j->w->nb * QK;
    if (j->wide) {
        for (int i = 0; i < n; i++) unpack_row(j, r0 + i, scratch + i * cols);
        rows_wide(j, scratch, r0, n);
        return;
    }
    for (int i = 0; i < n; i += 2) {
        const int nr = n - i < 2 ? 1 : 2;
        const float *w1 = nr == 2 ? scratch + cols : scratch;
        unpack_row(j, r0 + i, scratch);
        if (nr == 2) unpack_row(j, r0 + i + 1, scratch + cols);
        tokens_unpacked(j, xe, scratch, w1, r0 + i, nr);
    }
}

/* Per token, the sums of x over each block, in order (the Q4 offsets multiply them). */
static void block_sums(const float *x, Py_ssize_t T, Py_ssize_t nb, float *sx) {
    for (Py_ssize_t t = 0; t < T; t++)
        for (Py_ssize_t b = 0; b < nb; b++) {
            const float *v = x + (t * nb + b) * QK;
            float s = 0.0f;
            for (int i = 0; i < QK; i++) s += v[i];
            sx[t * nb + b] = s;
        }
}

int qmatmul(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads) {
    return qmatmul_tiles(w, x, T, out, threads, 1);
}

int qmatmul_tiles(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads,
                  int allow_wide) {
    const Py_ssize_t nb = w->nb, groups = (w->rows + ROW_GROUP - 1) / ROW_GROUP;
    float *sx = NULL;
    if (w->type != Q8_0) {
        sx = malloc((T * nb + 1) * sizeof(float));
        if (sx == NULL) return -1;
        block_sums(x, T, nb, sx);
    }
    const int isa512 = allow_wide && __builtin_cpu_supports("avx512f") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    /* unpack each row once for its tiles of tokens (else each block in registers) */
    const int unpacked = T >= 4 && !(isa512 && T <= DIRECT_TOKENS);
    const int wide = unpacked && isa512;
    job_t j = {w, isa512, wide, x, sx, out, T};
    float *xe = unpacked && !wide ? aligned_alloc(32, T * nb * QK * sizeof(float) + 32) : NULL;
    if (xe != NULL) tokens_by_eighth(&j, xe);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const Py_ssize_t floats = (unpacked ? QK : 1) * ROW_GROUP * nb;
        float *scratch = aligned_alloc(32, floats * sizeof(float) + 32);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (Py_ssize_t g = 0; g < groups; g++) {
            Py_ssize_t r0 = g * ROW_GROUP;
            int n = (int)(w->rows - r0 < ROW_GROUP ? w->rows - r0 : ROW_GROUP);
            if (scratch != NULL) row_group(&j, r0, n, xe, scratch);
        }
        free(scratch);
    }
    free(xe);
    free(sx);
    return failed ? -1 : 0;
}
