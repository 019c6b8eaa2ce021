/*
 * Native kernels of the fast backend (AVX2 + FMA, float32 activations): what the
 * translation units share. Each kernel runs one fixed sequence of operations per
 * output element whatever the batch or the thread split (no -ffast-math; explicit
 * intrinsics), so a sequence's results are bit-identical alone or batched.
 */
#ifndef MESHNET_NATIVE_H
#define MESHNET_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 32 /* weights per block: a matrix's width is nb * QK in every type */
#define QK_K 256 /* weights per super-block of the K-quants */

/* The GGUF block types the matmul reads, in three families:
 *   Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,  row groups, a GROUP_BYTES entry per block of 32 columns
 *   MXFP4
 *   Q4_K, Q5_K, Q6_K               row groups, a GROUP_BYTES entry per super-block of 256
 *   Q2_K, Q3_K, F16, BF16, F32     the GGUF's own rows, unpacked a tile at a time
 *                                  ("row-wise") */
enum {
    Q4_0 = 0, Q4_1 = 1, Q8_0 = 2,
    Q4_K = 3, Q5_K = 4, Q6_K = 5,
    Q2_K = 6, Q3_K = 7, Q5_0 = 8, Q5_1 = 9, F16 = 10, BF16 = 11, F32 = 12, MXFP4 = 13,
    TYPE_COUNT = 14
};
#define IS_KQUANT(type) ((type) >= Q4_K && (type) <= Q6_K)
#define IS_BLOCKWISE(type) \
    ((type) <= Q8_0 || (type) == Q5_0 || (type) == Q5_1 || (type) == MXFP4)
#define IS_ROWWISE(type) (!IS_KQUANT(type) && !IS_BLOCKWISE(type))

/*
 * A [rows, nb * QK] matrix. Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, MXFP4 and the K-quants are
 * held in row groups of GROUP_ROWS (the last one padded with zero blocks), so one load
 * gives a column of 8 or 16 rows:
 *   Q4_0, Q4_1, Q8_0: per group and block, the 16 rows' float16 scales d, for Q4_1 their
 *     float16 offsets m, then the quants column by column, one byte per row: 16 columns
 *     for 4-bit blocks (byte i of a row holds its weights i and 16 + i, low nibble
 *     first), 32 for Q8_0.
 *   Q5_0, Q5_1: as Q4_0, Q4_1 (d, Q5_1's m, the 16 nibble columns), then the fifth bits
 *     in 4 byte columns (bit i % 8 of byte i / 8: column i, the GGUF's qh).
 *     w = d (q - 16) (Q5_0), d q + m (Q5_1).
 *   MXFP4: per group and block, the 16 rows' E8M0 exponents e (a byte each), then 16
 *     byte columns of 4-bit codes as Q4_0's. w = kvalues[q] 2^(e - 128), kvalues the
 *     E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12, then the same negated), as llama.cpp.
 *   Q4_K, Q5_K: per group and super-block, the rows' float16 d, float16 dmin, the 6-bit
 *     sub-block scales and mins as the file packs them (12 byte columns of 16 rows: 16
 *     rows x 12 bytes, unpacked per super-block by kscales.h), Q5_K's fifth bits (per
 *     sub-block 4 byte columns: bit m of byte b is column b + 4 m), then the nibbles (per
 *     sub-block 16 byte columns: byte i holds columns i, low nibble, and 16 + i, as
 *     Q4_0's). w = (d sc) q - dmin m.
 *   Q6_K: per group and super-block, the rows' float16 d, the 16 int8 scales of the
 *     sub-blocks of 16 (16 columns of 16 rows), then per sub-block its low nibbles (8
 *     byte columns: byte i holds columns i and 8 + i) and its top two bits (4 byte
 *     columns: bits 2 m of byte j are column j + 4 m). w = (d sc) (q - 32).
 *   The quants are regrouped from the GGUF's order so that one byte column serves two
 *     or four columns of the same sub-block: one load, fewer unpacking operations.
 * The other types keep the GGUF's own rows (no padding).
 */
#define GROUP_ROWS 16

/* Byte offsets of the fields in a K-quant group's super-block. */
enum {
    K_D = 0,                                         /* 16 float16 */
    K_DMIN = 2 * GROUP_ROWS,                         /* 16 float16 (Q4_K, Q5_K) */
    K_SC = 4 * GROUP_ROWS,                           /* 12 x 16 bytes: scales, mins */
    K_QH5 = K_SC + 12 * GROUP_ROWS,                  /* Q5_K: 32 x 16 bytes */
    K_QS4 = K_QH5,                                   /* Q4_K: 128 x 16 bytes */
    K_QS5 = K_QH5 + 32 * GROUP_ROWS,                 /* Q5_K: 128 x 16 bytes */
    K6_SC = 2 * GROUP_ROWS,                          /* Q6_K: 16 x 16 int8 */
    K6_SUB = K6_SC + 16 * GROUP_ROWS,                /* Q6_K: 16 sub-blocks of ... */
    K6_SUB_BYTES = 12 * GROUP_ROWS,                  /* ... 8 nibble + 4 high-bit columns */
};

