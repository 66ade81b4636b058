/* The selectors' C kernels (see scan.py): the fused magnitude scan and the exact top-k of its candidates.
 *
 * scan_ge: one read pass over a float32 vector x (n < 2^31) that returns
 *
 *   - sum |x_i| (accumulated in double lanes, which float32 input cannot overflow: NaN or Inf in x,
 *     and only they, make it non-finite),
 *   - max |x_i|,
 *   - every (i, |x_i|) with |x_i| >= floor, in increasing i (the "candidates"; i as int32, which the
 *     caller widens when it copies them out of its reused buffer).
 *
 * This is what every selector of sparsecomm.selectors needs from the full vector: RedSync's mean and
 * max (Algorithms 2 and 3), MSTopK's (Shi et al. Algorithm 1), the finiteness check, and the elements
 * above a sampled floor on which the threshold searches then run. In torch it takes three to four
 * passes (abs into a buffer, sum, compare into a mask, compaction); here it is one read of x. See
 * docs/selectors.md.
 *
 * With an addend (the gradient), the same pass first adds it into x and writes the sum to dest (x
 * itself unless the caller gives another vector): the residual update acc = residual + grad of error
 * feedback and the selection's scan in one read of each vector. A separate dest is written with
 * non-temporal stores where it is aligned to the vector width: a 100 MB sum does not stay in cache
 * anyway, and so its lines are not read before being overwritten.
 *
 * The candidates are written without sorting or a branch per lane: each block of lanes is compared
 * with the floor into a bit mask, the lanes whose bit is set are packed to the front of a register
 * (the magnitudes, and in another the lanes' indices), the whole registers are stored at the current
 * end of the output, and the end advances by the mask's popcount. The vector is scanned in chunks of
 * CHUNK_BLOCKS blocks of 16. While candidates are sparse (fewer than 1 in SPARSE_CANDIDATES so far,
 * checked at each chunk) a chunk is scanned first without storing a candidate, noting in one bit per
 * block whether it holds one, and then only the noted blocks are read again (from L1: the sum where
 * the scan wrote it into x, else x + add recomputed) and packed, found by counting the trailing zero
 * bits of that word. A branch per block on "any candidate here" mispredicts about as often as a block
 * holds one (a fifth of the blocks at 1.5% candidates), and those mispredictions, not the memory
 * traffic, are most of the scan's time above its floor; the loop over the noted blocks mispredicts
 * about once per chunk. Once candidates are dense, every block is packed as it comes (two 64-byte
 * stores a block, no branch).
 * The output therefore needs a block's worth of room beyond the last candidate; near the end of the
 * buffer (and beyond it, where candidates are only counted) the lanes are taken one by one. Three
 * variants with identical candidates and max (the sum differs only by rounding):
 *
 *   - AVX-512 (AVX512F, chosen at run time when the CPU and OS have it): 16 lanes, packed by
 *     vcompressps/vpcompressd into a register, then stored (on AMD Zen 4 the compress with a memory
 *     destination is microcoded and several times slower);
 *   - AVX2: two halves of 8 lanes, each packed by vpermps with a permutation looked up in a
 *     256-entry table indexed by the half's mask;
 *   - portable scalar C: every lane is written, and the end advances by its comparison (0 or 1).
 *
 * select_largest: the indices of the k largest of the candidates, still in increasing index order, by
 * a radix select on the magnitudes' bit patterns (for floats >= 0, and only those, the uint32 bit
 * patterns order as the floats do): a 65536-bin histogram of the top 16 bits over all candidates,
 * then one of the low 16 bits of those in the bin that holds the k-th largest; this gives the k-th
 * largest value exactly, and how many of the values equal to it belong to the k largest. One
 * compaction pass then keeps the values above it and the first such ties in index order (packed as
 * above, by vpcompressq or a vpermd table; blocks holding a tie lane by lane): torch.topk's k-th value
 * and the tie rule of scan.py's largest_in_order, without sorting. NaN or a negative value makes it
 * decline (the caller then uses torch).
 *
 * block_energies: the squared L2 norm of every block of x (S2 Reducer's and OmniReduce's block top-k),
 * with error feedback's addition in the same pass, summed in block.py's canonical order.
 *
 * split_largest: the same top-k of (index, value) pairs by magnitude, kept and dropped both written
 * in one pass (gTop-k's and Ok-Topk's merges of received chunks).
 *
 * sample_magnitudes: the sample of scan.sample_floor, |x + add| in runs of adjacent elements at a stride,
 * the lines prefetched ahead.
 *
 * take_and_clear: values[j] = x[idx[j]] and then x[idx[j]] = 0 for the selected indices: the sent
 * message's values taken out of acc = residual + grad, which leaves the residual (error feedback).
 * One visit of each touched cache line (torch's index_select and index_fill_ visit each twice), the
 * lines fetched some entries ahead; at 1% of a 100 MB vector it halves the time of the two.
 *
 * They run on the calling thread with the GIL released: a second thread was measured to gain nothing
 * when the scan follows a torch operation (as it does in training), because torch's idle OpenMP
 * workers spin on the other cores. The Python side (scan.py) validates every pointer and size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define SCAN_HAVE_X86_VARIANTS 1
#else
#define SCAN_HAVE_X86_VARIANTS 0
#endif

/* The vector kernels scan chunks of CHUNK_BLOCKS blocks of 16 elements (one bit per block in a 64-bit
 * word); a chunk packs only its blocks with a candidate, after scanning them all, while fewer than 1 in
 * SPARSE_CANDIDATES elements so far were candidates, and every block as it comes otherwise. */
#define CHUNK_BLOCKS 64
#define SPARSE_CANDIDATES 16

typedef struct {
    const float *x;
    const float *add; /* NULL, or the addend: dest = x + add is written during the scan */
    float *dest;      /* where x + add goes (x itself, or a separate vector); unused without add */
    int64_t n;
    float floor;
    int32_t *idx; /* the output: room for cap candidates (n < 2^31) */
    float *val;
    int64_t cap;
    int64_t count; /* results: candidates found (may exceed cap), sum and max of |x| */
    double sum;
    float max;
} scan_t;

/* One candidate, taken lane by lane: written while it fits, counted always. */
static inline void emit(scan_t *c, int64_t *count, int64_t i, float a) {
    if (*count < c->cap) {
        c->idx[*count] = (int32_t)i;
        c->val[*count] = a;
    }
    (*count)++;
}

/* The elements [i, n) after a vector variant's blocks, one by one (sum and max continue *sum, *max). */
static void scan_tail(scan_t *c, int64_t i, int64_t *count, double *sum, float *max) {
    for (; i < c->n; i++) {
        float v = c->x[i];
        if (c->add) {
            v += c->add[i];
            c->dest[i] = v;
        }
        float a = fabsf(v);
        *sum += a;
        *max = *max > a ? *max : a;
        if (a >= c->floor) emit(c, count, i, a);
    }
}

