/* Native serving kernel: raw ids -> rows through per-table hash maps, and pooling of every bag of
 * every slot straight into the model's output layout, fp32 and int8 / int4 rows dequantized in
 * the loop, fp16 rows widened to float32 in the loop (F16C 8 at a time where the CPU has it).
 *
 * Part of the one native library (how it is built, loaded and called: native.h), through
 * `recsys/serving/native_pool.py`. The per-table path (`recsys.serving.Predictor(fused=False)`) stays
 * the reference; tests compare the two bit for bit.
 *
 * Hash map of one table: int64 [C, 2] buckets (key, value), C = 2**bits, value -1 = empty (so any
 * int64 key, -1 included, can be stored). Linear probing from
 * home = splitmix64(key + PS_GOLDEN) >> (64 - bits). Values are the table's local rows.
 *
 * Slot descriptor, int64 [S, SV_K] (a slot is one (table, feature) pair, in the batch's slot order):
 *   0 map offset (buckets)   1 map bits          2 hashed: num_embeddings (0: the id is the key)
 *   3 row base (added to the local row)          4 matrix address   5 row bytes
 *   6 kind (0 fp32, 1 fp16, 2 int8, 3 int4)      7 dim D            8 mode (0 sum, 1 mean)
 *   9 output (0 or 1)        10 output column of example 0          11 output stride (floats)
 *   12 row of an unknown id: -1 (zeros default), -2 (uniform default, computed here), -3 (other
 *      default: the caller computes it and points the row at it)
 *   13 uniform default: splitmix64(seed)            14 uniform default: the float32 bits of its scale
 *
 * Float math (so that results are bit-equal to today's paths):
 *   fp32 (torch embedding_bag on CPU, fbgemm SpMDM): acc = 0; per id acc += row (unweighted) or
 *     acc = fma(w, row, acc) (per-id weights, sum bags only); mean bags: acc / (float)len.
 *   fp16: the same, on the row widened to float32 (exact: every half is a float), so the results
 *     are those of the fp32 path over the widened rows.
 *   int8 / int4 (fbgemm IntNBit TBE, rows f16 scale | f16 bias | codes; here f32 copies of those
 *     f16 values at the row's start): w = weight (sum bags), 1.0f / len (mean bags) or 1;
 *     acc = fma(scale * w, code, acc + bias * w).
 *   Rows of unknown ids: -1 (zeros default) contribute nothing; -2: the uniform default row of the
 *   key, computed in the loop exactly as embedding_ps/init.py's `init_rows` computes it; <= -4:
 *   a default row the caller computed (see sv_bag).
 *
 * Threads: lookups and pooling split the examples into contiguous chunks, one per thread
 * (`ps_parallel`, native.h); every item's math is the same whatever
 * the chunking, so results do not depend on the thread count.
 */
#include "native.h"

#define SV_K 16
#define SV_PF 8             /* ids ahead to prefetch */
#define SV_MIN_BAGS 1024    /* bags per thread below which a thread costs more than it saves */

/* ------------------------------------------------------------------ hash map */
static inline uint64_t sv_home(int64_t key, int64_t bits) {
    return ps_splitmix64((uint64_t)key + PS_GOLDEN) >> (64 - bits);
}

/* Insert keys[i] -> i (i < n) into one table's map (2**bits buckets, values -1). Returns the number
 * of keys already present (left as they were), or -1 when the map is full. */
int64_t sv_map_build(int64_t *map, int64_t bits, const int64_t *keys, int64_t n) {
    const uint64_t mask = ((uint64_t)1 << bits) - 1;
    int64_t dup = 0;
    for (int64_t i = 0; i < n; i++) {
        uint64_t p = sv_home(keys[i], bits);
        uint64_t left = mask + 1;
        while (map[2 * p + 1] >= 0 && map[2 * p] != keys[i]) {
            p = (p + 1) & mask;
            if (--left == 0) return -1;
        }
        if (map[2 * p + 1] >= 0) dup++;
        else {
            map[2 * p] = keys[i];
            map[2 * p + 1] = i;
        }
    }
    return dup;
}

static inline int64_t sv_key(int64_t id, uint64_t hashed) {
    return hashed ? (int64_t)(ps_splitmix64((uint64_t)id) % hashed) : id;
}

