/*
 * Q4_K's and Q5_K's 6-bit sub-block scales and mins. A row group keeps them as the file
 * packs them, 12 bytes a row (native.h: 12 byte columns of 16 rows, column j the GGUF's
 * byte 4 + j), and the tiles unpack them once per super-block, all 16 rows at once, into
 * the 256 bytes on the stack that they read: 8 byte columns of scales, then 8 of mins,
 * one byte per row and sub-block. As gguf-py's and llama.cpp's get_scale_min_k4, with
 * q the 12 bytes:
 *   sub-block k < 4:  scale q[k] & 63,                      min q[4 + k] & 63
 *   sub-block 4 + i:  scale (q[8 + i] & 15) | (q[i] >> 6) << 4,
 *                     min (q[8 + i] >> 4) | (q[4 + i] >> 6) << 4
 * The same integers as the unpacked layout that held them before (a byte each: 64 more
 * bytes per 16 rows and super-block, 2.8% of a Q4_K matrix), so no result changes; the
 * unpacking is ~10-20 vector operations a super-block, against the hundreds of its dot
 * products.
 */
#ifndef MESHNET_KSCALES_H
#define MESHNET_KSCALES_H

#include <immintrin.h>
#include <stdint.h>

#define KSCALES_PACKED 12   /* byte columns of packed scales and mins in a row group */
#define KSCALES_MINS 128    /* where the mins start in the unpacked 256 bytes */

/* The bits 6 and 7 of each byte of v moved to bits 4 and 5, the rest zero. */
static inline __m256i kscales_top256(__m256i v) {
    return _mm256_and_si256(_mm256_srli_epi16(v, 2), _mm256_set1_epi8(0x30));
}

/* ``packed`` (the 12 byte columns of 16 rows) into ``out`` (8 columns of scales, 8 of
 * mins), 256-bit vectors: two byte columns each. */
static inline __attribute__((always_inline)) void kscales_unpack_avx2(const uint8_t *packed,
                                                                      uint8_t *out) {
    const __m256i low6 = _mm256_set1_epi8(63), nib = _mm256_set1_epi8(15);
    for (int h = 0; h < 2; h++) { /* columns 2 h, 2 h + 1 of each group of four */
        const __m256i s = _mm256_loadu_si256((const __m256i *)(packed + 32 * h));
        const __m256i m = _mm256_loadu_si256((const __m256i *)(packed + 64 + 32 * h));
        const __m256i q = _mm256_loadu_si256((const __m256i *)(packed + 128 + 32 * h));
        const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(q, nib), kscales_top256(s));
        const __m256i mn_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), nib),
                                              kscales_top256(m));
        _mm256_storeu_si256((__m256i *)(out + 32 * h), _mm256_and_si256(s, low6));
        _mm256_storeu_si256((__m256i *)(out + 64 + 32 * h), sc_hi);
        _mm256_storeu_si256((__m256i *)(out + KSCALES_MINS + 32 * h), _mm256_and_si256(m, low6));
        _mm256_storeu_si256((__m256i *)(out + KSCALES_MINS + 64 + 32 * h), mn_hi);
    }
}

#define KSCALES_WIDE __attribute__((always_inline, target("avx2,avx512f,avx512bw")))

/* The same with 512-bit vectors: four byte columns each. The top bits are masked before
 * the shift (then nothing of the next byte comes in), so one bit-select joins them. */
static inline KSCALES_WIDE void kscales_unpack_avx512(const uint8_t *packed, uint8_t *out) {
    const __m512i s = _mm512_loadu_si512((const void *)packed);
    const __m512i m = _mm512_loadu_si512((const void *)(packed + 64));
    const __m512i q = _mm512_loadu_si512((const void *)(packed + 128));
    const __m512i low6 = _mm512_set1_epi8(63), nib = _mm512_set1_epi8(15);
    const __m512i top = _mm512_set1_epi8((char)0xC0);
    const __m512i s_top = _mm512_srli_epi16(_mm512_and_si512(s, top), 2);
    const __m512i m_top = _mm512_srli_epi16(_mm512_and_si512(m, top), 2);
    /* 0xD8: b where the mask (c) is set, a elsewhere */
    const __m512i sc_hi = _mm512_ternarylogic_epi32(s_top, q, nib, 0xD8);
    const __m512i mn_hi = _mm512_ternarylogic_epi32(m_top, _mm512_srli_epi16(q, 4), nib, 0xD8);
    _mm512_storeu_si512((void *)out, _mm512_and_si512(s, low6));
    _mm512_storeu_si512((void *)(out + 64), sc_hi);
    _mm512_storeu_si512((void *)(out + KSCALES_MINS), _mm512_and_si512(m, low6));
    _mm512_storeu_si512((void *)(out + KSCALES_MINS + 64), mn_hi);
}

/* Sub-block k's scale (``min`` 0) or min (1) of row ``lane`` from the packed columns. */
static inline int kscale_of(const uint8_t *packed, int lane, int k, int min) {
#define KCOL(j) ((int)packed[(j) * 16 + lane])
    if (k < 4) return KCOL(k + 4 * min) & 63;
    const int nibble = min ? KCOL(k + 4) >> 4 : KCOL(k + 4) & 15;
    return nibble | (KCOL(k - 4 + 4 * min) >> 6) << 4;
#undef KCOL
}

#endif