static void scan_scalar(scan_t *c) {
    const float *x = c->x;
    const float *add = c->add;
    float *dest = c->dest;
    const float floor = c->floor;
    int64_t count = 0;
    double s[8] = {0};
    float m[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= c->n; i += 8) {
        float a[8];
        for (int l = 0; l < 8; l++) {
            float v = x[i + l];
            if (add) {
                v += add[i + l];
                dest[i + l] = v;
            }
            a[l] = fabsf(v);
            s[l] += a[l];
            m[l] = m[l] > a[l] ? m[l] : a[l];
        }
        if (count + 8 <= c->cap) {
            for (int l = 0; l < 8; l++) {
                c->idx[count] = (int32_t)(i + l);
                c->val[count] = a[l];
                count += a[l] >= floor;
            }
        } else {
            for (int l = 0; l < 8; l++)
                if (a[l] >= floor) emit(c, &count, i + l, a[l]);
        }
    }
    double sum = 0.0;
    float max = 0.0f;
    for (int l = 0; l < 8; l++) {
        sum += s[l];
        max = max > m[l] ? max : m[l];
    }
    scan_tail(c, i, &count, &sum, &max);
    c->count = count;
    c->sum = sum;
    c->max = max;
}

#if SCAN_HAVE_X86_VARIANTS
/* AVX2_PACK[m]: the lanes whose bit is set in the 8-bit mask m, in increasing order, then zeros. */
static int32_t AVX2_PACK[256][8] __attribute__((aligned(32)));

static void init_avx2_pack(void) {
    for (int m = 0; m < 256; m++) {
        int j = 0;
        for (int l = 0; l < 8; l++)
            if (m >> l & 1) AVX2_PACK[m][j++] = l;
        for (; j < 8; j++) AVX2_PACK[m][j] = 0;
    }
}

__attribute__((target("avx2"))) static inline __m256d widen_low(__m256 a) {
    return _mm256_cvtps_pd(_mm256_castps256_ps128(a));
}

__attribute__((target("avx2"))) static inline __m256d widen_high(__m256 a) {
    return _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
}

/* Writes the lanes of a (magnitudes of the elements first..first+7) set in mask at idx/val + count:
 * all 8 stored, count advanced by the set ones. */
__attribute__((target("avx2,popcnt"))) static inline int64_t pack_avx2(__m256 a, unsigned mask, int64_t first,
                                                                      int32_t *idx, float *val, int64_t count) {
    __m256i lanes = _mm256_load_si256((const __m256i *)AVX2_PACK[mask]);
    _mm256_storeu_ps(val + count, _mm256_permutevar8x32_ps(a, lanes));
    _mm256_storeu_si256((__m256i *)(idx + count), _mm256_add_epi32(_mm256_set1_epi32((int32_t)first), lanes));
    return count + __builtin_popcount(mask);
}

/* The candidates of elements i .. i + 15 (magnitudes a0, a1, set in hits0, hits1) written or counted: packed while
 * 16 fit, counted once nothing more fits, lane by lane in between. */
__attribute__((target("avx2,popcnt"))) static inline int64_t emit16_avx2(scan_t *c, int64_t count, int64_t i,
                                                                        __m256 a0, __m256 a1, unsigned hits0,
                                                                        unsigned hits1) {
    if (count + 16 <= c->cap) {
        count = pack_avx2(a0, hits0, i, c->idx, c->val, count);
        return pack_avx2(a1, hits1, i + 8, c->idx, c->val, count);
    }
    if (count >= c->cap) return count + __builtin_popcount(hits0 | hits1 << 8);
    float lanes[16];
    _mm256_storeu_ps(lanes, a0);
    _mm256_storeu_ps(lanes + 8, a1);
    for (unsigned hits = hits0 | hits1 << 8; hits; hits &= hits - 1) {
        int l = __builtin_ctz(hits);
        emit(c, &count, i + l, lanes[l]);
    }
    return count;
}

/* The magnitudes of elements i .. i + 7 (of x + add where add is given, the sum written to dest where
 * that is given too). */
__attribute__((target("avx2"))) static inline __m256 magnitudes8_avx2(const float *x, const float *add, float *dest,
                                                                     int stream, int64_t i) {
    const __m256 magnitude_bits = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v = _mm256_loadu_ps(x + i);
    if (add) {
        v = _mm256_add_ps(v, _mm256_loadu_ps(add + i));
        if (dest && stream)
            _mm256_stream_ps(dest + i, v);
        else if (dest)
            _mm256_storeu_ps(dest + i, v);
    }
    return _mm256_and_ps(v, magnitude_bits);
}

__attribute__((target("avx2"))) static inline unsigned hits8_avx2(__m256 a, __m256 floor) {
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, floor, _CMP_GE_OQ));
}

/* The running sums (in double) and maxima of the magnitudes a0, a1. */
__attribute__((target("avx2"))) static inline void accumulate16_avx2(__m256 a0, __m256 a1, __m256d *sum0, __m256d *sum1,
                                                                    __m256d *sum2, __m256d *sum3, __m256 *max0,
                                                                    __m256 *max1) {
    *sum0 = _mm256_add_pd(*sum0, widen_low(a0));
    *sum1 = _mm256_add_pd(*sum1, widen_high(a0));
    *sum2 = _mm256_add_pd(*sum2, widen_low(a1));
    *sum3 = _mm256_add_pd(*sum3, widen_high(a1));
    *max0 = _mm256_max_ps(*max0, a0);
    *max1 = _mm256_max_ps(*max1, a1);
}