/* Positions where[M] (and bags bag[M]) of the rows -3, in order; returns M. */
int64_t sv_misses(const int32_t *rows, const int64_t *offsets, int64_t nbags, int64_t *where, int64_t *bag) {
    int64_t m = 0, k = 0;
    const int64_t n = offsets[nbags];
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] != -3) continue;
        while (offsets[k + 1] <= i) k++;
        where[m] = i;
        bag[m++] = k;
    }
    return m;
}

/* The uniform default row of a key: `ps_bits_row` (init.py's symmetric bits) times the slot's scale. */
static inline void sv_uniform(float *x, int64_t key, const int64_t *sl, int64_t d) {
    float scale;
    const uint32_t bits = (uint32_t)sl[14];
    memcpy(&scale, &bits, sizeof scale);
    ps_bits_row(x, key, (uint64_t)sl[13], d, scale);
}

/* ------------------------------------------------------------------ row ops
 * One id's row, from element j on, into a bag's accumulator acc [d] (on the stack). Per element,
 * x = the row's element widened to float32 (kind 0 fp32, 1 fp16 (exact), 2 int8 code, 3 int4 code:
 * element 2i the low nibble of byte i, 2i + 1 the high one):
 *   kind 0, 1: acc += x, or acc = fma(w, x, acc) when weighted;
 *   kind 2, 3: acc = fma(w, x, acc + bias).
 * kind and weighted are constants at every call (sv_bag), so each call compiles to its case's loop
 * alone. Each output element gets the same operations in the same order in the scalar (portable)
 * and the AVX2 versions, so both give the same bits. The AVX2 one exists because GCC unrolls the
 * scalar loops of small constant widths (8, 16) into scalar code before its vectorizer sees them,
 * and never vectorizes the int4 one. */
static inline __attribute__((always_inline)) void sv_row_c(float *restrict acc, const void *restrict row, int kind,
                                                           int weighted, float w, float bias, int64_t j, int64_t d) {
    const float *f = row;
    const uint16_t *h = row;
    const uint8_t *q = row;
    if (kind == 3) {                                /* j even */
        for (; j + 1 < d; j += 2) {
            const uint8_t byte = q[j >> 1];
            acc[j] = fmaf(w, (float)(byte & 15), acc[j] + bias);
            acc[j + 1] = fmaf(w, (float)(byte >> 4), acc[j + 1] + bias);
        }
        if (d & 1) acc[d - 1] = fmaf(w, (float)(q[(d - 1) >> 1] & 15), acc[d - 1] + bias);
        return;
    }
    for (; j < d; j++) {
        const float x = kind == 0 ? f[j] : kind == 1 ? ps_h2f(h[j]) : (float)q[j];
        acc[j] = kind >= 2 ? fmaf(w, x, acc[j] + bias) : weighted ? fmaf(w, x, acc[j]) : acc[j] + x;
    }
}

/* SV_PORTABLE (a -D flag): no AVX2 path at all, as on a machine other than x86 (tests build it so). */
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__)) && !defined(SV_PORTABLE)
#define SV_FMA_DISPATCH 1
#include <immintrin.h>
/* 8 elements a step (fp16 widened by vcvtph2ps, exact; int4: 16), sv_row_c for the rest; only
 * inlined into sv_pool_chunk_fma (flatten), the generic code never calls it (sv_bag's V = 0). */
static inline __attribute__((target("avx2,fma,f16c"))) void sv_row_avx(float *restrict acc, const void *restrict row,
                                                                        int kind, int weighted, float w, float bias,
                                                                        int64_t d) {
    const __m256 vw = _mm256_set1_ps(w), vb = _mm256_set1_ps(bias);
    const float *f = row;
    const uint16_t *h = row;
    const uint8_t *q = row;
    int64_t j = 0;
    if (kind == 3) {
        const __m128i m15 = _mm_set1_epi8(15);
        for (; j + 16 <= d; j += 16) {              /* 8 bytes: 16 codes */
            const __m128i by = _mm_loadl_epi64((const __m128i *)(q + (j >> 1)));
            const __m128i lo = _mm_and_si128(by, m15), hi = _mm_and_si128(_mm_srli_epi16(by, 4), m15);
            const __m128i codes = _mm_unpacklo_epi8(lo, hi);                   /* [16] bytes in element order */
            const __m256 c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
            const __m256 c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)));
            _mm256_storeu_ps(acc + j, _mm256_fmadd_ps(vw, c0, _mm256_add_ps(_mm256_loadu_ps(acc + j), vb)));
            _mm256_storeu_ps(acc + j + 8, _mm256_fmadd_ps(vw, c1, _mm256_add_ps(_mm256_loadu_ps(acc + j + 8), vb)));
        }
    } else {
        for (; j + 8 <= d; j += 8) {
            const __m256 a = _mm256_loadu_ps(acc + j);
            const __m256 x = kind == 0 ? _mm256_loadu_ps(f + j)
                             : kind == 1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + j)))
                             : _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j))));
            _mm256_storeu_ps(acc + j, kind >= 2 ? _mm256_fmadd_ps(vw, x, _mm256_add_ps(a, vb))
                                      : weighted ? _mm256_fmadd_ps(vw, x, a) : _mm256_add_ps(a, x));
        }
    }
    sv_row_c(acc, row, kind, weighted, w, bias, j, d);
}
#else
#define sv_row_avx(acc, row, kind, weighted, w, bias, d) sv_row_c(acc, row, kind, weighted, w, bias, 0, d)
#endif

