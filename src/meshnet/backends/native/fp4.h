/*
 * MXFP4's two fields as vectors, for the float32 tiles (matmul.c) and the q8 tiles (q8.c)
 * at both widths:
 *   - E8M0 exponents e (a byte per row) as float32 2^(e - 128), llama.cpp's
 *     ggml_e8m0_to_fp32_half: a normal float's exponent field e - 1, or for e < 2 the
 *     subnormals 2^-128, 2^-127 (0x00200000 << e). Exact, every e included.
 *   - the 4-bit codes' values k: the E2M1 values doubled (llama.cpp's kvalues_mxfp4),
 *     looked up in a table of 16 with a byte shuffle (AVX2) or a lane permute (AVX-512).
 */
#ifndef MESHNET_FP4_H
#define MESHNET_FP4_H

#include <immintrin.h>
#include <stdint.h>

#define FP4_K(s) 0, 1 * (s), 2 * (s), 3 * (s), 4 * (s), 6 * (s), 8 * (s), 12 * (s), \
    0, -1 * (s), -2 * (s), -3 * (s), -4 * (s), -6 * (s), -8 * (s), -12 * (s)

/* The float32 tiles take each weight as k * 2^24: AVX2 forms it as k in a lane's top
 * byte, converted (no sign extension needed); AVX-512 looks the same floats up. A
 * block's sum of k 2^24 x is then scaled by 2^-24 (see matmul.c). */
#define FP4_SCALE 16777216.0f

/* 2^(e - 128) for 8 lanes of e (0 .. 255). */
static inline __m256 fp4_scales8(__m256i e) {
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i is_tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, is_tiny));
}

static inline __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw")))
__m512 fp4_scales16(__m512i e) {
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
    const __mmask16 tiny = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
    return _mm512_castsi512_ps(
        _mm512_mask_sllv_epi32(normal, tiny, _mm512_set1_epi32(0x00200000), e));
}

static const int8_t FP4_BYTES[16] = {FP4_K(1)};
static const float FP4_FLOATS[16] = {FP4_K(FP4_SCALE)};

/* The 16 values as bytes in both 128-bit halves (vpshufb looks up within each half). */
static inline __m256i fp4_table_bytes(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_BYTES));
}

/* Columns i and 16 + i of 8 rows (their bytes at p) as k * 2^24: each byte moved to the
 * top of its lane (the other three bytes are cleared, so look up entry 0, which is 0),
 * its low or high nibble looked up there, the lane converted. */
static inline void fp4_column8(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i place = _mm256_setr_epi8(-128, -128, -128, 0, -128, -128, -128, 1, -128, -128,
                                           -128, 2, -128, -128, -128, 3, -128, -128, -128, 4,
                                           -128, -128, -128, 5, -128, -128, -128, 6, -128, -128,
                                           -128, 7);
    const __m256i bytes = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)p));
    const __m256i top = _mm256_shuffle_epi8(bytes, place);
    const __m256i low = _mm256_and_si256(top, _mm256_set1_epi32(0x0F000000));
    /* the high nibble shifted down to the top byte's low bits; the byte below then holds
     * the low nibble in its top bits: it looks up entry 0 or, bit 7 set, gives 0 */
    const __m256i high = _mm256_srli_epi32(top, 4);
    *lo = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(fp4_table_bytes(), low));
    *hi = _mm256_cvtepi32_ps(_mm256_shuffle_epi8(fp4_table_bytes(), high));
}

static inline __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw")))
void fp4_column16(const uint8_t *p, __m512 *lo, __m512 *hi) {
    const __m512 values = _mm512_loadu_ps(FP4_FLOATS);
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_permutexvar_ps(codes, values); /* the low 4 bits of each lane pick */
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), values);
}

/* The q8 tiles take k + FP4_BIAS (0 .. 24): unsigned, as the 8-bit products want one side;
 * the bias times the block's sum of activation quants is taken off after. */
#define FP4_BIAS 12
static const uint8_t FP4_BIASED_BYTES[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                             12, 11, 10, 9, 8, 6, 4, 0};

/* That table in every 128-bit lane, for a byte shuffle of codes (0 .. 15) to k + 12. */
static inline __m256i fp4_biased8(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)FP4_BIASED_BYTES));
}

static inline __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512dq,avx512bw")))
__m512i fp4_biased16(void) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)FP4_BIASED_BYTES));
}

#endif
