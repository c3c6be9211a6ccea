/* Shared infrastructure of the native library (`ps.c`: the shard's and client's hot operations,
 * `pool.c`: the serving kernel), compiled together into one shared object by
 * `embedding_ps/native_build.py`: one loader, one cache directory, one ABI number (`ps_abi_version`).
 *
 * GNU C99 (gcc or clang: builtins, attributes, __atomic), no Python or torch headers: callers
 * pass raw pointers through ctypes after `native.py` checked dtypes, contiguity and sizes.
 * Here: the parallel-for, SplitMix64, IEEE fp16 <-> fp32, and the formula of a default row
 * (`embedding_ps/init.py`'s symmetric bits), each in one copy.
 */
#ifndef EMBEDDING_PS_NATIVE_H
#define EMBEDDING_PS_NATIVE_H

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define PS_GOLDEN 0x9E3779B97F4A7C15ULL

#define PREFETCH(p) __builtin_prefetch((const void *)(p))
#define PREFETCH_W(p) __builtin_prefetch((const void *)(p), 1)
#define PS_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)

/* ------------------------------------------------------------------ parallel for */
#define PS_MAX_THREADS 64

typedef void (*ps_chunk_fn)(void *ctx, int64_t lo, int64_t hi);

struct ps_job {
    ps_chunk_fn fn;
    void *ctx;
    int64_t lo, hi;
};

static void *ps_job_run(void *p) {
    struct ps_job *j = (struct ps_job *)p;
    j->fn(j->ctx, j->lo, j->hi);
    return NULL;
}

/* fn(ctx, lo, hi) over [0, n) in min(nthreads, n / min_chunk) contiguous chunks, in parallel:
 * threads 1..T-1 are started per call, chunk 0 runs on the caller, and a thread that cannot be
 * started has its chunk run inline. Callers make every item's math independent of the chunking,
 * so results do not depend on the thread count. */
static inline void ps_parallel(ps_chunk_fn fn, void *ctx, int64_t n, int nthreads, int64_t min_chunk) {
    int64_t t = nthreads < PS_MAX_THREADS ? nthreads : PS_MAX_THREADS;
    if (t > n / min_chunk) t = n / min_chunk;
    if (t <= 1) {
        fn(ctx, 0, n);
        return;
    }
    struct ps_job jobs[PS_MAX_THREADS];
    pthread_t tid[PS_MAX_THREADS];
    int started[PS_MAX_THREADS];
    for (int64_t i = 0; i < t; i++) jobs[i] = (struct ps_job){fn, ctx, n * i / t, n * (i + 1) / t};
    for (int64_t i = 1; i < t; i++) started[i] = pthread_create(&tid[i], NULL, ps_job_run, &jobs[i]) == 0;
    fn(ctx, jobs[0].lo, jobs[0].hi);
    for (int64_t i = 1; i < t; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            fn(ctx, jobs[i].lo, jobs[i].hi); /* no thread: run its chunk here */
    }
}

/* ------------------------------------------------------------------ hashing */
/* the SplitMix64 finalizer (embedding_ps.wire.sharding.splitmix64_np is its numpy copy) */
static inline uint64_t ps_splitmix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

/* ------------------------------------------------------------------ fp16 <-> fp32 (IEEE, RNE) */
/* half -> float, exact (every half is a float): normal, subnormal (man * 2**-24), zero, inf,
 * NaN (quieted, as F16C's vcvtph2ps does). */
static inline float ps_h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits;
    float f;
    if (exp == 0x1F)
        bits = sign | 0x7F800000u | (man ? 0x400000u | (man << 13) : 0u);
    else if (exp)
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    else {
        f = (float)man * 0x1p-24f; /* 0 or a subnormal half: exact in float32 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x >> shift (1 <= shift < 32), rounded to nearest even */
static inline uint32_t ps_rne(uint32_t x, uint32_t shift) {
    const uint32_t r = x >> shift, rem = x & ((1u << shift) - 1), half = 1u << (shift - 1);
    return r + (rem > half || (rem == half && (r & 1)));
}

/* float -> half, round to nearest even; inf / NaN kept (NaN payload's top bits, quieted) */
static inline uint16_t ps_f2h(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) /* inf or nan */
        return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000u ? (0x200 | ((ax >> 13) & 0x3FF)) : 0));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00); /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) /* below the smallest normal half: in units of 2**-24 (< 2**-25: rounds to zero) */
        return (uint16_t)(sign | (ax < 0x33000000u ? 0 : ps_rne((ax & 0x7FFFFF) | 0x800000, 126 - (ax >> 23))));
    return (uint16_t)(sign | ps_rne(ax - 0x38000000u, 13)); /* rebias exponent 127 -> 15 */
}

/* ------------------------------------------------------------------ default rows (init.py) */
/* out [d] = init.py's symmetric bits of key k times `scale`: s = splitmix64(uint64(k) ^ seed_mix),
 * a / b its low / high 32 bits, column c = (2 * (fmix32((a + (c + 1) * 0x9E3779B9) ^ b) >> 8) + 1 -
 * 2**24) / 2**24 (odd integers in (-2**24, 2**24), exact in fp32), times the float32 scale (1: the
 * bits themselves). The shard's new rows (`ps_init_bits`) and the serving kernel's uniform default
 * rows (`sv_bag`) both come from here; numpy's `reference.init_bits` is the reference. */
static inline void ps_bits_row(float *restrict o, int64_t key, uint64_t seed_mix, int64_t d, float scale) {
    const uint64_t s = ps_splitmix64((uint64_t)key ^ seed_mix);
    const uint32_t a = (uint32_t)s, b = (uint32_t)(s >> 32);
    for (int64_t j = 0; j < d; j++) { /* independent lanes: vectorizes */
        uint32_t x = (a + (uint32_t)(j + 1) * 0x9E3779B9u) ^ b;
        x ^= x >> 16;
        x *= 0x85EBCA6Bu;
        x ^= x >> 13;
        x *= 0xC2B2AE35u;
        x ^= x >> 16;
        const int32_t v = (int32_t)((x >> 8) << 1) - ((1 << 24) - 1);
        o[j] = ((float)v * 0x1p-24f) * scale;
    }
}

#endif
