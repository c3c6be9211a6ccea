/* The hot operations of shards and clients: id -> slot map probes, gathers, fused sparse optimizer
 * updates, dedup, row init and the shared-memory handshakes.
 *
 * Part of the one native library (how it is built, loaded and called: native.h); every function
 * has a numpy/torch twin in `embedding_ps/reference.py`.
 *
 * Map layout and probing: idmap.py's docstring (keys int64 [C], vals int32 [C], any C in [1, 2**32);
 * vals >= 0 occupied, -1 EMPTY, -2 TOMBSTONE; linear from home = ((splitmix64(key + GOLDEN) >> 32) * C) >> 32).
 *
 * Float math follows the torch ops of optim.py step by step in fp32 (scalars rounded to fp32
 * as torch does for a float32 tensor op with a Python scalar), so sgd and adagrad are bit-exact;
 * rowwise_adagrad's mean of g*g is a reduction whose order differs from torch's (~1 ulp).
 *
 * Threads (ps.threads): lookups, gathers, row inits and updates take `nthreads` and split their n
 * items into contiguous chunks, one per thread (`ps_parallel`, native.h: results do not depend on
 * nthreads; tests compare them). Updates get unique slots (the caller merged duplicates), so two
 * threads never touch one row. Inserts (ps_map_place) stay on one thread.
 */
#include "native.h"

#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <limits.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define PS_EMPTY (-1)
#define PS_TOMB (-2)
#define PF 8   /* keys ahead to prefetch in map probes */
#define PFU 16 /* rows ahead to prefetch in gathers and updates */
#define PS_MIN_CHUNK 4096 /* items per thread below which starting a thread costs more than it saves */

/* the ABI of the whole library (ps.c and pool.c): native.py refuses a cached build of another one */
int ps_abi_version(void) { return 11; }

static inline uint64_t ps_home(int64_t key, uint64_t nb) {
    const uint64_t z = ps_splitmix64((uint64_t)key + PS_GOLDEN);
    return ((z >> 32) * nb) >> 32;
}

/* ps_home, with the bucket's value and key prefetched (for a store when `w`): the probes keep a
 * ring of the next PF keys' homes, so each one's cache lines are on their way before it is probed. */
static inline uint64_t ps_home_pf(int64_t key, uint64_t nb, const int64_t *kv, const int32_t *vv, int w) {
    const uint64_t h = ps_home(key, nb);
    if (w) {
        PREFETCH_W(vv + h);
        PREFETCH_W(kv + h);
    } else {
        PREFETCH(vv + h);
        PREFETCH(kv + h);
    }
    return h;
}

/* For each key: its value (out_val, -1 if absent) and/or bucket (out_pos, -1 if absent).
 * Either output may be NULL. Returns 0, or -1 if a probe chain had no EMPTY end (corrupt map). */
static int ps_map_find_range(const int64_t *kv, const int32_t *vv, int64_t nbuckets, const int64_t *keys, int64_t n,
                             int32_t *out_val, int64_t *out_pos) {
    const uint64_t nb = (uint64_t)nbuckets;
    uint64_t ring[PF];
    int64_t i;
    for (i = 0; i < n && i < PF; i++) ring[i] = ps_home_pf(keys[i], nb, kv, vv, 0);
    for (i = 0; i < n; i++) {
        uint64_t p = ring[i % PF];
        if (i + PF < n) ring[i % PF] = ps_home_pf(keys[i + PF], nb, kv, vv, 0);
        const int64_t k = keys[i];
        int32_t val = -1;
        int64_t pos = -1;
        uint64_t left = nb;
        for (;;) {
            int32_t v = vv[p];
            if (v == PS_EMPTY) break;
            if (v >= 0 && kv[p] == k) {
                val = v;
                pos = (int64_t)p;
                break;
            }
            if (++p == nb) p = 0;
            if (--left == 0) return -1;
        }
        if (out_val) out_val[i] = val;
        if (out_pos) out_pos[i] = pos;
    }
    return 0;
}

