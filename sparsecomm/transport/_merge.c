/* Merge of sorted sparse chunks: the decompression of the sparse methods.
 *
 * Every sparse method ends by adding the P chunks it received, index by index, in rank order, and
 * (for the result) dividing each sum by P. Each chunk's indices arrive sorted, so nothing is sorted
 * again: every index's sum is accumulated as 0 + v_0 + v_1 + ... in chunk order, in the value type,
 * exactly as torch's sequential index_add_ of one chunk after another does: the bits are those of the
 * torch paths in sparsecomm/transport/merge.py and chunk.py, on every rank.
 *
 *   merge_sum:     the coalesced sum, written as (unique index, sum) pairs in increasing index: a
 *                  blocked sweep over the index space, each block's runs added chunk after chunk
 *                  into a scratch block in L1 (below);
 *   merge_average: the sum divided by `divisor` (true division, as torch's div) written into a dense
 *                  vector, which is zero everywhere else afterwards: a blocked sweep over the vector
 *                  (below) that also zeroes what the previous call wrote there, counts the non-zero
 *                  results and records, one bit per 16 elements, where it wrote;
 *   members:       which entries of one sorted index vector occur in another (Ok-Topk's "which of my
 *                  selected entries made the global result"), one walk over both.
 *
 * Both first check, in one sequential read of the indices, that each chunk is sorted and (for
 * merge_average) every index lies inside the dense vector, and write nothing unless it holds: a chunk
 * out of order returns -1 (the caller then takes its torch path), an index out of range -2. Indices are
 * int32 or int64, values float32 or float64, the same types across the chunks. The GIL is released
 * during the merge.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MERGE_MAX_CHUNKS 4096
#define MAX_INDEX (INT64_C(1) << 50) /* larger indices take the torch path (block bounds never overflow) */

typedef struct {
    int nchunks;
    const void *idx[MERGE_MAX_CHUNKS];
    const void *val[MERGE_MAX_CHUNKS];
    int64_t len[MERGE_MAX_CHUNKS];
    int64_t pos[MERGE_MAX_CHUNKS];
    int64_t end[MERGE_MAX_CHUNKS];  /* merge_average: where each chunk's run in the block ends */
    int64_t ahead[MERGE_MAX_CHUNKS]; /* merge_average: each chunk's cursor for the block PREFETCH_BLOCKS on */
    int64_t ahead_from[MERGE_MAX_CHUNKS];
    int wide_index;                 /* int64 indices (else int32) */
} merge_t;

static inline int64_t index_at(const merge_t *m, int c, int64_t i) {
    return m->wide_index ? ((const int64_t *)m->idx[c])[i] : (int64_t)((const int32_t *)m->idx[c])[i];
}

/* 0 when every chunk is sorted with indices in [0, MAX_INDEX) (and, with n >= 0, in [0, n));
 * -1 when a chunk is out of order or holds an index the keys cannot carry, -2 when one lies outside n. */
static int check_chunks(const merge_t *m, int64_t n) {
    for (int c = 0; c < m->nchunks; c++) {
        int64_t previous = 0;
        for (int64_t i = 0; i < m->len[c]; i++) {
            int64_t index = index_at(m, c, i);
            if (index < previous) return index < 0 && n >= 0 ? -2 : -1;
            previous = index;
        }
        if (previous >= MAX_INDEX) return -1;
        if (n >= 0 && previous >= n) return -2;
    }
    return 0;
}

/* The two merge_sums, once per value type (float, double), on chunks check_chunks accepted: a blocked
 * sweep over the index space. Each block of SUM_BLOCK consecutive indices starts at the lowest index
 * any chunk has left (blocks holding no entry are never visited); every chunk's run of entries in the
 * block is added, chunk after chunk, into a zeroed scratch block (in L1), a bit per index marking
 * which hold a sum; the marked indices are then written out in increasing order (a walk over the
 * block's 64 bit words) and their scratch entries zeroed again. Each sum is 0 + v_0 + v_1 + ... in
 * chunk order (and within a chunk in its own order), the order of index_add_ one chunk after another,
 * so the bits are the same. Cost: one sequential read of every chunk, one write of the unique pairs,
 * and per block O(chunks) to find where the next one starts and a walk of 64 words. `out_idx` has the
 * chunks' index type. Returns the number of unique indices, or -3 when the scratch block cannot be
 * allocated (the caller then takes its torch path). */
#define SUM_BLOCK 4096
#define MERGE_SUM_RUN(I)                                                                                    \
    {                                                                                                       \
        const I *ids = (const I *)m->idx[c];                                                                \
        for (; p < len && (int64_t)ids[p] < end; p++) {                                                     \
            int64_t at = (int64_t)ids[p] - base;                                                            \
            scratch[at] += values[p];                                                                       \
            marks[at >> 6] |= UINT64_C(1) << (at & 63);                                                     \
        }                                                                                                   \
    }
#define MERGE_SUM_BODY(T)                                                                                   \
    static int64_t merge_sum_##T(merge_t *m, void *out_idx, T *out_val) {                                   \
        T *scratch = calloc(SUM_BLOCK, sizeof(T));                                                          \
        if (scratch == NULL) return -3;                                                                     \
        uint64_t marks[SUM_BLOCK / 64] = {0};                                                               \
        int64_t count = 0;                                                                                  \
        for (int c = 0; c < m->nchunks; c++) m->pos[c] = 0;                                                 \
        for (;;) {                                                                                          \
            int64_t lowest = INT64_MAX;                                                                     \
            for (int c = 0; c < m->nchunks; c++)                                                            \
                if (m->pos[c] < m->len[c] && index_at(m, c, m->pos[c]) < lowest)                            \
                    lowest = index_at(m, c, m->pos[c]);                                                     \
            if (lowest == INT64_MAX) break;                                                                 \
            int64_t base = lowest - lowest % SUM_BLOCK, end = base + SUM_BLOCK;                             \
            for (int c = 0; c < m->nchunks; c++) {                                                          \
                const T *values = (const T *)m->val[c];                                                     \
                int64_t p = m->pos[c], len = m->len[c];                                                     \
                if (m->wide_index) MERGE_SUM_RUN(int64_t) else MERGE_SUM_RUN(int32_t)                       \
                m->pos[c] = p;                                                                              \
            }                                                                                               \
            for (int w = 0; w < SUM_BLOCK / 64; w++) {                                                      \
                for (uint64_t bits = marks[w]; bits; bits &= bits - 1) {                                    \
                    int64_t at = w * 64 + __builtin_ctzll(bits);                                            \
                    if (m->wide_index)                                                                      \
                        ((int64_t *)out_idx)[count] = base + at;                                            \
                    else                                                                                    \
                        ((int32_t *)out_idx)[count] = (int32_t)(base + at);                                 \
                    out_val[count++] = scratch[at];                                                         \
                    scratch[at] = (T)0;                                                                     \
                }                                                                                           \
                marks[w] = 0;                                                                               \
            }                                                                                               \
        }                                                                                                   \
        free(scratch);                                                                                      \
        return count;                                                                                       \
    }

MERGE_SUM_BODY(float)
MERGE_SUM_BODY(double)

/* ---------------------------------------------------------------- merge_average: the blocked sweep
 *
 * The dense vector is processed in blocks of BLOCK elements, in order, without a heap: the chunks'
 * cursors only advance, and each block takes from every chunk in turn the run of its entries that fall
 * in the block (found by a scan of the indices; the second read, to add, comes from L1). The block's
 * received entries and its stale groups (where the previous call wrote; see the mask below) bound the
 * GROUP-element groups it must touch, and choose how it is written:
 *
 *   in place (that bound at most DENSE_NUM/DENSE_DEN of the block's groups): the lines to touch are
 *       prefetched PREFETCH_BLOCKS blocks earlier (a cursor per chunk runs that far ahead, so that the
 *       few lines of several blocks are in flight at once) where the whole sweep's entries and stale
 *       groups would leave every block in place, else just before the block (so that a denser sweep
 *       does not read its indices twice), the stale groups zeroed, each run added in chunk order straight into the
 *       vector, and every touched entry divided once. Only the cache lines of a stale group or a
 *       received index are touched, each fetched once (the block stays in L1/L2 between the steps);
 *   dense (more to touch, or the vector's contents unknown): the runs added in chunk order into a
 *       zeroed scratch block in L1, then one loop divides the whole block, counts its non-zeros,
 *       streams it into the vector with non-temporal stores (zeros and averages alike: one write
 *       per cache line, no read of the vector) and zeroes the scratch again.
 *
 * Each entry's sum starts from `start`: +0.0 (index_add_ into zeros) or -0.0 (the first value itself,
 * as an assignment). In the dense scratch +0.0 is already there; otherwise (and in place, to divide
 * each touched entry once) a byte per entry of the block tells the first value from the next ones and
 * a list holds the touched entries. The division multiplies by 1/divisor where the divisor is a power
 * of two (the same correctly rounded quotient); the non-zero results are counted on the way, so no
 * caller counts them again.
 *
 * The mask (one bit per group, the vector zero outside the marked groups) is read on entry in mode
 * MASK_STALE and rewritten in place, block by block, with the groups this call wrote.
 *
 * Cost: one sequential read of the received pairs (plus the order check's read of the indices), and per
 * block either its covered cache lines touched once or one streaming write of the block (and a
 * vectorized pass over it in L1); O(P) per block with nothing to do. */
