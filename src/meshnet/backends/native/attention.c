/*
 * Attention for every row of a batch (rows of several sequences, each with its own KV
 * cache) in one call, tiled over the keys: memory O(tile) per (row, head) pair, never a
 * score per visible position.
 *
 * The positions are cut into tiles of TILE at fixed boundaries (multiples of TILE). A
 * pair's result is the left fold, tile by tile in order, of each tile's partial over the
 * positions the row sees in it (its max m, its total l of e^(s - m), its weighted values
 * acc): M' = max(M, m), L = L e^(M - M') + l e^(m - M'), A = A e^(M - M') + acc e^(m - M').
 * A partial depends only on the row's position, its query and the cache, and the fold
 * only on the partials in order, so a row's output is bit-identical alone, batched,
 * replayed, in any prefill chunk, and whichever thread computes which tile: one long row
 * (a decode step deep in a context) spreads its tiles over the threads and folds them
 * after; the rows of a prompt chunk share each key tile while it is in cache.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "isa.h"
#include "native.h"

#define TILE ATTENTION_TILE
/* A unit's rows of one sequence share each key tile while it is in cache: up to ROWS_MOST
 * of them, fewer where a call has too few rows to give every thread several units. Deep in
 * a context each unit streams the whole cache from memory once, so more rows a unit read
 * it fewer times: one thread, 16,384 rows of Gemma 3 270M's global attention (4 heads of
 * 256, 1 KV head), 8 rows ran ~31 GMAC/s of CPU time and 64 rows ~44. */
#define ROWS_MOST 64
#define ROWS_LEAST 8

/* The four scores hsum256(a0) .. hsum256(a3) at once, each with hsum256's own sums:
 * ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)) (the halves added, then adjacent pairs
 * twice), so a score's bits do not depend on which keys share its reduction. */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 x01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20),
                                     _mm256_permute2f128_ps(a0, a1, 0x31));
    const __m256 x23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20),
                                     _mm256_permute2f128_ps(a2, a3, 0x31));
    const __m256 h = _mm256_hadd_ps(x01, x23);
    const __m256 h2 = _mm256_hadd_ps(h, h); /* low: a0, a2; high: a1, a3 */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1));
}

/* Eight keys or values from element i of a cache: float32, or float16 widened (exact), so
 * a half cache's scores and sums are the float32 kernel's on the values it holds. */
static inline __attribute__((always_inline)) __m256 load8(const void *p, Py_ssize_t i,
                                                          const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)))
                : _mm256_loadu_ps((const float *)p + i);
}

static inline __attribute__((always_inline, target("avx512f"))) __m512 load16(
    const void *p, Py_ssize_t i, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
                : _mm512_loadu_ps((const float *)p + i);
}

/* The bytes of one element of a cache. */
static inline int element(int half) { return half ? 2 : (int)sizeof(float); }

/* q . the key at element i of k. */
static inline __attribute__((always_inline)) float dot(const float *q, const void *k,
                                                       Py_ssize_t i, int hd, const int half) {
    __m256 acc = _mm256_setzero_ps();
    for (int c = 0; c < hd; c += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), load8(k, i + c, half), acc);
    return hsum256(acc);
}

/* Deep in a context a tile's keys and values come from memory, and the hardware's
 * prefetch alone left a decode step's attention at a third of the read bandwidth: while
 * the scores of keys j .. j + 3 are computed, the keys AHEAD_BYTES on and the values of
 * rows j .. j + 3 (read after the scores, in column blocks) are fetched. ``fetch`` is the
 * tile's values, or NULL (a tile read before, from cache). One Gemma 3 270M global layer
 * at 16k positions, 2 threads, from memory: 2.39 -> 1.92 ms (bench/deep_decode.py).
 * ``kj``, ``vj``: the four rows' first bytes, ``row`` bytes each; ``left`` rows after them. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 8192
#endif
static inline __attribute__((always_inline)) void fetch_ahead(const char *kj, const char *vj,
                                                              int row, int left) {
    for (int line = 0; line < 4 * row; line += 64) /* to L2: a tile's values outsize L1 */
        _mm_prefetch(vj + line, _MM_HINT_T1);
    if ((Py_ssize_t)left * row >= AHEAD_BYTES)
        for (int line = 0; line < 4 * row; line += 64)
            _mm_prefetch(kj + AHEAD_BYTES + line, _MM_HINT_T0);
}