__attribute__((target("avx2,popcnt"))) static void scan_avx2(scan_t *c) {
    const float *x = c->x;
    const float *add = c->add;
    float *dest = c->dest;
    const __m256 floor = _mm256_set1_ps(c->floor);
    int64_t count = 0;
    __m256d sum0 = _mm256_setzero_pd(), sum1 = _mm256_setzero_pd();
    __m256d sum2 = _mm256_setzero_pd(), sum3 = _mm256_setzero_pd();
    __m256 max0 = _mm256_setzero_ps(), max1 = _mm256_setzero_ps();
    const int stream = dest != x && (uintptr_t)dest % 32 == 0;
    /* a noted block is read again: the sum from x where the scan wrote it there, else x + add anew */
    const float *add_again = add && dest != x ? add : NULL;
    const int64_t blocks_end = c->n - c->n % 16;
    int64_t i = 0;
    while (i < blocks_end) {
        const int64_t chunk = i, chunk_end = i + 16 * CHUNK_BLOCKS < blocks_end ? i + 16 * CHUNK_BLOCKS : blocks_end;
        if (count * SPARSE_CANDIDATES > i) { /* dense: every block's lanes packed as they come */
            for (; i < chunk_end; i += 16) {
                __m256 a0 = magnitudes8_avx2(x, add, dest, stream, i);
                __m256 a1 = magnitudes8_avx2(x, add, dest, stream, i + 8);
                accumulate16_avx2(a0, a1, &sum0, &sum1, &sum2, &sum3, &max0, &max1);
                count = emit16_avx2(c, count, i, a0, a1, hits8_avx2(a0, floor), hits8_avx2(a1, floor));
            }
            continue;
        }
        uint64_t any = 0; /* sparse: bit b for a block b of the chunk with a candidate, packed afterwards */
        for (int b = 0; i < chunk_end; b++, i += 16) {
            __m256 a0 = magnitudes8_avx2(x, add, dest, stream, i), a1 = magnitudes8_avx2(x, add, dest, stream, i + 8);
            accumulate16_avx2(a0, a1, &sum0, &sum1, &sum2, &sum3, &max0, &max1);
            any |= (uint64_t)((hits8_avx2(a0, floor) | hits8_avx2(a1, floor)) != 0) << b;
        }
        for (; any; any &= any - 1) {
            const int64_t j = chunk + 16 * (int64_t)__builtin_ctzll(any);
            __m256 a0 = magnitudes8_avx2(x, add_again, NULL, 0, j), a1 = magnitudes8_avx2(x, add_again, NULL, 0, j + 8);
            count = emit16_avx2(c, count, j, a0, a1, hits8_avx2(a0, floor), hits8_avx2(a1, floor));
        }
    }
    if (stream) _mm_sfence();
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(_mm256_add_pd(sum0, sum1), _mm256_add_pd(sum2, sum3)));
    double sum = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    float maxes[8];
    _mm256_storeu_ps(maxes, _mm256_max_ps(max0, max1));
    float max = 0.0f;
    for (int l = 0; l < 8; l++) max = max > maxes[l] ? max : maxes[l];
    scan_tail(c, i, &count, &sum, &max);
    c->count = count;
    c->sum = sum;
    c->max = max;
}

/* The candidates of elements i .. i + 15 (magnitudes a, set in hits) written or counted, as
 * emit16_avx2. */
__attribute__((target("avx512f,popcnt"))) static inline int64_t emit16_avx512(scan_t *c, int64_t count, int64_t i,
                                                                              __m512 a, __mmask16 hits) {
    if (count + 16 <= c->cap) {
        const __m512i lane_offsets = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i indices = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), lane_offsets);
        _mm512_storeu_ps(c->val + count, _mm512_maskz_compress_ps(hits, a));
        _mm512_storeu_si512(c->idx + count, _mm512_maskz_compress_epi32(hits, indices));
        return count + __builtin_popcount(hits);
    }
    if (count >= c->cap) return count + __builtin_popcount(hits);
    float lanes[16];
    _mm512_storeu_ps(lanes, a);
    for (unsigned rest = hits; rest; rest &= rest - 1) {
        int l = __builtin_ctz(rest);
        emit(c, &count, i + l, lanes[l]);
    }
    return count;
}

/* The magnitudes of elements i .. i + 15 (of x + add where add is given, the sum written to dest where
 * that is given too). */
__attribute__((target("avx512f"))) static inline __m512 magnitudes16_avx512(const float *x, const float *add,
                                                                          float *dest, int stream, int64_t i) {
    __m512 v = _mm512_loadu_ps(x + i);
    if (add) {
        v = _mm512_add_ps(v, _mm512_loadu_ps(add + i));
        if (dest && stream)
            _mm512_stream_ps(dest + i, v);
        else if (dest)
            _mm512_storeu_ps(dest + i, v);
    }
    return _mm512_abs_ps(v);
}

