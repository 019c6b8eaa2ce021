/*
 * The q8 matmul's tiles for one vector width, included by q8.c once per instruction set
 * (the macros are q8.c's; the header undefines them at its end). Each lane is one output
 * row; a tile is RV row vectors x TT tokens. Integer sums are exact, so how they are
 * split or ordered is free; the float operations per (row, token) are fixed:
 *
 *   Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, per block in order, acc from zero:
 *     acc = fma(dw * dx, (float) isum, acc)      isum = sum of the block's q_w q_x
 *                                                (Q4_0, Q5_0: (q_w - 8 or 16) q_x;
 *                                                MXFP4: k q_x, k its E2M1 values
 *                                                doubled, dw = 2^(e - 128))
 *     Q4_1, Q5_1 then: acc = fma(m, s_x, acc)    s_x: Q8_1's float16 d_x * sum q_x
 *   Q4_K, Q5_K, per super-block in order:
 *     acc = fma(d * dx, (float) sum_k sc_k isum_k, acc)
 *     acc = acc - (dmin * dx) (float) sum_k m_k bsum_k   (one rounding)
 *   Q6_K, per super-block in order:
 *     acc = fma(d * dx, (float) sum_k sc_k (isum_k - 32 bsum_k), acc)
 *
 * dw, d, dmin, m are the weights' float16 fields, dx the activations' d.
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)
#define Q8_INLINE static inline __attribute__((always_inline)) TARGET

/* Most tokens a tile of the K-quant ``type`` takes, and of any K-quant (its arrays). */
#define KTILE_OF(type) ((type) == Q6_K ? K6TILE_MAX : KTILE_MAX)
#define KTILE_MOST (K6TILE_MAX > KTILE_MAX ? K6TILE_MAX : KTILE_MAX)

/* First row of vector v's rows within its group, and the group's bytes at unit u. */
#define GROUP_OF(w, v, units, gb) ((w)->packed + (((v) * LANES) / GROUP_ROWS) * (units) * (gb))

/* Quad q (columns 4 q ..) of a 4-bit region's word z, and (five) its fifth bits from h
 * (bit m of byte b: column b + 4 m): low nibbles columns 4 q + b, high 16 + 4 q + b. */
#define LO5(z, h, q, five) ((five) ? ORI(BYTES15(z), BMASK(SLLI32(h, 4 - (q)), 0x10)) : BYTES15(z))
#define HI5(z, h, q, five) ((five) ? ORI(HIGH15(z), BMASK(SRLI32(h, q), 0x10)) : HIGH15(z))

/* Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4). MXFP4's codes are looked up as
 * k + 12 (0 .. 24, unsigned as the 8-bit products take them) and 12 times the block's
 * sum of q_x taken off, as Q4_0's 8: the same integer. */