/* The scores read a tile's keys and values from memory; the weighing then runs from
 * cache, and memory would idle. So while a tile's values are weighed, the keys of the
 * tile this thread likely takes next are fetched to L2 (by_tiles: ``threads`` tiles on,
 * as the threads take tiles in turn; by_units: the next one), AHEAD_LINES lines per
 * value row weighed (a whole tile of 64 keys of 256 over the AVX-512 weighing's 256
 * rows). With the values fetched to L2 rather than L1, one global layer, 2 threads, from
 * memory (bench/deep_decode.py), at 4k, 16k, 32k positions: Gemma 3 270M 1.38x, 1.31x,
 * 1.21x; Llama 3.2 1B 1.31x, 1.32x, 1.74x. Either change alone measured ~1.0x, and
 * giving each thread contiguous runs of tiles 0.8x. ``at`` to ``end``: what is left to
 * fetch (none: at == end). */
typedef struct {
    const char *at, *end;
} ahead_t;

#define AHEAD_LINES 4
static inline __attribute__((always_inline)) void fetch_step(ahead_t *f) {
    if (f->at < f->end) {
        for (int i = 0; i < AHEAD_LINES; i++) _mm_prefetch(f->at + 64 * i, _MM_HINT_T1);
        f->at += 64 * AHEAD_LINES;
    }
}

/* Scores of P (1 .. 4) queries q[x] against the n keys from ``k``, into s[x][0 .. n): per
 * (query, key) one 8-lane FMA chain over hd (a multiple of 8) and hsum256's sums, whatever
 * P; two queries and four keys side by side so each load serves several chains, a second
 * pair of queries (P 3 or 4) on the same four keys next, while they are in L1. */
static inline __attribute__((always_inline)) void dots(const int P, const float *const *q,
                                                       const void *k, const void *fetch,
                                                       int hd, int n, float *const *s,
                                                       const int half) {
    const int row = hd * element(half);
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const Py_ssize_t kj = (Py_ssize_t)j * hd;
        if (fetch != NULL)
            fetch_ahead((const char *)k + j * row, (const char *)fetch + j * row, row,
                        n - j - 4);
#pragma GCC unroll 2
        for (int x0 = 0; x0 < P; x0 += 2) {
            const int PP = P - x0 < 2 ? 1 : 2;
            __m256 a[2][4];
            for (int x = 0; x < PP; x++)
                for (int y = 0; y < 4; y++) a[x][y] = _mm256_setzero_ps();
            for (int c = 0; c < hd; c += 8) {
                __m256 qv[2];
                for (int x = 0; x < PP; x++) qv[x] = _mm256_loadu_ps(q[x0 + x] + c);
                for (int y = 0; y < 4; y++) {
                    const __m256 kv = load8(k, kj + y * hd + c, half);
                    for (int x = 0; x < PP; x++) a[x][y] = _mm256_fmadd_ps(qv[x], kv, a[x][y]);
                }
            }
            for (int x = 0; x < PP; x++)
                _mm_storeu_ps(s[x0 + x] + j, hsum4(a[x][0], a[x][1], a[x][2], a[x][3]));
        }
    }
    for (; j < n; j++)
        for (int x = 0; x < P; x++) s[x][j] = dot(q[x], k, (Py_ssize_t)j * hd, hd, half);
}

/* dots of four queries with 16-lane vectors: a register holds two queries' 8-lane chains
 * side by side against one key broadcast to both halves, so each chain is the one dots
 * runs (the same bits); the halves reduced by hsum4. qp: scratch of 4 hd floats. */
static inline __attribute__((always_inline, target("avx512f,avx512dq"))) void dots16_as(
    const float *const *q, const void *k, const void *fetch, int hd, int n, float *qp,
    float *const *s, const int half) {
    for (int c = 0; c < hd; c += 8) /* [q0 | q1] and [q2 | q3] per 8 columns */
        for (int x = 0; x < 4; x++)
            memcpy(qp + (x / 2) * 2 * hd + 2 * c + 8 * (x % 2), q[x] + c, 8 * sizeof(float));
    const int row = hd * element(half);
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const Py_ssize_t kj = (Py_ssize_t)j * hd;
        if (fetch != NULL)
            fetch_ahead((const char *)k + j * row, (const char *)fetch + j * row, row,
                        n - j - 4);
        __m512 a[2][4];
        for (int x = 0; x < 2; x++)
            for (int y = 0; y < 4; y++) a[x][y] = _mm512_setzero_ps();
        for (int c = 0; c < hd; c += 8) {
            const __m512 q01 = _mm512_loadu_ps(qp + 2 * c);
            const __m512 q23 = _mm512_loadu_ps(qp + 2 * hd + 2 * c);
            for (int y = 0; y < 4; y++) {
                const __m512 kv = _mm512_broadcast_f32x8(load8(k, kj + y * hd + c, half));
                a[0][y] = _mm512_fmadd_ps(q01, kv, a[0][y]);
                a[1][y] = _mm512_fmadd_ps(q23, kv, a[1][y]);
            }
        }
        for (int x = 0; x < 2; x++) {
            __m256 lo[4], hi[4];
            for (int y = 0; y < 4; y++) {
                lo[y] = _mm512_castps512_ps256(a[x][y]);
                hi[y] = _mm512_extractf32x8_ps(a[x][y], 1);
            }
            _mm_storeu_ps(s[2 * x] + j, hsum4(lo[0], lo[1], lo[2], lo[3]));
            _mm_storeu_ps(s[2 * x + 1] + j, hsum4(hi[0], hi[1], hi[2], hi[3]));
        }
    }
    for (; j < n; j++)
        for (int x = 0; x < 4; x++) s[x][j] = dot(q[x], k, (Py_ssize_t)j * hd, hd, half);
}