/* The running sums (in double) and maximum of the magnitudes a. */
__attribute__((target("avx512f"))) static inline void accumulate16_avx512(__m512 a, __m512d *sum0, __m512d *sum1,
                                                                         __m512 *max16) {
    *sum0 = _mm512_add_pd(*sum0, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
    *sum1 = _mm512_add_pd(*sum1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
    *max16 = _mm512_max_ps(*max16, a);
}

/* The AVX-512 variant: the AVX2 variant's 16-element blocks in one register each. Its max lanes are
 * combined as the AVX2 variant's (lanes l and l + 8, then 0..7 in order), so even with NaN in x the
 * two report the same max. */
__attribute__((target("avx512f,popcnt"))) static void scan_avx512(scan_t *c) {
    const float *x = c->x;
    const float *add = c->add;
    float *dest = c->dest;
    const __m512 floor = _mm512_set1_ps(c->floor);
    int64_t count = 0;
    __m512d sum0 = _mm512_setzero_pd(), sum1 = _mm512_setzero_pd();
    __m512 max16 = _mm512_setzero_ps();
    const int stream = dest != x && (uintptr_t)dest % 64 == 0;
    /* a noted block is read again: the sum from x where the scan wrote it there, else x + add anew */
    const float *add_again = add && dest != x ? add : NULL;
    const int64_t blocks_end = c->n - c->n % 16;
    int64_t i = 0;
    while (i < blocks_end) {
        const int64_t chunk = i, chunk_end = i + 16 * CHUNK_BLOCKS < blocks_end ? i + 16 * CHUNK_BLOCKS : blocks_end;
        if (count * SPARSE_CANDIDATES > i) { /* dense: every block packed as it comes */
            for (; i < chunk_end; i += 16) {
                __m512 a = magnitudes16_avx512(x, add, dest, stream, i);
                accumulate16_avx512(a, &sum0, &sum1, &max16);
                count = emit16_avx512(c, count, i, a, _mm512_cmp_ps_mask(a, floor, _CMP_GE_OQ));
            }
            continue;
        }
        uint64_t any = 0; /* sparse: bit b for a block b of the chunk with a candidate, packed afterwards */
        for (int b = 0; i < chunk_end; b++, i += 16) {
            __m512 a = magnitudes16_avx512(x, add, dest, stream, i);
            accumulate16_avx512(a, &sum0, &sum1, &max16);
            any |= (uint64_t)(_mm512_cmp_ps_mask(a, floor, _CMP_GE_OQ) != 0) << b;
        }
        for (; any; any &= any - 1) {
            const int64_t j = chunk + 16 * (int64_t)__builtin_ctzll(any);
            __m512 a = magnitudes16_avx512(x, add_again, NULL, 0, j);
            count = emit16_avx512(c, count, j, a, _mm512_cmp_ps_mask(a, floor, _CMP_GE_OQ));
        }
    }
    if (stream) _mm_sfence();
    double lanes[8];
    _mm512_storeu_pd(lanes, _mm512_add_pd(sum0, sum1));
    double sum = 0.0;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    float halves[16], max = 0.0f;
    _mm512_storeu_ps(halves, max16);
    for (int l = 0; l < 8; l++) {
        float m = _mm_cvtss_f32(_mm_max_ss(_mm_set_ss(halves[l]), _mm_set_ss(halves[l + 8])));
        max = max > m ? max : m;
    }
    scan_tail(c, i, &count, &sum, &max);
    c->count = count;
    c->sum = sum;
    c->max = max;
}
#endif

static int cpu_has(const char *variant) {
    if (strcmp(variant, "scalar") == 0) return 1;
#if SCAN_HAVE_X86_VARIANTS
    __builtin_cpu_init();
    if (strcmp(variant, "avx2") == 0) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    if (strcmp(variant, "avx512") == 0)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("popcnt");
#endif
    return 0;
}

/* scan_ge(x_ptr, n, floor, idx_ptr, val_ptr, cap, variant, add_ptr=0, dest_ptr=0) -> (count, sum, max)
 *
 * Writes the first min(count, cap) candidates and may write the rest of idx[0:cap] and val[0:cap];
 * `count` is exact either way, so a caller whose buffer was too small (count > cap) grows it and
 * scans again (without add_ptr, of the sum). With add_ptr, dest_i = x_i + add_i is written first
 * (dest_ptr, or x_ptr when it is 0) and the scan is of the sum: the residual update acc = residual +
 * grad and the selection's scan in one read of each input. `variant` is "avx512", "avx2" or "scalar".
 */
static PyObject *scan_ge(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x_ptr, idx_ptr, val_ptr, add_ptr = 0, dest_ptr = 0;
    long long n, cap;
    float floor;
    const char *variant;
    if (!PyArg_ParseTuple(args, "KLfKKLs|KK", &x_ptr, &n, &floor, &idx_ptr, &val_ptr, &cap, &variant, &add_ptr,
                          &dest_ptr))
        return NULL;
    if (n < 0 || n > INT32_MAX || cap < 0) {
        PyErr_Format(PyExc_ValueError, "scan_ge: needs 0 <= n < 2^31 and cap >= 0, got n=%lld cap=%lld", n, cap);
        return NULL;
    }
    if (!cpu_has(variant)) {
        PyErr_Format(PyExc_ValueError, "scan_ge: variant %R does not run here (see variants())",
                     PyTuple_GET_ITEM(args, 6));
        return NULL;
    }
    scan_t c = {(const float *)(uintptr_t)x_ptr,
                (const float *)(uintptr_t)add_ptr,
                (float *)(uintptr_t)(dest_ptr ? dest_ptr : x_ptr),
                n,
                floor,
                (int32_t *)(uintptr_t)idx_ptr,
                (float *)(uintptr_t)val_ptr,
                cap,
                0,
                0.0,
                0.0f};
    Py_BEGIN_ALLOW_THREADS
#if SCAN_HAVE_X86_VARIANTS
    if (strcmp(variant, "avx512") == 0)
        scan_avx512(&c);
    else if (strcmp(variant, "avx2") == 0)
        scan_avx2(&c);
    else
#endif
        scan_scalar(&c);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("Ldf", (long long)c.count, c.sum, (double)c.max);
}

static PyObject *variants(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    static const char *const fastest_first[] = {"avx512", "avx2", "scalar"};
    PyObject *result = PyList_New(0);
    for (size_t v = 0; result && v < sizeof fastest_first / sizeof fastest_first[0]; v++) {
        if (!cpu_has(fastest_first[v])) continue;
        PyObject *name = PyUnicode_FromString(fastest_first[v]);
        if (!name || PyList_Append(result, name) < 0) Py_CLEAR(result);
        Py_XDECREF(name);
    }
    return result;
}

/* The bin of the rank-th largest key counted in hist[0:highest + 1] (the bins above highest empty), and
 * in *rank that key's rank within its bin (1 = the bin's largest). */
static uint32_t bin_of_kth(const uint32_t *hist, uint32_t highest, int64_t *rank) {
    uint32_t b = highest;
    for (; b > 0 && hist[b] < *rank; b--) *rank -= hist[b];
    return b;
}

#define KEY_NOT_ORDERED -1 /* kth_largest_key's answers besides a key */
#define KEY_NO_MEMORY -2

/* The histogram of kth_largest_key, one per thread, allocated on first use and kept: all zero between
 * calls (each call clears the bins it used). A fresh 256 KiB calloc per call costs its page faults,
 * which dominate a select of a few thousand keys. */
static _Thread_local uint32_t *key_hist;

/* hist[bin(keys[i])]++ for the count keys (bin: the top or, with low, the bottom 16 bits); the lowest and
 * highest bins used. */
static void histogram(uint32_t *hist, const uint32_t *keys, int64_t count, int low, uint32_t *lowest,
                      uint32_t *highest) {
    uint32_t lo = 0xffff, hi = 0;
    for (int64_t i = 0; i < count; i++) {
        uint32_t bin = low ? keys[i] & 0xffff : keys[i] >> 16;
        hist[bin]++;
        lo = bin < lo ? bin : lo;
        hi = bin > hi ? bin : hi;
    }
    *lowest = lo;
    *highest = hi;
}

/* Radix select: the k-th largest of the count uint32 keys (0 < k <= count < 2^32), found by a 65536-bin
 * histogram of the keys' top 16 bits, then one of the low 16 bits of the keys in the bin that holds
 * it (copied out first: a few percent of the keys for the candidates of a scan). Returns it, and in
 * *ties how many keys equal to it are among the k largest; KEY_NOT_ORDERED when a key is above
 * 0x7f800000 (the bits of a NaN or of a negative float), KEY_NO_MEMORY. */
static int64_t kth_largest_key(const uint32_t *keys, int64_t count, int64_t k, int64_t *ties) {
    if (!key_hist && !(key_hist = calloc(1 << 16, sizeof *key_hist))) return KEY_NO_MEMORY;
    uint32_t *hist = key_hist;
    uint32_t lowest, highest; /* the walks start from the highest bin in use; the clears span those used */
    histogram(hist, keys, count, 0, &lowest, &highest);
    if (highest >= 0x7f80) /* keys from 0x7f800000 (+Inf) up: checked one by one only when there are some */
        for (int64_t i = 0; i < count; i++)
            if (keys[i] > 0x7f800000u) {
                memset(hist + lowest, 0, (highest - lowest + 1) * sizeof *hist);
                return KEY_NOT_ORDERED;
            }
    int64_t rank = k;
    uint32_t top = bin_of_kth(hist, highest, &rank);
    /* the keys of that bin, copied without a branch (each key is written, the next may overwrite it) */
    uint32_t *in_top = malloc((hist[top] + 1) * sizeof *in_top);
    memset(hist + lowest, 0, (highest - lowest + 1) * sizeof *hist);
    if (!in_top) return KEY_NO_MEMORY;
    int64_t m = 0;
    for (int64_t i = 0; i < count; i++) {
        in_top[m] = keys[i];
        m += keys[i] >> 16 == top;
    }
    histogram(hist, in_top, m, 1, &lowest, &highest);
    uint32_t low = bin_of_kth(hist, highest, &rank);
    memset(hist + lowest, 0, (highest - lowest + 1) * sizeof *hist);
    free(in_top);
    *ties = rank;
    return (int64_t)(top << 16 | low);
}

/* The compaction after the select: out[0:k] = the idx[i] whose key is above kth, or equal to it and
 * among the first `ties` such, in the order of idx. */
typedef struct {
    const int64_t *idx;
    const uint32_t *keys;
    int64_t count, k;
    uint32_t kth;
    int64_t *out;
    int64_t ties;    /* counts down the ties still to keep */
    int64_t written; /* results: the entries of out written (k) */
} keep_t;

/* The compaction of the entries [i, end), lane by lane: every entry is written, the end of the output
 * advances by whether it is kept. */
static void keep_scalar(keep_t *p, int64_t i, int64_t end) {
    for (; p->written < p->k && i < end; i++) {
        p->out[p->written] = p->idx[i];
        int tie = p->keys[i] == p->kth;
        p->written += (p->keys[i] > p->kth) | (tie & (p->ties > 0));
        p->ties -= tie;
    }
}

#if SCAN_HAVE_X86_VARIANTS
/* AVX2_PACK_EPI64[m]: the 32-bit lanes of the 64-bit lanes set in the 4-bit mask m, in order. */
static int32_t AVX2_PACK_EPI64[16][8] __attribute__((aligned(32)));

static void init_avx2_pack_epi64(void) {
    for (int m = 0; m < 16; m++) {
        int j = 0;
        for (int l = 0; l < 4; l++)
            if (m >> l & 1) {
                AVX2_PACK_EPI64[m][j++] = 2 * l;
                AVX2_PACK_EPI64[m][j++] = 2 * l + 1;
            }
        for (; j < 8; j++) AVX2_PACK_EPI64[m][j] = 0;
    }
}

/* Blocks of 8 keys: those above kth packed by vpermd (two halves of 4 indices), a block holding a tie
 * taken lane by lane. The keys are at most 0x7f800000, so the signed compare orders them. */
__attribute__((target("avx2,popcnt"))) static void keep_avx2(keep_t *p) {
    const __m256i kth = _mm256_set1_epi32((int32_t)p->kth);
    int64_t i = 0;
    for (; i + 8 <= p->count && p->written + 8 <= p->k; i += 8) {
        __m256i keys = _mm256_loadu_si256((const __m256i *)(p->keys + i));
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi32(keys, kth))) {
            keep_scalar(p, i, i + 8);
            continue;
        }
        unsigned above = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, kth)));
        for (int half = 0; half < 2; half++) {
            unsigned m = above >> 4 * half & 0xf;
            __m256i lanes = _mm256_load_si256((const __m256i *)AVX2_PACK_EPI64[m]);
            __m256i idx = _mm256_loadu_si256((const __m256i *)(p->idx + i + 4 * half));
            _mm256_storeu_si256((__m256i *)(p->out + p->written), _mm256_permutevar8x32_epi32(idx, lanes));
            p->written += __builtin_popcount(m);
        }
    }
    keep_scalar(p, i, p->count);
}