struct ps_find_ctx {
    const int64_t *kv;
    const int32_t *vv;
    int64_t nbuckets;
    const int64_t *keys;
    int32_t *out_val;
    int64_t *out_pos;
    int64_t failed;
};

static void ps_find_chunk(void *p, int64_t lo, int64_t hi) {
    struct ps_find_ctx *c = (struct ps_find_ctx *)p;
    if (ps_map_find_range(c->kv, c->vv, c->nbuckets, c->keys + lo, hi - lo, c->out_val ? c->out_val + lo : NULL,
                          c->out_pos ? c->out_pos + lo : NULL) != 0)
        PS_ADD(&c->failed, 1);
}

/* ps_map_find_range over nthreads threads (the map is only read). */
int ps_map_find(const int64_t *kv, const int32_t *vv, int64_t nbuckets, const int64_t *keys, int64_t n,
                int32_t *out_val, int64_t *out_pos, int nthreads) {
    struct ps_find_ctx c = {kv, vv, nbuckets, keys, out_val, out_pos, 0};
    ps_parallel(ps_find_chunk, &c, n, nthreads, PS_MIN_CHUNK);
    return c.failed ? -1 : 0;
}

/* Insert distinct keys absent from the map into the first free bucket (EMPTY or TOMBSTONE) of
 * their chain, in order. The caller grew the map first. Returns the number of tombstones
 * reused, or -1 if a chain had no free bucket. */
int64_t ps_map_place(int64_t *kv, int32_t *vv, int64_t nbuckets, const int64_t *keys, const int32_t *vals,
                     int64_t n) {
    const uint64_t nb = (uint64_t)nbuckets;
    uint64_t ring[PF];
    int64_t i, tombs = 0;
    for (i = 0; i < n && i < PF; i++) ring[i] = ps_home_pf(keys[i], nb, kv, vv, 1);
    for (i = 0; i < n; i++) {
        uint64_t p = ring[i % PF];
        if (i + PF < n) ring[i % PF] = ps_home_pf(keys[i + PF], nb, kv, vv, 1);
        uint64_t left = nb;
        while (vv[p] >= 0) {
            if (++p == nb) p = 0;
            if (--left == 0) return -1;
        }
        if (vv[p] == PS_TOMB) tombs++;
        kv[p] = keys[i];
        vv[p] = vals[i];
    }
    return tombs;
}

/* Bags feature-major -> example-major: lengths [F * B] of bag (f, b) at f * B + b, indices [N]
 * (and weights [N] unless NULL) bag after bag in that order -> out [N] (out_w [N]) with bag (f, b)
 * at b * F + f, em_lengths [B * F] and em_offsets [B * F] (its bags' starts). One pass over the
 * bags; the trainer's pooled [B, F, D] comes straight out of one embedding_bag over them. */
void ps_to_example_major(const int64_t *lengths, int64_t F, int64_t B, const int64_t *indices, const float *weights,
                         int64_t *out, float *out_w, int64_t *em_lengths, int64_t *em_offsets) {
    int64_t pos = 0;
    for (int64_t b = 0; b < B; b++) /* example-major starts */
        for (int64_t f = 0; f < F; f++) {
            int64_t len = lengths[f * B + b];
            em_lengths[b * F + f] = len;
            em_offsets[b * F + f] = pos;
            pos += len;
        }
    int64_t src = 0;
    for (int64_t f = 0; f < F; f++) /* feature-major reading order */
        for (int64_t b = 0; b < B; b++) {
            int64_t len = lengths[f * B + b], dst = em_offsets[b * F + f];
            for (int64_t k = 0; k < len; k++) out[dst + k] = indices[src + k];
            if (weights)
                for (int64_t k = 0; k < len; k++) out_w[dst + k] = weights[src + k];
            src += len;
        }
}