#define BLOCK 4096      /* elements per block: a float block in a quarter of L1, a double block in half */
#define GROUP 16        /* elements per mask bit: a float cache line */
#define MASK_WORDS_PER_BLOCK (BLOCK / GROUP / 64)
/* in place at most 1/6 of a block's groups: a touched line in place costs about six streamed ones (its
 * read, its write-back and the hardware prefetcher's neighbours), so past that share streaming the
 * whole block is cheaper. */
#define DENSE_NUM 1
#define DENSE_DEN 6

/* an in-place block's lines are fetched this many blocks before it is written: at 0.1% of entries a
 * block touches about eight lines, and fetched just before it the sweep would wait for memory block by
 * block; several blocks' lines in flight at once hide that wait (the distance matters little between
 * 2 and 16 blocks). */
#define PREFETCH_BLOCKS 4

enum { MASK_CLEAN = 0, MASK_STALE = 1, MASK_ALL = 2 }; /* the vector zero / zero outside the mask / anything */

/* Whether a block of `size` elements with `received` entries and `stale` stale groups is written in
 * place (else through the scratch block, streamed): at most DENSE_NUM/DENSE_DEN of its groups to touch. */
static inline int written_in_place(int mode, int64_t received, int64_t stale, int64_t size) {
    return mode != MASK_ALL && (received + stale) * DENSE_DEN <= (size + GROUP - 1) / GROUP * DENSE_NUM;
}

/* The scratch block's offset into its allocation (of PAGE bytes more than the block): where its address
 * lies half a page from the vector's within a page, on a cache line. A dense block's finish loads
 * scratch[i] while it streams dst[i] out; with the two at nearly the same offset within their pages, a
 * load whose address matches a store just issued in its low 12 bits waits for that store (4K aliasing)
 * and the sweep runs at a fraction of its speed. Where calloc puts the scratch depends on the process's
 * heap, so the offset is chosen here rather than left to it. */
#define PAGE 4096
static inline size_t half_page_away(const void *memory, const void *vector) {
    const size_t want = ((uintptr_t)vector + PAGE / 2) % PAGE / 64 * 64;
    return (want - (uintptr_t)memory % PAGE + PAGE) % PAGE;
}

typedef struct {
    uint8_t seen[BLOCK];   /* in the block: whether the entry has its first value yet (all 0 between blocks) */
    uint16_t list[BLOCK];  /* the entries touched in the block, in the order first touched */
    uint8_t marks[BLOCK / GROUP]; /* in the block: whether a group was written (all 0 between blocks) */
} block_t;

/* The mask word of 64 groups from their marks (bytes 0 or 1), which it zeroes. */
static inline uint64_t group_bits(uint8_t *marks) {
    uint64_t word = 0;
    for (int i = 0; i < 8; i++) {
        uint64_t eight;
        memcpy(&eight, marks + 8 * i, 8);
        /* bytes of 0 or 1: the multiply gathers byte b's bit at bit 56 + b (no carries) */
        word |= ((eight * UINT64_C(0x0102040810204080)) >> 56) << (8 * i);
    }
    memset(marks, 0, 64);
    return word;
}

static inline int is_power_of_two(double d) {
    int exponent;
    return d > 0 && frexp(d, &exponent) == 0.5;
}

/* The end of a dense block: dst[i] = src[i] / divisor (times `inverse` where `scale`; src[i] itself
 * unless `divide`) and src[i] = 0 for i in [0, size), dst written with non-temporal stores where the
 * target has them; returns how many dst[i] != 0. An AVX2 variant where the CPU runs it, else SSE2 (on
 * every x86-64), else plain C. */
#define FINISH_ONE(T)                                                                                       \
    static inline int64_t finish_one_##T(T *dst, T *src, int64_t i, int divide, int scale, T divisor,      \
                                         T inverse) {                                                       \
        T x = divide ? (scale ? src[i] * inverse : src[i] / divisor) : src[i];                              \
        dst[i] = x;                                                                                         \
        src[i] = (T)0;                                                                                      \
        return x != (T)0;                                                                                   \
    }
FINISH_ONE(float)
FINISH_ONE(double)

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define MERGE_HAVE_SIMD 1
#define NEQ_SSE(SUF, a, b) _mm_cmpneq_##SUF(a, b)
#define NEQ_AVX(SUF, a, b) _mm256_cmp_##SUF(a, b, _CMP_NEQ_UQ)
/* PFX: _mm or _mm256; SUF: ps or pd; CT: the integer of T's width, counted lane by lane */
#define FINISH_SIMD(NAME, ATTR, T, V, VI, PFX, SUF, ISUF, CT, SUB, NEQ)                                     \
    ATTR static int64_t NAME(T *dst, T *src, int64_t size, int divide, int scale, T divisor, T inverse) {   \
        enum { LANES = (int)(sizeof(V) / sizeof(T)) };                                                      \
        int64_t i = 0, nz = 0;                                                                              \
        for (; i < size && ((uintptr_t)(dst + i) & (sizeof(V) - 1)) != 0; i++)                              \
            nz += finish_one_##T(dst, src, i, divide, scale, divisor, inverse);                             \
        const V zero = PFX##_setzero_##SUF(), d = PFX##_set1_##SUF(divisor), inv = PFX##_set1_##SUF(inverse); \
        VI count = PFX##_setzero_##ISUF(); /* minus the non-zeros, lane by lane */                          \
        for (; i + LANES <= size; i += LANES) {                                                             \
            V x = PFX##_loadu_##SUF(src + i);                                                               \
            if (divide) x = scale ? PFX##_mul_##SUF(x, inv) : PFX##_div_##SUF(x, d);                        \
            PFX##_stream_##SUF(dst + i, x);                                                                 \
            PFX##_storeu_##SUF(src + i, zero);                                                              \
            count = PFX##_##SUB(count, PFX##_cast##SUF##_##ISUF(NEQ(SUF, x, zero)));                        \
        }                                                                                                   \
        CT lanes[LANES];                                                                                    \
        PFX##_storeu_##ISUF((VI *)(void *)lanes, count);                                                    \
        for (int lane = 0; lane < LANES; lane++) nz += lanes[lane];                                         \
        for (; i < size; i++) nz += finish_one_##T(dst, src, i, divide, scale, divisor, inverse);           \
        return nz;                                                                                          \
    }
FINISH_SIMD(finish_float_sse2, , float, __m128, __m128i, _mm, ps, si128, int32_t, sub_epi32, NEQ_SSE)
FINISH_SIMD(finish_double_sse2, , double, __m128d, __m128i, _mm, pd, si128, int64_t, sub_epi64, NEQ_SSE)
FINISH_SIMD(finish_float_avx2, __attribute__((target("avx2"))), float, __m256, __m256i, _mm256, ps, si256, int32_t,
            sub_epi32, NEQ_AVX)
FINISH_SIMD(finish_double_avx2, __attribute__((target("avx2"))), double, __m256d, __m256i, _mm256, pd, si256,
            int64_t, sub_epi64, NEQ_AVX)
static int use_avx2 = 0; /* set at import */
#define FINISH(T, ...) (use_avx2 ? finish_##T##_avx2(__VA_ARGS__) : finish_##T##_sse2(__VA_ARGS__))
#define STREAM_FENCE() _mm_sfence()
#else
#define MERGE_HAVE_SIMD 0
#define FINISH_PLAIN(T)                                                                                     \
    static int64_t finish_##T(T *dst, T *src, int64_t size, int divide, int scale, T divisor, T inverse) {  \
        int64_t nz = 0;                                                                                     \
        for (int64_t i = 0; i < size; i++) nz += finish_one_##T(dst, src, i, divide, scale, divisor, inverse); \
        return nz;                                                                                          \
    }
FINISH_PLAIN(float)
FINISH_PLAIN(double)
#define FINISH(T, ...) finish_##T(__VA_ARGS__)
#define STREAM_FENCE()
#endif

/* Prefetches (for writing) the lines an in-place block at `lo` touches: its stale groups (mask words
 * `words[0:nwords]`) and each chunk's entries from[c] to to[c]. */
#define PREFETCH_LINES_BODY(T, I)                                                                           \
    static inline void prefetch_lines_##T##_##I(const merge_t *m, T *dense, int64_t lo, const uint64_t *words,  \
                                                int64_t nwords, int mode, const int64_t *from,              \
                                                const int64_t *to) {                                        \
        if (mode == MASK_STALE)                                                                             \
            for (int64_t w = 0; w < nwords; w++)                                                            \
                for (uint64_t bits = words[w]; bits; bits &= bits - 1)                                      \
                    __builtin_prefetch(dense + lo + (w * 64 + __builtin_ctzll(bits)) * GROUP, 1, 3);        \
        for (int c = 0; c < m->nchunks; c++)                                                                \
            for (int64_t p = from[c]; p < to[c]; p++)                                                       \
                __builtin_prefetch(dense + ((const I *)m->idx[c])[p], 1, 3);                                \
    }

/* The block at `lo` (if below n): advances the chunks' `ahead` cursors past it and, when it will be written
 * in place, prefetches its lines. */
