/* Merge of sorted sparse chunks: the decompression of the sparse methods in one ordered pass.
 *
 * Every sparse method ends by adding the P chunks it received, index by index, in rank order, and
 * (for the result) dividing each sum by P. Each chunk's indices arrive sorted, so the union is a
 * P-way merge, not a sort: a binary heap over the chunks' heads, keyed on (index, chunk number),
 * pops every (index, value) pair in increasing index and, for equal indices, in chunk order. Each
 * index's sum is therefore accumulated as 0 + v_0 + v_1 + ... in chunk order, in the value type,
 * exactly as torch's sequential index_add_ of one chunk after another does: the bits are those of
 * sparsecomm.transport.chunk.add_chunks' torch path, on every rank.
 *
 *   merge_sum:     the coalesced sum, written as (unique index, sum) pairs;
 *   merge_average: the sum divided by `divisor`, written straight into a dense vector at its index
 *                  (true division, as torch's div), with the sorted unique indices written and the
 *                  non-zero results counted on the way.
 *
 * Both first check, in one sequential read of the indices, that each chunk is sorted and (for
 * merge_average) every index lies inside the dense vector, and write nothing unless it holds: a chunk
 * out of order returns -1 (the caller then takes its torch path), an index out of range -2. Indices are int32 or int64, values float32 or float64, the
 * same types across the chunks. The GIL is released during the merge.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>

#define MERGE_MAX_CHUNKS 4096
#define CHUNK_BITS 12 /* a heap key is (index << CHUNK_BITS) | chunk: one compare orders both */
#define MAX_INDEX (INT64_C(1) << (62 - CHUNK_BITS))

typedef struct {
    int nchunks;
    const void *idx[MERGE_MAX_CHUNKS];
    const void *val[MERGE_MAX_CHUNKS];
    int64_t len[MERGE_MAX_CHUNKS];
    int64_t pos[MERGE_MAX_CHUNKS];
    int64_t heap[MERGE_MAX_CHUNKS]; /* keys of the chunks' heads, a binary min-heap */
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

static inline void sift_down(int64_t *heap, int size) {
    int at = 0;
    int64_t moving = heap[0];
    for (;;) {
        int child = 2 * at + 1;
        if (child >= size) break;
        if (child + 1 < size && heap[child + 1] < heap[child]) child++;
        if (heap[child] >= moving) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = moving;
}

static int heap_build(merge_t *m) {
    int size = 0;
    for (int c = 0; c < m->nchunks; c++) {
        m->pos[c] = 0;
        if (m->len[c] > 0) {
            /* insert, sifting up */
            int64_t key = (index_at(m, c, 0) << CHUNK_BITS) | c;
            int at = size++;
            while (at > 0 && m->heap[(at - 1) / 2] > key) {
                m->heap[at] = m->heap[(at - 1) / 2];
                at = (at - 1) / 2;
            }
            m->heap[at] = key;
        }
    }
    return size;
}

/* Consume the head of the chunk at the top of the heap; returns the new heap size. */
static inline int heap_advance(merge_t *m, int size) {
    int c = (int)(m->heap[0] & ((1 << CHUNK_BITS) - 1));
    int64_t next = ++m->pos[c];
    if (next < m->len[c])
        m->heap[0] = (index_at(m, c, next) << CHUNK_BITS) | c;
    else
        m->heap[0] = m->heap[--size];
    sift_down(m->heap, size);
    return size;
}

#define TOP_INDEX(m) ((m)->heap[0] >> CHUNK_BITS)
#define TOP_CHUNK(m) ((int)((m)->heap[0] & ((1 << CHUNK_BITS) - 1)))

/* The two merges, once per value type (float, double), on chunks check_chunks accepted. `out_idx` is
 * int64 for merge_average and the chunks' index type for merge_sum. Returns the unique indices. */
#define MERGE_BODY(T)                                                                                       \
    static int64_t merge_sum_##T(merge_t *m, void *out_idx, T *out_val) {                                   \
        int size = heap_build(m);                                                                           \
        int64_t count = 0;                                                                                  \
        while (size > 0) {                                                                                  \
            int64_t index = TOP_INDEX(m);                                                                   \
            T sum = (T)0;                                                                                   \
            while (size > 0 && TOP_INDEX(m) == index) {                                                     \
                int c = TOP_CHUNK(m);                                                                       \
                sum += ((const T *)m->val[c])[m->pos[c]];                                                   \
                size = heap_advance(m, size);                                                               \
            }                                                                                               \
            if (m->wide_index)                                                                              \
                ((int64_t *)out_idx)[count] = index;                                                        \
            else                                                                                            \
                ((int32_t *)out_idx)[count] = (int32_t)index;                                               \
            out_val[count++] = sum;                                                                         \
        }                                                                                                   \
        return count;                                                                                       \
    }                                                                                                       \
    static int64_t merge_average_##T(merge_t *m, T *dense, T divisor, int64_t *out_idx,                    \
                                     int64_t *nonzero) {                                                    \
        int size = heap_build(m);                                                                           \
        int64_t count = 0, nz = 0;                                                                          \
        while (size > 0) {                                                                                  \
            int64_t index = TOP_INDEX(m);                                                                   \
            T sum = (T)0;                                                                                   \
            while (size > 0 && TOP_INDEX(m) == index) {                                                     \
                int c = TOP_CHUNK(m);                                                                       \
                sum += ((const T *)m->val[c])[m->pos[c]];                                                   \
                size = heap_advance(m, size);                                                               \
            }                                                                                               \
            T value = sum / divisor;                                                                        \
            dense[index] = value;                                                                           \
            nz += value != (T)0;                                                                            \
            out_idx[count++] = index;                                                                       \
        }                                                                                                   \
        *nonzero = nz;                                                                                      \
        return count;                                                                                       \
    }