/* sv_row_avx (V: 1, only in sv_pool_chunk_fma) or sv_row_c (V: 0) */
static inline __attribute__((always_inline)) void sv_row(float *restrict acc, const void *restrict row, int kind,
                                                         int weighted, float w, float bias, int64_t d, const int V) {
    if (V) sv_row_avx(acc, row, kind, weighted, w, bias, d);
    else sv_row_c(acc, row, kind, weighted, w, bias, 0, d);
}

/* ------------------------------------------------------------------ pooling */
#define SV_DMAX 1024 /* widest row the kernel pools (the caller checks) */

struct sv_pool_ctx {
    int32_t *rows;
    const int64_t *map, *values;
    const float *weights, *defaults;
    const int64_t *offsets, *slots;
    int64_t B, S;
    float *out[2];
};

/* One bag k = s * B + b. Rows r >= 0: the slot's matrix; -1: nothing; -2: the key's uniform default
 * row; r <= -4: the float32 default row at defaults + (-r - 4). Default rows are summed in id
 * order like a matrix row (fp32, fp16) or, for int8 / int4, weighted and summed apart and added at the
 * end (as tbe_pool.QuantizedPooling adds them after fbgemm's TBE).
 * DC: the width when known at compile time (0: the slot's, at most SV_DMAX); V: see sv_row. */
static inline __attribute__((always_inline)) void sv_bag(const struct sv_pool_ctx *c, int64_t k, const int64_t *sl,
                                                         int64_t s, int64_t send, const int64_t DC, const int V) {
    const int64_t b = k - s * c->B;
    const uint8_t *mat = (const uint8_t *)(intptr_t)sl[4];
    const int64_t rb = sl[5], kind = sl[6], d = DC ? DC : sl[7], mean = sl[8];
    float *o = c->out[sl[9]] + sl[10] + b * sl[11];
    const int64_t i0 = c->offsets[k], i1 = c->offsets[k + 1];
    const float *wts = mean ? NULL : c->weights;
    float acc[SV_DMAX], dacc[SV_DMAX], def[SV_DMAX];     /* on the stack: no aliasing with rows or output */
    int defaults = 0;
    for (int64_t j = 0; j < d; j++) acc[j] = 0.0f;
    const float inv = (mean && kind >= 2 && i1 > i0) ? 1.0f / (float)(i1 - i0) : 1.0f;
    for (int64_t i = i0; i < i1; i++) {
        if (i + SV_PF < send && c->rows[i + SV_PF] >= 0) PREFETCH(mat + rb * c->rows[i + SV_PF]);
        const int32_t r = c->rows[i];
        if (r == -1 || r == -3) continue;
        if (kind == 1 && r >= 0) {                  /* an fp16 row (default rows are float32: below) */
            const uint8_t *h = mat + rb * r;
            if (wts) sv_row(acc, h, 1, 1, wts[i], 0.0f, d, V);
            else sv_row(acc, h, 1, 0, 0.0f, 0.0f, d, V);
            continue;
        }
        const float *x;
        if (r >= 0) x = (const float *)(mat + rb * r);
        else if (r == -2) {
            sv_uniform(def, sv_key(c->values[i], (uint64_t)sl[2]), sl, d);
            x = def;
        } else x = c->defaults + (-(int64_t)r - 4);
        if (kind <= 1) {
            if (wts) sv_row(acc, x, 0, 1, wts[i], 0.0f, d, V);
            else sv_row(acc, x, 0, 0, 0.0f, 0.0f, d, V);
            continue;
        }
        const float w = wts ? wts[i] : inv;
        if (r < 0) {
            if (!defaults) {
                for (int64_t j = 0; j < d; j++) dacc[j] = 0.0f;
                defaults = 1;
            }
            for (int64_t j = 0; j < d; j++) dacc[j] += x[j] * w;
            continue;
        }
        const uint8_t *row = mat + rb * r;
        float sb[2];
        memcpy(sb, row, sizeof sb);
        if (kind == 2) sv_row(acc, row + 8, 2, 0, sb[0] * w, sb[1] * w, d, V);
        else sv_row(acc, row + 8, 3, 0, sb[0] * w, sb[1] * w, d, V);
    }
    if (mean && kind <= 1 && i1 > i0) {
        const float n = (float)(i1 - i0);
        for (int64_t j = 0; j < d; j++) o[j] = acc[j] / n;
    } else if (defaults) {
        for (int64_t j = 0; j < d; j++) o[j] = acc[j] + dacc[j];
    } else {
        for (int64_t j = 0; j < d; j++) o[j] = acc[j];
    }
}