/* A temporary open-addressing table for n items: *nb buckets (a power of two >= 2n, at least 16) of
 * a key (key_size bytes) and an int32 row each. Returns the keys (the rows in *rows), or NULL
 * (nothing allocated) out of memory. */
static void *ps_tmp_table(int64_t n, size_t key_size, int64_t *nb, int32_t **rows) {
    *nb = 16;
    while (*nb < 2 * n) *nb <<= 1;
    void *keys = malloc((size_t)*nb * key_size);
    *rows = (int32_t *)malloc((size_t)*nb * sizeof(int32_t));
    if (keys == NULL || *rows == NULL) {
        free(keys);
        free(*rows);
        return NULL;
    }
    return keys;
}

/* ids [n] -> uniq [u] (each distinct id once, in order of first appearance), inverse [n] (the
 * position of ids[i] in uniq) and, unless counts is NULL, counts [u] (occurrences). One pass with a
 * temporary open-addressing table (a power of two >= 2n buckets, 12 B each): the trainer's
 * per-table dedup of a batch's ids, which torch.unique does by sorting. Returns u, or -1 if out of
 * memory. */
int64_t ps_unique(const int64_t *ids, int64_t n, int64_t *uniq, int64_t *inverse, int64_t *counts) {
    int64_t nb;
    int32_t *rows;
    int64_t *keys = ps_tmp_table(n, sizeof(int64_t), &nb, &rows);
    if (keys == NULL) return -1;
    memset(rows, 0xff, (size_t)nb * sizeof(int32_t)); /* -1: empty (any int64 is an id) */
    const uint64_t mask = (uint64_t)nb - 1;
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t k = ids[i];
        uint64_t h = (uint64_t)k;
        h ^= h >> 33;
        h *= 0xff51afd7ed558ccdULL;
        h ^= h >> 33;
        uint64_t b = h & mask;
        while (rows[b] != -1 && keys[b] != k) b = (b + 1) & mask;
        if (rows[b] == -1) {
            rows[b] = (int32_t)u;
            keys[b] = k;
            uniq[u] = k;
            if (counts) counts[u] = 0;
            u++;
        }
        inverse[i] = rows[b];
        if (counts) counts[rows[b]]++;
    }
    free(keys);
    free(rows);
    return u;
}

/* 1 if slots [n] (each in [0, nbits)) hold a value twice, else 0. `bitmap` has >= nbits bits,
 * all zero on entry, and is all zero again on return. */
int ps_has_duplicates(const int32_t *slots, int64_t n, uint8_t *bitmap) {
    int dup = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t s = (uint32_t)slots[i];
        uint8_t bit = (uint8_t)(1u << (s & 7));
        if (bitmap[s >> 3] & bit) dup = 1;
        bitmap[s >> 3] |= bit;
    }
    for (int64_t i = 0; i < n; i++) bitmap[(uint32_t)slots[i] >> 3] = 0;
    return dup;
}

/* Duplicate slots [n] of grads [n, d] summed: out_slots [u] (in order of first arrival) and out
 * [u, d], each row 0.0f + its grads in arrival order (what zeros [u, d] + index_add_ computes, bit
 * for bit). A temporary open-addressing table of slot -> output row (>= 2n buckets, ~8 B each) finds
 * the rows: no per-row array of the table's capacity. Returns u, or -1 if out of memory. */
int64_t ps_merge_rows(const int32_t *slots, const float *grads, int64_t n, int64_t d, int32_t *out_slots,
                      float *out) {
    int64_t nb;
    int32_t *rows;
    int32_t *keys = ps_tmp_table(n, sizeof(int32_t), &nb, &rows);
    if (keys == NULL) return -1;
    memset(keys, 0xff, (size_t)nb * sizeof(int32_t)); /* -1: empty (slots are >= 0) */
    const uint64_t mask = (uint64_t)nb - 1;
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t s = slots[i];
        uint64_t b = ((uint64_t)(uint32_t)s * PS_GOLDEN >> 32) & mask;
        while (keys[b] != -1 && keys[b] != s) b = (b + 1) & mask;
        const float *restrict g = grads + i * d;
        if (keys[b] == -1) {
            keys[b] = s;
            rows[b] = (int32_t)u;
            out_slots[u] = s;
            float *restrict o = out + u * d;
            for (int64_t j = 0; j < d; j++) o[j] = 0.0f + g[j];
            u++;
        } else {
            float *restrict o = out + (int64_t)rows[b] * d;
            for (int64_t j = 0; j < d; j++) o[j] += g[j];
        }
    }
    free(keys);
    free(rows);
    return u;
}