static __attribute__((target("avx512f,avx512dq"))) void dots16(
    const float *const *q, const void *k, const void *fetch, int hd, int n, float *qp,
    float *const *s, int half) {
    if (half)
        dots16_as(q, k, fetch, hd, n, qp, s, 1);
    else
        dots16_as(q, k, fetch, hd, n, qp, s, 0);
}

/* acc[x][c0 .. c0 + 8 W) = sum over j in order of e[x][j] v[j] for P queries (at most 4)
 * and W vectors (P W at most 12, W at most 8): per element one FMA chain from zero over
 * the positions, whatever P and W; each value vector loaded once for the P queries. */
static inline __attribute__((always_inline)) void weigh(const int P, const int W,
                                                        const float *const *e,
                                                        const void *values, int hd, int n,
                                                        int c0, float *const *acc, ahead_t *f,
                                                        const int half) {
    __m256 a[4][8];
    for (int x = 0; x < P; x++)
        for (int w = 0; w < W; w++) a[x][w] = _mm256_setzero_ps();
    for (int j = 0; j < n; j++) {
        fetch_step(f);
        const Py_ssize_t v = (Py_ssize_t)j * hd + c0;
        __m256 vv[8];
        for (int w = 0; w < W; w++) vv[w] = load8(values, v + 8 * w, half);
        for (int x = 0; x < P; x++) {
            const __m256 p = _mm256_broadcast_ss(e[x] + j);
            for (int w = 0; w < W; w++) a[x][w] = _mm256_fmadd_ps(p, vv[w], a[x][w]);
        }
    }
    for (int x = 0; x < P; x++)
        for (int w = 0; w < W; w++) _mm256_storeu_ps(acc[x] + c0 + 8 * w, a[x][w]);
}

/* weigh with 16-lane vectors (AVX-512's 32 registers hold four queries x four vectors):
 * lane for lane the same FMA chains, so the same bits. */
static inline __attribute__((always_inline, target("avx512f"))) void weigh16(
    const int P, const int W, const float *const *e, const void *values, int hd, int n,
    int c0, float *const *acc, ahead_t *f, const int half) {
    __m512 a[4][4];
    for (int x = 0; x < P; x++)
        for (int w = 0; w < W; w++) a[x][w] = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        fetch_step(f);
        const Py_ssize_t v = (Py_ssize_t)j * hd + c0;
        __m512 vv[4];
        for (int w = 0; w < W; w++) vv[w] = load16(values, v + 16 * w, half);
        for (int x = 0; x < P; x++) {
            const __m512 p = _mm512_set1_ps(e[x][j]);
            for (int w = 0; w < W; w++) a[x][w] = _mm512_fmadd_ps(p, vv[w], a[x][w]);
        }
    }
    for (int x = 0; x < P; x++)
        for (int w = 0; w < W; w++) _mm512_storeu_ps(acc[x] + c0 + 16 * w, a[x][w]);
}

/* The columns from 0 that four queries' 16-lane blocks of 64 (then 32) cover. */
static inline __attribute__((always_inline, target("avx512f"))) int weigh16_all_as(
    const float *const *e, const void *values, int hd, int n, float *const *acc, ahead_t *f,
    const int half) {
    int c0 = 0;
    for (; c0 + 64 <= hd; c0 += 64) weigh16(4, 4, e, values, hd, n, c0, acc, f, half);
    for (; c0 + 32 <= hd; c0 += 32) weigh16(4, 2, e, values, hd, n, c0, acc, f, half);
    return c0;
}

static __attribute__((target("avx512f"))) int weigh16_all(const float *const *e,
                                                          const void *values, int hd, int n,
                                                          float *const *acc, ahead_t *f,
                                                          int half) {
    return half ? weigh16_all_as(e, values, hd, n, acc, f, 1)
                : weigh16_all_as(e, values, hd, n, acc, f, 0);
}