/* Blocks of 16 keys: those above kth packed by vpcompressq into registers (two halves of 8 indices),
 * then stored; a block holding a tie taken lane by lane. */
__attribute__((target("avx512f,popcnt"))) static void keep_avx512(keep_t *p) {
    const __m512i kth = _mm512_set1_epi32((int32_t)p->kth);
    int64_t i = 0;
    for (; i + 16 <= p->count && p->written + 16 <= p->k; i += 16) {
        __m512i keys = _mm512_loadu_si512(p->keys + i);
        if (_mm512_cmpeq_epu32_mask(keys, kth)) {
            keep_scalar(p, i, i + 16);
            continue;
        }
        __mmask16 above = _mm512_cmpgt_epu32_mask(keys, kth);
        __mmask8 low = (__mmask8)above, high = (__mmask8)(above >> 8);
        _mm512_storeu_si512(p->out + p->written, _mm512_maskz_compress_epi64(low, _mm512_loadu_si512(p->idx + i)));
        p->written += __builtin_popcount(low);
        _mm512_storeu_si512(p->out + p->written,
                            _mm512_maskz_compress_epi64(high, _mm512_loadu_si512(p->idx + i + 8)));
        p->written += __builtin_popcount(high);
    }
    keep_scalar(p, i, p->count);
}
#endif

/* select_largest(idx_ptr, val_ptr, count, k, out_ptr, variant) -> int
 *
 * Writes to out[0:k] the idx entries of the k largest of the count float32 values (0 < k < count),
 * in their order in idx; among values equal to the k-th largest, the first ones. Returns k, or -1
 * (out unspecified) when a value is NaN or negative (its bits then do not order as the value) or
 * count >= 2^32. `variant` ("avx512", "avx2", "scalar") picks the compaction's code.
 */
static PyObject *select_largest(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long idx_ptr, val_ptr, out_ptr;
    long long count, k;
    const char *variant;
    if (!PyArg_ParseTuple(args, "KKLLKs", &idx_ptr, &val_ptr, &count, &k, &out_ptr, &variant)) return NULL;
    if (k <= 0 || k >= count) {
        PyErr_Format(PyExc_ValueError, "select_largest: needs 0 < k < count, got k=%lld count=%lld", k, count);
        return NULL;
    }
    if (!cpu_has(variant)) {
        PyErr_Format(PyExc_ValueError, "select_largest: variant %R does not run here (see variants())",
                     PyTuple_GET_ITEM(args, 5));
        return NULL;
    }
    if (count > (long long)UINT32_MAX) return PyLong_FromLong(-1);
    keep_t p = {(const int64_t *)(uintptr_t)idx_ptr, (const uint32_t *)(uintptr_t)val_ptr, count, k, 0,
                (int64_t *)(uintptr_t)out_ptr, 0, -1};
    int64_t kth;
    Py_BEGIN_ALLOW_THREADS
    kth = kth_largest_key(p.keys, count, k, &p.ties);
    if (kth >= 0) {
        p.kth = (uint32_t)kth;
        p.written = 0;
#if SCAN_HAVE_X86_VARIANTS
        if (strcmp(variant, "avx512") == 0)
            keep_avx512(&p);
        else if (strcmp(variant, "avx2") == 0)
            keep_avx2(&p);
        else
#endif
            keep_scalar(&p, 0, count);
    }
    Py_END_ALLOW_THREADS
    if (kth == KEY_NO_MEMORY) return PyErr_NoMemory();
    return PyLong_FromLongLong((long long)p.written);
}