/* A group's bytes per block, or per super-block (K-quants); 0: row-wise. Defined here, not
 * in one unit, so the tiles' strides are constants where the type is (a stride read from
 * memory cost the Q8_0 tiles ~20%). */
static const Py_ssize_t GROUP_BYTES[TYPE_COUNT] = {
    2 * GROUP_ROWS + 16 * GROUP_ROWS,  /* Q4_0: d, 16 byte columns */
    4 * GROUP_ROWS + 16 * GROUP_ROWS,  /* Q4_1: d, m, 16 byte columns */
    2 * GROUP_ROWS + 32 * GROUP_ROWS,  /* Q8_0: d, 32 byte columns */
    K_QS4 + 128 * GROUP_ROWS,          /* Q4_K: 2304 = 16 rows x 144 */
    K_QS5 + 128 * GROUP_ROWS,          /* Q5_K: 2816 = 16 rows x 176 */
    K6_SUB + 16 * K6_SUB_BYTES,        /* Q6_K: 3360 = 16 rows x 210 */
    0, 0,                              /* Q2_K, Q3_K: row-wise */
    2 * GROUP_ROWS + 20 * GROUP_ROWS,  /* Q5_0: d, 16 nibble and 4 fifth-bit columns */
    4 * GROUP_ROWS + 20 * GROUP_ROWS,  /* Q5_1: d, m, 16 nibble and 4 fifth-bit columns */
    0, 0, 0,                           /* F16, BF16, F32: row-wise */
    GROUP_ROWS + 16 * GROUP_ROWS,      /* MXFP4: e, 16 byte columns (16 rows x 17) */
};

/*
 * The q8 layout (the q8 backend's matrices: every type of the two row-group families):
 * the layout above with each quant region's byte columns regrouped four at a time, so
 * that a row's four bytes of columns 4 i .. 4 i + 3 lie side by side: byte column c of
 * row r moves from c * 16 + r to (c / 4) * 64 + r * 4 + c % 4 within its region (Q4_0,
 * Q4_1, Q8_0, Q5_0, Q5_1, MXFP4: the 16 or 32 byte columns of a block's quants; Q4_K,
 * Q5_K: the 128 of a super-block's nibbles, and Q5_K's 32 of fifth bits; Q6_K: the 192
 * of its sub-blocks). Q5_0's and Q5_1's fifth bits are re-encoded as Q5_K's: per row 4 bytes,
 * bit m of byte b for column b + 4 m. The scales stay as they are. One int32 lane then
 * holds four weights of one row, as an 8-bit integer dot product takes them (q8.c). A
 * type code with Q8_LAYOUT set names a matrix in this layout.
 */
#define Q8_LAYOUT 32
#define HAS_Q8_KERNEL(type) (!IS_ROWWISE(type))

typedef struct {
    const uint8_t *packed; /* qmat_bytes(type, rows, nb) bytes */
    Py_ssize_t rows, nb;
    int type;
    int q8; /* in the q8 layout: multiplied by q8matmul with 8-bit activations */
} qmat_t;

/* ``code`` (a type, Q8_LAYOUT or'ed in for the q8 layout) into w's type and q8; -1 for a
 * code naming no type, or the q8 layout of a type without a q8 kernel. */
int qmat_set_type(qmat_t *w, int code);

/* out[t, r] = W[r] . x[t] with each row of x first quantized to 8 bits as llama.cpp does
 * for W's type (Q8_0 blocks for Q4_0 and Q8_0, Q8_1 for Q4_1, Q8_K for the K-quants),
 * then integer dot products per block (q8.c); -1 when out of memory. W in the q8 layout.
 * wide 0 keeps to AVX2 (the same bits). */
int q8matmul(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads, int wide);

/* outs[i] = the q8matmul of ws[i] and x for n (1 .. 4) matrices in the q8 layout of one
 * width, x quantized once for all and every matrix's rows in one parallel region (Q/K/V
 * of differing types); the same results as a q8matmul each. -1 when out of memory or
 * the matrices do not fit. */
int q8matmul_many(const qmat_t *const *ws, int n, const float *x, Py_ssize_t T,
                  float *const *outs, int threads, int wide);

/* The bytes a [rows, nb * QK] matrix of ``type`` takes, or -1 where the type is unknown
 * or the width does not fit it (K-quants: nb a multiple of 8). */
Py_ssize_t qmat_bytes(int type, Py_ssize_t rows, Py_ssize_t nb);