Q8_INLINE void FN(btile)(const q8job_t *j, const int type, const Py_ssize_t v0, const int RV,
                         const Py_ssize_t t0, const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, gb = GROUP_BYTES[type];
    const int with_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
    const int fp4 = type == MXFP4;
    const int quants = fp4 ? GROUP_ROWS : with_min ? 4 * GROUP_ROWS : 2 * GROUP_ROWS;
    const uint8_t *group[4];
    int lane[4];
    for (int v = 0; v < RV; v++) {
        group[v] = GROUP_OF(w, v0 + v, nb, gb);
        lane[v] = (int)(((v0 + v) * LANES) % GROUP_ROWS);
    }
    VEC acc[4][TILE_MAX];
    for (int v = 0; v < RV; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const int8_t *xb = j->xq + t0 * cols + b * QK;
        const uint8_t *p[4];
        for (int v = 0; v < RV; v++) {
            p[v] = group[v] + b * gb;
            if (TT >= 2 || (LANES == 8 && lane[v] == 0))
                for (Py_ssize_t line = 0; line < gb; line += 64)
                    _mm_prefetch((const char *)p[v] + Q8_AHEAD * gb + line, _MM_HINT_T0);
        }
        IVEC isum[4][TILE_MAX];
        if (type == Q8_0) {
            for (int v = 0; v < RV; v++)
                for (int t = 0; t < TT; t++) isum[v][t] = IZERO();
            /* more tokens than rows: the weights' side of DOTS made once, not per token */
            const int per_row = RV < TT;
            for (int q = 0; q < QK / 4; q++) {
                IVEC wq[4], wp[4];
                for (int v = 0; v < RV; v++) {
                    wq[v] = LDQ(p[v] + quants + q * 64 + 4 * lane[v]);
                    if (per_row) wp[v] = WPREP(wq[v]);
                }
                for (int t = 0; t < TT; t++) {
                    const IVEC bx = BX(xb + t * cols + 4 * q);
                    for (int v = 0; v < RV; v++)
                        isum[v][t] = per_row ? DOTSW(isum[v][t], wp[v], wq[v], bx)
                                             : DOTS(isum[v][t], wq[v], bx);
                }
            }
            if (DOTS_BIAS)
                for (int t = 0; t < TT; t++) {
                    const IVEC bias = SET1I(DOTS_BIAS * j->xb[(t0 + t) * nb + b]);
                    for (int v = 0; v < RV; v++) isum[v][t] = SUBI(isum[v][t], bias);
                }
        } else {
            /* AVX2's int16 partials hold 8 products of 4-bit quants, 4 of 5-bit ones or of
             * MXFP4's biased values (below 25): those sum low and high quads apart */
            IVEC part[4][TILE_MAX], part5[4][TILE_MAX];
            for (int v = 0; v < RV; v++)
                for (int t = 0; t < TT; t++) part[v][t] = part5[v][t] = PZERO();
            IVEC h[4];
            for (int v = 0; v < RV; v++)
                h[v] = five ? LDQ(p[v] + quants + 16 * GROUP_ROWS + 4 * lane[v]) : IZERO();
#pragma GCC unroll 4 /* the fifth bits' shift counts become constants */
            for (int q = 0; q < 4; q++) {
                IVEC lo[4], hi[4];
                for (int v = 0; v < RV; v++) {
                    const IVEC z = LDQ(p[v] + quants + q * 64 + 4 * lane[v]);
                    lo[v] = fp4 ? LUT16(FP4_BIASED, BYTES15(z)) : LO5(z, h[v], q, five);
                    hi[v] = fp4 ? LUT16(FP4_BIASED, HIGH15(z)) : HI5(z, h[v], q, five);
                }
                for (int t = 0; t < TT; t++) {
                    const IVEC bl = BX(xb + t * cols + 4 * q), bh = BX(xb + t * cols + 16 + 4 * q);
                    for (int v = 0; v < RV; v++) {
                        part[v][t] = DOTU(part[v][t], lo[v], bl);
                        if (five || fp4) part5[v][t] = DOTU(part5[v][t], hi[v], bh);
                        else part[v][t] = DOTU(part[v][t], hi[v], bh);
                    }
                }
            }
            for (int t = 0; t < TT; t++) {
                const int32_t sx = with_min ? 0 : j->xb[(t0 + t) * nb + b];
                const int bias = type == Q4_0 ? 8 : type == Q5_0 ? 16 : fp4 ? FP4_BIAS : 0;
                const IVEC off = SET1I(bias * sx);
                for (int v = 0; v < RV; v++) {
                    IVEC sum = PFLUSH(part[v][t]);
                    if (five || fp4) sum = ADDI(sum, PFLUSH(part5[v][t]));
                    isum[v][t] = SUBI(sum, off);
                }
            }
        }
        for (int v = 0; v < RV; v++) {
            const VEC dw = fp4 ? FP4_SCALES(p[v] + lane[v]) : HALVES(p[v] + 2 * lane[v]);
            for (int t = 0; t < TT; t++) {
                const VEC dd = MUL(dw, SET1(j->xd[(t0 + t) * nb + b]));
                acc[v][t] = FMA(dd, CVT(isum[v][t]), acc[v][t]);
            }
            if (with_min) {
                const VEC m = HALVES(p[v] + 2 * GROUP_ROWS + 2 * lane[v]);
                for (int t = 0; t < TT; t++)
                    acc[v][t] = FMA(m, SET1(j->xs[(t0 + t) * nb + b]), acc[v][t]);
            }
        }
    }
    for (int v = 0; v < RV; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        if (row >= w->rows) continue;
        const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
        for (int t = 0; t < TT; t++) STORE(j->out + (t0 + t) * w->rows + row, acc[v][t], n);
    }
}

