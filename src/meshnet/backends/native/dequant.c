/*
 * Matrix sizes per block type, and weights as float32 from every layout native.h
 * describes: a block of a row-wise type's GGUF row (the matmul unpacks its tiles with
 * it) and whole rows of any matrix (embedding lookups). Every weight is computed with
 * gguf-py's formula, operation for operation, so a row here equals its dequantize bit for
 * bit.
 */
#include <string.h>

#include "kscales.h"
#include "native.h"

/* GGUF bytes of a row of a row-wise type. */
static Py_ssize_t rowwise_bytes(int type, Py_ssize_t nb) {
    switch (type) {
    case Q2_K: return nb / 8 * 84;
    case Q3_K: return nb / 8 * 110;
    case F16:
    case BF16: return nb * 2 * QK;
    default: return nb * 4 * QK; /* F32 */
    }
}

Py_ssize_t row_bytes(int type, Py_ssize_t nb) { return rowwise_bytes(type, nb); }

Py_ssize_t qmat_bytes(int type, Py_ssize_t rows, Py_ssize_t nb) {
    if (type < 0 || type >= TYPE_COUNT || rows < 0 || nb < 0) return -1;
    const int per_super = IS_KQUANT(type) || type == Q2_K || type == Q3_K;
    if (per_super && nb % (QK_K / QK)) return -1;
    const Py_ssize_t groups = (rows + GROUP_ROWS - 1) / GROUP_ROWS;
    if (IS_ROWWISE(type)) return rows * rowwise_bytes(type, nb);
    if (IS_KQUANT(type)) return groups * (nb / (QK_K / QK)) * GROUP_BYTES[type];
    return groups * nb * GROUP_BYTES[type];
}

int qmat_set_type(qmat_t *w, int code) {
    w->q8 = (code & Q8_LAYOUT) != 0;
    w->type = code & ~Q8_LAYOUT;
    if (w->type < 0 || w->type >= TYPE_COUNT) return -1;
    return w->q8 && !HAS_Q8_KERNEL(w->type) ? -1 : 0;
}

/* Byte column ``c`` of row ``lane`` in a quant region of a row group (native.h): column
 * by column, or in the q8 layout four columns of a row side by side. */
static inline uint8_t qbyte(const uint8_t *region, int c, int lane, int q8) {
    return q8 ? region[(c / 4) * 4 * GROUP_ROWS + lane * 4 + c % 4] : region[c * GROUP_ROWS + lane];
}

static float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q2_K super-block: scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
 * Weight n = 128 h + 32 j + l: bits 2 j of qs[32 h + l]; sub-block of 16 n / 16. */
static void q2_k(const uint8_t *sb, int part, float *out) {
    const float d = half(sb + 80), dmin = half(sb + 82);
    const int h = part / 4, j = part % 4;
    for (int half16 = 0; half16 < 2; half16++) { /* the part's two sub-blocks of 16 */
        const uint8_t sc = sb[(part * QK) / 16 + half16];
        const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
        for (int l = 16 * half16; l < 16 * half16 + 16; l++) {
            const float q = (float)((sb[16 + 32 * h + l] >> (2 * j)) & 3);
            out[l] = dl * q - ml;
        }
    }
}

/* Q3_K super-block: hmask[32], qs[64], scales[12] (6-bit, signed by -32), d. Weight
 * n = 128 h + 32 j + l: bits 2 j of qs[32 h + l], minus 4 unless bit n / 32 of
 * hmask[l] is set. */
static void q3_k(const uint8_t *sb, int part, float *out) {
    const float d = half(sb + 108);
    const uint8_t *scales = sb + 96;
    const int h = part / 4, j = part % 4;
    for (int half16 = 0; half16 < 2; half16++) { /* the part's two sub-blocks of 16 */
        const int i = (part * QK) / 16 + half16;
        const int low = i < 8 ? scales[i] & 15 : scales[i - 8] >> 4;
        const int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
        const float dl = d * (float)((low | high << 4) - 32);
        for (int l = 16 * half16; l < 16 * half16 + 16; l++) {
            const int ql = (sb[32 + 32 * h + l] >> (2 * j)) & 3;
            const int hbit = (sb[l] >> part) & 1;
            out[l] = dl * (float)(ql - 4 * (1 - hbit));
        }
    }
}

/* The E2M1 values doubled (llama.cpp's kvalues_mxfp4): an MXFP4 weight is
 * FP4_VALUES[q] * 2^(e - 128), the block's E8M0 exponent e halved to match; each such
 * product is exact (an integer of at most 4 bits times a power of two). */
static const int8_t FP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* 2^(e - 128) (ggml_e8m0_to_fp32_half): a float32 subnormal for e < 2. */
static float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof(d));
    return d;
}