/* ------------------------------------------------------------------ fp16 arrays */
void ps_f2h_array(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = ps_f2h(src[i]);
}

void ps_h2f_array(const uint16_t *src, float *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = ps_h2f(src[i]);
}

/* ------------------------------------------------------------------ shared-memory pushes */
/* Wake every thread of any process asleep on the futex `word` (no waiter: one cheap syscall). */
static inline void ps_wake(int32_t *word) {
#ifdef __linux__
    syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
#endif
}

/* Sleep on the futex `word` while it holds `seen` (it returns at once otherwise), for at most 1 ms and
 * what is left of timeout_ns since t0 (CLOCK_MONOTONIC); elsewhere than Linux: yield. Returns 0 (no
 * sleep) when no time is left. A writer that stores without a wake is seen at the next sleep. */
static int ps_sleep(int32_t *word, int32_t seen, const struct timespec *t0, int64_t timeout_ns) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    int64_t left = timeout_ns - ((t.tv_sec - t0->tv_sec) * 1000000000LL + (t.tv_nsec - t0->tv_nsec));
    if (left <= 0) return 0;
#ifdef __linux__
    if (left > 1000000) left = 1000000;
    struct timespec rel = {0, (long)left};
    syscall(SYS_futex, word, FUTEX_WAIT, seen, &rel, NULL, 0);
#else
    sched_yield();
#endif
    return 1;
}

/* dst [n] = src [n] (32-bit values: fp32 grads), in one pass that also checks every value is
 * finite: returns 1 if none is NaN or +-inf, else 0. The exponent field of each value plus one
 * exponent unit carries into bit 31 only for an all-ones exponent (inf, NaN), so an OR of those
 * sums tells (integer ops: vectorizes without -ffast-math; the bits are copied unchanged).
 * wake_fd >= 0: one byte is written to it first (the PS client's I/O thread's wake-up pipe: the
 * thread then sends the request while this copies, without the two contending for Python's GIL). */
int ps_copy_finite(const uint32_t *restrict src, uint32_t *restrict dst, int64_t n, int wake_fd) {
    uint32_t acc = 0;
    if (wake_fd >= 0) /* wake another thread first (its work overlaps the copy); a full pipe is fine */
        (void)!write(wake_fd, "x", 1);
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = src[i];
        dst[i] = u;
        acc |= (u & 0x7f800000u) + 0x00800000u;
    }
    return !(acc & 0x80000000u);
}

/* Store `value` into *flag after every earlier store of this thread (the grads written into a
 * segment, non-temporal ones included) is visible to another process mapping the same memory, then
 * wake a shard asleep in ps_wait_flag on it (a futex on the flag's low 32 bits; no waiter: one cheap
 * syscall). */
void ps_publish(int64_t *flag, int64_t value) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
    ps_wake((int32_t *)flag); /* x86-64: low half first */
}

/* Wait until *flag is `want` or `-want` (the writer gave up) or timeout_ns passed: spins on an
 * acquire load for the first few thousand checks (the copy is usually done by then), then sleeps on
 * a futex of the flag's low 32 bits (ps_sleep; ps_publish wakes it), as spinning with more processes
 * than cores would take CPU from the very writer it waits for. Returns the value last read. */