/* Q4_K, Q5_K: super-blocks of 8 sub-blocks of 32; ``scales`` their 8 scales' byte
 * columns, unpacked (kscales.h). */
Q8_INLINE void FN(q4k_super)(const int type, const uint8_t *p, const uint8_t *scales,
                             const int lane, const int8_t *xs, const Py_ssize_t cols,
                             IVEC sumi[KTILE_MOST], const int TT) {
    const int five = type == Q5_K;
    const Py_ssize_t qs = five ? K_QS5 : K_QS4;
#if DOTS_BIAS
    /* Q4_K on int32 partials: the high nibbles taken where they lie (z & 0xF0, sixteen
     * times their value: no shift) into a chain of their own (part5) beside the low ones'
     * (part), each sub-block's 16 isum_k = 16 part + part5 scaled; the super-block's sum,
     * below 2^29 (16 x 8 sub-blocks x 63 x 32 x 15 x 127), is 16 sum_k sc_k isum_k
     * exactly: one arithmetic shift at the end. A lone token only: it saves a shift
     * per 64 bytes and costs a shift and an add per sub-block and token (AVX-512, one
     * thread, in cache: 1 token 3-10% faster, 2 ~10% slower, 8 ~5%; bench/q8_kernel.py
     * and the same calls at T > 1). */
    const int in_place = !five && TT == 1;
#else
    const int in_place = 0;
#endif
    for (int t = 0; t < TT; t++) sumi[t] = IZERO();
    for (int k = 0; k < QK_K / QK; k++) {
        IVEC part[KTILE_MAX], part5[KTILE_MAX]; /* 5-bit: low and high quads apart */
        for (int t = 0; t < TT; t++) part[t] = part5[t] = PZERO();
        const IVEC h = five ? LDQ(p + K_QH5 + k * 64 + 4 * lane) : IZERO();
#pragma GCC unroll 4 /* the fifth bits' shift counts become constants */
        for (int q = 0; q < 4; q++) {
            const IVEC z = LDQ(p + qs + (k * 4 + q) * 64 + 4 * lane);
            const IVEC lo = LO5(z, h, q, five);
            const IVEC hi = in_place ? BMASK(z, (char)0xF0) : HI5(z, h, q, five);
            for (int t = 0; t < TT; t++) {
                const int8_t *xk = xs + t * cols + QK * k;
                part[t] = DOTU(part[t], lo, BX(xk + 4 * q));
                if (five || in_place) part5[t] = DOTU(part5[t], hi, BX(xk + 16 + 4 * q));
                else part[t] = DOTU(part[t], hi, BX(xk + 16 + 4 * q));
            }
        }
        const IVEC sc = U8(scales + k * GROUP_ROWS + lane);
        for (int t = 0; t < TT; t++) {
            if (in_place) sumi[t] = ADDI(sumi[t], PSCALE(ADDI(SLLI32(part[t], 4), part5[t]), sc));
            else if (!five) sumi[t] = ADDI(sumi[t], PSCALE(part[t], sc));
#if DOTS_BIAS /* int32 partials: add, then one multiply */
            else sumi[t] = ADDI(sumi[t], PSCALE(ADDI(part[t], part5[t]), sc));
#else
            else sumi[t] = ADDI(sumi[t], ADDI(PSCALE(part[t], sc), PSCALE(part5[t], sc)));
#endif
        }
    }
    if (in_place)
        for (int t = 0; t < TT; t++) sumi[t] = SRAI32(sumi[t], 4);
}