/* weigh over every column of the head, in blocks of as many vectors as fit beside P. */
#define WEIGH_ALL(P, WIDE)                                                                  \
    do {                                                                                    \
        int c0 = (P) == 4 && wide_isa_selected() ? weigh16_all(e, values, hd, n, acc, f, half) \
                                                 : 0;                                       \
        for (; c0 + 8 * (WIDE) <= hd; c0 += 8 * (WIDE))                                     \
            weigh(P, WIDE, e, values, hd, n, c0, acc, f, half);                             \
        for (; c0 + 16 <= hd; c0 += 16) weigh(P, 2, e, values, hd, n, c0, acc, f, half);    \
        for (; c0 < hd; c0 += 8) weigh(P, 1, e, values, hd, n, c0, acc, f, half);           \
    } while (0)

static inline __attribute__((always_inline)) void weigh_all(int P, const float *const *e,
                                                            const void *values, int hd, int n,
                                                            float *const *acc, ahead_t *f,
                                                            const int half) {
    switch (P) {
    case 4: WEIGH_ALL(4, 3); break;
    case 3: WEIGH_ALL(3, 4); break;
    case 2: WEIGH_ALL(2, 6); break;
    default: WEIGH_ALL(1, 8); break;
    }
}

/* The partials of np (1 .. 4) queries q[x] of one row (so one range of positions) over
 * the n (1 .. TILE) positions whose keys and values start at ``keys``, ``values`` (with
 * ``from_memory``, fetched ahead, and the next_n keys from ``next`` too: ahead_t):
 * part[x][0] = m, part[x][1] = l, part[x][2 ..] = acc [hd]. Scores are q . k * scale,
 * soft-capped when the family says so; e^(s - m) in 8-lane chunks (each lane's result its
 * own), l summed lane j % 8 then folded, acc one FMA chain per element over the positions
 * in order: each query's partial the same bits whichever queries share the call. */
static inline __attribute__((always_inline)) void partials_as(
    const heads_t *sh, const float *const *q, int np, const void *keys, const void *values,
    int n, int from_memory, const void *next, int next_n, float *const *part, const int half) {
    const int hd = sh->hd;
    const float scale = sh->scale, cap = sh->softcap;
    float buf[4][TILE];
    float *s[4] = {buf[0], buf[1], buf[2], buf[3]};
    int x = 0;
    if (np == 4 && wide_isa_selected() && hd <= 256) {
        float qp[4 * 256];
        dots16(q, keys, from_memory ? values : NULL, hd, n, qp, s, half);
        x = 4;
    }
    /* A tile read from memory (a decode step's): both pairs of queries on each four keys
     * at once, the keys read once; Llama 3.2 1B's shape at 16k positions, AVX2, 2 threads,
     * 1.11-1.13x (bench/deep_decode.py, three runs; Gemma 3's 0.99-1.02x). From cache
     * (the rows of a prompt after a unit's first) a pair at a time over the whole tile,
     * as before: all four at once ran a 16k prompt's global layer 0.90-0.92x. */
    if (x == 0 && np == 4 && from_memory) {
        dots(4, q, keys, values, hd, n, s, half);
        x = 4;
    }
    for (; x + 2 <= np; x += 2)
        dots(2, q + x, keys, from_memory && x == 0 ? values : NULL, hd, n, s + x, half);
    if (x < np) dots(1, q + x, keys, from_memory && x == 0 ? values : NULL, hd, n, s + x, half);
    const __m256 vscale = _mm256_set1_ps(scale);
    for (x = 0; x < np; x++) {
        float *sx = s[x];
        /* the scores scaled (and capped), and their max: exact in any order */
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        int j = 0;
        if (cap > 0) {
            for (; j < n; j++) sx[j] = cap * tanhf(sx[j] * scale / cap);
            j = 0;
            for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sx + j));
        } else {
            for (; j + 8 <= n; j += 8) {
                const __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(sx + j), vscale);
                _mm256_storeu_ps(sx + j, sv);
                vmax = _mm256_max_ps(vmax, sv);
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax);
        float top = -INFINITY;
        for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
        for (; j < n; j++) {
            if (cap <= 0) sx[j] = sx[j] * scale;
            top = sx[j] > top ? sx[j] : top;
        }
        const __m256 vtop = _mm256_set1_ps(top);
        __m256 total = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
            const __m256 ev = exp256(_mm256_sub_ps(_mm256_loadu_ps(sx + j), vtop));
            _mm256_storeu_ps(sx + j, ev);
            total = _mm256_add_ps(total, ev);
        }
        if (j < n) { /* lanes past the end add nothing */
            const int m = n - j;
            for (int i = 0; i < 8; i++) lanes[i] = i < m ? sx[j + i] : 0.0f;
            _mm256_storeu_ps(lanes, exp256(_mm256_sub_ps(_mm256_loadu_ps(lanes), vtop)));
            for (int i = m; i < 8; i++) lanes[i] = 0.0f;
            total = _mm256_add_ps(total, _mm256_loadu_ps(lanes));
            for (int i = 0; i < m; i++) sx[j + i] = lanes[i];
        }
        part[x][0] = top;
        part[x][1] = hsum256(total);
    }
    float *acc[4];
    for (x = 0; x < np; x++) acc[x] = part[x] + 2;
    ahead_t f = {(const char *)next, (const char *)next + (Py_ssize_t)next_n * hd * element(half)};
    weigh_all(np, (const float *const *)s, values, hd, n, acc, &f, half);
}

