/*
 * The matmuls' instruction set for this process (isa.h): set once at import by
 * select_isa (module.c), read-only after, so every thread reads the same.
 */
#include <string.h>

#include "isa.h"

/* Whether the AVX-512 tiles run in this process: the CPU has them and MESHNET_ISA did not
 * ask for AVX2 (select_isa, once at import; read-only after). */
static int wide_isa;

static int cpu_has_avx512(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
}

int select_isa(const char *name) {
    if (name == NULL || name[0] == '\0' || strcmp(name, "auto") == 0) {
        wide_isa = cpu_has_avx512();
        return 0;
    }
    if (strcmp(name, "avx2") == 0) {
        wide_isa = 0;
        return 0;
    }
    if (strcmp(name, "avx512") == 0 && cpu_has_avx512()) {
        wide_isa = 1;
        return 0;
    }
    return -1;
}

const char *isa_name(void) { return wide_isa ? "avx512" : "avx2"; }

int wide_isa_selected(void) { return wide_isa; }