/* A block's ids (examples [b0, b1) of every slot) are looked up in two passes. sv_home_block:
 * each id's home bucket into c->rows (as uint32: a map has at most 2**32 buckets, its table at
 * most 2**31 rows) and that bucket prefetched; sv_bags runs it one block ahead, so the buckets
 * arrive while the block before is pooled (a lookup right before its pooling waited on them:
 * every block touches every table's map). sv_probe_block: from those homes, each id's row (or
 * its slot's code of unknown ids), and the row's first line prefetched for
 * the pooling that follows. Hashed tables compute their keys in both passes. */
static inline __attribute__((always_inline)) void sv_home_block(const struct sv_pool_ctx *c, int64_t b0,
                                                                int64_t b1) {
    for (int64_t s = 0; s < c->S; s++) {
        const int64_t *sl = c->slots + SV_K * s, *map = c->map + 2 * sl[0];
        const int64_t lo = c->offsets[s * c->B + b0], hi = c->offsets[s * c->B + b1], bits = sl[1];
        const uint64_t hashed = (uint64_t)sl[2];
        for (int64_t i = lo; i < hi; i++) {
            const uint64_t h = sv_home(sv_key(c->values[i], hashed), bits);
            c->rows[i] = (int32_t)(uint32_t)h;
            PREFETCH(map + 2 * h);
        }
    }
}

static inline __attribute__((always_inline)) void sv_probe_block(const struct sv_pool_ctx *c, int64_t b0,
                                                                 int64_t b1) {
    for (int64_t s = 0; s < c->S; s++) {
        const int64_t *sl = c->slots + SV_K * s, *map = c->map + 2 * sl[0];
        const int64_t lo = c->offsets[s * c->B + b0], hi = c->offsets[s * c->B + b1], base = sl[3], rb = sl[5];
        const uint64_t hashed = (uint64_t)sl[2], mask = ((uint64_t)1 << sl[1]) - 1;
        const uint8_t *mat = (const uint8_t *)(intptr_t)sl[4];
        const int32_t miss = (int32_t)sl[12];
        for (int64_t i = lo; i < hi; i++) {
            const int64_t k = sv_key(c->values[i], hashed);
            uint64_t p = (uint32_t)c->rows[i];
            int64_t v;
            while ((v = map[2 * p + 1]) >= 0 && map[2 * p] != k) p = (p + 1) & mask;
            if (v >= 0) {
                c->rows[i] = (int32_t)(base + v);
                PREFETCH(mat + rb * (base + v));
            } else c->rows[i] = miss;
        }
    }
}

#define SV_BLOCK 64

struct sv_lookup_ctx {
    struct sv_pool_ctx c;
    int64_t misses;
};

/* Examples [lo, hi) of every slot looked up as the pooling looks them up, block by block */
static void sv_lookup_chunk(void *p, int64_t lo, int64_t hi) {
    struct sv_lookup_ctx *l = (struct sv_lookup_ctx *)p;
    const struct sv_pool_ctx *c = &l->c;
    for (int64_t b0 = lo; b0 < hi; b0 += SV_BLOCK) {
        const int64_t b1 = b0 + SV_BLOCK < hi ? b0 + SV_BLOCK : hi;
        sv_home_block(c, b0, b1);
        sv_probe_block(c, b0, b1);
    }
    int64_t misses = 0;
    for (int64_t s = 0; s < c->S; s++)
        for (int64_t i = c->offsets[s * c->B + lo]; i < c->offsets[s * c->B + hi]; i++) misses += c->rows[i] == -3;
    PS_ADD(&l->misses, misses);
}