static void partials(const heads_t *sh, const float *const *q, int np, const void *keys,
                     const void *values, int n, int from_memory, const void *next,
                     int next_n, float *const *part, int half) {
    if (half)
        partials_as(sh, q, np, keys, values, n, from_memory, next, next_n, part, 1);
    else
        partials_as(sh, q, np, keys, values, n, from_memory, next, next_n, part, 0);
}

/* state (M, L, A [hd]) <- the fold of the partial ``part`` into it. A fresh state is
 * (-inf, 0, 0), and the fold of the first partial into it is that partial, exactly. */
static void fold(float *state, const float *part, int hd) {
    const float top = state[0] > part[0] ? state[0] : part[0];
    const float a = expf(state[0] - top), b = expf(part[0] - top);
    state[0] = top;
    state[1] = state[1] * a + part[1] * b;
    const __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
    for (int c = 0; c < hd; c += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(state + 2 + c), va);
        const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(part + 2 + c), vb);
        _mm256_storeu_ps(state + 2 + c, _mm256_add_ps(x, y));
    }
}

static void fresh(float *state, int hd) {
    state[0] = -INFINITY;
    memset(state + 1, 0, (hd + 1) * sizeof(float));
}

/* out [hd] <- A / L of a folded state; a ``sink`` (NULL: none) is one more logit with no
 * value: it joins the max, and e^(sink - max) the total. */
static void finish(float *state, const float *sink, int hd, float *out) {
    float total = state[1];
    __m256 va = _mm256_set1_ps(1.0f);
    if (sink != NULL) {
        const float top = state[0] > *sink ? state[0] : *sink;
        const float a = expf(state[0] - top);
        total = total * a + expf(*sink - top);
        va = _mm256_set1_ps(a);
    }
    const __m256 vt = _mm256_set1_ps(total);
    for (int c = 0; c < hd; c += 8) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(state + 2 + c), va);
        _mm256_storeu_ps(out + c, _mm256_div_ps(x, vt));
    }
}

/* A unit of work: ``rows`` rows of one sequence from its row ``i0``, every query head of
 * kv head ``kv``. */
typedef struct {
    const seq_t *s;
    Py_ssize_t i0, rows;
    int kv;
} unit_t;

/* The positions row ``i`` of s sees: [*lo, *hi). */
static inline void visible(const heads_t *sh, const seq_t *s, Py_ssize_t i, Py_ssize_t *lo,
                           Py_ssize_t *hi) {
    *hi = s->first + i + 1;
    *lo = sh->window > 0 && *hi > sh->window ? *hi - sh->window : 0;
}

/* The tiles a unit's rows see: [*t0, *t1). */
static void unit_tiles(const heads_t *sh, const unit_t *u, Py_ssize_t *t0, Py_ssize_t *t1) {
    Py_ssize_t lo, hi, unused, last;
    visible(sh, u->s, u->i0, &lo, &hi); /* lo and hi grow with the row */
    visible(sh, u->s, u->i0 + u->rows - 1, &unused, &last);
    *t0 = lo / TILE;
    *t1 = (last - 1) / TILE + 1;
}

/* Where position p (past the pages) of s is in its own arrays: slot p - shared, or
 * p % ring in a ring. */
static inline Py_ssize_t slot(const seq_t *s, Py_ssize_t p) {
    return s->ring > 0 ? p % s->ring : p - s->shared;
}

/* Kv head kv's keys (``values`` 1: values) from position p of s on, contiguous to the end
 * of p's tile (or a ring's end): a page's or the sequence's own. */
static inline const void *cached(const heads_t *sh, const seq_t *s, int kv, int values,
                                  Py_ssize_t p) {
    const Py_ssize_t row = (Py_ssize_t)sh->hd * element(s->half);
    if (p < s->shared) {
        const char *page = s->pages[values * (s->shared / TILE) + p / TILE];
        return page + ((Py_ssize_t)kv * TILE + p % TILE) * row;
    }
    const char *own = values ? s->values : s->keys;
    return own + ((Py_ssize_t)kv * s->capacity + slot(s, p)) * row;
}