/* Q6_K: super-blocks of 16 sub-blocks of 16; its quants are 0 .. 63, less 32. */
Q8_INLINE void FN(q6k_super)(const uint8_t *p, const int lane, const int8_t *xs,
                             const Py_ssize_t cols, IVEC sumi[KTILE_MOST], const int TT) {
    for (int t = 0; t < TT; t++) sumi[t] = IZERO();
    for (int k = 0; k < QK_K / 16; k++) {
        const uint8_t *sub = p + K6_SUB + k * K6_SUB_BYTES + 4 * lane;
        const IVEC ql0 = LDQ(sub), ql1 = LDQ(sub + 64), qh = LDQ(sub + 128);
        const IVEC q0 = ORI(BYTES15(ql0), BMASK(SLLI32(qh, 4), 0x30));
        const IVEC q1 = ORI(BYTES15(ql1), BMASK(SLLI32(qh, 2), 0x30));
        const IVEC q2 = ORI(HIGH15(ql0), BMASK(qh, 0x30));
        const IVEC q3 = ORI(HIGH15(ql1), BMASK(SRLI32(qh, 2), 0x30));
        const IVEC sc = S8(p + K6_SC + k * GROUP_ROWS + lane);
        for (int t = 0; t < TT; t++) {
            const int8_t *xk = xs + t * cols + 16 * k;
            IVEC a = DOTU(DOTU(PZERO(), q0, BX(xk)), q1, BX(xk + 4));
            IVEC c = DOTU(DOTU(PZERO(), q2, BX(xk + 8)), q3, BX(xk + 12));
#if DOTS_BIAS /* int32 partials: add, then one multiply */
            sumi[t] = ADDI(sumi[t], PSCALE(ADDI(a, c), sc));
#else /* int16 partials: two of them would overflow; widened, then one multiply (two
       * madd by scale pairs cost more) */
            sumi[t] = ADDI(sumi[t], MULLO(ADDI(PFLUSH(a), PFLUSH(c)), sc));
#endif
        }
    }
}

/* Sum over pairs of pieces of (a's int16 pair) x (the token's int16 pair): mins times the
 * sums of 32 quants (Q4_K), or scales times the sums of 16 (Q6_K). */
Q8_INLINE IVEC FN(pair_dot)(const IVEC *a, const int32_t *pairs, const int n) {
    IVEC s = IZERO();
    for (int i = 0; i < n; i++) s = ADDI(s, MADD16(a[i], SET1I(pairs[i])));
    return s;
}

/* Int16 pairs of byte fields k and k + 1 of 16 rows (unsigned, or signed with ``sign``). */
Q8_INLINE IVEC FN(field_pair)(const uint8_t *f, const int lane, const int k, const int sign) {
    const IVEC a = sign ? S8(f + k * GROUP_ROWS + lane) : U8(f + k * GROUP_ROWS + lane);
    const IVEC b = sign ? S8(f + (k + 1) * GROUP_ROWS + lane) : U8(f + (k + 1) * GROUP_ROWS + lane);
    return ORI(SRLI32(SLLI32(a, 16), 16), SLLI32(b, 16)); /* low half a, high half b */
}

/* The K-quants (Q4_K, Q5_K, Q6_K). Q4_K's and Q5_K's scales and mins are unpacked once
 * per super-block and group (two AVX2 row vectors of one group share them). */
