/*
 * The q8 matmul's batch tiles that only the 8-lane (AVX2) instruction set takes, included
 * by q8_tile.h with its macros while LANES is 8. On AVX2 (measured on Zen 4) maddubs,
 * madd, psign/pabs, mul and fma all issue on the same two of the four vector pipes and
 * 256-bit loads (broadcasts too) at two a cycle, so these tiles are built to spend fewer
 * of those per product than the shared tiles; the float operations per (row, token) are
 * btile's, in its order, so the results are the same bits (q8_tile.h's header).
 */

#define NIBBLE_TOKENS 16 /* tokens per pass of nibble_rows (their sums stay on the stack) */
#define NIBBLE_MIN_T 4   /* fewer: token_tiles fit the registers (b=2, 3 ran 4-5% faster there) */
#define NIBBLE_CHUNK 8   /* blocks whose integer sums nibble_rows makes before their float operations */
#define PAIRS_TILE 4     /* tokens per tile of pairs_tile (2 x 4 int32 sums in registers) */
#ifndef KPAIR_TILE
#define KPAIR_TILE 4     /* tokens per tile of k4_pair (2 x 4 int16 partials in registers) */
#endif

/* Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 for NIBBLE_MIN_T tokens or more: per block the row
 * vector's 32 columns unpacked once into eight registers (Q5's fifth bits or'ed in, as
 * btile's LO5, HI5), then every token's integer sum from them (8 maddubs into int16, one
 * madd; 5-bit quants and MXFP4's biased values, below 25, two madds of 8 products each,
 * as int16 holds 8 of them), kept as floats in L1 for NIBBLE_CHUNK
 * blocks; only then each block's float operations for every token (Q4_1's m term with
 * them, not in a pass of its own), the tokens' accumulators in registers through the
 * chunk. The batch tiles (token_tiles) kept unpacked quants, partial sums and sums of up
 * to 4 tokens in the 16 registers and spilled. Called with a constant TT
 * (nibble_tokens), each token loop unrolls. Against one loop of sums and float
 * operations per block (and Q4_1's m in a pass of its own), b=4 and b=8 ran 1.15-1.21x
 * (bench/q8_kernel.py --against, the bundled model's Q4_1 shapes, one thread); the sums
 * and float operations apart per block only, ~6% less at b=8, and in halves of 4 tokens
 * 15% less. */