MERGE_BODY(float)
MERGE_BODY(double)

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

/* merge_average(idx_ptrs, val_ptrs, lens, wide_index, double, dense_ptr, n, divisor, out_idx_ptr)
 *   -> (count, nonzero)
 * out_idx (int64) must hold sum(lens) entries; dense must hold n. */
static PyObject *merge_average(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *idx_ptrs, *val_ptrs, *lens;
    int wide_index, wide_value;
    unsigned long long dense, out_idx;
    long long n;
    double divisor;
    if (!PyArg_ParseTuple(args, "OOOppKLdK", &idx_ptrs, &val_ptrs, &lens, &wide_index, &wide_value, &dense, &n,
                          &divisor, &out_idx))
        return NULL;
    merge_t *m = malloc(sizeof(merge_t));
    if (m == NULL) return PyErr_NoMemory();
    if (read_chunks(m, idx_ptrs, val_ptrs, lens, wide_index) < 0) {
        free(m);
        return NULL;
    }
    int64_t count, nonzero = 0;
    Py_BEGIN_ALLOW_THREADS
    count = check_chunks(m, n);
    if (count == 0 && wide_value)
        count = merge_average_double(m, (double *)(uintptr_t)dense, divisor, (int64_t *)(uintptr_t)out_idx,
                                     &nonzero);
    else if (count == 0)
        count = merge_average_float(m, (float *)(uintptr_t)dense, (float)divisor, (int64_t *)(uintptr_t)out_idx,
                                    &nonzero);
    Py_END_ALLOW_THREADS
    free(m);
    return Py_BuildValue("LL", (long long)count, (long long)nonzero);
}

static PyMethodDef methods[] = {
    {"merge_sum", merge_sum, METH_VARARGS,
     "merge_sum(idx_ptrs, val_ptrs, lens, wide_index, wide_value, out_idx_ptr, out_val_ptr) -> count: the "
     "coalesced sum of sorted chunks, in chunk order per index (-1: a chunk is not sorted)."},
    {"merge_average", merge_average, METH_VARARGS,
     "merge_average(idx_ptrs, val_ptrs, lens, wide_index, wide_value, dense_ptr, n, divisor, out_idx_ptr) -> "
     "(count, nonzero): dense[i] = (sum of the chunks at i, in chunk order) / divisor at every index of the "
     "union (-1: a chunk is not sorted, -2: an index is out of range)."},
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

PyMODINIT_FUNC PyInit__merge(void) { return PyModule_Create(&module); }