#define PREFETCH_BODY(T, I)                                                                                 \
    PREFETCH_LINES_BODY(T, I)                                                                               \
    static void prefetch_block_##T##_##I(merge_t *m, T *dense, int64_t n, int64_t lo, const uint64_t *mask, \
                                         int64_t mask_words, int mode) {                                    \
        if (lo >= n || mode == MASK_ALL) return;                                                            \
        const int64_t hi = lo + BLOCK < n ? lo + BLOCK : n;                                                 \
        const uint64_t *words = mask + lo / (GROUP * 64);                                                   \
        const int64_t nwords = mask_words - lo / (GROUP * 64) < MASK_WORDS_PER_BLOCK                       \
                                   ? mask_words - lo / (GROUP * 64) : MASK_WORDS_PER_BLOCK;                 \
        int64_t received = 0, stale = 0;                                                                    \
        for (int c = 0; c < m->nchunks; c++) {                                                              \
            const I *ix = (const I *)m->idx[c];                                                             \
            int64_t p = m->ahead[c];                                                                        \
            m->ahead_from[c] = p;                                                                           \
            while (p < m->len[c] && ix[p] < hi) p++;                                                        \
            m->ahead[c] = p;                                                                                \
            received += p - m->ahead_from[c];                                                               \
        }                                                                                                   \
        if (mode == MASK_STALE)                                                                             \
            for (int64_t w = 0; w < nwords; w++) stale += __builtin_popcountll(words[w]);                   \
        if (received + stale > 0 && written_in_place(mode, received, stale, hi - lo))                       \
            prefetch_lines_##T##_##I(m, dense, lo, words, nwords, mode, m->ahead_from, m->ahead);           \
    }

PREFETCH_BODY(float, int32_t)
PREFETCH_BODY(float, int64_t)
PREFETCH_BODY(double, int32_t)
PREFETCH_BODY(double, int64_t)

/* Returns the non-zero results; the chunks were checked (sorted, inside [0, n)) before. One function per
 * value type T and index type I. */
#define AVERAGE_BODY(T, I)                                                                                  \
    static int64_t merge_average_##T##_##I(merge_t *m, T *dense, int64_t n, double divisor, int keep_sign,  \
                                           uint64_t *mask, int mode, T *scratch, block_t *b) {              \
        const int nchunks = m->nchunks;                                                                     \
        int64_t *pos = m->pos, *end = m->end, *len = m->len;                                                \
        uint8_t *seen = b->seen;                                                                            \
        uint16_t *list = b->list;                                                                           \
        uint8_t *marks = b->marks;                                                                          \
        int64_t nz = 0, mask_words = ((n + GROUP - 1) / GROUP + 63) / 64;                                    \
        const int divide = divisor != 1.0, scale = is_power_of_two(divisor);                                \
        const T d = (T)divisor, inverse = (T)(1.0 / divisor), start = keep_sign ? -(T)0 : (T)0;             \
        /* prefetching ahead (a second cursor over the indices) pays where the sweep is mostly in place: */ \
        /* its entries and stale groups, spread evenly, would leave every block in place */                 \
        int64_t to_touch = 0;                                                                               \
        for (int c = 0; c < nchunks; c++) to_touch += len[c];                                               \
        if (mode == MASK_STALE)                                                                             \
            for (int64_t w = 0; w < mask_words; w++) to_touch += __builtin_popcountll(mask[w]);             \
        const int prefetching = written_in_place(mode, to_touch, 0, n);                                     \
        for (int c = 0; c < nchunks; c++) pos[c] = m->ahead[c] = 0;                                         \
        for (int64_t lo = 0; prefetching && lo < PREFETCH_BLOCKS * BLOCK; lo += BLOCK)                      \
            prefetch_block_##T##_##I(m, dense, n, lo, mask, mask_words, mode);                              \
        for (int64_t lo = 0; lo < n; lo += BLOCK) {                                                         \
            if (prefetching)                                                                                \
                prefetch_block_##T##_##I(m, dense, n, lo + PREFETCH_BLOCKS * BLOCK, mask, mask_words, mode); \
            const int64_t hi = lo + BLOCK < n ? lo + BLOCK : n, size = hi - lo;                             \
            uint64_t *words = mask + lo / (GROUP * 64);                                                     \
            const int64_t nwords = mask_words - lo / (GROUP * 64) < MASK_WORDS_PER_BLOCK                   \
                                       ? mask_words - lo / (GROUP * 64) : MASK_WORDS_PER_BLOCK;             \
            int64_t received = 0, stale = 0;                                                                \
            for (int c = 0; c < nchunks; c++) { /* each chunk's run in the block */                         \
                const I *ix = (const I *)m->idx[c];                                                         \
                const int64_t length = len[c];                                                              \
                int64_t p = pos[c];                                                                         \
                while (p < length && ix[p] < hi) p++;                                                       \
                end[c] = p;                                                                                 \
                received += p - pos[c];                                                                     \
            }                                                                                               \
            if (mode == MASK_STALE)                                                                         \
                for (int64_t w = 0; w < nwords; w++) stale += __builtin_popcountll(words[w]);               \
            if (mode != MASK_ALL && received + stale == 0) continue; /* nothing stale, nothing received */  \
            /* at most received + stale of its groups to touch: in place when that is a small share */      \
            const int in_place = written_in_place(mode, received, stale, size);                             \
            T *t = in_place ? dense + lo : scratch;                                                         \
            if (in_place && !prefetching) /* (else its lines were fetched PREFETCH_BLOCKS blocks ago) */    \
                prefetch_lines_##T##_##I(m, dense, lo, words, nwords, mode, pos, end);                      \
            if (in_place && mode == MASK_STALE)                                                             \
                for (int64_t w = 0; w < nwords; w++)                                                        \
                    for (uint64_t bits = words[w]; bits; bits &= bits - 1) {                                \
                        int64_t from = (w * 64 + __builtin_ctzll(bits)) * GROUP;                            \
                        if (from + GROUP <= size)                                                           \
                            memset(t + from, 0, GROUP * sizeof(T));                                         \
                        else                                                                                \
                            for (int64_t j = from; j < size; j++) t[j] = (T)0;                              \
                    }                                                                                       \
            int64_t touched = 0;                                                                            \
            for (int c = 0; c < nchunks; c++) {                                                             \
                const I *ix = (const I *)m->idx[c];                                                         \
                const T *values = (const T *)m->val[c];                                                     \
                const int64_t from = pos[c], to = end[c];                                                   \
                if (in_place || keep_sign)                                                                  \
                    for (int64_t p = from; p < to; p++) {                                                   \
                        int64_t j = (int64_t)ix[p] - lo;                                                    \
                        int first = !seen[j];                                                               \
                        seen[j] = 1;                                                                        \
                        list[touched] = (uint16_t)j;                                                        \
                        touched += first;                                                                   \
                        t[j] = (first ? start : t[j]) + values[p];                                          \
                        marks[j / GROUP] = 1;                                                               \
                    }                                                                                       \
                else /* the scratch is zero: +0.0 is there to start from */                                 \
                    for (int64_t p = from; p < to; p++) {                                                   \
                        int64_t j = (int64_t)ix[p] - lo;                                                    \
                        t[j] += values[p];                                                                  \
                        marks[j / GROUP] = 1;                                                               \
                    }                                                                                       \
                pos[c] = to;                                                                                \
            }                                                                                               \
            for (int64_t i = 0; i < touched; i++) {                                                         \
                int64_t j = list[i];                                                                        \
                seen[j] = 0;                                                                                \
                if (in_place) {                                                                             \
                    T x = divide ? (scale ? t[j] * inverse : t[j] / d) : t[j];                              \
                    t[j] = x;                                                                               \
                    nz += x != (T)0;                                                                        \
                }                                                                                           \
            }                                                                                               \
            if (!in_place) nz += FINISH(T, dense + lo, scratch, size, divide, scale, d, inverse);           \
            for (int64_t w = 0; w < nwords; w++) words[w] = group_bits(marks + w * 64);                     \
        }                                                                                                   \
        STREAM_FENCE();                                                                                     \
        return nz;                                                                                          \
    }

AVERAGE_BODY(float, int32_t)
AVERAGE_BODY(float, int64_t)
AVERAGE_BODY(double, int32_t)
AVERAGE_BODY(double, int64_t)


/* average_blocks: the average of one chunk made of whole blocks, written as merge_average writes it.
 * Block `ids[b]` (strictly increasing, each below ceil(n / size)) covers elements [ids[b] * size,
 * ids[b] * size + size) clipped to n; its values are values[b * size + j] (those past n ignored). Every
 * covered element becomes (start + value) / divisor, everything else is zero afterwards (mode: as
 * merge_average's, the stale groups zeroed first), the mask is rewritten with the covered groups.
 * Returns the non-zero results. Cost: the covered elements and the stale groups, plus the mask. */
/* average_blocks fetches the stale groups STALE_AHEAD_WORDS mask words (1024 elements each) and the lines
 * of the block BLOCKS_AHEAD blocks before it writes them: otherwise each written line is waited for in
 * turn, as in merge_average's in-place blocks (the distances matter little within 1-4 words and 4-16
 * blocks). */