Q8_INLINE void FN(nibble_rows)(const q8job_t *j, const int type, const Py_ssize_t v,
                               const Py_ssize_t t0, const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, gb = GROUP_BYTES[type];
    const int with_min = type == Q4_1 || type == Q5_1, fp4 = type == MXFP4;
    const int five = type == Q5_0 || type == Q5_1, wide_sums = five || fp4;
    const int quants = fp4 ? GROUP_ROWS : with_min ? 4 * GROUP_ROWS : 2 * GROUP_ROWS;
    const uint8_t *group = GROUP_OF(w, v, nb, gb);
    const int lane = (int)((v * LANES) % GROUP_ROWS);
    VEC acc[NIBBLE_TOKENS];
    for (int t = 0; t < TT; t++) acc[t] = ZERO();
    for (Py_ssize_t b0 = 0; b0 < nb; b0 += NIBBLE_CHUNK) {
        const int nbc = nb - b0 < NIBBLE_CHUNK ? (int)(nb - b0) : NIBBLE_CHUNK;
        VEC fsum[NIBBLE_CHUNK][NIBBLE_TOKENS];
        for (int bb = 0; bb < nbc; bb++) {
            const Py_ssize_t b = b0 + bb;
            const uint8_t *p = group + b * gb;
            if (lane == 0)
                for (Py_ssize_t line = 0; line < gb; line += 64)
                    _mm_prefetch((const char *)p + Q8_AHEAD * gb + line, _MM_HINT_T0);
            IVEC lo[4], hi[4];
            const IVEC h = five ? LDQ(p + quants + 16 * GROUP_ROWS + 4 * lane) : IZERO();
#pragma GCC unroll 4 /* the fifth bits' shift counts become constants */
            for (int q = 0; q < 4; q++) {
                const IVEC z = LDQ(p + quants + q * 64 + 4 * lane);
                lo[q] = fp4 ? LUT16(FP4_BIASED, BYTES15(z)) : LO5(z, h, q, five);
                hi[q] = fp4 ? LUT16(FP4_BIASED, HIGH15(z)) : HI5(z, h, q, five);
            }
            const int8_t *xb = j->xq + t0 * cols + b * QK;
            for (int t = 0; t < TT; t++) {
                const int8_t *xt = xb + t * cols;
                const IVEC a = ADD16(DOTU(PZERO(), lo[0], BX(xt)), DOTU(PZERO(), lo[1], BX(xt + 4)));
                const IVEC c = ADD16(DOTU(PZERO(), lo[2], BX(xt + 8)), DOTU(PZERO(), lo[3], BX(xt + 12)));
                const IVEC e = ADD16(DOTU(PZERO(), hi[0], BX(xt + 16)), DOTU(PZERO(), hi[1], BX(xt + 20)));
                const IVEC f = ADD16(DOTU(PZERO(), hi[2], BX(xt + 24)), DOTU(PZERO(), hi[3], BX(xt + 28)));
                IVEC isum = wide_sums ? ADDI(PFLUSH(ADD16(a, c)), PFLUSH(ADD16(e, f)))
                                      : PFLUSH(ADD16(ADD16(a, c), ADD16(e, f)));
                const int bias = fp4 ? FP4_BIAS : five ? 16 : 8;
                if (!with_min) isum = SUBI(isum, SET1I(bias * j->xb[(t0 + t) * nb + b]));
                fsum[bb][t] = CVT(isum);
            }
        }
        for (int bb = 0; bb < nbc; bb++) {
            const Py_ssize_t b = b0 + bb;
            const uint8_t *p = group + b * gb;
            const VEC dw = fp4 ? FP4_SCALES(p + lane) : HALVES(p + 2 * lane);
            const VEC m = with_min ? HALVES(p + 2 * GROUP_ROWS + 2 * lane) : ZERO();
            for (int t = 0; t < TT; t++) {
                const VEC dd = MUL(dw, SET1(j->xd[(t0 + t) * nb + b]));
                acc[t] = FMA(dd, fsum[bb][t], acc[t]);
                if (with_min) acc[t] = FMA(m, SET1(j->xs[(t0 + t) * nb + b]), acc[t]);
            }
        }
    }
    const Py_ssize_t row = v * LANES;
    if (row >= w->rows) return;
    const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
    for (int t = 0; t < TT; t++) STORE(j->out + (t0 + t) * w->rows + row, acc[t], n);
}

/* Every token of row vector v through nibble_rows, in passes of up to NIBBLE_TOKENS, the
 * usual widths as constants. */
Q8_INLINE void FN(nibble_tokens)(const q8job_t *j, const int type, const Py_ssize_t v) {
    for (Py_ssize_t t = 0; t < j->T; t += NIBBLE_TOKENS) {
        const int n = j->T - t < NIBBLE_TOKENS ? (int)(j->T - t) : NIBBLE_TOKENS;
        switch (n) {
        case 8: FN(nibble_rows)(j, type, v, t, 8); break;
        case 7: FN(nibble_rows)(j, type, v, t, 7); break;
        case 6: FN(nibble_rows)(j, type, v, t, 6); break;
        case 5: FN(nibble_rows)(j, type, v, t, 5); break;
        case 4: FN(nibble_rows)(j, type, v, t, 4); break;
        default: FN(nibble_rows)(j, type, v, t, n); break;
        }
    }
}

/* Q8_0 for 2 tokens or more (j->xw made): RV (1, 2) row vectors x TT tokens. The sign
 * trick (btile's DOTS, DOTSW) costs three multiplier-pipe operations per 32 products
 * (psign, maddubs, madd); here each lane's four weights are sign-extended once a tile to
 * int16 pairs, the even columns (0, 2) and the odd (1, 3) by shifts (the other pipes),
 * and multiplied by madd against the activations' int16 pairs in the same order
 * (q8_quantize.h's widen_pairs: x0, x2 then x1, x3): two madds per 32 products, the sum
 * exact in int32 (32 products of at most 127 x 127). Two row vectors share each
 * broadcast. */