/* Row i's positions in tile t, [*a, *b): empty when *a >= *b. */
static inline void in_tile(const heads_t *sh, const seq_t *s, Py_ssize_t i, Py_ssize_t t,
                           Py_ssize_t *a, Py_ssize_t *b) {
    Py_ssize_t lo, hi;
    visible(sh, s, i, &lo, &hi);
    *a = t * TILE > lo ? t * TILE : lo;
    *b = (t + 1) * TILE < hi ? (t + 1) * TILE : hi;
}

/* The keys of row r of unit u in tile t, and (*n) how many lie in a row from there (to a
 * ring's end); NULL and 0 where the row sees nothing of the tile. */
static const void *tile_keys(const heads_t *sh, const unit_t *u, Py_ssize_t r, Py_ssize_t t,
                             int *n) {
    const seq_t *s = u->s;
    Py_ssize_t a, b;
    in_tile(sh, s, u->i0 + r, t, &a, &b);
    *n = 0;
    if (a >= b) return NULL;
    const Py_ssize_t at = slot(s, a);
    *n = (int)(s->ring > 0 && at + (b - a) > s->ring ? s->ring - at : b - a);
    return cached(sh, s, u->kv, 0, a);
}

/* The partials of every pair of unit u in tile t, into parts[(r * g + head) * (hd + 2)]
 * (a pair that sees nothing of the tile is skipped); a row's query heads four at a time,
 * so each key and value of the tile is read once for them. The keys of tile t + stride
 * (the one this thread likely takes next) are fetched meanwhile. */
static void tile_parts(const heads_t *sh, const float *qs, const unit_t *u, Py_ssize_t t,
                       Py_ssize_t stride, float *parts) {
    const int hd = sh->hd, g = sh->n_heads / sh->n_kv;
    const seq_t *s = u->s;
    for (Py_ssize_t r = 0; r < u->rows; r++) {
        Py_ssize_t a, b;
        in_tile(sh, s, u->i0 + r, t, &a, &b);
        if (a >= b) continue;
        int next_n = 0;
        const void *next = r == 0 ? tile_keys(sh, u, r, t + stride, &next_n) : NULL;
        for (int x0 = 0; x0 < g; x0 += 4) {
            const int np = g - x0 < 4 ? g - x0 : 4;
            const float *q[4];
            float *part[4];
            for (int x = 0; x < np; x++) {
                const int h = u->kv * g + x0 + x;
                q[x] = qs + ((s->row + u->i0 + r) * sh->n_heads + h) * hd;
                part[x] = parts + (r * g + x0 + x) * (Py_ssize_t)(hd + 2);
            }
            const int first = r == 0 && x0 == 0;
            partials(sh, q, np, cached(sh, s, u->kv, 0, a), cached(sh, s, u->kv, 1, a),
                     (int)(b - a), first, next, first ? next_n : 0, part, s->half);
        }
    }
}

/* The partials of row r of unit u (every query head of its kv head) in tile t, folded at
 * once into the row's states (laid out as tile_parts's parts): the same partials and the
 * same fold as tile_parts then fold_tile, with one row's partials (g (hd + 2) floats) in
 * ``part`` rather than a unit's. */
static void tile_fold_row(const heads_t *sh, const float *qs, const unit_t *u, Py_ssize_t r,
                          Py_ssize_t t, float *part, float *states) {
    const int hd = sh->hd, g = sh->n_heads / sh->n_kv;
    const seq_t *s = u->s;
    Py_ssize_t a, b;
    in_tile(sh, s, u->i0 + r, t, &a, &b);
    if (a >= b) return;
    const void *keys = cached(sh, s, u->kv, 0, a), *values = cached(sh, s, u->kv, 1, a);
    for (int x0 = 0; x0 < g; x0 += 4) {
        const int np = g - x0 < 4 ? g - x0 : 4;
        const float *q[4];
        float *p[4];
        for (int x = 0; x < np; x++) {
            q[x] = qs + ((s->row + u->i0 + r) * sh->n_heads + u->kv * g + x0 + x) * hd;
            p[x] = part + x * (Py_ssize_t)(hd + 2);
        }
        const int first = x0 == 0 && r == 0; /* the unit's first read of tile t: memory */
        int next_n = 0;
        const void *next = first ? tile_keys(sh, u, r, t + 1, &next_n) : NULL;
        partials(sh, q, np, keys, values, (int)(b - a), first, next, next_n, p, s->half);
        for (int x = 0; x < np; x++)
            fold(states + (r * g + x0 + x) * (Py_ssize_t)(hd + 2), p[x], hd);
    }
}