#define STALE_AHEAD_WORDS 2
#define BLOCKS_AHEAD 8
#define BLOCKS_BODY(T, I)                                                                                   \
    static int64_t average_blocks_##T##_##I(const I *ids, int64_t nblocks, int64_t size, const T *values,   \
                                            T *dense, int64_t n, double divisor, int keep_sign,             \
                                            uint64_t *mask, int mode) {                                     \
        const int64_t mask_words = ((n + GROUP - 1) / GROUP + 63) / 64;                                     \
        const int divide = divisor != 1.0, scale = is_power_of_two(divisor);                                \
        const T d = (T)divisor, inverse = (T)(1.0 / divisor), start = keep_sign ? -(T)0 : (T)0;             \
        int64_t nz = 0, done = 0; /* done: the elements below it are final (MASK_ALL) */                    \
        if (mode == MASK_STALE)                                                                             \
            for (int64_t w = 0; w < mask_words; w++) {                                                      \
                if (w + STALE_AHEAD_WORDS < mask_words) /* the stale lines some words on, fetched ahead */   \
                    for (uint64_t bits = mask[w + STALE_AHEAD_WORDS]; bits; bits &= bits - 1)               \
                        __builtin_prefetch(dense + ((w + STALE_AHEAD_WORDS) * 64 + __builtin_ctzll(bits)) * GROUP, \
                                           1, 3);                                                           \
                for (uint64_t bits = mask[w]; bits; bits &= bits - 1) {                                     \
                    int64_t from = (w * 64 + __builtin_ctzll(bits)) * GROUP;                                \
                    int64_t to = from + GROUP < n ? from + GROUP : n;                                       \
                    memset(dense + from, 0, (size_t)(to - from) * sizeof(T));                               \
                }                                                                                           \
            }                                                                                               \
        memset(mask, 0, (size_t)mask_words * sizeof(uint64_t));                                             \
        for (int64_t b = 0; b < nblocks; b++) {                                                             \
            if (mode != MASK_ALL && b + BLOCKS_AHEAD < nblocks) { /* the lines of a block some blocks on */ \
                const int64_t at = (int64_t)ids[b + BLOCKS_AHEAD] * size;                                   \
                const int64_t last = (at + size < n ? at + size : n) - 1;                                   \
                for (int64_t i = at; i <= last; i += 64 / (int64_t)sizeof(T)) __builtin_prefetch(dense + i, 1, 3); \
                __builtin_prefetch(dense + last, 1, 3);                                                     \
            }                                                                                               \
            const int64_t lo = (int64_t)ids[b] * size, hi = lo + size < n ? lo + size : n;                  \
            const T *v = values + b * size - lo;                                                            \
            if (mode == MASK_ALL) memset(dense + done, 0, (size_t)(lo - done) * sizeof(T));                 \
            for (int64_t i = lo; i < hi; i++) {                                                             \
                T x = start + v[i];                                                                         \
                if (divide) x = scale ? x * inverse : x / d;                                                \
                dense[i] = x;                                                                               \
                nz += x != (T)0;                                                                            \
            }                                                                                               \
            for (int64_t g = lo / GROUP; g <= (hi - 1) / GROUP; g++) mask[g / 64] |= UINT64_C(1) << (g % 64); \
            done = hi;                                                                                      \
        }                                                                                                   \
        if (mode == MASK_ALL) memset(dense + done, 0, (size_t)(n - done) * sizeof(T));                      \
        return nz;                                                                                          \
    }

BLOCKS_BODY(float, int32_t)
BLOCKS_BODY(float, int64_t)
BLOCKS_BODY(double, int32_t)
BLOCKS_BODY(double, int64_t)

/* 0 when the block ids are strictly increasing and each below `limit`, -1 when out of order, -2 when
 * one lies outside. */
static int check_blocks(const void *ids, int wide, int64_t nblocks, int64_t limit) {
    int64_t previous = -1;
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t id = wide ? ((const int64_t *)ids)[b] : (int64_t)((const int32_t *)ids)[b];
        if (id < 0 || id >= limit) return -2;
        if (id <= previous) return -1;
        previous = id;
    }
    return 0;
}

/* The count-sketch hashes of sparsecomm/selection/sketch.py: per row a bucket mixer and a sign mixer,
 * each x -> (x*a + b) & mask, x ^= x >> shift, x = (x*c) & mask, x ^= x >> shift (wrapping unsigned
 * arithmetic: the bits of torch's int64 operations on x < 2^62); bucket = mix(i) % cols, sign = +1 when
 * the sign mix is even, else -1. A mask below 2^32 takes 32-bit arithmetic (the same low bits) and a
 * division-free modulo. */
#define SKETCH_MAX_ROWS 64
typedef struct {
    int rows;
    uint64_t cols, fastmod; /* fastmod: 2^64 / cols rounded up, for x % cols with 32-bit x and cols */
    uint64_t mask;
    int shift;
    uint64_t a[2 * SKETCH_MAX_ROWS], b[2 * SKETCH_MAX_ROWS], c[2 * SKETCH_MAX_ROWS]; /* buckets, then signs */
} sketch_t;

static inline uint64_t sketch_mix(const sketch_t *s, int m, uint64_t x) {
    if (s->mask <= UINT32_MAX) {
        uint32_t y = ((uint32_t)x * (uint32_t)s->a[m] + (uint32_t)s->b[m]) & (uint32_t)s->mask;
        y ^= y >> s->shift;
        y = (y * (uint32_t)s->c[m]) & (uint32_t)s->mask;
        return y ^ (y >> s->shift);
    }
    x = (x * s->a[m] + s->b[m]) & s->mask;
    x ^= x >> s->shift;
    x = (x * s->c[m]) & s->mask;
    return x ^ (x >> s->shift);
}

static inline uint64_t sketch_bucket(const sketch_t *s, int row, uint64_t i) {
    uint64_t x = sketch_mix(s, row, i);
    if (s->mask <= UINT32_MAX && s->cols <= UINT32_MAX) /* Lemire's fastmod, exact for 32-bit x and cols */
        return (uint64_t)(((__uint128_t)(s->fastmod * x) * s->cols) >> 64);
    return x % s->cols;
}

/* The lower median of e[0..rows) as torch's median over a dimension gives it: a NaN if there is one
 * (the first), else the element at (rows - 1) / 2 of a stable sort by `<`. */
#define MEDIAN(T)                                                                                           \
    static inline T median_##T(T *e, int rows) {                                                            \
        for (int r = 0; r < rows; r++)                                                                      \
            if (e[r] != e[r]) return e[r];                                                                  \
        for (int r = 1; r < rows; r++) { /* insertion sort: stable */                                       \
            T x = e[r];                                                                                     \
            int q = r;                                                                                      \
            for (; q > 0 && x < e[q - 1]; q--) e[q] = e[q - 1];                                             \
            e[q] = x;                                                                                       \
        }                                                                                                   \
        return e[(rows - 1) / 2];                                                                           \
    }
MEDIAN(float)
MEDIAN(double)

/* The same lower median of three NaN-free values without a branch: a stable sort of three by `<` is the
 * bubble sort's three compare-and-swaps (swap only when strictly less: stable), each a pair of selects
 * the compiler makes conditional moves; the middle element, with the sign of its zero, is the one the
 * insertion sort leaves there. (The branches of the insertion sort, taken at random by the data, were
 * most of the query's time.) */
#define MEDIAN3(T)                                                                                          \
    static inline T median3_##T(T a, T b, T c) {                                                            \
        T lo = b < a ? b : a, hi = b < a ? a : b; /* (a, b) sorted, stable */                               \
        T mid = c < hi ? c : hi;                  /* (hi, c): the larger of them leaves for the end */      \
        return mid < lo ? lo : mid;               /* (lo, mid) sorted: the middle is the larger */          \
    }
MEDIAN3(float)
MEDIAN3(double)

/* sketch_insert: table[r * cols + bucket_r(idx[p])] += values[p] * sign_r(idx[p]), row by row, p in
 * order (torch's index_add_ of values * signs, row after row). With `lanes` 16 (AVX-512) or 8 (AVX2) the
 * buckets and signs of that many indices are hashed at once (hash16, hash8), and the additions stay one
 * by one, in order; 0 hashes one by one. */
#define INSERT_BODY(T, I)                                                                                   \
    static void sketch_insert_##T##_##I(const sketch_t *s, const I *idx, const T *values, int64_t m,        \
                                        T *table, int lanes) {                                              \
        for (int r = 0; r < s->rows; r++) {                                                                 \
            T *row = table + (int64_t)r * (int64_t)s->cols;                                                 \
            int64_t p = HASH_LANES(lanes, s, idx, values, m, r, row);                                       \
            for (; p < m; p++) {                                                                            \
                uint64_t i = (uint64_t)idx[p];                                                              \
                T sign = (sketch_mix(s, s->rows + r, i) & 1) ? (T)-1 : (T)1;                                \
                row[sketch_bucket(s, r, i)] += values[p] * sign;                                            \
            }                                                                                               \
        }                                                                                                   \
    }

/* The query of one element i (CountSketch.query): the median over the rows of sign_r(i) * table[r, bucket_r(i)]. */
#define QUERY_ONE(T)                                                                                        \
    static inline T query_one_##T(const sketch_t *s, uint64_t i, const T *table) {                          \
        T e[SKETCH_MAX_ROWS];                                                                               \
        for (int r = 0; r < s->rows; r++) {                                                                 \
            T sign = (sketch_mix(s, s->rows + r, i) & 1) ? (T)-1 : (T)1;                                    \
            e[r] = table[(int64_t)r * (int64_t)s->cols + (int64_t)sketch_bucket(s, r, i)] * sign;           \
        }                                                                                                   \
        if (s->rows == 1) return e[0];                                                                      \
        if (s->rows == 3 && e[0] == e[0] && e[1] == e[1] && e[2] == e[2]) return median3_##T(e[0], e[1], e[2]); \
        return median_##T(e, s->rows);                                                                      \
    }
QUERY_ONE(float)
QUERY_ONE(double)

