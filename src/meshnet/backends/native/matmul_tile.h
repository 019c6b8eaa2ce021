/*
 * The quantized matmul's register tiles for one vector width, included by matmul.c once
 * per instruction set with these defined:
 *   LANES     rows per vector (8: AVX2, 16: AVX-512)
 *   VEC, IVEC float and int32 vectors of LANES lanes
 *   TARGET    the function attribute of that instruction set
 *   SFX       the suffix of the functions' names
 *   TILE_MAX  the widest tile of tokens its registers hold
 *   BATCH_RV  row vectors per tile for batches of four tokens or more (1 or 2)
 *   U8, S8    LANES bytes from memory, zero- or sign-extended to int32 lanes
 *   HALVES    LANES float16 from memory as float32 lanes (exact)
 *   AND15, SHR4, CVT, MUL, FMA, SET1, ZERO   the lane-wise operations
 *   SRL, SLL (by a count), ANDI, ORI, SUBI (an int32 constant)   int32 lane operations
 *   ADD, FNMA, LOAD   float addition, c - a b in one rounding, an aligned load
 *   OR_AND(a, b, k)   a | (b & k) on int32 lanes (one instruction with AVX-512)
 *   FP4_COLUMN(p, lo, hi)   MXFP4 codes of LANES rows at p: lo, hi = k 2^24 (fp4.h)
 *   FP4_SCALES(p)     LANES E8M0 exponents at p as float32 2^(e - 128) (fp4.h)
 *   STORE(p, v, n)   the first n lanes of v to p
 * Each lane is one output row, so every (row, token) pair runs the same FMA chain at
 * either width: the two instantiations give the same bits. The header undefines these
 * at its end, ready for the next instantiation.
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

/* Column i (and 16 + i) of a 4- or 5-bit block or an MXFP4 block (``fp4``) for the tile's
 * rows and tokens: s += q x. */
static inline __attribute__((always_inline)) TARGET void FN(nibble_column)(
    const uint8_t *const p[4], const int lane[4], const int quants, const float *xb,
    const Py_ssize_t cols, VEC s[4][TILE_MAX], const int i, const int RV, const int TT,
    const int five, const int fp4) {
    VEC lo[4], hi[4];
    for (int v = 0; v < RV; v++) {
        if (fp4) {
            FP4_COLUMN(p[v] + quants + i * GROUP_ROWS + lane[v], lo[v], hi[v]);
            continue;
        }
        const IVEC z = U8(p[v] + quants + i * GROUP_ROWS + lane[v]);
        if (five) { /* bit i % 8 of bytes i / 8 and 2 + i / 8, moved to bit 4 */
            const uint8_t *qh = p[v] + quants + 16 * GROUP_ROWS + lane[v];
            const IVEC h0 = U8(qh + (i / 8) * GROUP_ROWS);
            const IVEC h1 = U8(qh + (2 + i / 8) * GROUP_ROWS);
            const int bit = i % 8;
            const IVEC f0 = bit <= 4 ? SLL(h0, 4 - bit) : SRL(h0, bit - 4);
            const IVEC f1 = bit <= 4 ? SLL(h1, 4 - bit) : SRL(h1, bit - 4);
            lo[v] = CVT(OR_AND(AND15(z), f0, 16));
            hi[v] = CVT(OR_AND(SHR4(z), f1, 16));
        } else {
            lo[v] = CVT(AND15(z));
            hi[v] = CVT(SHR4(z));
        }
    }
    for (int t = 0; t < TT; t++) {
        const VEC xl = SET1(xb[t * cols + i]), xh = SET1(xb[t * cols + QK / 2 + i]);
        for (int v = 0; v < RV; v++) s[v][t] = FMA(lo[v], xl, s[v][t]);
        for (int v = 0; v < RV; v++) s[v][t] = FMA(hi[v], xh, s[v][t]);
    }
}

/*
 * Row vectors v0 .. v0 + RV - 1 (rows v * LANES ..) x tokens t0 .. t0 + TT - 1. Each
 * column of a block is unpacked once for the tile's rows (the integer quants as floats)
 * and met by every token's broadcast value; the order is the one matmul.c's header gives.
 */