/* Folds tile t's partials (from tile_parts) into the unit's states, laid out alike. */
static void fold_tile(const heads_t *sh, const unit_t *u, Py_ssize_t t, const float *parts,
                      float *states) {
    const int hd = sh->hd, g = sh->n_heads / sh->n_kv;
    for (Py_ssize_t r = 0; r < u->rows; r++) {
        Py_ssize_t a, b;
        in_tile(sh, u->s, u->i0 + r, t, &a, &b);
        if (a >= b) continue;
        for (int x = 0; x < g; x++) {
            const Py_ssize_t at = (r * g + x) * (Py_ssize_t)(hd + 2);
            fold(states + at, parts + at, hd);
        }
    }
}

static void finish_unit(const heads_t *sh, const unit_t *u, float *states, float *outs) {
    const int hd = sh->hd, g = sh->n_heads / sh->n_kv;
    for (Py_ssize_t r = 0; r < u->rows; r++)
        for (int x = 0; x < g; x++) {
            const int h = u->kv * g + x;
            const float *sink = sh->sinks != NULL ? sh->sinks + h : NULL;
            float *out = outs + ((u->s->row + u->i0 + r) * sh->n_heads + h) * hd;
            finish(states + (r * g + x) * (Py_ssize_t)(hd + 2), sink, hd, out);
        }
}

static void fresh_unit(const heads_t *sh, const unit_t *u, float *states) {
    const int g = sh->n_heads / sh->n_kv;
    for (Py_ssize_t p = 0; p < u->rows * g; p++) fresh(states + p * (sh->hd + 2), sh->hd);
}

/* hd floats at ``from`` rounded to float16 (to nearest, ties to even: numpy's astype). */
static void to_half(uint16_t *to, const float *from, int hd) {
    for (int c = 0; c < hd; c += 8)
        _mm_storeu_si128((__m128i *)(to + c),
                         _mm256_cvtps_ph(_mm256_loadu_ps(from + c), _MM_FROUND_TO_NEAREST_INT));
}

/* Copies the sequence's new rows of k and v ([T, n_kv, hd]) to positions first .. (their
 * slots in its own arrays: the pages are never written), as float16 in a half cache. */
static void store_rows(const seq_t *s, const float *k, const float *v, int n_kv, int hd) {
    for (Py_ssize_t i = 0; i < s->count; i++)
        for (int h = 0; h < n_kv; h++) {
            const Py_ssize_t src = ((s->row + i) * n_kv + h) * hd;
            const Py_ssize_t dst = (h * s->capacity + slot(s, s->first + i)) * hd;
            if (s->half) {
                to_half((uint16_t *)s->keys + dst, k + src, hd);
                to_half((uint16_t *)s->values + dst, v + src, hd);
            } else {
                memcpy((float *)s->keys + dst, k + src, hd * sizeof(float));
                memcpy((float *)s->values + dst, v + src, hd * sizeof(float));
            }
        }
}

/* How many units of ``rows`` rows at most the batch makes. */
static Py_ssize_t units_of(const heads_t *h, const seq_t *seqs, Py_ssize_t n, Py_ssize_t rows) {
    Py_ssize_t total = 0;
    for (Py_ssize_t e = 0; e < n; e++) total += (seqs[e].count + rows - 1) / rows * h->n_kv;
    return total;
}

/* The batch's units, ``rows`` rows at most each; NULL when out of memory. */
static unit_t *make_units(const heads_t *h, const seq_t *seqs, Py_ssize_t n, Py_ssize_t rows,
                          Py_ssize_t *count) {
    const Py_ssize_t total = units_of(h, seqs, n, rows);
    unit_t *units = malloc((total + 1) * sizeof(unit_t));
    if (units == NULL) return NULL;
    Py_ssize_t u = 0;
    for (Py_ssize_t e = 0; e < n; e++)
        for (Py_ssize_t i0 = 0; i0 < seqs[e].count; i0 += rows)
            for (int kv = 0; kv < h->n_kv; kv++) {
                const Py_ssize_t left = seqs[e].count - i0;
                units[u++] = (unit_t){&seqs[e], i0, left < rows ? left : rows, kv};
            }
    *count = total;
    return units;
}

/* Each thread takes whole units (dynamically: later rows of a prompt see more) and folds
 * each row's partials of a tile as it computes them; ``rows``: the most a unit has. */
