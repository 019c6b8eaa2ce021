/*
 * The instruction set the matmuls run in this process (isa.c): AVX2's 8-lane vectors or
 * AVX-512's 16, chosen once at import. Its own unit, below both matmuls: matmul.c and
 * q8.c each read it, and matmul.c calls q8.c, never the other way round.
 */
#ifndef MESHNET_ISA_H
#define MESHNET_ISA_H

/* The matmul's instruction set for this process, chosen once at import: "avx2", "avx512"
 * (where the CPU has AVX-512 F/VL/DQ/BW), or "auto"/NULL/"" for the widest the CPU has.
 * -1 for a name it does not know or a set the CPU lacks. */
int select_isa(const char *name);

/* "avx512" or "avx2": the vectors the matmul runs (every other kernel is AVX2). */
const char *isa_name(void);

/* Whether the matmuls may take 16-lane vectors in this process (select_isa). */
int wide_isa_selected(void);

#endif