int64_t ps_wait_flag(const int64_t *flag, int64_t want, int64_t timeout_ns) {
    struct timespec t0;
    for (int64_t i = 0;; i++) {
        int64_t v = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
        if (v == want || v == -want) return v;
        if (i < 4096) continue; /* spinning */
        if (i == 4096) clock_gettime(CLOCK_MONOTONIC, &t0);
        if (!ps_sleep((int32_t *)flag, (int32_t)(uint32_t)(uint64_t)v, &t0, timeout_ns)) return v;
    }
}

/* *word = value (a release store), then wake every thread of any process waiting in ps_wait_word
 * on it (a futex on shared memory: no private flag). */
void ps_notify(int32_t *word, int32_t value) {
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
    ps_wake(word);
}

/* Wait until *word != 0 or timeout_ns passed, asleep in the kernel (ps_sleep: a writer without the
 * wake, a peer without this library: reference.notify, is seen within 1 ms); returns the value last
 * read (0: timed out). */
int32_t ps_wait_word(int32_t *word, int64_t timeout_ns) {
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (;;) {
        int32_t v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
        if (v != 0) return v;
        if (!ps_sleep(word, 0, &t0, timeout_ns)) return 0;
    }
}

/* ------------------------------------------------------------------ global weight decay (decay.py) */
/* The factor of a row `k` steps behind (k > 0): (float)(decay^k), decay the (float)(1 - lr * wd) of
 * GlobalDecay.factor; numpy's np.power(float64(decay), k) cast to float32 in decay.py. */
static inline float ps_decay_pow(float decay, int64_t k) { return (float)pow((double)decay, (double)k); }

/* ------------------------------------------------------------------ gather (pull) */
/* out [n, d] float32 = rows slots of w [C, d] (fp32 or fp16 when half != 0); rows of out whose
 * slot is < 0 are left as they are. Returns the number of such rows. With dstep != NULL (global
 * weight decay: each row's decayed-through step, int32 [C]) a row k = target - dstep[slot] > 0
 * steps behind is scaled by decay^k on the way (GlobalDecay.pulled; the table is not written). */
static int64_t ps_gather_range(const void *w, int half, int64_t d, const int32_t *slots, int64_t n, float *out,
                               const int32_t *dstep, int64_t target, float decay) {
    const int64_t es = half ? 2 : 4;
    const char *base = (const char *)w;
    int64_t missing = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + PFU < n && slots[i + PFU] >= 0) {
            const char *r = base + (int64_t)slots[i + PFU] * d * es;
            for (int64_t b = 0; b < d * es; b += 64) PREFETCH(r + b);
        }
        if (slots[i] < 0) {
            missing++;
            continue;
        }
        const char *row = base + (int64_t)slots[i] * d * es;
        float *o = out + i * d;
        const int64_t k = dstep ? target - (int64_t)dstep[slots[i]] : 0;
        const float sc = k > 0 ? ps_decay_pow(decay, k) : 1.0f; /* x * 1.0f is x, bit for bit */
        if (half) {
            const uint16_t *h = (const uint16_t *)row;
            for (int64_t j = 0; j < d; j++) o[j] = ps_h2f(h[j]) * sc;
        } else if (k > 0) {
            const float *r = (const float *)row;
            for (int64_t j = 0; j < d; j++) o[j] = r[j] * sc;
        } else {
            memcpy(o, row, (size_t)(d * 4));
        }
    }
    return missing;
}

struct ps_gather_ctx {
    const void *w;
    int half;
    int64_t d;
    const int32_t *slots;
    float *out;
    int64_t missing;
    const int32_t *dstep;
    int64_t target;
    float decay;
};

static void ps_gather_chunk(void *p, int64_t lo, int64_t hi) {
    struct ps_gather_ctx *c = (struct ps_gather_ctx *)p;
    int64_t m = ps_gather_range(c->w, c->half, c->d, c->slots + lo, hi - lo, c->out + lo * c->d, c->dstep, c->target,
                                c->decay);
    if (m) PS_ADD(&c->missing, m);
}