/* kth_largest(val_ptr, count, k) -> int: the bits of the k-th largest of the count float32 values
 * (0 < k <= count), a radix select on their bit patterns; -1 when a value is NaN or negative (their bits
 * do not order as the values do) or count is 2^32 or more. */
static PyObject *kth_largest(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long val_ptr;
    long long count, k;
    if (!PyArg_ParseTuple(args, "KLL", &val_ptr, &count, &k)) return NULL;
    if (k <= 0 || k > count) {
        PyErr_Format(PyExc_ValueError, "kth_largest: needs 0 < k <= count, got k=%lld count=%lld", k, count);
        return NULL;
    }
    if (count > (long long)UINT32_MAX) return PyLong_FromLong(-1); /* the histogram counts in 32 bits */
    int64_t ties, kth;
    Py_BEGIN_ALLOW_THREADS
    kth = kth_largest_key((const uint32_t *)(uintptr_t)val_ptr, count, k, &ties);
    Py_END_ALLOW_THREADS
    if (kth == KEY_NO_MEMORY) return PyErr_NoMemory();
    return PyLong_FromLongLong(kth >= 0 ? (long long)kth : -1);
}

/* take_and_clear(x_ptr, n, idx_ptr, count, out_ptr) -> int: out[j] = x[idx[j]], then x[idx[j]] = 0, for
 * float32 x of n elements and count int64 indices (any order; a repeated index takes 0 the second
 * time). Returns 0, or -1 without writing anything when an index lies outside [0, n). */
#define TAKE_AHEAD 16
static PyObject *take_and_clear(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x_ptr, idx_ptr, out_ptr;
    long long n, count;
    if (!PyArg_ParseTuple(args, "KLKLK", &x_ptr, &n, &idx_ptr, &count, &out_ptr)) return NULL;
    if (n < 0 || count < 0) {
        PyErr_Format(PyExc_ValueError, "take_and_clear: needs n >= 0 and count >= 0, got n=%lld count=%lld", n,
                     count);
        return NULL;
    }
    float *x = (float *)(uintptr_t)x_ptr, *out = (float *)(uintptr_t)out_ptr;
    const int64_t *idx = (const int64_t *)(uintptr_t)idx_ptr;
    int inside = 1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t j = 0; j < count; j++) inside &= (uint64_t)idx[j] < (uint64_t)n;
    if (inside)
        for (int64_t j = 0; j < count; j++) {
            if (j + TAKE_AHEAD < count) __builtin_prefetch(x + idx[j + TAKE_AHEAD], 1, 3);
            float *at = x + idx[j];
            out[j] = *at;
            *at = 0.0f;
        }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(inside ? 0 : -1);
}

/* sample_magnitudes(x_ptr, add_ptr, stride, runs, run, out_ptr): out[r run + j] = |x[r stride + j] +
 * add[r stride + j]| (of x alone when add_ptr is 0) for r < runs and j < run, float32; the caller checks
 * that the last run lies inside x. The sample of scan.sample_floor: each run on its own cache line or two,
 * most of them not cached after the last call's passes, so they are prefetched SAMPLE_AHEAD runs ahead
 * (a strided read by torch waited for each line in turn). */