#if MERGE_HAVE_SIMD
static int use_avx512 = 0; /* set at import: AVX512F and AVX512DQ */

/* 16 lanes of one mixer (32-bit keys: a mask below 2^32). */
__attribute__((target("avx512f,avx512dq"))) static inline __m512i mix16(const sketch_t *s, int m, __m512i x) {
    const __m512i mask = _mm512_set1_epi32((int)(uint32_t)s->mask);
    const __m128i shift = _mm_cvtsi32_si128(s->shift);
    __m512i y = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)(uint32_t)s->a[m]));
    y = _mm512_and_si512(_mm512_add_epi32(y, _mm512_set1_epi32((int)(uint32_t)s->b[m])), mask);
    y = _mm512_xor_si512(y, _mm512_srl_epi32(y, shift));
    y = _mm512_and_si512(_mm512_mullo_epi32(y, _mm512_set1_epi32((int)(uint32_t)s->c[m])), mask);
    return _mm512_xor_si512(y, _mm512_srl_epi32(y, shift));
}

/* 8 lanes of x % cols for 32-bit x and cols below 2^31: the quotient by a double multiply, corrected by
 * one either way (the remainder is an exact integer in double). */
__attribute__((target("avx512f,avx512dq"))) static inline __m256i mod8(__m256i x, __m512d cols, __m512d inverse) {
    const __m512d xd = _mm512_cvtepu32_pd(x);
    const __m512d q = _mm512_roundscale_pd(_mm512_mul_pd(xd, inverse), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(q, cols, xd);
    r = _mm512_mask_add_pd(r, _mm512_cmp_pd_mask(r, _mm512_setzero_pd(), _CMP_LT_OQ), r, cols);
    r = _mm512_mask_sub_pd(r, _mm512_cmp_pd_mask(r, cols, _CMP_GE_OQ), r, cols);
    return _mm512_cvttpd_epi32(r);
}

/* Row r's buckets of the sixteen indices i (returned) and the lanes whose sign is -1 (*negative). */
__attribute__((target("avx512f,avx512dq"))) static inline __m512i hash16(const sketch_t *s, int r, __m512i i,
                                                                        __mmask16 *negative) {
    const __m512d cols = _mm512_set1_pd((double)s->cols), inverse = _mm512_set1_pd(1.0 / (double)s->cols);
    const __m512i h = mix16(s, r, i);
    *negative = _mm512_test_epi32_mask(mix16(s, s->rows + r, i), _mm512_set1_epi32(1));
    return _mm512_inserti64x4(_mm512_castsi256_si512(mod8(_mm512_castsi512_si256(h), cols, inverse)),
                              mod8(_mm512_extracti64x4_epi64(h, 1), cols, inverse), 1);
}

/* The estimates of the 16 elements i0 .. i0 + 15 of a three-row float sketch with 32-bit keys into out;
 * returns 0 (nothing written) when one of them reads a NaN, which the scalar median handles. The same
 * bits as query_one_float: the buckets are the same integers, a sign of -1 multiplies exactly as the
 * sign bit flips (NaN aside), and the median is median3's compare-and-swaps as masked blends. */
__attribute__((target("avx512f,avx512dq"))) static int query16_float3(const sketch_t *s, uint32_t i0,
                                                                        const float *table, float *out) {
    const __m512i i = _mm512_add_epi32(_mm512_set1_epi32((int)i0),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i sign_bit = _mm512_set1_epi32((int)0x80000000u);
    __m512 e[3];
    for (int r = 0; r < 3; r++) {
        __mmask16 negative;
        const __m512i bucket = hash16(s, r, i, &negative);
        const __m512 v = _mm512_i32gather_ps(bucket, table + (int64_t)r * (int64_t)s->cols, 4);
        e[r] = _mm512_castsi512_ps(_mm512_mask_xor_epi32(_mm512_castps_si512(v), negative, _mm512_castps_si512(v),
                                                         sign_bit));
        if (_mm512_cmp_ps_mask(e[r], e[r], _CMP_UNORD_Q)) return 0;
    }
    const __mmask16 swap_ab = _mm512_cmp_ps_mask(e[1], e[0], _CMP_LT_OQ);
    const __m512 lo = _mm512_mask_blend_ps(swap_ab, e[0], e[1]), hi = _mm512_mask_blend_ps(swap_ab, e[1], e[0]);
    const __m512 mid = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(e[2], hi, _CMP_LT_OQ), hi, e[2]);
    _mm512_storeu_ps(out, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mid, lo, _CMP_LT_OQ), mid, lo));
    return 1;
}

/* Sixteen indices as 32-bit lanes (they are below the 32-bit mask). */
__attribute__((target("avx512f"))) static inline __m512i load16_int32_t(const int32_t *idx) {
    return _mm512_loadu_si512((const void *)idx);
}
__attribute__((target("avx512f"))) static inline __m512i load16_int64_t(const int64_t *idx) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(_mm512_loadu_si512((const void *)idx))),
                              _mm512_cvtepi64_epi32(_mm512_loadu_si512((const void *)(idx + 8))), 1);
}

/* The AVX2 counterparts of mix16, mod8, hash16 and query16_float3: eight lanes, the same integers and
 * bits (x % cols exact, as mod8_avx2 shows). */
__attribute__((target("avx2"))) static inline __m256i mix8(const sketch_t *s, int m, __m256i x) {
    const __m256i mask = _mm256_set1_epi32((int)(uint32_t)s->mask);
    const __m128i shift = _mm_cvtsi32_si128(s->shift);
    __m256i y = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)(uint32_t)s->a[m]));
    y = _mm256_and_si256(_mm256_add_epi32(y, _mm256_set1_epi32((int)(uint32_t)s->b[m])), mask);
    y = _mm256_xor_si256(y, _mm256_srl_epi32(y, shift));
    y = _mm256_and_si256(_mm256_mullo_epi32(y, _mm256_set1_epi32((int)(uint32_t)s->c[m])), mask);
    return _mm256_xor_si256(y, _mm256_srl_epi32(y, shift));
}

/* 8 lanes of x % cols for 32-bit unsigned x and 2 <= cols < 2^31. In double, x * fl(1 / cols) lies within
 * 2^-52 relative of x / cols, while a quotient that is not an integer is at least 1 / x >= 2^-32 relative
 * from the next one: its truncation q is the quotient, or one less where x is a multiple of cols. So
 * x - q * cols (32 bits) is the remainder or the remainder plus cols; the unsigned minimum with itself
 * minus cols is the remainder. (x enters the conversion as signed after flipping its top bit, plus 2^31.) */
__attribute__((target("avx2"))) static inline __m256i mod8_avx2(__m256i x, __m256i cols, __m256d inverse) {
    const __m256d two31 = _mm256_set1_pd(2147483648.0);
    const __m256i flipped = _mm256_xor_si256(x, _mm256_set1_epi32((int)0x80000000u));
    const __m256d lo = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(flipped)), two31);
    const __m256d hi = _mm256_add_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(flipped, 1)), two31);
    const __m256i q = _mm256_set_m128i(_mm256_cvttpd_epi32(_mm256_mul_pd(hi, inverse)),
                                       _mm256_cvttpd_epi32(_mm256_mul_pd(lo, inverse)));
    const __m256i r = _mm256_sub_epi32(x, _mm256_mullo_epi32(q, cols));
    return _mm256_min_epu32(r, _mm256_sub_epi32(r, cols));
}

/* Row r's buckets of the eight indices i (returned) and, per lane, the sign bit to flip (*flip). */
__attribute__((target("avx2"))) static inline __m256i hash8(const sketch_t *s, int r, __m256i i, __m256i *flip) {
    *flip = _mm256_slli_epi32(mix8(s, s->rows + r, i), 31);
    return mod8_avx2(mix8(s, r, i), _mm256_set1_epi32((int)s->cols), _mm256_set1_pd(1.0 / (double)s->cols));
}

/* query16_float3 in eight lanes: the estimates of i0 .. i0 + 7; 0 (nothing written) on a NaN. */
__attribute__((target("avx2"))) static int query8_float3(const sketch_t *s, uint32_t i0, const float *table,
                                                          float *out) {
    const __m256i i = _mm256_add_epi32(_mm256_set1_epi32((int)i0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 e[3];
    for (int r = 0; r < 3; r++) {
        __m256i flip;
        const __m256i bucket = hash8(s, r, i, &flip);
        const __m256 v = _mm256_i32gather_ps(table + (int64_t)r * (int64_t)s->cols, bucket, 4);
        e[r] = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(v), flip));
        if (_mm256_movemask_ps(_mm256_cmp_ps(e[r], e[r], _CMP_UNORD_Q))) return 0;
    }
    const __m256 swap_ab = _mm256_cmp_ps(e[1], e[0], _CMP_LT_OQ);
    const __m256 lo = _mm256_blendv_ps(e[0], e[1], swap_ab), hi = _mm256_blendv_ps(e[1], e[0], swap_ab);
    const __m256 mid = _mm256_blendv_ps(hi, e[2], _mm256_cmp_ps(e[2], hi, _CMP_LT_OQ));
    _mm256_storeu_ps(out, _mm256_blendv_ps(mid, lo, _mm256_cmp_ps(mid, lo, _CMP_LT_OQ)));
    return 1;
}