/* ps_gather_range over nthreads threads (rows are only read; each thread writes its rows of out);
 * dstep NULL: no global weight decay, else rows caught up through `target` (see ps_gather_range). */
int64_t ps_gather(const void *w, int half, int64_t d, const int32_t *slots, int64_t n, float *out,
                  const int32_t *dstep, int64_t target, float decay, int nthreads) {
    struct ps_gather_ctx c = {w, half, d, slots, out, 0, dstep, target, decay};
    ps_parallel(ps_gather_chunk, &c, n, nthreads, PS_MIN_CHUNK);
    return c.missing;
}

/* ------------------------------------------------------------------ fused updates (push) */
enum { PS_SGD = 0, PS_ADAGRAD = 1, PS_ROWWISE_ADAGRAD = 2 };

/* sum of g[j]^2 over a row: 16 independent fp32 lanes (vectorizes without -ffast-math), then
 * pairwise. torch's vector_norm reduces in another order: results differ by ~1 ulp. */
static inline float ps_sumsq(const float *restrict g, int64_t d) {
    float acc[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= d; j += 16)
        for (int l = 0; l < 16; l++) acc[l] += g[j + l] * g[j + l];
    for (int l = 0; j < d; j++, l++) acc[l] += g[j] * g[j];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static inline void ps_axpy_f32(float *restrict w, const float *restrict g, float a, int64_t d) {
    for (int64_t j = 0; j < d; j++) w[j] += g[j] * a; /* torch: delta = g * a (fp32), w += delta */
}

static inline void ps_adagrad_f32(float *restrict w, float *restrict h, const float *restrict g, float neg_lr,
                                  float eps, int64_t d) {
    for (int64_t j = 0; j < d; j++) {
        float hj = h[j] + g[j] * g[j];
        h[j] = hj;
        w[j] += (g[j] / (sqrtf(hj) + eps)) * neg_lr;
    }
}

/* Update rows slots [order[k]] for k in [0, n) (order NULL: k itself; slots unique) of w [C, d] (fp32, or
 * fp16 when half != 0) and the optimizer state from grads g [n, d] (read-only, indexed like slots): the
 * math of optim._sgd / _adagrad / _rowwise_adagrad
 * (state: sum_sq [C, d] for adagrad, [C] for rowwise_adagrad, unused for sgd). `neg_lr` is
 * (float)(-lr), `eps` (float)eps. With meta != NULL also the row's counters, as table.push:
 * count = min(count + 1, 2**31 - 1), last_seen = step (meta = count << 32 | last_seen).
 * fp16 rows are updated in fp32 and rounded once (round to nearest even), as optim._add_rows.
 * Weight decay (optim.py): wd_mode 1 ("l2") adds wd * w to the row's gradient before the update
 * (accumulators included, as fbgemm's TBE); wd_mode 2 ("decoupled") scales the row by `decay`
 * ((float)(1 - lr * wd)) before adding the update, AdamW-style; wd_mode 3 ("global", decay.py)
 * first catches a row k = step - dstep[s] > 0 steps behind up by decay^k and sets dstep[s] = step
 * (a row already past `step` is not scaled), then adds the update; 0: none. */
static int ps_update_range(int opt, void *w, int half, float *state, int64_t d, const int32_t *slots,
                            const int32_t *order, int64_t n, const float *g, float neg_lr, float eps, int64_t *meta,
                            int64_t step, int wd_mode, float wd, float decay, int32_t *dstep) {
    const int64_t es = half ? 2 : 4;
    char *base = (char *)w;
    float tmp[256];
    float *gbuf = NULL; /* l2: the row's gradient + wd * w [d] */
    if (wd_mode == 1) {
        gbuf = (float *)malloc((size_t)d * sizeof(float));
        if (!gbuf) return -1; /* out of memory: nothing of the range updated */
    }
    for (int64_t k = 0; k < n; k++) {
        if (k + PFU < n) {
            int64_t ia = order ? order[k + PFU] : k + PFU;
            int64_t s = slots[ia];
            const char *r = base + s * d * es;
            for (int64_t b = 0; b < d * es; b += 64) PREFETCH_W(r + b);
            if (order)
                for (int64_t b = 0; b < d; b += 16) PREFETCH(g + ia * d + b);
            if (opt == PS_ADAGRAD) {
                const float *hr = state + s * d;
                for (int64_t b = 0; b < d; b += 16) PREFETCH_W(hr + b);
            } else if (opt == PS_ROWWISE_ADAGRAD) {
                PREFETCH_W(state + s);
            }
            if (meta) PREFETCH_W(meta + s);
            if (dstep) PREFETCH_W(dstep + s);
        }
        const int64_t i = order ? order[k] : k;
        const int64_t s = slots[i];
        const float *gi = g + i * d;
        if (wd_mode == 1) {
            if (!half) {
                const float *wr = (const float *)base + s * d;
                for (int64_t j = 0; j < d; j++) gbuf[j] = gi[j] + wr[j] * wd;
            } else {
                const uint16_t *wr = (const uint16_t *)base + s * d;
                for (int64_t j = 0; j < d; j++) gbuf[j] = gi[j] + ps_h2f(wr[j]) * wd;
            }
            gi = gbuf;
        }
        float sc = decay; /* what the row is scaled by before the update */
        int scaled = wd_mode == 2;
        if (wd_mode == 3) {
            const int64_t k = step - (int64_t)dstep[s];
            if (k > 0) {
                sc = ps_decay_pow(decay, k);
                scaled = 1;
                dstep[s] = (int32_t)step;
            }
        }
        float mult = neg_lr;
        if (opt == PS_ROWWISE_ADAGRAD) {
            float nrm = sqrtf(ps_sumsq(gi, d));
            float h = state[s] + (nrm * nrm) / (float)d;
            state[s] = h;
            mult = (1.0f / (sqrtf(h) + eps)) * neg_lr;
        }
        if (!half) {
            float *wr = (float *)base + s * d;
            if (scaled)
                for (int64_t j = 0; j < d; j++) wr[j] *= sc;
            if (opt == PS_ADAGRAD)
                ps_adagrad_f32(wr, state + s * d, gi, neg_lr, eps, d);
            else
                ps_axpy_f32(wr, gi, mult, d);
        } else {
            for (int64_t j0 = 0; j0 < d; j0 += 256) {
                int64_t m = d - j0 < 256 ? d - j0 : 256;
                const float *gj = gi + j0;
                uint16_t *wr = (uint16_t *)base + s * d + j0;
                for (int64_t j = 0; j < m; j++) tmp[j] = ps_h2f(wr[j]);
                if (scaled)
                    for (int64_t j = 0; j < m; j++) tmp[j] *= sc;
                if (opt == PS_ADAGRAD)
                    ps_adagrad_f32(tmp, state + s * d + j0, gj, neg_lr, eps, m);
                else
                    ps_axpy_f32(tmp, gj, mult, m);
                for (int64_t j = 0; j < m; j++) wr[j] = ps_f2h(tmp[j]);
            }
        }
        if (meta) {
            int64_t c = (meta[s] >> 32) + 1;
            if (c > 0x7FFFFFFF) c = 0x7FFFFFFF;
            meta[s] = (c << 32) | step;
        }
    }
    free(gbuf);
    return 0;
}

struct ps_update_ctx {
    int opt;
    void *w;
    int half;
    float *state;
    int64_t d;
    const int32_t *slots;
    const int32_t *order;
    const float *g;
    float neg_lr, eps;
    int64_t *meta;
    int64_t step;
    int wd_mode;
    float wd, decay;
    int32_t *dstep;
    int failed; /* a range found no memory (set by any thread, read after the join) */
};

static void ps_update_chunk(void *p, int64_t lo, int64_t hi) {
    struct ps_update_ctx *c = (struct ps_update_ctx *)p;
    /* sorted: the chunk is a range of the order, slots and grads stay indexed by request position */
    const int64_t at = c->order ? 0 : lo;
    if (ps_update_range(c->opt, c->w, c->half, c->state, c->d, c->slots + at, c->order ? c->order + lo : NULL,
                        hi - lo, c->g + at * c->d, c->neg_lr, c->eps, c->meta, c->step, c->wd_mode, c->wd, c->decay,
                        c->dstep) != 0)
        __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
}

#define PS_SORT_MIN 2048 /* rows below which sorting costs more than the cache misses it saves */
#define PS_SORT_BUCKETS 8192

/* The positions [n] of slots [n] (>= 0) grouped by slot >> shift, buckets in increasing order
 * (one counting-sort pass; shift makes the largest slot's bucket < PS_SORT_BUCKETS, so a bucket
 * spans a few hundred KB of a multi-GB table: page and cache locality without a full sort).
 * Inside a bucket, arrival order. NULL if out of memory (the caller keeps arrival order). */
static int32_t *ps_slot_order(const int32_t *slots, int64_t n) {
    int32_t *order = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    if (!order) return NULL;
    int32_t top = 0;
    for (int64_t i = 0; i < n; i++)
        if (slots[i] > top) top = slots[i];
    int shift = 0;
    while ((top >> shift) >= PS_SORT_BUCKETS) shift++;
    int64_t start[PS_SORT_BUCKETS + 1] = {0}; /* counts, then each bucket's first position */
    for (int64_t i = 0; i < n; i++) start[(slots[i] >> shift) + 1]++;
    for (int j = 1; j < PS_SORT_BUCKETS; j++) start[j] += start[j - 1];
    for (int64_t i = 0; i < n; i++) order[start[slots[i] >> shift]++] = (int32_t)i;
    return order;
}

/* ps_update_range over nthreads threads: slots must be unique, so each row has one owner thread.
 * sort != 0 (and n >= PS_SORT_MIN): rows are updated grouped by slot range, in increasing order
 * (ps_slot_order; each row's math is the same in any order: same results, fewer cache and TLB
 * misses on a large table). Returns 0, or -1 when out of memory (some rows not updated). */
int ps_update(int opt, void *w, int half, float *state, int64_t d, const int32_t *slots, int64_t n,
               const float *g, float neg_lr, float eps, int64_t *meta, int64_t step, int wd_mode, float wd,
               float decay, int32_t *dstep, int nthreads, int sort) {
    int32_t *order = sort && n >= PS_SORT_MIN ? ps_slot_order(slots, n) : NULL;
    struct ps_update_ctx c = {opt, w, half, state, d, slots, order, g, neg_lr, eps, meta, step, wd_mode, wd, decay,
                              dstep, 0};
    ps_parallel(ps_update_chunk, &c, n, nthreads, PS_MIN_CHUNK);
    free(order);
    return c.failed ? -1 : 0;
}

/* ------------------------------------------------------------------ row init (init.py) */
/* out [n, d] float32 = init.py's symmetric bits in (-1, 1) of each key (`ps_bits_row`) */
struct ps_init_ctx {
    const int64_t *keys;
    int64_t d;
    uint64_t seed_mix;
    float *out;
};

static void ps_init_chunk(void *p, int64_t lo, int64_t hi) {
    const struct ps_init_ctx *c = (const struct ps_init_ctx *)p;
    for (int64_t i = lo; i < hi; i++) ps_bits_row(c->out + i * c->d, c->keys[i], c->seed_mix, c->d, 1.0f);
}

void ps_init_bits(const int64_t *keys, int64_t n, int64_t d, uint64_t seed_mix, float *out, int nthreads) {
    struct ps_init_ctx c = {keys, d, seed_mix, out};
    ps_parallel(ps_init_chunk, &c, n, nthreads, PS_MIN_CHUNK);
}
