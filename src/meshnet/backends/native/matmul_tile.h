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
 *   STORE(p, v, n)   the first n lanes of v to p
 * Each lane is one output row, so every (row, token) pair runs the same FMA chain at
 * either width: the two instantiations give the same bits. The header undefines these
 * at its end, ready for the next instantiation.
 */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define FN(name) CAT(name, SFX)

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
    const int quants = type == Q4_1 ? 4 * GROUP_ROWS : 2 * GROUP_ROWS; /* bytes of halves */
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
            if (TT >= 2) /* see PREFETCH_BLOCKS */
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
            for (int i = 0; i < QK / 2; i++) {
                VEC lo[4], hi[4];
                for (int v = 0; v < RV; v++) {
                    const IVEC z = U8(p[v] + quants + i * GROUP_ROWS + lane[v]);
                    lo[v] = CVT(AND15(z));
                    hi[v] = CVT(SHR4(z));
                }
                for (int t = 0; t < TT; t++) {
                    const VEC xl = SET1(xb[t * cols + i]), xh = SET1(xb[t * cols + QK / 2 + i]);
                    for (int v = 0; v < RV; v++) s[v][t] = FMA(lo[v], xl, s[v][t]);
                    for (int v = 0; v < RV; v++) s[v][t] = FMA(hi[v], xh, s[v][t]);
                }
            }
        }
        for (int v = 0; v < RV; v++) {
            const VEC d = HALVES(p[v] + 2 * lane[v]);
            for (int t = 0; t < TT; t++) acc[v][t] = FMA(d, s[v][t], acc[v][t]);
            if (type == Q8_0) continue;
            const VEC m = type == Q4_1 ? HALVES(p[v] + 2 * GROUP_ROWS + 2 * lane[v])
                                       : MUL(d, SET1(-8.0f));
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
 * FMA chain from zero over its columns in order, q the integer quants (Q6_K: q - 32);
 * then acc = fma(d sc, s, acc) and, for Q4_K and Q5_K, acc = acc - (dmin m) (sum of x
 * over the sub-block) in one rounding. d sc and dmin m are exact in float32.
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
                const int h = k / 8, r0 = (k % 8) * 16; /* half, first column within it */
                const Py_ssize_t ql = K6_QL + (64 * h + r0 % 64) * GROUP_ROWS;
                const Py_ssize_t qh = K6_QH + (32 * h + r0 % 32) * GROUP_ROWS;
                const int lshift = 4 * (r0 / 64), hshift = 2 * (r0 / 32);
                VEC s[4][TILE_MAX];
                for (int v = 0; v < RV; v++)
                    for (int t = 0; t < TT; t++) s[v][t] = ZERO();
                for (int c = 0; c < 16; c++) {
                    VEC wc[4];
                    for (int v = 0; v < RV; v++) {
                        const Py_ssize_t at = c * GROUP_ROWS;
                        const IVEC lo = ANDI(SRL(U8(p[v] + ql + at), lshift), 15);
                        const IVEC hi = SLL(ANDI(SRL(U8(p[v] + qh + at), hshift), 3), 4);
                        wc[v] = CVT(SUBI(ORI(lo, hi), 32));
                    }
                    for (int t = 0; t < TT; t++) {
                        const VEC xc = SET1(xs[t * cols + 16 * k + c]);
                        for (int v = 0; v < RV; v++) s[v][t] = FMA(wc[v], xc, s[v][t]);
                    }
                }
                for (int v = 0; v < RV; v++) {
                    const VEC dl = MUL(HALVES(p[v] + K_D + lane[v]),
                                       CVT(S8(p[v] + K6_SC + k * GROUP_ROWS)));
                    for (int t = 0; t < TT; t++) acc[v][t] = FMA(dl, s[v][t], acc[v][t]);
                }
            }
            continue;
        }
        const Py_ssize_t qs = type == Q5_K ? K_QS5 : K_QS4;
        for (int k = 0; k < QK_K / QK; k++) {
            VEC s[4][TILE_MAX];
            for (int v = 0; v < RV; v++)
                for (int t = 0; t < TT; t++) s[v][t] = ZERO();
            const Py_ssize_t nibbles = qs + (k / 2) * QK * GROUP_ROWS;
            for (int c = 0; c < QK; c++) {
                VEC wc[4];
                for (int v = 0; v < RV; v++) {
                    const IVEC z = U8(p[v] + nibbles + c * GROUP_ROWS);
                    IVEC q = k % 2 ? SHR4(z) : AND15(z);
                    if (type == Q5_K)
                        q = ORI(q, SLL(ANDI(SRL(U8(p[v] + K_QH5 + c * GROUP_ROWS), k), 1), 4));
                    wc[v] = CVT(q);
                }
                for (int t = 0; t < TT; t++) {
                    const VEC xc = SET1(xs[t * cols + QK * k + c]);
                    for (int v = 0; v < RV; v++) s[v][t] = FMA(wc[v], xc, s[v][t]);
                }
            }
            for (int v = 0; v < RV; v++) {
                const VEC dl = MUL(HALVES(p[v] + K_D + lane[v]),
                                   CVT(U8(p[v] + K_SC + k * GROUP_ROWS)));
                const VEC ml = MUL(HALVES(p[v] + K_DMIN + lane[v]),
                                   CVT(U8(p[v] + K_MIN + k * GROUP_ROWS)));
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
    float block[QK];
    VEC acc[4][TILE_MAX];
    for (int v = 0; v < RV; v++)
        for (int t = 0; t < TT; t++) acc[v][t] = ZERO();
    for (Py_ssize_t b = 0; b < nb; b++) {
        for (int v = 0; v < RV; v++)
            for (int l = 0; l < LANES; l++) {
                const Py_ssize_t row = (v0 + v) * LANES + l;
                if (row < w->rows) dequant_block(type, w->packed + row * stride, b, block);
                else memset(block, 0, sizeof(block));
                for (int c = 0; c < QK; c++) wb[v][c][l] = block[c];
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

/* Row vectors [v0, v1) for every token: a lone token takes four row vectors at once
 * (four FMA chains to hide the latency), two or three tokens two, larger batches
 * BATCH_RV (their tiles of tokens give chains enough). */
static inline __attribute__((always_inline)) TARGET void FN(rows_typed)(const job_t *j,
                                                                        const int type,
                                                                        Py_ssize_t v0,
                                                                        Py_ssize_t v1) {
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
    for (; v + 2 <= v1; v += 2) FN(token_tiles)(j, type, v, 2);
    if (v < v1) FN(token_tiles)(j, type, v, 1);
}

static TARGET void FN(rows)(const job_t *j, Py_ssize_t v0, Py_ssize_t v1) {
    switch (j->w->type) {
    case Q4_0: FN(rows_typed)(j, Q4_0, v0, v1); break;
    case Q4_1: FN(rows_typed)(j, Q4_1, v0, v1); break;
    case Q8_0: FN(rows_typed)(j, Q8_0, v0, v1); break;
    case Q4_K: FN(rows_typed)(j, Q4_K, v0, v1); break;
    case Q5_K: FN(rows_typed)(j, Q5_K, v0, v1); break;
    case Q6_K: FN(rows_typed)(j, Q6_K, v0, v1); break;
    default: FN(rows_typed)(j, F32, v0, v1); break; /* every row-wise type: see ftile */
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