Q8_INLINE void FN(pairs_tile)(const q8job_t *j, const Py_ssize_t v0, const int RV,
                              const Py_ssize_t t0, const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, gb = GROUP_BYTES[Q8_0];
    const uint8_t *group[2];
    int lane[2];
    for (int v = 0; v < RV; v++) {
        group[v] = GROUP_OF(w, v0 + v, nb, gb);
        lane[v] = (int)(((v0 + v) * LANES) % GROUP_ROWS);
    }
    VEC acc[2][PAIRS_TILE];
    for (int v = 0; v < RV; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const int16_t *xb = j->xw + t0 * cols + b * QK;
        const uint8_t *p[2];
        for (int v = 0; v < RV; v++) {
            p[v] = group[v] + b * gb;
            for (Py_ssize_t line = 0; line < gb; line += 64)
                _mm_prefetch((const char *)p[v] + Q8_AHEAD * gb + line, _MM_HINT_T0);
        }
        IVEC isum[2][PAIRS_TILE];
        for (int v = 0; v < RV; v++)
            for (int t = 0; t < TT; t++) isum[v][t] = IZERO();
        for (int q = 0; q < QK / 4; q++) {
            IVEC even[2], odd[2];
            for (int v = 0; v < RV; v++) {
                const IVEC z = LDQ(p[v] + 2 * GROUP_ROWS + q * 64 + 4 * lane[v]);
                even[v] = _mm256_srai_epi16(_mm256_slli_epi16(z, 8), 8); /* columns 0, 2 */
                odd[v] = _mm256_srai_epi16(z, 8);                        /* columns 1, 3 */
            }
            for (int t = 0; t < TT; t++) {
                const IVEC xe = BX(xb + t * cols + 4 * q), xo = BX(xb + t * cols + 4 * q + 2);
                for (int v = 0; v < RV; v++)
                    isum[v][t] = ADDI(isum[v][t], ADDI(MADD16(even[v], xe), MADD16(odd[v], xo)));
            }
        }
        for (int v = 0; v < RV; v++) {
            const VEC dw = HALVES(p[v] + 2 * lane[v]);
            for (int t = 0; t < TT; t++) {
                const VEC dd = MUL(dw, SET1(j->xd[(t0 + t) * nb + b]));
                acc[v][t] = FMA(dd, CVT(isum[v][t]), acc[v][t]);
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

/* Every token of row vectors [v, v + RV) through pairs_tile, in as few tiles of at most
 * PAIRS_TILE as possible, widths as even as possible (as token_tiles). */
Q8_INLINE void FN(pairs_tokens)(const q8job_t *j, const Py_ssize_t v, const int RV) {
    const Py_ssize_t tiles = (j->T + PAIRS_TILE - 1) / PAIRS_TILE;
    Py_ssize_t t = 0;
    for (Py_ssize_t i = 0; i < tiles; i++) {
        const int width = (int)(j->T / tiles + (i < j->T % tiles));
        switch (width * 2 + (RV == 2)) { /* each (width, RV) its own constant tile */
        case 9: FN(pairs_tile)(j, v, 2, t, 4); break;
        case 8: FN(pairs_tile)(j, v, 1, t, 4); break;
        case 7: FN(pairs_tile)(j, v, 2, t, 3); break;
        case 6: FN(pairs_tile)(j, v, 1, t, 3); break;
        case 5: FN(pairs_tile)(j, v, 2, t, 2); break;
        case 4: FN(pairs_tile)(j, v, 1, t, 2); break;
        case 3: FN(pairs_tile)(j, v, 2, t, 1); break;
        default: FN(pairs_tile)(j, v, 1, t, 1); break;
        }
        t += width;
    }
}

/* Quad q of a Q4_K sub-block for k4_pair: each row vector's 4 low and 4 high nibbles of
 * a row (the sub-block's columns 4 q .. 4 q + 3 and 16 + 4 q .., at z and z + 32) times
 * every token's activations there (xk: token 0's column 4 q), into the int16 partials.
 * The sub-block's first quad sets them (``first``) rather than add them to zero, and each
 * token's two products are added before they meet the partial: against one chain of
 * adds from zero, 1.03-1.06x on Q4_K's 64-token calls (bench/q8_kernel.py --isa avx2)
 * and the Llama-3.2-1B shape's 4k prefill 1.07x (bench/long_prefill.py), the same bits
 * (the int16 sums are exact in any order). */
Q8_INLINE void FN(k4_quad)(const uint8_t *z, const int8_t *xk, const Py_ssize_t cols,
                           IVEC part[2][KPAIR_TILE], const int TT, const int first) {
    const IVEC z0 = LDQ(z), z1 = LDQ(z + 4 * LANES);
    const IVEC lo0 = BYTES15(z0), hi0 = HIGH15(z0);
    const IVEC lo1 = BYTES15(z1), hi1 = HIGH15(z1);
    for (int t = 0; t < TT; t++) {
        const IVEC bl = BX(xk + t * cols), bh = BX(xk + t * cols + 16);
        const IVEC p0 = ADD16(_mm256_maddubs_epi16(lo0, bl), _mm256_maddubs_epi16(hi0, bh));
        const IVEC p1 = ADD16(_mm256_maddubs_epi16(lo1, bl), _mm256_maddubs_epi16(hi1, bh));
        part[0][t] = first ? p0 : ADD16(part[0][t], p0);
        part[1][t] = first ? p1 : ADD16(part[1][t], p1);
    }
}

/* Q4_K for 2 tokens or more: both row vectors of a row group (its 16 rows) x TT tokens,
 * each token's activations broadcast once for the two (ktile's batches take one row
 * vector a tile, so a broadcast per maddubs). Per sub-block the same exact int16
 * partials (8 maddubs of nibbles) and PSCALE by its scale, per super-block ktile's float
 * operations in its order: the same bits. */
Q8_INLINE void FN(k4_pair)(const q8job_t *j, const Py_ssize_t v0, const Py_ssize_t t0,
                           const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, supers = nb / (QK_K / QK);
    const Py_ssize_t gb = GROUP_BYTES[Q4_K];
    const uint8_t *group = GROUP_OF(w, v0, supers, gb); /* v0 even: v0 + 1 is in it too */
    VEC acc[2][KPAIR_TILE];
    for (int v = 0; v < 2; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    uint8_t unpacked[2 * KSCALES_MINS] __attribute__((aligned(64)));
    for (Py_ssize_t sb = 0; sb < supers; sb++) {
        const int8_t *xs = j->xq + t0 * cols + sb * QK_K;
        const uint8_t *p = group + sb * gb;
        for (Py_ssize_t line = 0; line < gb; line += 64)
            _mm_prefetch((const char *)p + gb + line, _MM_HINT_T0);
        KSCALES(p + K_SC, unpacked);
        IVEC sumi[2][KPAIR_TILE];
        for (int v = 0; v < 2; v++)
            for (int t = 0; t < TT; t++) sumi[v][t] = IZERO();
#pragma GCC unroll 1 /* unrolled, the sub-blocks' and quads' loads ran ahead and spilled */
        for (int k = 0; k < QK_K / QK; k++) {
            const uint8_t *z = p + K_QS4 + k * 4 * 64;
            const int8_t *xk = xs + QK * k;
            IVEC part[2][KPAIR_TILE];
            FN(k4_quad)(z, xk, cols, part, TT, 1);
#pragma GCC unroll 1
            for (int q = 1; q < 4; q++) FN(k4_quad)(z + q * 64, xk + 4 * q, cols, part, TT, 0);
            for (int v = 0; v < 2; v++) {
                const IVEC sc = U8(unpacked + k * GROUP_ROWS + v * LANES);
                for (int t = 0; t < TT; t++) sumi[v][t] = ADDI(sumi[v][t], PSCALE(part[v][t], sc));
            }
        }
        for (int v = 0; v < 2; v++) {
            IVEC fp[4];
            for (int i = 0; i < 4; i++)
                fp[i] = FN(field_pair)(unpacked + KSCALES_MINS, v * LANES, 2 * i, 0);
            const VEC d = HALVES(p + K_D + 2 * v * LANES);
            const VEC dmin = HALVES(p + K_DMIN + 2 * v * LANES);
            for (int t = 0; t < TT; t++) {
                const int32_t *pairs = j->xb + ((t0 + t) * supers + sb) * 4;
                const IVEC off = FN(pair_dot)(fp, pairs, 4);
                const VEC dx = SET1(j->xd[(t0 + t) * supers + sb]);
                acc[v][t] = FMA(MUL(d, dx), CVT(sumi[v][t]), acc[v][t]);
                acc[v][t] = FNMA(MUL(dmin, dx), CVT(off), acc[v][t]);
            }
        }
    }
    for (int v = 0; v < 2; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        if (row >= w->rows) continue;
        const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
        for (int t = 0; t < TT; t++) STORE(j->out + (t0 + t) * w->rows + row, acc[v][t], n);
    }
}

/* Q4_K's batch rows: each whole row group through k4_pair in as few tiles of at most
 * KPAIR_TILE tokens as possible, widths as even as possible; a row vector whose group
 * the range cuts through ktile's tiles. */
static __attribute__((noinline)) TARGET void FN(batch_q4_k)(const q8job_t *j, Py_ssize_t v0,
                                                            Py_ssize_t v1) {
    Py_ssize_t v = v0;
    if (v % 2 && v < v1) FN(token_tiles)(j, Q4_K, v++, KTILE_MAX);
    for (; v + 2 <= v1; v += 2) {
        const Py_ssize_t tiles = (j->T + KPAIR_TILE - 1) / KPAIR_TILE;
        Py_ssize_t t = 0;
        for (Py_ssize_t i = 0; i < tiles; i++) {
            const int width = (int)(j->T / tiles + (i < j->T % tiles));
            switch (width) {
            case 4: FN(k4_pair)(j, v, t, 4); break;
            case 3: FN(k4_pair)(j, v, t, 3); break;
            case 2: FN(k4_pair)(j, v, t, 2); break;
            default: FN(k4_pair)(j, v, t, 1); break;
            }
            t += width;
        }
    }
    if (v < v1) FN(token_tiles)(j, Q4_K, v, KTILE_MAX);
}

/* Each type's batch rows apart from q8rows_typed (noinline): inlined there, the larger
 * body (nibble_rows' sums on the stack) held the lone token's Q4_1 tiles of the same
 * function ~4% slower. */
#define BATCH_ROWS_OF(name, code)                                                            \
    static __attribute__((noinline)) TARGET void FN(CAT(batch_, name))(                      \
        const q8job_t *j, Py_ssize_t v0, Py_ssize_t v1) {                                    \
        for (Py_ssize_t v = v0; v < v1; v++) FN(nibble_tokens)(j, code, v);                  \
    }
BATCH_ROWS_OF(q4_0, Q4_0)
BATCH_ROWS_OF(q4_1, Q4_1)
BATCH_ROWS_OF(q5_0, Q5_0)
BATCH_ROWS_OF(q5_1, Q5_1)
BATCH_ROWS_OF(mxfp4, MXFP4)
#undef BATCH_ROWS_OF

static __attribute__((noinline)) TARGET void FN(batch_q8_0)(const q8job_t *j, Py_ssize_t v0,
                                                            Py_ssize_t v1) {
    Py_ssize_t v = v0;
    for (; v + 2 <= v1; v += 2) FN(pairs_tokens)(j, v, 2);
    for (; v < v1; v++) FN(pairs_tokens)(j, v, 1);
}

/* Row vectors [v0, v1) of a batch (T >= 2) where a tile of this header takes ``type``:
 * 1 when done, 0 to leave them to the shared tiles. */
Q8_INLINE int FN(avx2_batch)(const q8job_t *j, const int type, Py_ssize_t v0, Py_ssize_t v1) {
    if (type == Q8_0 && j->xw != NULL) FN(batch_q8_0)(j, v0, v1);
#ifndef NO_K4_PAIR
    else if (type == Q4_K) FN(batch_q4_k)(j, v0, v1);
#endif
    else if (j->T < NIBBLE_MIN_T) return 0;
    else if (type == Q4_0) FN(batch_q4_0)(j, v0, v1);
    else if (type == Q4_1) FN(batch_q4_1)(j, v0, v1);
    else if (type == Q5_0) FN(batch_q5_0)(j, v0, v1);
    else if (type == Q5_1) FN(batch_q5_1)(j, v0, v1);
    else if (type == MXFP4) FN(batch_mxfp4)(j, v0, v1);
    else return 0;
    return 1;
}

#undef NIBBLE_TOKENS
#undef NIBBLE_MIN_T
#undef PAIRS_TILE
#undef KPAIR_TILE