#define SAMPLE_AHEAD 32
static PyObject *sample_magnitudes(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x_ptr, add_ptr, out_ptr;
    long long stride, runs, run;
    if (!PyArg_ParseTuple(args, "KKLLLK", &x_ptr, &add_ptr, &stride, &runs, &run, &out_ptr)) return NULL;
    if (run <= 0 || stride < run || runs < 0) {
        PyErr_Format(PyExc_ValueError, "sample_magnitudes: needs stride >= run > 0 and runs >= 0, got stride=%lld "
                     "run=%lld runs=%lld", stride, run, runs);
        return NULL;
    }
    const float *x = (const float *)(uintptr_t)x_ptr, *add = (const float *)(uintptr_t)add_ptr;
    float *out = (float *)(uintptr_t)out_ptr;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t r = 0; r < runs; r++) {
        if (r + SAMPLE_AHEAD < runs) {
            __builtin_prefetch(x + (r + SAMPLE_AHEAD) * stride, 0, 0);
            if (add) __builtin_prefetch(add + (r + SAMPLE_AHEAD) * stride, 0, 0);
        }
        for (int64_t j = 0; j < run; j++) {
            float v = x[r * stride + j];
            if (add) v += add[r * stride + j];
            out[r * run + j] = fabsf(v);
        }
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* split_largest(val_ptr, count, k, idx_ptr, wide_index, kept_idx, kept_val, dropped_idx, dropped_val) -> int:
 * the k entries of largest magnitude of (idx, val) pairs (float32 values, int32 or int64 indices) and the
 * others, both in their order, the first ones among ties with the k-th kept (select_largest's rule); one
 * radix select on the magnitudes' bits and one pass that writes both. Returns k, or -1 (nothing written)
 * when a value is NaN. */
static PyObject *split_largest(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long val_ptr, idx_ptr, kept_idx, kept_val, dropped_idx, dropped_val;
    long long count, k;
    int wide;
    if (!PyArg_ParseTuple(args, "KLLKpKKKK", &val_ptr, &count, &k, &idx_ptr, &wide, &kept_idx, &kept_val,
                          &dropped_idx, &dropped_val))
        return NULL;
    if (k <= 0 || k >= count) {
        PyErr_Format(PyExc_ValueError, "split_largest: needs 0 < k < count, got k=%lld count=%lld", k, count);
        return NULL;
    }
    const uint32_t *bits = (const uint32_t *)(uintptr_t)val_ptr;
    uint32_t *keys = calloc((size_t)count, sizeof *keys); /* calloc: gcc cannot see the loop below fill it */
    if (!keys) return PyErr_NoMemory();
    int64_t kth, ties = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < count; i++) keys[i] = bits[i] & 0x7fffffffu; /* |value| */
    kth = kth_largest_key(keys, count, k, &ties);
    if (kth >= 0) {
        const uint32_t *vin = bits;
        uint32_t *kv = (uint32_t *)(uintptr_t)kept_val, *dv = (uint32_t *)(uintptr_t)dropped_val;
        int64_t kept = 0, dropped = 0;
        for (int64_t i = 0; i < count; i++) {
            const int keep = keys[i] > (uint32_t)kth || (keys[i] == (uint32_t)kth && ties > 0);
            ties -= keys[i] == (uint32_t)kth && keep;
            if (wide) {
                int64_t *out = (int64_t *)(uintptr_t)(keep ? kept_idx : dropped_idx);
                out[keep ? kept : dropped] = ((const int64_t *)(uintptr_t)idx_ptr)[i];
            } else {
                int32_t *out = (int32_t *)(uintptr_t)(keep ? kept_idx : dropped_idx);
                out[keep ? kept : dropped] = ((const int32_t *)(uintptr_t)idx_ptr)[i];
            }
            (keep ? kv : dv)[keep ? kept : dropped] = vin[i];
            kept += keep;
            dropped += !keep;
        }
    }
    Py_END_ALLOW_THREADS
    free(keys);
    if (kth == KEY_NO_MEMORY) return PyErr_NoMemory();
    return PyLong_FromLongLong(kth >= 0 ? k : -1);
}

/* block_energies(x_ptr, n, size, add_ptr, dest_ptr, out_ptr, variant) -> None: out[b] = the sum of the
 * squares of block b (size elements, the last one shorter), of dest = x + add where add_ptr is given
 * (written in the same pass to dest, x itself unless dest_ptr), else of x. The sum is the canonical
 * pairwise tree of block.py's torch path: the squares padded with +0.0 to a power of two w, then, while
 * w > 1, element i added to element i + w/2 for i < w/2 (every addition an IEEE float32 one, so both
 * paths give the same bits). AVX-512 for blocks of 32 (two registers: 16 + 16, then halves of 8, 4, 2,
 * 1), portable C otherwise; blocks above BLOCK_ENERGY_MAX elements are left to torch. */
#define BLOCK_ENERGY_MAX 4096
static void energies_scalar(const float *x, const float *add, float *dest, int64_t n, int64_t size, float *out,
                            int64_t from_block) {
    float squares[BLOCK_ENERGY_MAX];
    int64_t width = 1;
    while (width < size) width <<= 1;
    for (int64_t b = from_block, lo = from_block * size; lo < n; b++, lo += size) {
        const int64_t m = n - lo < size ? n - lo : size;
        for (int64_t j = 0; j < m; j++) {
            float v = x[lo + j];
            if (add) {
                v += add[lo + j];
                dest[lo + j] = v;
            }
            squares[j] = v * v;
        }
        for (int64_t j = m; j < width; j++) squares[j] = 0.0f;
        for (int64_t w = width; w > 1; w >>= 1)
            for (int64_t j = 0; j < w / 2; j++) squares[j] += squares[j + w / 2];
        out[b] = squares[0];
    }
}

#if SCAN_HAVE_X86_VARIANTS
__attribute__((target("avx512f"))) static int64_t energies32_avx512(const float *x, const float *add, float *dest,
                                                                    int64_t n, float *out) {
    const int stream = add && dest != x && (uintptr_t)dest % 64 == 0;
    int64_t b = 0;
    for (int64_t lo = 0; lo + 32 <= n; lo += 32, b++) {
        __m512 v0 = _mm512_loadu_ps(x + lo), v1 = _mm512_loadu_ps(x + lo + 16);
        if (add) {
            v0 = _mm512_add_ps(v0, _mm512_loadu_ps(add + lo));
            v1 = _mm512_add_ps(v1, _mm512_loadu_ps(add + lo + 16));
            if (stream) {
                _mm512_stream_ps(dest + lo, v0);
                _mm512_stream_ps(dest + lo + 16, v1);
            } else {
                _mm512_storeu_ps(dest + lo, v0);
                _mm512_storeu_ps(dest + lo + 16, v1);
            }
        }
        const __m512 w16 = _mm512_add_ps(_mm512_mul_ps(v0, v0), _mm512_mul_ps(v1, v1)); /* i + 16 */
        const __m256 w8 = _mm256_add_ps(_mm512_castps512_ps256(w16),                      /* i + 8 */
                                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w16), 1)));
        const __m128 w4 = _mm_add_ps(_mm256_castps256_ps128(w8), _mm256_extractf128_ps(w8, 1)); /* i + 4 */
        const __m128 w2 = _mm_add_ps(w4, _mm_movehl_ps(w4, w4));                                 /* i + 2 */
        out[b] = _mm_cvtss_f32(_mm_add_ss(w2, _mm_shuffle_ps(w2, w2, 1)));                       /* i + 1 */
    }
    if (stream) _mm_sfence();
    return b;
}
#endif