static inline __attribute__((always_inline)) TARGET void FN(tile)(const job_t *j, const int type,
                                                                  const Py_ssize_t v0,
                                                                  const int RV,
                                                                  const Py_ssize_t t0,
                                                                  const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, gb = GROUP_BYTES[type];
    const int with_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
    const int fp4 = type == MXFP4;
    const int quants = fp4 ? GROUP_ROWS : with_min ? 4 * GROUP_ROWS : 2 * GROUP_ROWS;
    const uint8_t *group[4];
    int lane[4]; /* the vector's first row within its group */
    for (int v = 0; v < RV; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        group[v] = w->packed + (row / GROUP_ROWS) * nb * gb;
        lane[v] = (int)(row % GROUP_ROWS);
    }
    VEC acc[4][TILE_MAX];
    for (int v = 0; v < RV; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    for (Py_ssize_t b = 0; b < nb; b++) {
        const float *xb = j->x + t0 * cols + b * QK;
        const uint8_t *p[4];
        VEC s[4][TILE_MAX]; /* the block's sum of q * x per (row, token) */
        for (int v = 0; v < RV; v++) {
            p[v] = group[v] + b * gb;
            for (int t = 0; t < TT; t++) s[v][t] = ZERO();
            if (TT >= 2 || (LANES == 8 && lane[v] == 0)) /* see PREFETCH_BLOCKS */
                for (Py_ssize_t line = 0; line < gb; line += 64)
                    _mm_prefetch((const char *)p[v] + PREFETCH_BLOCKS * gb + line, _MM_HINT_T0);
        }
        if (type == Q8_0) {
            for (int c = 0; c < QK; c++) {
                VEC wc[4];
                for (int v = 0; v < RV; v++)
                    wc[v] = CVT(S8(p[v] + quants + c * GROUP_ROWS + lane[v]));
                for (int t = 0; t < TT; t++) {
                    const VEC xc = SET1(xb[t * cols + c]);
                    for (int v = 0; v < RV; v++) s[v][t] = FMA(wc[v], xc, s[v][t]);
                }
            }
        } else {
            if (five) {
#pragma GCC unroll 16 /* the fifth bits' shift counts become constants */
                for (int i = 0; i < QK / 2; i++)
                    FN(nibble_column)(p, lane, quants, xb, cols, s, i, RV, TT, 1, 0);
            } else { /* left to the compiler: unrolled 16 times, tiles of 4 tokens ran
                      * 1.8x slower, 32 tokens 1.25x (Q4_1, AVX-512) */
                for (int i = 0; i < QK / 2; i++)
                    FN(nibble_column)(p, lane, quants, xb, cols, s, i, RV, TT, 0, fp4);
            }
        }
        if (fp4) {
            for (int v = 0; v < RV; v++) {
                const VEC d = FP4_SCALES(p[v] + lane[v]);
                for (int t = 0; t < TT; t++)
                    acc[v][t] = FMA(d, MUL(s[v][t], SET1(1.0f / FP4_SCALE)), acc[v][t]);
            }
            continue;
        }
        for (int v = 0; v < RV; v++) {
            const VEC d = HALVES(p[v] + 2 * lane[v]);
            for (int t = 0; t < TT; t++) acc[v][t] = FMA(d, s[v][t], acc[v][t]);
            if (type == Q8_0) continue;
            const VEC m = with_min ? HALVES(p[v] + 2 * GROUP_ROWS + 2 * lane[v])
                                   : MUL(d, SET1(five ? -16.0f : -8.0f));
            for (int t = 0; t < TT; t++)
                acc[v][t] = FMA(m, SET1(j->sx[(t0 + t) * nb + b]), acc[v][t]);
        }
    }
    for (int v = 0; v < RV; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
        for (int t = 0; t < TT; t++) STORE(j->out + (t0 + t) * w->rows + row, acc[v][t], n);
    }
}

/*
 * The same tile for the K-quants, a super-block (256 columns) at a time. Per (row, token)
 * and sub-block in order (Q4_K, Q5_K: 8 of 32 columns; Q6_K: 16 of 16): s = q . x as one
 * FMA chain from zero, q the integer quants, over the sub-block's columns
 * in the order its byte columns hold them (native.h): Q4_K, Q5_K i, 16 + i for
 * i = 0 .. 15 (Q4_0's); Q6_K j, 4 + j, 8 + j, 12 + j for j = 0 .. 3. Then
 * acc = fma(d sc, s, acc) and acc = acc - o (sum of x over the sub-block) in one
 * rounding, o = dmin m (Q4_K, Q5_K) or 32 d sc (Q6_K: its quants are q - 32). d sc,
 * dmin m and 32 d sc are exact in float32.
 */
static inline __attribute__((always_inline)) TARGET void FN(ktile)(const job_t *j, const int type,
                                                                   const Py_ssize_t v0,
                                                                   const int RV,
                                                                   const Py_ssize_t t0,
                                                                   const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, supers = nb / (QK_K / QK);
    const Py_ssize_t gb = GROUP_BYTES[type];
    const uint8_t *group[4];
    int lane[4];
    for (int v = 0; v < RV; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        group[v] = w->packed + (row / GROUP_ROWS) * supers * gb;
        lane[v] = (int)(row % GROUP_ROWS);
    }
    VEC acc[4][TILE_MAX];
    for (int v = 0; v < RV; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    /* Q4_K, Q5_K: each group's scales and mins of the super-block (kscales.h), unpacked
     * once for its row vectors */
    uint8_t unpacked[4][2 * KSCALES_MINS] __attribute__((aligned(64)));
    const uint8_t *scales[4];
    for (int v = 0; v < RV; v++)
        scales[v] = v > 0 && group[v] == group[v - 1] ? scales[v - 1] : unpacked[v];
    for (Py_ssize_t sb = 0; sb < supers; sb++) {
        const float *xs = j->x + t0 * cols + sb * QK_K;
        const uint8_t *p[4];
        for (int v = 0; v < RV; v++) {
            p[v] = group[v] + sb * gb + lane[v];
            if (TT >= 2) /* see PREFETCH_BLOCKS */
                for (Py_ssize_t line = 0; line < gb; line += 64)
                    _mm_prefetch((const char *)p[v] + gb + line, _MM_HINT_T0);
        }
        if (type == Q6_K) {
            for (int k = 0; k < QK_K / 16; k++) {
                const Py_ssize_t sub = K6_SUB + k * K6_SUB_BYTES;
                const float *xk = xs + 16 * k;
                VEC s[4][TILE_MAX];
                for (int v = 0; v < RV; v++)
                    for (int t = 0; t < TT; t++) s[v][t] = ZERO();
                for (int c = 0; c < 4; c++) {
                    for (int v = 0; v < RV; v++) {
                        const uint8_t *q = p[v] + sub + c * GROUP_ROWS;
                        const IVEC z0 = U8(q), z1 = U8(q + 4 * GROUP_ROWS);
                        const IVEC h = U8(q + 8 * GROUP_ROWS);
                        const VEC w0 = CVT(OR_AND(AND15(z0), SLL(h, 4), 48));
                        const VEC w1 = CVT(OR_AND(AND15(z1), SLL(h, 2), 48));
                        const VEC w2 = CVT(OR_AND(SHR4(z0), h, 48));
                        const VEC w3 = CVT(OR_AND(SHR4(z1), SRL(h, 2), 48));
                        for (int t = 0; t < TT; t++) {
                            const float *xt = xk + t * cols + c;
                            s[v][t] = FMA(w0, SET1(xt[0]), s[v][t]);
                            s[v][t] = FMA(w1, SET1(xt[4]), s[v][t]);
                            s[v][t] = FMA(w2, SET1(xt[8]), s[v][t]);
                            s[v][t] = FMA(w3, SET1(xt[12]), s[v][t]);
                        }
                    }
                }
                for (int v = 0; v < RV; v++) {
                    const VEC dl = MUL(HALVES(p[v] - lane[v] + K_D + 2 * lane[v]),
                                       CVT(S8(p[v] + K6_SC + k * GROUP_ROWS)));
                    const VEC ml = MUL(dl, SET1(32.0f));
                    for (int t = 0; t < TT; t++) {
                        acc[v][t] = FMA(dl, s[v][t], acc[v][t]);
                        const VEC sx = SET1(j->sx[(t0 + t) * 2 * nb + sb * (QK_K / 16) + k]);
                        acc[v][t] = FNMA(ml, sx, acc[v][t]);
                    }
                }
            }
            continue;
        }
        const Py_ssize_t qs = type == Q5_K ? K_QS5 : K_QS4;
        for (int v = 0; v < RV; v++)
            if (scales[v] == unpacked[v]) KSCALES(group[v] + sb * gb + K_SC, unpacked[v]);
        for (int k = 0; k < QK_K / QK; k++) {
            const float *xk = xs + QK * k;
            VEC s[4][TILE_MAX];
            for (int v = 0; v < RV; v++)
                for (int t = 0; t < TT; t++) s[v][t] = ZERO();
#pragma GCC unroll 16 /* Q5_K's shift counts become constants */
            for (int i = 0; i < QK / 2; i++) {
                for (int v = 0; v < RV; v++) {
                    const IVEC z = U8(p[v] + qs + (k * 16 + i) * GROUP_ROWS);
                    IVEC lo = AND15(z), hi = SHR4(z);
                    if (type == Q5_K) { /* bits i / 4 and 4 + i / 4 of byte i % 4 */
                        const IVEC h = U8(p[v] + K_QH5 + (k * 4 + i % 4) * GROUP_ROWS);
                        lo = OR_AND(lo, SLL(h, 4 - i / 4), 16);
                        hi = OR_AND(hi, SRL(h, i / 4), 16);
                    }
                    const VEC wl = CVT(lo), wh = CVT(hi);
                    for (int t = 0; t < TT; t++) {
                        const float *xt = xk + t * cols + i;
                        s[v][t] = FMA(wl, SET1(xt[0]), s[v][t]);
                        s[v][t] = FMA(wh, SET1(xt[QK / 2]), s[v][t]);
                    }
                }
            }
            for (int v = 0; v < RV; v++) {
                const uint8_t *sc = scales[v] + k * GROUP_ROWS + lane[v];
                const VEC dl = MUL(HALVES(p[v] - lane[v] + K_D + 2 * lane[v]), CVT(U8(sc)));
                const VEC ml = MUL(HALVES(p[v] - lane[v] + K_DMIN + 2 * lane[v]),
                                   CVT(U8(sc + KSCALES_MINS)));
                for (int t = 0; t < TT; t++) {
                    acc[v][t] = FMA(dl, s[v][t], acc[v][t]);
                    const VEC sx = SET1(j->sx[(t0 + t) * nb + sb * (QK_K / QK) + k]);
                    acc[v][t] = FNMA(ml, sx, acc[v][t]);
                }
            }
        }
    }
    for (int v = 0; v < RV; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
        for (int t = 0; t < TT; t++) STORE(j->out + (t0 + t) * w->rows + row, acc[v][t], n);
    }
}

/*
 * The same tile for the row-wise types (Q2_K, Q3_K, Q5_0, Q5_1, F16, BF16, F32): each
 * block of 32 columns of the tile's rows is unpacked to float32 on the stack (one scalar
 * routine for both widths), then per (row, token) s = w . x as one FMA chain from zero
 * over the block's columns in order and acc = acc + s, acc starting at zero.
 */
static inline __attribute__((always_inline)) TARGET void FN(ftile)(const job_t *j,
                                                                   const Py_ssize_t v0,
                                                                   const int RV,
                                                                   const Py_ssize_t t0,
                                                                   const int TT) {
    const qmat_t *w = j->w;
    const int type = w->type; /* one instantiation serves every row-wise type */
    const Py_ssize_t nb = w->nb, cols = nb * QK, stride = row_bytes(type, nb);
    float wb[4][QK][LANES] __attribute__((aligned(64)));
    float rowwise[LANES][QK] __attribute__((aligned(64)));
    VEC acc[4][TILE_MAX];
    for (int v = 0; v < RV; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    for (Py_ssize_t b = 0; b < nb; b++) {
        for (int v = 0; v < RV; v++) {
            const Py_ssize_t first = (v0 + v) * LANES;
            if (type == F32 && first + LANES <= w->rows) { /* no unpacking: turned at once */
                const float *src = (const float *)w->packed + first * cols + b * QK;
                for (int r = 0; r < LANES; r += 8)
                    for (int c = 0; c < QK; c += 8)
                        transpose8(src + r * cols + c, cols, &wb[v][c][r], LANES);
                continue;
            }
            for (int l = 0; l < LANES; l++) {
                const Py_ssize_t row = first + l;
                if (row < w->rows) dequant_block(type, w->packed + row * stride, b, rowwise[l]);
                else memset(rowwise[l], 0, sizeof(rowwise[l]));
            }
            for (int r = 0; r < LANES; r += 8) /* exact moves: the same at either width */
                for (int c = 0; c < QK; c += 8) transpose8(&rowwise[r][c], QK, &wb[v][c][r], LANES);
        }
        const float *xb = j->x + t0 * cols + b * QK;
        VEC s[4][TILE_MAX];
        for (int v = 0; v < RV; v++)
            for (int t = 0; t < TT; t++) s[v][t] = ZERO();
        for (int c = 0; c < QK; c++) {
            VEC wc[4];
            for (int v = 0; v < RV; v++) wc[v] = LOAD(wb[v][c]);
            for (int t = 0; t < TT; t++) {
                const VEC xc = SET1(xb[t * cols + c]);
                for (int v = 0; v < RV; v++) s[v][t] = FMA(wc[v], xc, s[v][t]);
            }
        }
        for (int v = 0; v < RV; v++)
            for (int t = 0; t < TT; t++) acc[v][t] = ADD(acc[v][t], s[v][t]);
    }
    for (int v = 0; v < RV; v++) {
        const Py_ssize_t row = (v0 + v) * LANES;
        const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
        for (int t = 0; t < TT; t++) STORE(j->out + (t0 + t) * w->rows + row, acc[v][t], n);
    }
}

/* The tile of ``type``'s family. */
static inline __attribute__((always_inline)) TARGET void FN(any_tile)(const job_t *j,
                                                                      const int type,
                                                                      const Py_ssize_t v0,
                                                                      const int RV,
                                                                      const Py_ssize_t t0,
                                                                      const int TT) {
    if (IS_KQUANT(type)) FN(ktile)(j, type, v0, RV, t0, TT);
    else if (IS_ROWWISE(type)) FN(ftile)(j, v0, RV, t0, TT);
    else FN(tile)(j, type, v0, RV, t0, TT);
}

/* Tokens in as few tiles as TILE_MAX allows, their widths as even as possible (a
 * narrow tile is latency-bound), for RV row vectors from v. */
static inline __attribute__((always_inline)) TARGET void FN(token_tiles)(const job_t *j,
                                                                         const int type,
                                                                         Py_ssize_t v,
                                                                         const int RV) {
    const Py_ssize_t tiles = (j->T + TILE_MAX - 1) / TILE_MAX;
    Py_ssize_t t = 0;
    for (Py_ssize_t i = 0; i < tiles; i++) {
        const int width = (int)(j->T / tiles + (i < j->T % tiles));
        switch (width) {
#if TILE_MAX != 4 && TILE_MAX != 8 && TILE_MAX != 12
#error "TILE_MAX must be 4, 8 or 12: the cases below cover exactly those"
#endif
#if TILE_MAX >= 12
        case 12: FN(any_tile)(j, type, v, RV, t, 12); break;
        case 11: FN(any_tile)(j, type, v, RV, t, 11); break;
        case 10: FN(any_tile)(j, type, v, RV, t, 10); break;
        case 9: FN(any_tile)(j, type, v, RV, t, 9); break;
#endif
#if TILE_MAX >= 8
        case 8: FN(any_tile)(j, type, v, RV, t, 8); break;
        case 7: FN(any_tile)(j, type, v, RV, t, 7); break;
        case 6: FN(any_tile)(j, type, v, RV, t, 6); break;
        case 5: FN(any_tile)(j, type, v, RV, t, 5); break;
#endif
        case 4: FN(any_tile)(j, type, v, RV, t, 4); break;
        case 3: FN(any_tile)(j, type, v, RV, t, 3); break;
        case 2: FN(any_tile)(j, type, v, RV, t, 2); break;
        default: FN(any_tile)(j, type, v, RV, t, 1); break;
        }
        t += width;
    }
}

#if UNPACK_MIN_T
/*
 * Batches of UNPACK_MIN_T tokens or more, 8-lane vectors, the types of blocks of 32:
 * each group's quants are unpacked to float32 once (UNPACK_BLOCKS blocks at a time, in
 * the order of their FMA chain), and tiles of the group's two row vectors x up to 6
 * tokens then meet them from cache. With AVX2's 16 registers the in-register tiles
 * (2 x 4) spend more operations unpacking than multiplying; here every column is loaded,
 * not unpacked, and 12 chains run side by side. The same operations per (row, token) in
 * the same order as FN(tile): the same bits.
 */
/* wq[(b - b0) * QK + k][16] = quant k of block b in chain order (4- and 5-bit: columns
 * 0, 16, 1, 17, ...; Q8_0: 0, 1, ...) for rows v * LANES .. of RV row vectors. */
static inline __attribute__((always_inline)) TARGET void FN(unpack_blocks)(
    const job_t *j, const int type, const Py_ssize_t v, const int RV, const Py_ssize_t b0,
    const Py_ssize_t b1, float *wq) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, gb = GROUP_BYTES[type];
    const int with_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
    const int quants = type == MXFP4 ? GROUP_ROWS : with_min ? 4 * GROUP_ROWS : 2 * GROUP_ROWS;
    const uint8_t *group = w->packed + (v * LANES / GROUP_ROWS) * nb * gb;
    for (Py_ssize_t b = b0; b < b1; b++) {
        float *out = wq + (b - b0) * QK * GROUP_ROWS;
        for (int r = 0; r < RV; r++) {
            const uint8_t *p = group + b * gb + r * LANES; /* lane r * LANES of the group */
            if (type == MXFP4) {
                for (int i = 0; i < QK / 2; i++) {
                    VEC lo, hi;
                    FP4_COLUMN(p + quants + i * GROUP_ROWS, lo, hi);
                    _mm256_store_ps(out + (2 * i) * GROUP_ROWS + r * LANES, lo);
                    _mm256_store_ps(out + (2 * i + 1) * GROUP_ROWS + r * LANES, hi);
                }
                continue;
            }
            if (type == Q8_0) {
                for (int c = 0; c < QK; c++)
                    _mm256_store_ps(out + c * GROUP_ROWS + r * LANES,
                                    CVT(S8(p + quants + c * GROUP_ROWS)));
                continue;
            }
#pragma GCC unroll 16
            for (int i = 0; i < QK / 2; i++) {
                const IVEC z = U8(p + quants + i * GROUP_ROWS);
                IVEC lo = AND15(z), hi = SHR4(z);
                if (five) {
                    const uint8_t *qh = p + quants + 16 * GROUP_ROWS;
                    const IVEC h0 = U8(qh + (i / 8) * GROUP_ROWS);
                    const IVEC h1 = U8(qh + (2 + i / 8) * GROUP_ROWS);
                    const int bit = i % 8;
                    lo = OR_AND(lo, bit <= 4 ? SLL(h0, 4 - bit) : SRL(h0, bit - 4), 16);
                    hi = OR_AND(hi, bit <= 4 ? SLL(h1, 4 - bit) : SRL(h1, bit - 4), 16);
                }
                _mm256_store_ps(out + (2 * i) * GROUP_ROWS + r * LANES, CVT(lo));
                _mm256_store_ps(out + (2 * i + 1) * GROUP_ROWS + r * LANES, CVT(hi));
            }
        }
    }
}

/* Tokens t0 .. t0 + TT - 1 of RV row vectors from v over blocks [b0, b1) unpacked in wq;
 * acc [T][16] carries each (row, token)'s sum between calls (zero before block 0). */
static inline __attribute__((always_inline)) TARGET void FN(unpacked_tile)(
    const job_t *j, const int type, const Py_ssize_t v, const int RV, const Py_ssize_t b0,
    const Py_ssize_t b1, const float *wq, float *acc, const Py_ssize_t t0, const int TT) {
    const qmat_t *w = j->w;
    const Py_ssize_t nb = w->nb, cols = nb * QK, gb = GROUP_BYTES[type];
    const int with_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
    const uint8_t *group = w->packed + (v * LANES / GROUP_ROWS) * nb * gb;
    for (Py_ssize_t b = b0; b < b1; b++) {
        const float *xb = j->xp + t0 * cols + b * QK * TT; /* [k][TT]: see pack_tokens */
        const float *wb = wq + (b - b0) * QK * GROUP_ROWS;
        VEC s[2][UNPACK_TT];
        for (int r = 0; r < RV; r++)
            for (int t = 0; t < TT; t++) s[r][t] = ZERO();
#pragma GCC unroll 32
        for (int k = 0; k < QK; k++) {
            VEC wc[2];
            for (int r = 0; r < RV; r++) wc[r] = LOAD(wb + k * GROUP_ROWS + r * LANES);
            for (int t = 0; t < TT; t++) {
                const VEC xc = SET1(xb[k * TT + t]);
                for (int r = 0; r < RV; r++) s[r][t] = FMA(wc[r], xc, s[r][t]);
            }
        }
        const uint8_t *p = group + b * gb;
        if (type == MXFP4) {
            for (int r = 0; r < RV; r++) {
                const VEC d = FP4_SCALES(p + r * LANES);
                for (int t = 0; t < TT; t++) {
                    float *a = acc + (t0 + t) * GROUP_ROWS + r * LANES;
                    _mm256_store_ps(a, FMA(d, MUL(s[r][t], SET1(1.0f / FP4_SCALE)), LOAD(a)));
                }
            }
            continue;
        }
        for (int r = 0; r < RV; r++) {
            const VEC d = HALVES(p + 2 * r * LANES);
            const VEC m = with_min ? HALVES(p + 2 * GROUP_ROWS + 2 * r * LANES)
                                   : MUL(d, SET1(five ? -16.0f : -8.0f));
            for (int t = 0; t < TT; t++) {
                float *a = acc + (t0 + t) * GROUP_ROWS + r * LANES;
                VEC sum = FMA(d, s[r][t], LOAD(a));
                if (type != Q8_0) sum = FMA(m, SET1(j->sx[(t0 + t) * nb + b]), sum);
                _mm256_store_ps(a, sum);
            }
        }
    }
}

/* Every token of RV row vectors from v (one group) through the unpacked tiles; scratch
 * holds UNPACK_BLOCKS * QK * 16 + T * 16 floats. */
static inline __attribute__((always_inline)) TARGET void FN(unpacked_rows)(
    const job_t *j, const int type, const Py_ssize_t v, const int RV, float *scratch) {
    const qmat_t *w = j->w;
    float *wq = scratch, *acc = scratch + UNPACK_BLOCKS * QK * GROUP_ROWS;
    memset(acc, 0, j->T * GROUP_ROWS * sizeof(float));
    const Py_ssize_t tiles = (j->T + UNPACK_TT - 1) / UNPACK_TT;
    for (Py_ssize_t b0 = 0; b0 < w->nb; b0 += UNPACK_BLOCKS) {
        const Py_ssize_t b1 = b0 + UNPACK_BLOCKS < w->nb ? b0 + UNPACK_BLOCKS : w->nb;
        FN(unpack_blocks)(j, type, v, RV, b0, b1, wq);
        Py_ssize_t t = 0;
        for (Py_ssize_t i = 0; i < tiles; i++) {
            const int width = (int)(j->T / tiles + (i < j->T % tiles));
#define UT(n, rv) FN(unpacked_tile)(j, type, v, rv, b0, b1, wq, acc, t, n)
#define UTS(n) if (RV == 2) UT(n, 2); else UT(n, 1); break
            switch (width) {
            case 6: UTS(6);
            case 5: UTS(5);
            case 4: UTS(4);
            case 3: UTS(3);
            case 2: UTS(2);
            default: UTS(1);
            }
#undef UTS
#undef UT
            t += width;
        }
    }
    for (int r = 0; r < RV; r++) {
        const Py_ssize_t row = (v + r) * LANES;
        const int n = w->rows - row < LANES ? (int)(w->rows - row) : LANES;
        for (Py_ssize_t t = 0; t < j->T; t++)
            STORE(j->out + t * w->rows + row, LOAD(acc + t * GROUP_ROWS + r * LANES), n);
    }
}
#endif

/* Row vectors [v0, v1) for every token: a lone token takes four row vectors at once
 * (four FMA chains to hide the latency), two or three tokens two, larger batches
 * BATCH_RV (their tiles of tokens give chains enough). */
static inline __attribute__((always_inline)) TARGET void FN(rows_typed)(const job_t *j,
                                                                        const int type,
                                                                        Py_ssize_t v0,
                                                                        Py_ssize_t v1,
                                                                        float *scratch) {
    Py_ssize_t v = v0;
    if (j->T == 1) {
        for (; v + 4 <= v1; v += 4) FN(any_tile)(j, type, v, 4, 0, 1);
        for (; v < v1; v++) FN(any_tile)(j, type, v, 1, 0, 1);
        return;
    }
    if (BATCH_RV == 1 && j->T >= 4) {
        for (; v < v1; v++) FN(token_tiles)(j, type, v, 1);
        return;
    }
#if UNPACK_MIN_T
    if (j->T >= UNPACK_MIN_T && IS_BLOCKWISE(type) && scratch != NULL) {
        for (; v + 2 <= v1; v += 2) FN(unpacked_rows)(j, type, v, 2, scratch);
        if (v < v1) FN(unpacked_rows)(j, type, v, 1, scratch);
        return;
    }
#endif
    for (; v + 2 <= v1; v += 2) FN(token_tiles)(j, type, v, 2);
    if (v < v1) FN(token_tiles)(j, type, v, 1);
}

/* Each type's rows in a function of its own: one function holding every type's tiles
 * was optimised worse (its 8-lane tiles ran 10-20% slower). */
#define ROWS_OF(name, code)                                                                  \
    static __attribute__((noinline)) TARGET void FN(CAT(rows_, name))(                       \
        const job_t *j, Py_ssize_t v0, Py_ssize_t v1, float *scratch) {                      \
        FN(rows_typed)(j, code, v0, v1, scratch);                                            \
    }
ROWS_OF(q4_0, Q4_0)
ROWS_OF(q4_1, Q4_1)
ROWS_OF(q8_0, Q8_0)
ROWS_OF(q5_0, Q5_0)
ROWS_OF(q5_1, Q5_1)
ROWS_OF(mxfp4, MXFP4)
ROWS_OF(q4_k, Q4_K)
ROWS_OF(q5_k, Q5_K)
ROWS_OF(q6_k, Q6_K)
ROWS_OF(rowwise, F32) /* every row-wise type: see ftile */
#undef ROWS_OF

static TARGET void FN(rows)(const job_t *j, Py_ssize_t v0, Py_ssize_t v1, float *scratch) {
    switch (j->w->type) {
    case Q4_0: FN(rows_q4_0)(j, v0, v1, scratch); break;
    case Q4_1: FN(rows_q4_1)(j, v0, v1, scratch); break;
    case Q8_0: FN(rows_q8_0)(j, v0, v1, scratch); break;
    case Q5_0: FN(rows_q5_0)(j, v0, v1, scratch); break;
    case Q5_1: FN(rows_q5_1)(j, v0, v1, scratch); break;
    case MXFP4: FN(rows_mxfp4)(j, v0, v1, scratch); break;
    case Q4_K: FN(rows_q4_k)(j, v0, v1, scratch); break;
    case Q5_K: FN(rows_q5_k)(j, v0, v1, scratch); break;
    case Q6_K: FN(rows_q6_k)(j, v0, v1, scratch); break;
    default: FN(rows_rowwise)(j, v0, v1, scratch); break;
    }
}

#undef FN
#undef CAT
#undef CAT_
#undef LANES
#undef VEC
#undef IVEC
#undef TARGET
#undef SFX
#undef TILE_MAX
#undef BATCH_RV
#undef U8
#undef S8
#undef HALVES
#undef AND15
#undef SHR4
#undef CVT
#undef MUL
#undef FMA
#undef SET1
#undef ZERO
#undef STORE
#undef SRL
#undef SLL
#undef ANDI
#undef ORI
#undef SUBI
#undef ADD
#undef FNMA
#undef LOAD
#undef OR_AND
#undef FP4_COLUMN
#undef FP4_SCALES
#undef KSCALES
#undef UNPACK_MIN_T