/* GGUF bytes of one row of a row-wise type (Q2_K, Q3_K, F16, BF16, F32). */
Py_ssize_t row_bytes(int type, Py_ssize_t nb);

/* out[0 .. QK) = weights b * QK .. of a row of a row-wise type (``row`` its GGUF bytes). */
void dequant_block(int type, const uint8_t *row, Py_ssize_t b, float *out);

/* out[0 .. nb * QK) = row r of w, exactly as gguf-py dequantizes it. */
void qmat_row(const qmat_t *w, Py_ssize_t r, float *out);

/* out[t, r] = W[r] . x[t] for x [T, nb * QK]; -1 when out of memory. wide 0 keeps to
 * AVX2's 8-row vectors where the process runs AVX-512 ones (the same bits: tests check
 * that both agree). */
int qmatmul(const qmat_t *w, const float *x, Py_ssize_t T, float *out, int threads, int wide);

/* One sequence's rows in a batch, and its cache of one layer: positions before ``shared``
 * in pages of ATTENTION_TILE positions that other sequences may read too (kv/pages.py),
 * page i's keys at pages[i] and its values at pages[n_pages + i], each [n_kv, TILE, hd];
 * the rest in its own arrays, position p in slot p - shared. Its keys and values are
 * float32, or with ``half`` float16 (stored rounded to nearest, read widened: exact). */
typedef struct {
    void *keys, *values; /* [n_kv, capacity, hd] each */
    Py_ssize_t capacity;
    Py_ssize_t first; /* positions before the new rows */
    Py_ssize_t count; /* new rows */
    Py_ssize_t row;   /* the first of them in the batch */
    Py_ssize_t ring;  /* > 0: position p is in slot p % ring (a windowed layer's ring) */
    Py_ssize_t shared;          /* positions in pages: a multiple of ATTENTION_TILE */
    const void *const *pages;   /* 2 shared / ATTENTION_TILE pointers, or NULL */
    int half;                   /* keys and values are float16 */
} seq_t;

/* Positions per tile of the attention (tiles start at multiples of it); a ring's
 * capacity is a multiple of it, so a tile's positions are contiguous slots. */
#define ATTENTION_TILE 64

/* The attention's shape and the family's rules for its scores. */
typedef struct {
    int n_heads, n_kv, hd;
    float scale;       /* scores = q . k * scale */
    float softcap;     /* scores = softcap * tanh(scores / softcap) when > 0 */
    Py_ssize_t window; /* > 0: a row sees only its last ``window`` positions, itself included */
    const float *sinks; /* [n_heads]: each head's softmax also counts e^sink (gpt-oss), or NULL */
} heads_t;

/* Stores each sequence's new keys/values (k, v [T, n_kv, hd]) in its cache, then
 * out[row] = causal attention of q [T, n_heads, hd]; -1 when out of memory. */
int attend_rows(const heads_t *h, const float *q, const float *k, const float *v, float *out,
                const seq_t *seqs, Py_ssize_t n, int threads);

/* The gated feed-forward's activation of its gate g and up u. */
enum {
    ACT_SILU = 0,       /* silu(g) u */
    ACT_GELU = 1,       /* gelu(g) u, the tanh approximation */
    ACT_SWIGLU_OAI = 2, /* gpt-oss: min(g, 7) sigmoid(1.702 min(g, 7)) (clamp(u, -7, 7) + 1) */
};

/* A gated feed-forward of hidden width d_ff: down(act(gate h + gate_bias, up h + up_bias))
 * + down_bias, the biases NULL where it has none. */
typedef struct {
    qmat_t gate_up[2]; /* [gate | up] rows fused (n_gate_up 1), or gate, up (2) */
    int n_gate_up;
    qmat_t down; /* [d, d_ff] */
    const float *gate_bias, *up_bias; /* [d_ff] */
    const float *down_bias;           /* [d] */
} ffn_t;

/* A mixture of experts: a row's router logits (router h + router_bias) pick n_used of the
 * n_experts feed-forwards, whose outputs are summed by the router's weights in the order
 * of the choice. gating 0: a softmax over every expert, the most probable kept; 1: the
 * largest logits kept, then a softmax over them (gpt-oss). normalize: the kept weights
 * are divided by their sum (at least float16's smallest normal, as llama.cpp). */
typedef struct {
    qmat_t router; /* [n_experts, d] */
    const float *router_bias; /* [n_experts], or NULL */
    const ffn_t *experts;     /* n_experts */
    int n_experts, n_used;
    Py_ssize_t d_ff;
    int gating, normalize;
    int act; /* the experts' activation (ACT_*) */
    const float *router_lanes; /* an F32 router turned for a few rows (router_lanes), or NULL */
} moe_t;

/* An F32 router [E, d] turned into groups of 8 rows, each [d][8] (the last group padded
 * with zeros), so that a few rows' logits need no transposing; NULL when out of memory or
 * the router is not F32. Free with free(). */