void dequant_block(int type, const uint8_t *row, Py_ssize_t b, float *out) {
    switch (type) {
    case Q2_K: q2_k(row + b / 8 * 84, (int)(b % 8), out); break;
    case Q3_K: q3_k(row + b / 8 * 110, (int)(b % 8), out); break;
    case F16: /* exact conversions, eight at a time */
        for (int l = 0; l < QK; l += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(row + (b * QK + l) * 2));
            _mm256_storeu_ps(out + l, _mm256_cvtph_ps(h));
        }
        break;
    case BF16: /* a bfloat16 is the top half of its float32 */
        for (int l = 0; l < QK; l += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(row + (b * QK + l) * 2));
            const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
            _mm256_storeu_ps(out + l, _mm256_castsi256_ps(wide));
        }
        break;
    default: memcpy(out, row + b * QK * 4, QK * sizeof(float)); break;
    }
}

/* Row ``lane`` of a row group's block (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, MXFP4). */
static void legacy_block(int type, const uint8_t *p, int lane, int q8, float *out) {
    if (type == MXFP4) {
        const float d = e8m0_half(p[lane]);
        for (int c = 0; c < QK; c++)
            out[c] = (float)FP4_VALUES[(qbyte(p + GROUP_ROWS, c % 16, lane, q8) >> (4 * (c / 16))) & 15] * d;
        return;
    }
    const float d = half(p + 2 * lane);
    if (type == Q8_0) {
        for (int c = 0; c < QK; c++)
            out[c] = (float)(int8_t)qbyte(p + 2 * GROUP_ROWS, c, lane, q8) * d;
        return;
    }
    const int with_min = type == Q4_1 || type == Q5_1, five = type == Q5_0 || type == Q5_1;
    const uint8_t *qs = p + (with_min ? 4 : 2) * GROUP_ROWS;
    const uint8_t *qh = qs + 16 * GROUP_ROWS;
    const float m = with_min ? half(p + 2 * GROUP_ROWS + 2 * lane) : 0.0f;
    for (int c = 0; c < QK; c++) {
        int q = (qbyte(qs, c % 16, lane, q8) >> (4 * (c / 16))) & 15;
        if (five && q8) q |= ((qh[4 * lane + c % 4] >> (c / 4)) & 1) << 4; /* see native.h */
        else if (five) q |= ((qh[(c / 8) * GROUP_ROWS + lane] >> (c % 8)) & 1) << 4;
        if (with_min) out[c] = d * (float)q + m;
        else out[c] = d * (float)(q - (five ? 16 : 8));
    }
}

/* Row ``lane`` of a row group's K-quant super-block: 256 weights. */
static void kquant_block(int type, const uint8_t *p, int lane, int q8, float *out) {
    const float d = half(p + K_D + 2 * lane);
    if (type == Q6_K) {
        for (int n = 0; n < QK_K; n++) {
            const int k = n / 16, c = n % 16; /* sub-block, column */
            const uint8_t *sub = p + K6_SUB + k * K6_SUB_BYTES;
            const int low = (qbyte(sub, c % 8, lane, q8) >> (4 * (c / 8))) & 15;
            const int high = (qbyte(sub, 8 + c % 4, lane, q8) >> (2 * (c / 4))) & 3;
            const float dl = d * (float)(int8_t)p[K6_SC + k * GROUP_ROWS + lane];
            out[n] = dl * (float)((low | high << 4) - 32);
        }
        return;
    }
    const float dmin = half(p + K_DMIN + 2 * lane);
    const uint8_t *qs = p + (type == Q5_K ? K_QS5 : K_QS4);
    for (int n = 0; n < QK_K; n++) {
        const int k = n / QK, c = n % QK, i = c % 16; /* sub-block, column, byte */
        int q = (qbyte(qs, k * 16 + i, lane, q8) >> (4 * (c / 16))) & 15;
        if (type == Q5_K) {
            const int m = i / 4 + 4 * (c / 16); /* the bit of byte i % 4 */
            q |= ((qbyte(p + K_QH5, k * 4 + i % 4, lane, q8) >> m) & 1) << 4;
        }
        const float dl = d * (float)kscale_of(p + K_SC, lane, k, 0);
        const float ml = dmin * (float)kscale_of(p + K_SC, lane, k, 1);
        out[n] = dl * (float)q - ml;
    }
}

void qmat_row(const qmat_t *w, Py_ssize_t r, float *out) {
    const int type = w->type;
    if (IS_ROWWISE(type)) {
        const uint8_t *row = w->packed + r * rowwise_bytes(type, w->nb);
        for (Py_ssize_t b = 0; b < w->nb; b++) dequant_block(type, row, b, out + b * QK);
        return;
    }
    const int lane = (int)(r % GROUP_ROWS);
    const Py_ssize_t per_unit = IS_KQUANT(type) ? QK_K / QK : 1; /* blocks per unit */
    const Py_ssize_t units = w->nb / per_unit, gb = GROUP_BYTES[type];
    const uint8_t *group = w->packed + (r / GROUP_ROWS) * units * gb;
    for (Py_ssize_t u = 0; u < units; u++) {
        if (IS_KQUANT(type)) kquant_block(type, group + u * gb, lane, w->q8, out + u * QK_K);
        else legacy_block(type, group + u * gb, lane, w->q8, out + u * QK);
    }
}