static PyObject *block_energies(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x_ptr, add_ptr, dest_ptr, out_ptr;
    long long n, size;
    const char *variant;
    if (!PyArg_ParseTuple(args, "KLLKKKs", &x_ptr, &n, &size, &add_ptr, &dest_ptr, &out_ptr, &variant)) return NULL;
    if (n < 0 || size < 1 || size > BLOCK_ENERGY_MAX) {
        PyErr_Format(PyExc_ValueError, "block_energies: needs n >= 0 and 1 <= size <= %d, got n=%lld size=%lld",
                     BLOCK_ENERGY_MAX, n, size);
        return NULL;
    }
    if (!cpu_has(variant)) {
        PyErr_Format(PyExc_ValueError, "block_energies: variant %R does not run here (see variants())",
                     PyTuple_GET_ITEM(args, 6));
        return NULL;
    }
    const float *x = (const float *)(uintptr_t)x_ptr, *add = (const float *)(uintptr_t)add_ptr;
    float *dest = dest_ptr ? (float *)(uintptr_t)dest_ptr : (float *)(uintptr_t)x_ptr;
    float *out = (float *)(uintptr_t)out_ptr;
    Py_BEGIN_ALLOW_THREADS
    int64_t done = 0;
#if SCAN_HAVE_X86_VARIANTS
    if (size == 32 && strcmp(variant, "avx512") == 0) done = energies32_avx512(x, add, dest, n, out);
#endif
    energies_scalar(x, add, dest, n, size, out, done);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* sum_ge(val_ptr, count, floor) -> (number, sum): of the float32 values v[i] >= floor (NaN never), how
 * many and their sum in double: eight partial sums (of i % 8, each in order of i) added in order at the
 * end, so every variant gives the same bits. SIDCo's later stages fit the exceedances over a threshold by
 * their mean (sidco.py). */
static int64_t sum_ge_lanes_scalar(const float *v, int64_t count, float floor, double sums[8]) {
    /* without a branch on the data (taken at random, it would be most of the time): a value below the
     * floor (or NaN) adds +0, as the AVX2 lanes' mask does, which leaves every partial sum's bits as they are */
    int64_t number = 0;
    for (int64_t i = 0; i < count; i++) {
        const int above = v[i] >= floor;
        uint32_t bits;
        memcpy(&bits, &v[i], sizeof bits);
        bits &= (uint32_t)0 - (uint32_t)above;
        float kept;
        memcpy(&kept, &bits, sizeof kept);
        sums[i % 8] += (double)kept;
        number += above;
    }
    return number;
}

#if SCAN_HAVE_X86_VARIANTS
/* The multiples of eight in AVX2: lanes 0-3 and 4-7 of each group in two double vectors. */
__attribute__((target("avx2,popcnt"))) static int64_t sum_ge_lanes_avx2(const float *v, int64_t count, float floor,
                                                                 double sums[8]) {
    __m256d low = _mm256_loadu_pd(sums), high = _mm256_loadu_pd(sums + 4);
    const __m256 f = _mm256_set1_ps(floor);
    int64_t number = 0, i = 0;
    for (; i + 8 <= count; i += 8) {
        const __m256 x = _mm256_loadu_ps(v + i);
        const __m256 above = _mm256_cmp_ps(x, f, _CMP_GE_OQ);
        const __m256 kept = _mm256_and_ps(x, above); /* +0 where below */
        number += __builtin_popcount((unsigned)_mm256_movemask_ps(above));
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
    }
    _mm256_storeu_pd(sums, low);
    _mm256_storeu_pd(sums + 4, high);
    return number + sum_ge_lanes_scalar(v + i, count - i, floor, sums); /* i % 8 == 0: the lanes line up */
}
#endif

static PyObject *sum_ge(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long val_ptr;
    long long count;
    float floor;
    const char *variant;
    if (!PyArg_ParseTuple(args, "KLfs", &val_ptr, &count, &floor, &variant)) return NULL;
    if (!cpu_has(variant)) {
        PyErr_Format(PyExc_ValueError, "sum_ge: variant %R does not run here (see variants())", variant);
        return NULL;
    }
    const float *v = (const float *)(uintptr_t)val_ptr;
    double sums[8] = {0};
    int64_t number;
    Py_BEGIN_ALLOW_THREADS
#if SCAN_HAVE_X86_VARIANTS
    if (strcmp(variant, "scalar") != 0) /* AVX-512 adds nothing to a read this short: its AVX2 */
        number = sum_ge_lanes_avx2(v, count, floor, sums);
    else
#endif
        number = sum_ge_lanes_scalar(v, count, floor, sums);
    Py_END_ALLOW_THREADS
    double sum = 0.0;
    for (int lane = 0; lane < 8; lane++) sum += sums[lane];
    return Py_BuildValue("Ld", (long long)number, sum);
}

static PyMethodDef methods[] = {
    {"scan_ge", scan_ge, METH_VARARGS,
     "scan_ge(x_ptr, n, floor, idx_ptr, val_ptr, cap, variant, add_ptr=0, dest_ptr=0) -> (count, sum, max): one "
     "pass over float32 x giving sum |x|, max |x| and the first cap (index, |x|) pairs with |x| >= floor; with "
     "add_ptr, dest = x + add first (dest_ptr, default x), in the same pass, and the scan is of the sum (see "
     "scan.py)."},
    {"variants", variants, METH_NOARGS,
     "variants() -> list: the scan_ge variants this CPU runs, fastest first ('avx512', 'avx2', 'scalar')."},
    {"select_largest", select_largest, METH_VARARGS,
     "select_largest(idx_ptr, val_ptr, count, k, out_ptr, variant) -> int: out[0:k] = the int64 idx entries of "
     "the k largest float32 values, in idx order, the first ones among ties with the k-th; returns k, or -1 "
     "when a value is NaN or negative (see scan.largest_in_order)."},
    {"kth_largest", kth_largest, METH_VARARGS,
     "kth_largest(val_ptr, count, k) -> int: the bit pattern of the k-th largest of count float32 values (0 < k "
     "<= count), or -1 when a value is NaN or negative (see scan.kth_largest)."},
    {"take_and_clear", take_and_clear, METH_VARARGS,
     "take_and_clear(x_ptr, n, idx_ptr, count, out_ptr) -> int: out[j] = x[idx[j]], then x[idx[j]] = 0 (float32 x, "
     "int64 idx); 0, or -1 (nothing written) when an index lies outside [0, n) (see scan.take_and_clear)."},
    {"split_largest", split_largest, METH_VARARGS,
     "split_largest(val_ptr, count, k, idx_ptr, wide_index, kept_idx_ptr, kept_val_ptr, dropped_idx_ptr, "
     "dropped_val_ptr) -> int: the k (index, value) pairs of largest |value| and the rest, each in order, the "
     "first ties with the k-th kept; k, or -1 (nothing written) when a value is NaN (see scan.split_largest)."},
    {"sample_magnitudes", sample_magnitudes, METH_VARARGS,
     "sample_magnitudes(x_ptr, add_ptr, stride, runs, run, out_ptr): out[r run + j] = |x[r stride + j] + "
     "add[r stride + j]| (x alone when add_ptr is 0) for r < runs, j < run, float32, the lines prefetched ahead "
     "(see scan.sample_floor)."},
    {"sum_ge", sum_ge, METH_VARARGS,
     "sum_ge(val_ptr, count, floor, variant) -> (number, sum): how many float32 values are >= floor and their "
     "sum in double, in eight partial sums by position (the same bits in every variant)."},
    {"block_energies", block_energies, METH_VARARGS,
     "block_energies(x_ptr, n, size, add_ptr, dest_ptr, out_ptr, variant): out[b] = the canonical pairwise sum "
     "of the squares of block b of x (of dest = x + add, written in the same pass, where add_ptr is given; see "
     "block.py)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT,
                                    "_scan",
                                    "The selectors' C kernels: fused magnitude scan, top-k of its candidates "
                                    "(see scan.py).",
                                    -1,
                                    methods,
                                    NULL,
                                    NULL,
                                    NULL,
                                    NULL};

/* the digest of this file, compiled in by setup.py: sparsecomm.core.optional refuses a build from
   other sources than the _scan.c beside it */
#ifndef SOURCE_DIGEST
#define SOURCE_DIGEST ""
#endif

PyMODINIT_FUNC PyInit__scan(void) {
#if SCAN_HAVE_X86_VARIANTS
    init_avx2_pack();
    init_avx2_pack_epi64();
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddStringConstant(m, "SOURCE_DIGEST", SOURCE_DIGEST) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