Q8_INLINE void FN(ktile)(const q8job_t *j, const int type, const Py_ssize_t v0, const int RV,
                         const Py_ssize_t t0, const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, supers = nb / (QK_K / QK);
    const Py_ssize_t gb = GROUP_BYTES[type];
    const int npairs = type == Q6_K ? 8 : 4;
    const uint8_t *group[4];
    int lane[4];
    for (int v = 0; v < RV; v++) {
        group[v] = GROUP_OF(w, v0 + v, supers, gb);
        lane[v] = (int)(((v0 + v) * LANES) % GROUP_ROWS);
    }
    VEC acc[4][KTILE_MOST];
    for (int v = 0; v < RV; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    uint8_t unpacked[2 * KSCALES_MINS] __attribute__((aligned(64)));
    for (Py_ssize_t sb = 0; sb < supers; sb++) {
        const int8_t *xs = j->xq + t0 * cols + sb * QK_K;
        for (int v = 0; v < RV; v++) {
            const uint8_t *p = group[v] + sb * gb;
            /* a lone token's one stream is left to the hardware's prefetch: fetching each
             * next super-block ahead held AVX2's 128256x2048 Q6_K head out of cache, one
             * thread, to ~20 GB/s where it runs ~29 without (AVX-512 never fetched).
             * Q5_K's, the slowest per byte, two super-blocks ahead: with its scales
             * packed, one ahead ran AVX-512's batches of 2 and 4 tokens from memory
             * ~1.2x slower, three ahead no faster (bench/q8_kernel.py, stream) */
            if (TT >= 2)
                for (Py_ssize_t line = 0; line < gb; line += 64)
                    _mm_prefetch((const char *)p + (type == Q5_K ? 2 : 1) * gb + line,
                                 _MM_HINT_T0);
            IVEC sumi[KTILE_MOST], fp[8];
            if (type != Q6_K && (v == 0 || group[v] != group[v - 1]))
                KSCALES(p + K_SC, unpacked);
            if (type == Q6_K) FN(q6k_super)(p, lane[v], xs, cols, sumi, TT);
            else FN(q4k_super)(type, p, unpacked, lane[v], xs, cols, sumi, TT);
            const uint8_t *fields = type == Q6_K ? p + K6_SC : unpacked + KSCALES_MINS;
            for (int i = 0; i < npairs; i++) fp[i] = FN(field_pair)(fields, lane[v], 2 * i, type == Q6_K);
            const VEC d = HALVES(p + K_D + 2 * lane[v]);
            for (int t = 0; t < TT; t++) {
                const int32_t *pairs = j->xb + ((t0 + t) * supers + sb) * npairs;
                const IVEC off = FN(pair_dot)(fp, pairs, npairs);
                const VEC dx = SET1(j->xd[(t0 + t) * supers + sb]);
                if (type == Q6_K) {
                    acc[v][t] = FMA(MUL(d, dx), CVT(SUBI(sumi[t], SLLI32(off, 5))), acc[v][t]);
                } else {
                    const VEC dmin = HALVES(p + K_DMIN + 2 * lane[v]);
                    acc[v][t] = FMA(MUL(d, dx), CVT(sumi[t]), acc[v][t]);
                    acc[v][t] = FNMA(MUL(dmin, dx), CVT(off), acc[v][t]);
                }
            }
        }
    }
    for (int v = 0; v < RV; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        if (row >= w->rows) continue;
        const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
        for (int t = 0; t < TT; t++) STORE(j->out + (t0 + t) * w->rows + row, acc[v][t], n);
    }
}

/* The tile of ``type``'s family. */
Q8_INLINE void FN(any_tile)(const q8job_t *j, const int type, const Py_ssize_t v,
                            const int RV, const Py_ssize_t t0, const int TT) {
    if (!IS_KQUANT(type)) {
        if (TT <= TILE_MAX) FN(btile)(j, type, v, RV, t0, TT); /* token_tiles keeps to it */
    } else if (TT <= KTILE_OF(type)) FN(ktile)(j, type, v, RV, t0, TT);
}

/* Tokens in as few tiles of at most ``most`` as possible, widths as even as possible. */
Q8_INLINE void FN(token_tiles)(const q8job_t *j, const int type, const Py_ssize_t v,
                               const int most) {
    const Py_ssize_t tiles = (j->T + most - 1) / most;
    Py_ssize_t t = 0;
    for (Py_ssize_t i = 0; i < tiles; i++) {
        const int width = (int)(j->T / tiles + (i < j->T % tiles));
        switch (width) {
#if TILE_MAX >= 12
        case 12: FN(any_tile)(j, type, v, 1, t, 12); break;
        case 11: FN(any_tile)(j, type, v, 1, t, 11); break;
        case 10: FN(any_tile)(j, type, v, 1, t, 10); break;
        case 9: FN(any_tile)(j, type, v, 1, t, 9); break;
#endif
#if TILE_MAX >= 8 || K6TILE_MAX >= 8
        case 8: FN(any_tile)(j, type, v, 1, t, 8); break;
        case 7: FN(any_tile)(j, type, v, 1, t, 7); break;
        case 6: FN(any_tile)(j, type, v, 1, t, 6); break;
        case 5: FN(any_tile)(j, type, v, 1, t, 5); break;
#endif
        case 4: FN(any_tile)(j, type, v, 1, t, 4); break;
        case 3: FN(any_tile)(j, type, v, 1, t, 3); break;
        case 2: FN(any_tile)(j, type, v, 1, t, 2); break;
        default: FN(any_tile)(j, type, v, 1, t, 1); break;
        }
        t += width;
    }
}

#if LANES == 8
#include "q8_avx2.h"
#endif

/* Row vectors [v0, v1) for every token: a lone token one row group at a time (one stream
 * from memory: four groups at once, four streams, ran the Q4_K and Q6_K matrices out of
 * cache up to half as fast), batches one row vector x tiles of tokens. */
Q8_INLINE void FN(q8rows_typed)(const q8job_t *j, const int type, Py_ssize_t v0,
                                Py_ssize_t v1) {
    Py_ssize_t v = v0;
    if (j->T == 1) {
        const int RVG = GROUP_ROWS / LANES;
        for (; v + RVG <= v1; v += RVG) FN(any_tile)(j, type, v, RVG, 0, 1);
        for (; v < v1; v++) FN(any_tile)(j, type, v, 1, 0, 1);
        return;
    }
#if LANES == 8
    if (FN(avx2_batch)(j, type, v, v1)) return;
#endif
    const int most = IS_KQUANT(type) ? KTILE_OF(type) : TILE_MAX;
    for (; v < v1; v++) FN(token_tiles)(j, type, v, most);
}

#define Q8_ROWS_OF(name, code)                                                               \
    static __attribute__((noinline)) TARGET void FN(CAT(q8rows_, name))(                     \
        const q8job_t *j, Py_ssize_t v0, Py_ssize_t v1) {                                    \
        FN(q8rows_typed)(j, code, v0, v1);                                                   \
    }
Q8_ROWS_OF(q4_0, Q4_0)
Q8_ROWS_OF(q4_1, Q4_1)
Q8_ROWS_OF(q8_0, Q8_0)
Q8_ROWS_OF(q5_0, Q5_0)
Q8_ROWS_OF(q5_1, Q5_1)
Q8_ROWS_OF(mxfp4, MXFP4)
Q8_ROWS_OF(q4_k, Q4_K)
Q8_ROWS_OF(q5_k, Q5_K)
Q8_ROWS_OF(q6_k, Q6_K)
#undef Q8_ROWS_OF

static TARGET void FN(q8rows)(const q8job_t *j, Py_ssize_t v0, Py_ssize_t v1) {
    switch (j->w->type) {
    case Q4_0: FN(q8rows_q4_0)(j, v0, v1); break;
    case Q4_1: FN(q8rows_q4_1)(j, v0, v1); break;
    case Q8_0: FN(q8rows_q8_0)(j, v0, v1); break;
    case Q5_0: FN(q8rows_q5_0)(j, v0, v1); break;
    case Q5_1: FN(q8rows_q5_1)(j, v0, v1); break;
    case MXFP4: FN(q8rows_mxfp4)(j, v0, v1); break;
    case Q4_K: FN(q8rows_q4_k)(j, v0, v1); break;
    case Q5_K: FN(q8rows_q5_k)(j, v0, v1); break;
    default: FN(q8rows_q6_k)(j, v0, v1); break;
    }
}

#undef FN
#undef CAT
#undef CAT_
#undef Q8_INLINE
#undef GROUP_OF
#undef LO5
#undef HI5
#undef LANES
#undef VEC
#undef IVEC
#undef TARGET
#undef SFX
#undef TILE_MAX
#undef KTILE_MAX
#undef K6TILE_MAX
#undef KTILE_OF
#undef KTILE_MOST
#undef LDQ
#undef BX
#undef BYTES15
#undef HIGH15
#undef BMASK
#undef SLLI32
#undef SRLI32
#undef SRAI32
#undef ORI
#undef IZERO
#undef PZERO
#undef DOTU
#undef PFLUSH
#undef PSCALE
#undef DOTS
#undef DOTS_BIAS
#undef WPREP
#undef DOTSW
#undef MADD16
#undef ADDI
#undef SUBI
#undef MULLO
#undef SET1I
#undef U8
#undef S8
#undef HALVES
#undef CVT
#undef MUL
#undef FMA
#undef FNMA
#undef SET1
#undef ZERO
#undef ADD16
#undef STORE
#undef LUT16
#undef FP4_BIASED
#undef FP4_SCALES
#undef KSCALES