float *router_lanes(const qmat_t *router);

/* The floats of scratch moe_rows needs for T rows of width d on ``threads`` threads. */
Py_ssize_t moe_scratch_floats(const moe_t *m, Py_ssize_t T, Py_ssize_t d, int threads);

/* out [T, d] = the mixture's output for the normed rows h [T, d]. Each row's result is a
 * function of its own values alone: rows are grouped by expert so an expert's weights are
 * read once for all the rows that chose it, and the matmuls give each row what it would
 * get alone. scratch: moe_scratch_floats floats. -1 when out of memory. */
int moe_rows(const moe_t *m, const float *h, Py_ssize_t T, Py_ssize_t d, float *scratch,
             float *out, int threads, int wide);

/* out [T, d] = the feed-forward of rows h [T, d]; gu [T, 2 d_ff] and act [T, d_ff] are its
 * scratch. -1 when out of memory. */
int ffn_rows(const ffn_t *f, Py_ssize_t d_ff, int act, const float *h, Py_ssize_t T,
             Py_ssize_t d, float *gu, float *act_buf, float *out, int threads, int wide);

/* One transformer block's weights and its family's traits. Optional vectors are NULL
 * where the family has none. The feed-forward is the dense one (has_dense), a mixture
 * of experts (moe), or both: the dense one is then the shared expert, scaled by
 * sigmoid(shared_gate . h) where shared_gate is given. */
typedef struct {
    qmat_t qkv[3];     /* [q | k | v] rows fused (n_qkv 1), or q, k, v (n_qkv 3) */
    int n_qkv;
    qmat_t wo;         /* [d, n_heads * hd] */
    ffn_t dense;       /* [d_ff] wide, where has_dense */
    int has_dense;
    const moe_t *moe;  /* or NULL */
    const float *attn_norm, *ffn_norm;          /* [d] */
    const float *qkv_bias;                      /* [q | k | v] widths, or NULL */
    const float *q_norm, *k_norm;               /* [hd] RMSNorm of each head, or NULL */
    const float *post_attn_norm, *post_ffn_norm; /* [d], or NULL */
    const float *wo_bias;                       /* [d], or NULL */
    const float *shared_gate;                   /* [d], or NULL */
    float eps;
    heads_t heads;
    Py_ssize_t d, d_ff, rope_pairs; /* rope_pairs: rotated pairs per head */
    int rope_halves;                /* pairs are (i, i + rope_pairs), not (2i, 2i + 1) */
    int act;                        /* the feed-forwards' activation (ACT_*) */
} block_t;

/* x [T, d] += the block's attention and feed-forward output for T rows at the
 * positions whose rotary tables are cos, sin [T, rope_pairs]; each sequence's new keys
 * and values are stored in its cache. -1 when out of memory: the step is then void
 * (x half updated, keys and values written past the committed positions only). ``keep``
 * holds the calling thread's scratch, however large, for the next block. */
int forward_block(const block_t *b, float *x, Py_ssize_t T, const float *cos, const float *sin,
                  const seq_t *seqs, Py_ssize_t n, int threads, int wide, int keep);

/* Give back the calling thread's block scratch past what a decode step keeps. */
void release_scratch(void);

/* Rotary embedding, in place, of x [T, heads, hd]: ``pairs`` pairs of each head turned by
 * cos, sin [T, pairs]; the pairs are (2i, 2i + 1), or (i, i + pairs) with ``halves``. */
void rope(float *x, Py_ssize_t T, int heads, int hd, Py_ssize_t pairs, const float *cos,
          const float *sin, int halves);

/* out [T, d_ff] = the activation ``act`` (ACT_*) of gate and up; row t's gate at
 * gate + t * stride, its up at up + t * stride. */
void glu(const float *gate, const float *up, Py_ssize_t stride, Py_ssize_t T, Py_ssize_t d_ff,
         float *out, int act, int threads);

/* Whether the n matrices are all in the q8 layout (then of one width: they share an
 * input), so q8matmul_many can take them together. */
int all_q8(const qmat_t *ws, int n);

/* x [n] += y [n] */
void add_into(float *x, const float *y, Py_ssize_t n);

/* e^x for every lane: range reduction by ln 2 and a degree-6 polynomial, ~1 ulp; lanes
 * below -87 or above 88 are taken as those limits. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v);
    __m128 hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* The first ``n`` lanes of a vector of row results (fewer than a vector at a matrix's last
 * row group), for the tiles of every kernel family. */
static inline void store_rows8(float *p, __m256 v, int n) {
    if (n == 8) {
        _mm256_storeu_ps(p, v);
        return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    memcpy(p, lanes, n * sizeof(float));
}

static inline __attribute__((target("avx512f"))) void store_rows16(float *p, __m512 v, int n) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}

#endif