/* rows[i] = the row of values[i] (slot of i: bag i falls in, bags k = s * B + b), or the slot's
 * code of unknown ids when its table lacks the key. Returns how many got code -3 (the caller's). */
int64_t sv_lookup(const int64_t *map, const int64_t *slots, int64_t S, int64_t B, const int64_t *values,
                  const int64_t *offsets, int32_t *rows, int nthreads) {
    struct sv_lookup_ctx l = {{rows, map, values, NULL, NULL, offsets, slots, B, S, {NULL, NULL}}, 0};
    ps_parallel(sv_lookup_chunk, &l, B, nthreads, S > 0 ? (SV_MIN_BAGS + S - 1) / S : SV_MIN_BAGS);
    return l.misses;
}

/* Examples [lo, hi) of every slot, in blocks of SV_BLOCK examples: for each block, slot by slot, so
 * that the block's output rows stay in cache while every slot writes its columns (slot by slot
 * over the whole batch would stream the whole output through the cache once per slot). The
 * common widths compile with constant loops. */
#define SV_BAGS(DC)                                                                                 \
    for (int64_t b = b0; b < b1; b++) sv_bag(c, s * c->B + b, sl, s, end, DC, V);                  \
    break;
static inline __attribute__((always_inline)) void sv_bags(const struct sv_pool_ctx *c, int64_t lo, int64_t hi,
                                                          int64_t S, const int V) {
    for (int64_t b0 = lo; b0 < hi; b0 += SV_BLOCK) {
        const int64_t b1 = b0 + SV_BLOCK < hi ? b0 + SV_BLOCK : hi;
        if (c->map) {                               /* this block's rows; the next block's buckets in flight */
            if (b0 == lo) sv_home_block(c, b0, b1);
            sv_probe_block(c, b0, b1);
            if (b1 < hi) sv_home_block(c, b1, b1 + SV_BLOCK < hi ? b1 + SV_BLOCK : hi);
        }
        for (int64_t s = 0; s < S; s++) {
            const int64_t *sl = c->slots + SV_K * s;
            const int64_t end = c->offsets[s * c->B + b1];
            switch (sl[7]) {
            case 1: SV_BAGS(1)
            case 8: SV_BAGS(8)
            case 16: SV_BAGS(16)
            case 32: SV_BAGS(32)
            case 64: SV_BAGS(64)
            case 128: SV_BAGS(128)
            default: SV_BAGS(0)
            }
        }
    }
}

static void sv_pool_chunk_generic(void *p, int64_t lo, int64_t hi) {
    sv_bags((const struct sv_pool_ctx *)p, lo, hi, ((const struct sv_pool_ctx *)p)->S, 0);
}

#ifdef SV_FMA_DISPATCH
/* The same code with hardware fma (fmaf is one instruction there, a libm call otherwise) and the
 * AVX2 / F16C row ops (flatten: inlined here with the constant widths). */
__attribute__((target("avx2,fma,f16c"), flatten)) static void sv_pool_chunk_fma(void *p, int64_t lo, int64_t hi) {
    sv_bags((const struct sv_pool_ctx *)p, lo, hi, ((const struct sv_pool_ctx *)p)->S, 1);
}
#endif

/* Pools bags k = s * B + b (ids offsets[k] .. offsets[k + 1], raw ids values) into out[slot's
 * output]. map: NULL when rows holds every id's row already (sv_lookup), else the maps: each
 * block's ids are looked up before it is pooled, their buckets prefetched while the block before
 * is pooled (sv_home_block; no slot may have code -3 then).
 * weights: float32 [N] per-id weights of the sum bags, or NULL; defaults: the default rows that
 * rows <= -4 point at, or NULL. */
void sv_pool(int32_t *rows, const int64_t *map, const int64_t *values, const float *weights, const float *defaults,
             const int64_t *offsets, const int64_t *slots, int64_t S, int64_t B, float *out0, float *out1,
             int nthreads) {
    struct sv_pool_ctx c = {rows, map, values, weights, defaults, offsets, slots, B, S, {out0, out1}};
    ps_chunk_fn fn = sv_pool_chunk_generic;
#ifdef SV_FMA_DISPATCH
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        fn = sv_pool_chunk_fma;
#endif
    ps_parallel(fn, &c, B, nthreads, S > 0 ? (SV_MIN_BAGS + S - 1) / S : SV_MIN_BAGS);   /* split the examples */
}