__attribute__((target("avx2"))) static inline __m256i load8_int32_t(const int32_t *idx) {
    return _mm256_loadu_si256((const __m256i *)(const void *)idx);
}
__attribute__((target("avx2"))) static inline __m256i load8_int64_t(const int64_t *idx) {
    /* the low halves of eight int64 (below 2^32): even 32-bit words of two vectors, in order */
    const __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)idx);
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(const void *)(idx + 4));
    const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    return _mm256_permute2x128_si256(_mm256_permutevar8x32_epi32(lo, even), _mm256_permutevar8x32_epi32(hi, even),
                                     0x20);
}

/* The first m - m % 8 insertions of row r, hashed eight at a time; returns how many were made. */
#define INSERT8(T, I)                                                                                       \
    __attribute__((target("avx2"))) static int64_t insert8_##T##_##I(const sketch_t *s, const I *idx,        \
                                                                     const T *values, int64_t m, int r, T *row) { \
        int32_t buckets[8], flips[8];                                                                       \
        int64_t p = 0;                                                                                      \
        for (; p + 8 <= m; p += 8) {                                                                        \
            __m256i flip;                                                                                   \
            _mm256_storeu_si256((__m256i *)(void *)buckets, hash8(s, r, load8_##I(idx + p), &flip));        \
            _mm256_storeu_si256((__m256i *)(void *)flips, flip);                                            \
            for (int l = 0; l < 8; l++) row[buckets[l]] += values[p + l] * (flips[l] ? (T)-1 : (T)1);        \
        }                                                                                                   \
        return p;                                                                                           \
    }
INSERT8(float, int32_t)
INSERT8(float, int64_t)
INSERT8(double, int32_t)
INSERT8(double, int64_t)

/* The first m - m % 16 insertions of row r, hashed sixteen at a time; returns how many were made. */
#define INSERT16(T, I)                                                                                      \
    __attribute__((target("avx512f,avx512dq"))) static int64_t insert16_##T##_##I(                          \
        const sketch_t *s, const I *idx, const T *values, int64_t m, int r, T *row) {                       \
        int32_t buckets[16];                                                                                \
        int64_t p = 0;                                                                                      \
        for (; p + 16 <= m; p += 16) {                                                                      \
            __mmask16 negative;                                                                             \
            _mm512_storeu_si512((void *)buckets, hash16(s, r, load16_##I(idx + p), &negative));             \
            for (int l = 0; l < 16; l++)                                                                    \
                row[buckets[l]] += values[p + l] * ((negative >> l) & 1 ? (T)-1 : (T)1);                    \
        }                                                                                                   \
        return p;                                                                                           \
    }
INSERT16(float, int32_t)
INSERT16(float, int64_t)
INSERT16(double, int32_t)
INSERT16(double, int64_t)
#endif

/* The vector lanes apply to 32-bit keys (a mask below 2^32) and 2 to 2^31 - 1 columns (with one, every
 * bucket is 0: one by one); the query's also to three rows of floats. `lanes`: 16 (AVX-512), 8 (AVX2) or
 * 0 (one by one), from the variant. */
#define SKETCH_LANES_APPLY(s) ((s)->mask <= UINT32_MAX && (s)->cols >= 2 && (s)->cols < (UINT64_C(1) << 31))
#if MERGE_HAVE_SIMD
#define SKETCH_PICK(F, idx, values)                                                                         \
    _Generic((values), const float *: _Generic((idx), const int32_t *: F##_float_int32_t, default: F##_float_int64_t), \
             default: _Generic((idx), const int32_t *: F##_double_int32_t, default: F##_double_int64_t))
#define HASH_LANES(lanes, s, idx, values, m, r, row)                                                        \
    (!SKETCH_LANES_APPLY(s) ? 0                                                                             \
     : (lanes) == 16        ? SKETCH_PICK(insert16, idx, values)(s, idx, values, m, r, row)                 \
     : (lanes) == 8         ? SKETCH_PICK(insert8, idx, values)(s, idx, values, m, r, row)                  \
                            : 0)
#define QUERY_LANES(lanes, s, i0, table, out)                                                               \
    ((lanes) == 16 ? query16_float3((s), (uint32_t)(i0), (const float *)(table), (float *)(out))            \
                   : query8_float3((s), (uint32_t)(i0), (const float *)(table), (float *)(out)))
#else
#define HASH_LANES(lanes, s, idx, values, m, r, row) 0
#define QUERY_LANES(lanes, s, i0, table, out) 0
#endif

/* sketch_query_blocks: out[b * size + j] = the median over the rows of sign_r(i) * table[r, bucket_r(i)]
 * for element i = ids[b] * size + j below n (the query of CountSketch.query); past n, 0. `lanes` elements
 * at a time (query16_float3, query8_float3) where they apply, else one by one. */
#define QUERY_BODY(T, I)                                                                                    \
    static void sketch_query_##T##_##I(const sketch_t *s, const I *ids, int64_t nblocks, int64_t size,      \
                                       int64_t n, const T *table, T *out, int lanes) {                      \
        if (sizeof(T) != sizeof(float) || s->rows != 3 || !SKETCH_LANES_APPLY(s)) lanes = 0;                \
        for (int64_t b = 0; b < nblocks; b++) {                                                             \
            const int64_t lo = (int64_t)ids[b] * size;                                                      \
            int64_t j = 0;                                                                                  \
            if (lanes)                                                                                      \
                for (; j + lanes <= size && lo + j + lanes <= n; j += lanes)                                \
                    if (!QUERY_LANES(lanes, s, lo + j, table, out + b * size + j))                          \
                        for (int64_t q = j; q < j + lanes; q++)                                             \
                            out[b * size + q] = query_one_##T(s, (uint64_t)(lo + q), table);               \
            for (; j < size; j++)                                                                           \
                out[b * size + j] = lo + j < n ? query_one_##T(s, (uint64_t)(lo + j), table) : (T)0;        \
        }                                                                                                   \
    }
INSERT_BODY(float, int32_t)
INSERT_BODY(float, int64_t)
INSERT_BODY(double, int32_t)
INSERT_BODY(double, int64_t)
QUERY_BODY(float, int32_t)
QUERY_BODY(float, int64_t)
QUERY_BODY(double, int32_t)
QUERY_BODY(double, int64_t)

/* Reads (cols, mask, shift, a, b, c) with a, b, c sequences of 2 * rows keys (bucket mixers, then sign
 * mixers). */
static int read_sketch(sketch_t *s, long long cols, unsigned long long mask, int shift, PyObject *a, PyObject *b,
                       PyObject *c) {
    Py_ssize_t count = PySequence_Size(a);
    if (count < 0) return -1;
    if (count < 2 || count % 2 || count > 2 * SKETCH_MAX_ROWS || PySequence_Size(b) != count ||
        PySequence_Size(c) != count || cols < 1 || shift < 1 || shift > 63 || mask >= (UINT64_C(1) << 62)) {
        PyErr_SetString(PyExc_ValueError, "sketch: bad keys, columns, mask or shift");
        return -1;
    }
    s->rows = (int)(count / 2);
    s->cols = (uint64_t)cols;
    s->fastmod = UINT64_MAX / s->cols + 1;
    s->mask = mask;
    s->shift = shift;
    PyObject *lists[3] = {a, b, c};
    uint64_t *keys[3] = {s->a, s->b, s->c};
    for (int k = 0; k < 3; k++)
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *item = PySequence_GetItem(lists[k], i);
            if (item == NULL) return -1;
            keys[k][i] = PyLong_AsUnsignedLongLong(item);
            Py_DECREF(item);
            if (PyErr_Occurred()) return -1;
        }
    return 0;
}

/* Reads the chunk pointers and lengths: three sequences of equal length (at most MERGE_MAX_CHUNKS). */
static int read_chunks(merge_t *m, PyObject *idx_ptrs, PyObject *val_ptrs, PyObject *lens, int wide_index) {
    Py_ssize_t count = PySequence_Size(idx_ptrs);
    if (count < 0) return -1;
    if (count > MERGE_MAX_CHUNKS || PySequence_Size(val_ptrs) != count || PySequence_Size(lens) != count) {
        PyErr_Format(PyExc_ValueError, "merge: need equally long pointer and length lists of at most %d chunks",
                     MERGE_MAX_CHUNKS);
        return -1;
    }
    m->nchunks = (int)count;
    m->wide_index = wide_index;
    for (Py_ssize_t c = 0; c < count; c++) {
        PyObject *a = PySequence_GetItem(idx_ptrs, c), *b = PySequence_GetItem(val_ptrs, c),
                 *l = PySequence_GetItem(lens, c);
        if (a == NULL || b == NULL || l == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_XDECREF(l);
            return -1;
        }
        m->idx[c] = (const void *)(uintptr_t)PyLong_AsUnsignedLongLong(a);
        m->val[c] = (const void *)(uintptr_t)PyLong_AsUnsignedLongLong(b);
        m->len[c] = (int64_t)PyLong_AsLongLong(l);
        Py_DECREF(a);
        Py_DECREF(b);
        Py_DECREF(l);
        if (PyErr_Occurred()) return -1;
        if (m->len[c] < 0) {
            PyErr_SetString(PyExc_ValueError, "merge: chunk lengths must be >= 0");
            return -1;
        }
    }
    return 0;
}

/* merge_sum(idx_ptrs, val_ptrs, lens, wide_index, double, out_idx_ptr, out_val_ptr) -> count
 * The outputs must hold sum(lens) entries. */
static PyObject *merge_sum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *idx_ptrs, *val_ptrs, *lens;
    int wide_index, wide_value;
    unsigned long long out_idx, out_val;
    if (!PyArg_ParseTuple(args, "OOOppKK", &idx_ptrs, &val_ptrs, &lens, &wide_index, &wide_value, &out_idx,
                          &out_val))
        return NULL;
    merge_t *m = malloc(sizeof(merge_t));
    if (m == NULL) return PyErr_NoMemory();
    if (read_chunks(m, idx_ptrs, val_ptrs, lens, wide_index) < 0) {
        free(m);
        return NULL;
    }
    int64_t count;
    Py_BEGIN_ALLOW_THREADS
    count = check_chunks(m, -1);
    if (count == 0 && wide_value)
        count = merge_sum_double(m, (void *)(uintptr_t)out_idx, (double *)(uintptr_t)out_val);
    else if (count == 0)
        count = merge_sum_float(m, (void *)(uintptr_t)out_idx, (float *)(uintptr_t)out_val);
    Py_END_ALLOW_THREADS
    free(m);
    return PyLong_FromLongLong((long long)count);
}

/* merge_average(idx_ptrs, val_ptrs, lens, wide_index, wide_value, dense_ptr, n, divisor, negative_start,
 *               mask_ptr, mode) -> (status, nonzero)
 * dense must hold n elements, mask ((n + 15) / 16 + 63) / 64 words: the stale groups on entry (mode 1),
 * zeros otherwise; the groups written on exit. status: 0, or -1 (a chunk out of order) or -2 (an index
 * out of range), with nothing written. */
static PyObject *merge_average(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *idx_ptrs, *val_ptrs, *lens;
    int wide_index, wide_value, negative_start, mode;
    unsigned long long dense, mask;
    long long n;
    double divisor;
    if (!PyArg_ParseTuple(args, "OOOppKLdpKi", &idx_ptrs, &val_ptrs, &lens, &wide_index, &wide_value, &dense, &n,
                          &divisor, &negative_start, &mask, &mode))
        return NULL;
    if (mode < MASK_CLEAN || mode > MASK_ALL || n < 0 || !(divisor > 0)) {
        PyErr_SetString(PyExc_ValueError, "merge_average: bad mode, length or divisor");
        return NULL;
    }
    merge_t *m = malloc(sizeof(merge_t));
    const size_t scratch_bytes = BLOCK * (wide_value ? sizeof(double) : sizeof(float));
    char *scratch_memory = calloc(scratch_bytes + PAGE, 1);
    block_t *b = calloc(1, sizeof(block_t));
    if (m == NULL || scratch_memory == NULL || b == NULL) {
        free(m);
        free(scratch_memory);
        free(b);
        return PyErr_NoMemory();
    }
    if (read_chunks(m, idx_ptrs, val_ptrs, lens, wide_index) < 0) {
        free(m);
        free(scratch_memory);
        free(b);
        return NULL;
    }
    void *scratch = scratch_memory + half_page_away(scratch_memory, (const void *)(uintptr_t)dense);
    int64_t status, nonzero = 0;
    Py_BEGIN_ALLOW_THREADS
    status = check_chunks(m, n);
    if (status == 0) {
        uint64_t *words = (uint64_t *)(uintptr_t)mask;
        if (wide_value) {
            double *vector = (double *)(uintptr_t)dense;
            nonzero = wide_index ? merge_average_double_int64_t(m, vector, n, divisor, negative_start, words, mode,
                                                                (double *)scratch, b)
                                 : merge_average_double_int32_t(m, vector, n, divisor, negative_start, words, mode,
                                                                (double *)scratch, b);
        } else {
            float *vector = (float *)(uintptr_t)dense;
            nonzero = wide_index ? merge_average_float_int64_t(m, vector, n, divisor, negative_start, words, mode,
                                                               (float *)scratch, b)
                                 : merge_average_float_int32_t(m, vector, n, divisor, negative_start, words, mode,
                                                               (float *)scratch, b);
        }
    }
    Py_END_ALLOW_THREADS
    free(m);
    free(scratch_memory);
    free(b);
    return Py_BuildValue("LL", (long long)status, (long long)nonzero);
}

/* average_blocks(ids_ptr, nblocks, wide_index, size, values_ptr, wide_value, dense_ptr, n, divisor,
 *                negative_start, mask_ptr, mode) -> (status, nonzero); status -1: ids out of order, -2: an
 * id out of range, with nothing written. */
static PyObject *average_blocks(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ids, values, dense, mask;
    long long nblocks, size, n;
    int wide_index, wide_value, negative_start, mode;
    double divisor;
    if (!PyArg_ParseTuple(args, "KLpLKpKLdpKi", &ids, &nblocks, &wide_index, &size, &values, &wide_value, &dense,
                          &n, &divisor, &negative_start, &mask, &mode))
        return NULL;
    if (mode < MASK_CLEAN || mode > MASK_ALL || n < 0 || nblocks < 0 || size < 1 || !(divisor > 0)) {
        PyErr_SetString(PyExc_ValueError, "average_blocks: bad mode, length, block size or divisor");
        return NULL;
    }
    int64_t status, nonzero = 0;
    const void *id = (const void *)(uintptr_t)ids;
    uint64_t *words = (uint64_t *)(uintptr_t)mask;
    Py_BEGIN_ALLOW_THREADS
    status = check_blocks(id, wide_index, nblocks, (n + size - 1) / size);
    if (status == 0) {
        if (wide_value)
            nonzero = wide_index ? average_blocks_double_int64_t(id, nblocks, size, (const double *)(uintptr_t)values,
                                                                 (double *)(uintptr_t)dense, n, divisor,
                                                                 negative_start, words, mode)
                                 : average_blocks_double_int32_t(id, nblocks, size, (const double *)(uintptr_t)values,
                                                                 (double *)(uintptr_t)dense, n, divisor,
                                                                 negative_start, words, mode);
        else
            nonzero = wide_index ? average_blocks_float_int64_t(id, nblocks, size, (const float *)(uintptr_t)values,
                                                                (float *)(uintptr_t)dense, n, divisor, negative_start,
                                                                words, mode)
                                 : average_blocks_float_int32_t(id, nblocks, size, (const float *)(uintptr_t)values,
                                                                (float *)(uintptr_t)dense, n, divisor, negative_start,
                                                                words, mode);
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("LL", (long long)status, (long long)nonzero);
}

/* sketch_insert(cols, mask, shift, a, b, c, idx_ptr, m, wide_index, values_ptr, wide_value, table_ptr, variant)
 * sketch_query_blocks(cols, mask, shift, a, b, c, ids_ptr, nblocks, wide_index, size, n, table_ptr,
 *                     wide_value, out_ptr, variant)
 * The indices (block ids) must lie in [0, n) ([0, ceil(n / size))): the caller checks. `variant`
 * ("avx512", "avx2" or "scalar", one of sketch_variants()) picks the lanes; all give the same bits. */
static int sketch_lanes(const char *variant) {
    if (strcmp(variant, "scalar") == 0) return 0;
#if MERGE_HAVE_SIMD
    if (strcmp(variant, "avx2") == 0 && use_avx2) return 8;
    if (strcmp(variant, "avx512") == 0 && use_avx512) return 16;
#endif
    PyErr_Format(PyExc_ValueError, "sketch: variant %R does not run here (see sketch_variants())", variant);
    return -1;
}

static PyObject *sketch_variants(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#if MERGE_HAVE_SIMD
    if (use_avx512) return Py_BuildValue("[sss]", "avx512", "avx2", "scalar");
    if (use_avx2) return Py_BuildValue("[ss]", "avx2", "scalar");
#endif
    return Py_BuildValue("[s]", "scalar");
}

static PyObject *sketch_insert(PyObject *self, PyObject *args) {
    (void)self;
    long long cols, m;
    unsigned long long mask, idx, values, table;
    int shift, wide_index, wide_value;
    PyObject *a, *b, *c;
    sketch_t s;
    const char *variant;
    int lanes;
    if (!PyArg_ParseTuple(args, "LKiOOOKLpKpKs", &cols, &mask, &shift, &a, &b, &c, &idx, &m, &wide_index, &values,
                          &wide_value, &table, &variant) ||
        read_sketch(&s, cols, mask, shift, a, b, c) < 0 || (lanes = sketch_lanes(variant)) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (wide_value && wide_index)
        sketch_insert_double_int64_t(&s, (const int64_t *)(uintptr_t)idx, (const double *)(uintptr_t)values, m,
                                     (double *)(uintptr_t)table, lanes);
    else if (wide_value)
        sketch_insert_double_int32_t(&s, (const int32_t *)(uintptr_t)idx, (const double *)(uintptr_t)values, m,
                                     (double *)(uintptr_t)table, lanes);
    else if (wide_index)
        sketch_insert_float_int64_t(&s, (const int64_t *)(uintptr_t)idx, (const float *)(uintptr_t)values, m,
                                    (float *)(uintptr_t)table, lanes);
    else
        sketch_insert_float_int32_t(&s, (const int32_t *)(uintptr_t)idx, (const float *)(uintptr_t)values, m,
                                    (float *)(uintptr_t)table, lanes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *sketch_query_blocks(PyObject *self, PyObject *args) {
    (void)self;
    long long cols, nblocks, size, n;
    unsigned long long mask, ids, table, out;
    int shift, wide_index, wide_value;
    PyObject *a, *b, *c;
    sketch_t s;
    const char *variant;
    int lanes;
    if (!PyArg_ParseTuple(args, "LKiOOOKLpLLKpKs", &cols, &mask, &shift, &a, &b, &c, &ids, &nblocks, &wide_index,
                          &size, &n, &table, &wide_value, &out, &variant) ||
        read_sketch(&s, cols, mask, shift, a, b, c) < 0 || (lanes = sketch_lanes(variant)) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (wide_value && wide_index)
        sketch_query_double_int64_t(&s, (const int64_t *)(uintptr_t)ids, nblocks, size, n,
                                    (const double *)(uintptr_t)table, (double *)(uintptr_t)out, lanes);
    else if (wide_value)
        sketch_query_double_int32_t(&s, (const int32_t *)(uintptr_t)ids, nblocks, size, n,
                                    (const double *)(uintptr_t)table, (double *)(uintptr_t)out, lanes);
    else if (wide_index)
        sketch_query_float_int64_t(&s, (const int64_t *)(uintptr_t)ids, nblocks, size, n,
                                   (const float *)(uintptr_t)table, (float *)(uintptr_t)out, lanes);
    else
        sketch_query_float_int32_t(&s, (const int32_t *)(uintptr_t)ids, nblocks, size, n,
                                   (const float *)(uintptr_t)table, (float *)(uintptr_t)out, lanes);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* members(a_ptr, na, wide_a, b_ptr, nb, wide_b, out_ptr) -> status: out[i] = 1 where a[i] occurs in b, else 0
 * (bytes), for a and b each in non-decreasing order (int32 or int64 each): one two-pointer walk over both,
 * O(na + nb) sequential reads (a binary search per element of a reads b at random). Returns 0, or -1 when a
 * is out of order (out then undefined: the caller's binary search takes a in any order). b's order is the
 * caller's promise, which neither way could do without. */
static inline int64_t element_at(const void *p, int wide, int64_t i) {
    return wide ? ((const int64_t *)p)[i] : (int64_t)((const int32_t *)p)[i];
}

static PyObject *members(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long a_ptr, b_ptr, out_ptr;
    long long na, nb;
    int wide_a, wide_b;
    if (!PyArg_ParseTuple(args, "KLpKLpK", &a_ptr, &na, &wide_a, &b_ptr, &nb, &wide_b, &out_ptr)) return NULL;
    const void *a = (const void *)(uintptr_t)a_ptr, *b = (const void *)(uintptr_t)b_ptr;
    uint8_t *out = (uint8_t *)(uintptr_t)out_ptr;
    int status = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t j = 0, previous = INT64_MIN;
    for (int64_t i = 0; i < na && status == 0; i++) {
        const int64_t x = element_at(a, wide_a, i);
        if (x < previous) status = -1;
        previous = x;
        while (j < nb && element_at(b, wide_b, j) < x) j++;
        out[i] = j < nb && element_at(b, wide_b, j) == x;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* Bit j set where byte j of w (little-endian) is not zero: the high bit of each byte set where the byte
 * is not zero (its low seven bits added to 0x7f carry into it), then the eight high bits gathered into
 * the top byte by one multiplication. */
static inline uint64_t nonzero_bytes8(uint64_t w) {
    const uint64_t low7 = UINT64_C(0x7f7f7f7f7f7f7f7f);
    const uint64_t high = (((w & low7) + low7) | w) & ~low7;
    return (high >> 7) * UINT64_C(0x0102040810204080) >> 56;
}

/* Bit l set where entry l of the 64 bytes at p (64 entries of 1 byte, or 16 of 4) is not zero. */
static inline uint64_t nonzero_mask64(const unsigned char *p, int itemsize) {
    uint64_t mask = 0;
    for (int j = 0; j < 8; j++) {
        uint64_t w;
        memcpy(&w, p + 8 * j, 8);
        mask |= itemsize == 1 ? nonzero_bytes8(w) << (8 * j)
                              : ((uint64_t)((uint32_t)w != 0) | (uint64_t)((w >> 32) != 0) << 1) << (2 * j);
    }
    return mask;
}

/* nonzero_positions(ptr, n, itemsize, out_ptr) -> count: the positions of the non-zero entries of a
 * vector of n bytes (itemsize 1) or 32-bit integers (itemsize 4), in increasing order, written to out
 * (int64) where out_ptr is not 0 (it must then hold the count); with out_ptr 0 they are only counted.
 * S2 Reducer's and the sparse embeddings' union bitmaps. Each 64 bytes become one word with a bit per
 * non-zero entry, without a branch, and only its set bits are visited (a branch per entry or per
 * eight bytes mispredicts about as often as one is set). */
static PyObject *nonzero_positions(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptr, out_ptr;
    long long n;
    int itemsize;
    if (!PyArg_ParseTuple(args, "KLiK", &ptr, &n, &itemsize, &out_ptr)) return NULL;
    if (n < 0 || (itemsize != 1 && itemsize != 4)) {
        PyErr_SetString(PyExc_ValueError, "nonzero_positions: bad length or item size");
        return NULL;
    }
    const unsigned char *bytes = (const unsigned char *)(uintptr_t)ptr;
    int64_t *out = (int64_t *)(uintptr_t)out_ptr;
    int64_t count = 0;
    Py_BEGIN_ALLOW_THREADS
    const int64_t per_chunk = 64 / itemsize, chunks = n / per_chunk;
    for (int64_t c = 0; c < chunks; c++) {
        uint64_t mask = nonzero_mask64(bytes + 64 * c, itemsize);
        if (out == NULL) {
            count += __builtin_popcountll(mask);
            continue;
        }
        for (; mask; mask &= mask - 1) out[count++] = c * per_chunk + __builtin_ctzll(mask);
    }
    for (int64_t e = chunks * per_chunk; e < n; e++) {
        const int set = itemsize == 1 ? bytes[e] != 0 : ((const int32_t *)(const void *)bytes)[e] != 0;
        if (set && out) out[count] = e;
        count += set;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)count);
}

static PyMethodDef methods[] = {
    {"members", members, METH_VARARGS,
     "members(a_ptr, na, wide_a, b_ptr, nb, wide_b, out_ptr) -> status: out[i] = a[i] occurs in b, both "
     "sorted (-1: a is not)."},
    {"merge_sum", merge_sum, METH_VARARGS,
     "merge_sum(idx_ptrs, val_ptrs, lens, wide_index, wide_value, out_idx_ptr, out_val_ptr) -> count: the "
     "coalesced sum of sorted chunks, in chunk order per index (-1: a chunk is not sorted)."},
    {"merge_average", merge_average, METH_VARARGS,
     "merge_average(idx_ptrs, val_ptrs, lens, wide_index, wide_value, dense_ptr, n, divisor, negative_start, "
     "mask_ptr, mode) -> (status, nonzero): dense[i] = (start + the chunks' values at i, in chunk order) / "
     "divisor on the union, 0 elsewhere; the mask of written groups updated (status -1: a chunk is not "
     "sorted, -2: an index is out of range)."},
    {"average_blocks", average_blocks, METH_VARARGS,
     "average_blocks(ids_ptr, nblocks, wide_index, size, values_ptr, wide_value, dense_ptr, n, divisor, "
     "negative_start, mask_ptr, mode) -> (status, nonzero): merge_average of one chunk of whole blocks, given by "
     "their sorted ids and their values (nblocks x size)."},
    {"nonzero_positions", nonzero_positions, METH_VARARGS,
     "nonzero_positions(ptr, n, itemsize, out_ptr) -> count: the increasing positions of the non-zero entries "
     "of n bytes or 32-bit integers, written as int64 to out_ptr unless it is 0."},
    {"sketch_insert", sketch_insert, METH_VARARGS,
     "sketch_insert(cols, mask, shift, a, b, c, idx_ptr, m, wide_index, values_ptr, wide_value, table_ptr, variant): add "
     "the signed values into their buckets of each row of a count-sketch table, in order."},
    {"sketch_variants", sketch_variants, METH_NOARGS,
     "sketch_variants() -> list: the sketch kernels' variants this CPU runs, fastest first."},
    {"sketch_query_blocks", sketch_query_blocks, METH_VARARGS,
     "sketch_query_blocks(cols, mask, shift, a, b, c, ids_ptr, nblocks, wide_index, size, n, table_ptr, "
     "wide_value, out_ptr, variant): the count-sketch estimate (median over the rows) of every element of the blocks."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                    "_merge",
                                    "Merge of sorted sparse chunks (see sparsecomm/transport/merge.py).",
                                    -1,
                                    methods,
                                    NULL,
                                    NULL,
                                    NULL,
                                    NULL};

/* the digest of this file, compiled in by setup.py: sparsecomm.core.optional refuses a build from
   other sources than the _merge.c beside it */
#ifndef SOURCE_DIGEST
#define SOURCE_DIGEST ""
#endif

PyMODINIT_FUNC PyInit__merge(void) {
#if MERGE_HAVE_SIMD
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
    use_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#endif
    PyObject *m = PyModule_Create(&module);
    /* the sweep's cut-over, for the simulator's model of its memory traffic (merge.IN_PLACE_SHARE) */
    if (m != NULL && (PyModule_AddIntConstant(m, "DENSE_NUM", DENSE_NUM) < 0 ||
                      PyModule_AddIntConstant(m, "DENSE_DEN", DENSE_DEN) < 0 ||
                      PyModule_AddStringConstant(m, "SOURCE_DIGEST", SOURCE_DIGEST) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
