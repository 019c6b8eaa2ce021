/*
 * A mixture of experts' feed-forward over a batch's rows. The router scores every expert
 * for each row; the rows are then grouped by the experts they chose, so that each chosen
 * expert's weights are read once for all its rows (a batch of 8 rows choosing 8 of 64
 * experts each reads ~45 experts, not 64 x 8). A row's output is its experts' outputs
 * summed by its weights in the order of its choice, whatever other rows share them.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"

/* llama.cpp clamps the sum of the chosen weights to float16's smallest normal. */
#define MIN_WEIGHT_SUM 6.103515625e-5f

/* Batches of at most this many rows take their experts a thread each (one parallel
 * region a layer) rather than every thread on each expert in turn (three regions an
 * expert): a decode step's experts are too small to share, and each region's barrier
 * costs a token dearly on a busy machine. The bits are the same either way. */
#define EXPERT_PARALLEL_ROWS 16

/* The F32 router of a few rows is multiplied from router_lanes: groups of 8 expert rows
 * stored column by column, ROUTER_CHAINS groups at a time so that their FMA chains
 * overlap. Each logit takes the operations of the general F32 matmul (matmul_tile.h's
 * ftile): per block of 32 columns one FMA chain from zero in column order, added to a
 * sum from zero; only the transposing of each block's rows on every call is gone (it
 * was most of a decode step's routing). No thread team: 64 x 1024 multiply-adds are
 * microseconds, a team's start and barrier more on a busy machine. */
#define ROUTER_GROUP 8
#define ROUTER_CHAINS 4

static Py_ssize_t router_groups(const qmat_t *router) {
    const Py_ssize_t g = (router->rows + ROUTER_GROUP - 1) / ROUTER_GROUP;
    return (g + ROUTER_CHAINS - 1) / ROUTER_CHAINS * ROUTER_CHAINS;
}

float *router_lanes(const qmat_t *router) {
    if (router->type != F32 || router->q8) return NULL;
    const Py_ssize_t cols = router->nb * QK, groups = router_groups(router);
    float *lanes = calloc((size_t)(groups * cols * ROUTER_GROUP), sizeof(float));
    if (lanes == NULL) return NULL;
    const float *w = (const float *)router->packed;
    for (Py_ssize_t r = 0; r < router->rows; r++)
        for (Py_ssize_t c = 0; c < cols; c++)
            lanes[((r / ROUTER_GROUP) * cols + c) * ROUTER_GROUP + r % ROUTER_GROUP] =
                w[r * cols + c];
    return lanes;
}

/* logits [T, n_experts] = router h for T rows of h, from router_lanes. */
static void route_few(const moe_t *m, const float *h, Py_ssize_t T, float *logits) {
    const Py_ssize_t cols = m->router.nb * QK, groups = router_groups(&m->router);
    const int E = m->n_experts;
    for (Py_ssize_t t = 0; t < T; t++) {
        const float *x = h + t * cols;
        for (Py_ssize_t g0 = 0; g0 < groups; g0 += ROUTER_CHAINS) {
            const float *w = m->router_lanes + g0 * cols * ROUTER_GROUP;
            __m256 acc[ROUTER_CHAINS];
            for (int i = 0; i < ROUTER_CHAINS; i++) acc[i] = _mm256_setzero_ps();
            for (Py_ssize_t b = 0; b < cols; b += QK) {
                __m256 s[ROUTER_CHAINS];
                for (int i = 0; i < ROUTER_CHAINS; i++) s[i] = _mm256_setzero_ps();
                for (Py_ssize_t c = b; c < b + QK; c++) {
                    const __m256 xc = _mm256_set1_ps(x[c]);
                    for (int i = 0; i < ROUTER_CHAINS; i++)
                        s[i] = _mm256_fmadd_ps(
                            _mm256_loadu_ps(w + (i * cols + c) * ROUTER_GROUP), xc, s[i]);
                }
                for (int i = 0; i < ROUTER_CHAINS; i++) acc[i] = _mm256_add_ps(acc[i], s[i]);
            }
            for (int i = 0; i < ROUTER_CHAINS; i++) {
                float lane[ROUTER_GROUP];
                _mm256_storeu_ps(lane, acc[i]);
                for (int l = 0; l < ROUTER_GROUP; l++) {
                    const Py_ssize_t e = (g0 + i) * ROUTER_GROUP + l;
                    if (e < E) logits[t * E + e] = lane[l];
                }
            }
        }
    }
}

/* One thread's room for an expert's rows: in, out [T, d], gate/up [T, 2 d_ff], act. */
typedef struct {
    float *x, *y, *gu, *act;
} work_t;

/* How moe_rows cuts its scratch (sizes in floats; ints take a float's room). */
typedef struct {
    float *logits;  /* [T, n_experts] */
    float *weights; /* [T, n_used] */
    int *choice;    /* [T, n_used] expert ids, best first */
    int *order;     /* [T * n_used] (row * n_used + slot), grouped by expert */
    float *slots;   /* [T, n_used, d] each chosen expert's output of each row */
    float *work;    /* per thread: work_floats */
} moe_scratch_t;

static Py_ssize_t work_floats(const moe_t *m, Py_ssize_t T, Py_ssize_t d) {
    return T * (2 * d + 3 * m->d_ff);
}

static work_t work_of(const moe_t *m, Py_ssize_t T, Py_ssize_t d, float *base) {
    work_t w = {base, base + T * d, base + 2 * T * d, base + 2 * T * d + T * 2 * m->d_ff};
    return w;
}

