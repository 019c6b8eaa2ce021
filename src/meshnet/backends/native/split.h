/*
 * How a matmul's units of rows are shared among its threads: each thread owns a
 * contiguous run of them and takes its own from the front; when it runs out it takes
 * the others' from their back, one at a time. So each thread streams through memory in
 * one long run while the others keep up (the hardware's prefetch keeps ahead of a long
 * run; units handed out in turns, two at a time, made every thread jump each ~70 KB and
 * held a lone token's 1B Q4_K_M decode, 2 threads, ~15-30% below this), and a thread
 * that stalls (a shared machine's other work on its core) is relieved unit by unit, as
 * a dynamic schedule would.
 *
 * A run is its [front, back) packed in one 64-bit word, changed by compare-and-swap,
 * alone on its cache line.
 */
#ifndef MESHNET_SPLIT_H
#define MESHNET_SPLIT_H

#include <stdint.h>
#include <stdlib.h>

typedef struct {
    uint64_t span; /* front in the low 32 bits, back in the high */
    char pad[56];
} split_run_t;

/* ``sets`` sets of runs, one after another (a long batch's blocks of tokens), each for
 * ``parts`` threads over units [0, units), as even as can be; NULL when out of memory.
 * Free with free(). */
static inline split_run_t *split_runs_many(int64_t units, int parts, int64_t sets) {
    split_run_t *runs = aligned_alloc(64, (size_t)(parts * sets) * sizeof(split_run_t));
    if (runs == NULL) return NULL;
    for (int64_t s = 0; s < sets; s++)
        for (int i = 0; i < parts; i++) {
            const uint64_t front = (uint64_t)(units * i / parts);
            const uint64_t back = (uint64_t)(units * (i + 1) / parts);
            runs[s * parts + i].span = front | back << 32;
        }
    return runs;
}


/* The next unit of run r from its front (own) or back (another's); -1 when it is empty. */
static inline int64_t split_take(split_run_t *r, int from_back) {
    uint64_t span = __atomic_load_n(&r->span, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t front = span & 0xFFFFFFFFu, back = span >> 32;
        if (front >= back) return -1;
        const uint64_t next = from_back ? front | (back - 1) << 32 : (front + 1) | back << 32;
        if (__atomic_compare_exchange_n(&r->span, &span, next, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            return (int64_t)(from_back ? back - 1 : front);
    }
}

/* The calling thread's next unit: its own run's front, then the other runs' backs in
 * turn from the next thread's on; -1 when every run is empty. ``me`` is the thread's
 * run, ``parts`` the runs (a team smaller than planned is covered: its members empty the
 * runs of the absent ones). */
static inline int64_t split_next(split_run_t *runs, int parts, int me) {
    const int64_t own = split_take(&runs[me % parts], 0);
    if (own >= 0) return own;
    for (int i = 1; i < parts; i++) {
        const int64_t stolen = split_take(&runs[(me + i) % parts], 1);
        if (stolen >= 0) return stolen;
    }
    return -1;
}

#endif