static int by_units(const heads_t *h, const float *q, float *out, const unit_t *units,
                    Py_ssize_t count, Py_ssize_t rows, int threads) {
    const Py_ssize_t pair = h->hd + 2, g = h->n_heads / h->n_kv;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *states = malloc((rows + 1) * g * pair * sizeof(float));
        if (states == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        float *part = states + rows * g * pair;
#pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t k = 0; k < count; k++) {
            if (states == NULL) continue;
            const unit_t *u = &units[k];
            Py_ssize_t t0, t1;
            unit_tiles(h, u, &t0, &t1);
            fresh_unit(h, u, states);
            for (Py_ssize_t t = t0; t < t1; t++)
                for (Py_ssize_t r = 0; r < u->rows; r++) tile_fold_row(h, q, u, r, t, part, states);
            finish_unit(h, u, states, out);
        }
        free(states);
    }
    return failed ? -1 : 0;
}

/* Few units with long rows (decode deep in a context): the threads share each unit's
 * tiles, computed into a buffer of partials (every tile at once where they fit in
 * PARTS_BYTES, else in waves), then folded in tile order. One parallel region per wave:
 * on a busy host each region's barrier may wait for a thread that lost its core. */
#define PARTS_BYTES (8 << 20)
static int by_tiles(const heads_t *h, const float *q, float *out, const unit_t *units,
                    Py_ssize_t count, int threads) {
    const Py_ssize_t pair = h->hd + 2, g = h->n_heads / h->n_kv, per_unit = g * pair;
    Py_ssize_t *span = malloc(2 * count * sizeof(Py_ssize_t));
    if (span == NULL) return -1;
    Py_ssize_t most = 1; /* tiles of the unit that sees the most */
    for (Py_ssize_t k = 0; k < count; k++) {
        unit_tiles(h, &units[k], &span[2 * k], &span[2 * k + 1]);
        most = span[2 * k + 1] - span[2 * k] > most ? span[2 * k + 1] - span[2 * k] : most;
    }
    Py_ssize_t wave = PARTS_BYTES / (Py_ssize_t)(count * per_unit * sizeof(float));
    wave = wave < 16 ? 16 : wave > most ? most : wave;
    float *states = malloc(count * per_unit * sizeof(float));
    float *parts = malloc(count * wave * per_unit * sizeof(float));
    const int ok = states != NULL && parts != NULL;
    for (Py_ssize_t k = 0; ok && k < count; k++) fresh_unit(h, &units[k], states + k * per_unit);
    for (Py_ssize_t w0 = 0; ok && w0 < most; w0 += wave) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
        for (Py_ssize_t task = 0; task < count * wave; task++) {
            const Py_ssize_t k = task / wave, t = span[2 * k] + w0 + task % wave;
            if (t < span[2 * k + 1])
                tile_parts(h, q, &units[k], t, threads, parts + task * per_unit);
        }
        for (Py_ssize_t k = 0; k < count; k++)
            for (Py_ssize_t x = 0; x < wave; x++) {
                const Py_ssize_t t = span[2 * k] + w0 + x;
                if (t < span[2 * k + 1])
                    fold_tile(h, &units[k], t, parts + (k * wave + x) * per_unit,
                              states + k * per_unit);
            }
    }
    for (Py_ssize_t k = 0; ok && k < count; k++)
        finish_unit(h, &units[k], states + k * per_unit, out);
    free(states);
    free(parts);
    free(span);
    return ok ? 0 : -1;
}

int attend_rows(const heads_t *h, const float *q, const float *k, const float *v, float *out,
                const seq_t *seqs, Py_ssize_t n, int threads) {
    Py_ssize_t longest = 0, least = 0;
    for (Py_ssize_t e = 0; e < n; e++) {
        store_rows(&seqs[e], k, v, h->n_kv, h->hd);
        if (seqs[e].first + seqs[e].count > longest) longest = seqs[e].first + seqs[e].count;
        least += (seqs[e].count + ROWS_LEAST - 1) / ROWS_LEAST * h->n_kv;
    }
    const Py_ssize_t seen = h->window > 0 && h->window < longest ? h->window : longest;
    /* row by row, and the tiles shared, where whole units would leave threads idle */
    const int split = threads > 1 && least < 2 * threads && seen >= 4 * TILE;
    /* else units as large as leave every thread four of them (dynamic balance) */
    Py_ssize_t rows = ROWS_LEAST;
    while (rows < ROWS_MOST && units_of(h, seqs, n, 2 * rows) >= 2 * threads) rows *= 2;
    Py_ssize_t count = 0;
    unit_t *units = make_units(h, seqs, n, split ? 1 : rows, &count);
    if (units == NULL) return -1;
    const int status = split ? by_tiles(h, q, out, units, count, threads)
                             : by_units(h, q, out, units, count, rows, threads);
    free(units);
    return status;
}