static moe_scratch_t cut_scratch(const moe_t *m, Py_ssize_t T, Py_ssize_t d, float *base) {
    const Py_ssize_t k = m->n_used;
    moe_scratch_t s;
    s.logits = base;
    s.weights = s.logits + T * m->n_experts;
    s.choice = (int *)(s.weights + T * k);
    s.order = s.choice + T * k;
    s.slots = (float *)(s.order + T * k);
    s.work = s.slots + T * k * d;
    return s;
}

Py_ssize_t moe_scratch_floats(const moe_t *m, Py_ssize_t T, Py_ssize_t d, int threads) {
    const Py_ssize_t k = m->n_used;
    const Py_ssize_t workers = threads > 1 ? threads : 1;
    return T * (m->n_experts + 3 * k + k * d) + workers * work_floats(m, T, d);
}

/* Softmax of v [n] in place, the largest subtracted first. */
static void softmax(float *v, int n) {
    float top = v[0];
    for (int i = 1; i < n; i++) top = v[i] > top ? v[i] : top;
    float total = 0.0f;
    for (int i = 0; i < n; i++) {
        v[i] = expf(v[i] - top);
        total += v[i];
    }
    for (int i = 0; i < n; i++) v[i] /= total;
}

/* One row's choice: the n_used experts with the largest scores, best first (ties to the
 * lower id), and their weights. scores [n_experts] is overwritten. */
static void choose(const moe_t *m, float *scores, int *choice, float *weights) {
    const int k = m->n_used;
    if (m->gating == 0) softmax(scores, m->n_experts);
    for (int s = 0; s < k; s++) {
        int best = -1;
        for (int e = 0; e < m->n_experts; e++) {
            int taken = 0;
            for (int j = 0; j < s; j++) taken |= choice[j] == e;
            if (!taken && (best < 0 || scores[e] > scores[best])) best = e;
        }
        choice[s] = best;
        weights[s] = scores[best];
    }
    if (m->gating == 1) softmax(weights, k);
    if (m->normalize) {
        float total = 0.0f;
        for (int s = 0; s < k; s++) total += weights[s];
        total = total > MIN_WEIGHT_SUM ? total : MIN_WEIGHT_SUM;
        for (int s = 0; s < k; s++) weights[s] /= total;
    }
}

/* Expert e's feed-forward of the n rows its (row * n_used + slot) pairs name, each output
 * into its row's slot. */
static int run_expert(const moe_t *m, int e, const int *pairs, Py_ssize_t n, const float *h,
                      Py_ssize_t d, const work_t *w, float *slots, int threads, int wide) {
    const int k = m->n_used;
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(w->x + i * d, h + (pairs[i] / k) * d, d * sizeof(float));
    if (ffn_rows(&m->experts[e], m->d_ff, m->act, w->x, n, d, w->gu, w->act, w->y, threads,
                 wide) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        memcpy(slots + (Py_ssize_t)pairs[i] * d, w->y + i * d, d * sizeof(float));
    return 0;
}

int moe_rows(const moe_t *m, const float *h, Py_ssize_t T, Py_ssize_t d, float *scratch,
             float *out, int threads, int wide) {
    const int k = m->n_used, E = m->n_experts;
    moe_scratch_t s = cut_scratch(m, T, d, scratch);
    if (m->router_lanes != NULL && T <= EXPERT_PARALLEL_ROWS)
        route_few(m, h, T, s.logits);
    else if (qmatmul(&m->router, h, T, s.logits, threads, wide) < 0)
        return -1;
    for (Py_ssize_t t = 0; t < T; t++) {
        float *row = s.logits + t * E;
        if (m->router_bias != NULL) add_into(row, m->router_bias, E);
        choose(m, row, s.choice + t * k, s.weights + t * k);
    }
    /* (row, slot) pairs grouped by expert: a counting sort, rows ascending within one */
    int *start = calloc((size_t)E + 1, sizeof(int));
    if (start == NULL) return -1;
    for (Py_ssize_t i = 0; i < T * k; i++) start[s.choice[i] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    int *fill = malloc((size_t)E * sizeof(int));
    if (fill == NULL) {
        free(start);
        return -1;
    }
    memcpy(fill, start, (size_t)E * sizeof(int));
    for (Py_ssize_t i = 0; i < T * k; i++) s.order[fill[s.choice[i]]++] = (int)i;
    free(fill);
    /* the experts some row chose, in id order */
    int *used = malloc((size_t)E * sizeof(int));
    if (used == NULL) {
        free(start);
        return -1;
    }
    int active = 0;
    for (int e = 0; e < E; e++)
        if (start[e + 1] > start[e]) used[active++] = e;
    int status = 0;
    if (T <= EXPERT_PARALLEL_ROWS && threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(min : status)
        for (int i = 0; i < active; i++) {
            float *mine = s.work + omp_get_thread_num() * work_floats(m, T, d);
            const work_t w = work_of(m, T, d, mine);
            const int e = used[i];
            const int r = run_expert(m, e, s.order + start[e], start[e + 1] - start[e], h, d,
                                     &w, s.slots, 1, wide);
            status = r < status ? r : status;
        }
    } else {
        const work_t w = work_of(m, T, d, s.work);
        for (int i = 0; i < active && status == 0; i++) {
            const int e = used[i];
            status = run_expert(m, e, s.order + start[e], start[e + 1] - start[e], h, d, &w,
                                s.slots, threads, wide);
        }
    }
    free(used);
    free(start);
    if (status < 0) return -1;
    for (Py_ssize_t t = 0; t < T; t++) { /* the experts' outputs weighted, summed in order */
        const float *slot = s.slots + t * k * d, *w = s.weights + t * k;
        float *o = out + t * d;
        for (Py_ssize_t c = 0; c < d; c++) o[c] = slot[c] * w[0];
        for (int j = 1; j < k; j++)
            for (Py_ssize_t c = 0; c < d; c++) o[c] += slot[j * d + c] * w[j];
    }
    return 0;
}
