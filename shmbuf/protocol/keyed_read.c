/*
 * keyed_read.c: keyed_take(buffer, count_offsets, base, count, lengths, ages,
 *                          ring_len, columns, stale) -> int
 *
 * The copy half of a keyed-ring read (protocol.keyed.KeyWords.read), for E keys
 * whose counts and live lengths the caller loaded: entry age a of key e is
 * position count[e]-1-a, slot (count[e]-1-a) % ring_len, row base[e]+slot.
 * ages is an (E, m) int64 array; an age outside [0, lengths[e]) gives a zero
 * row.  columns is a tuple of (src, start, stop, out): src the column's
 * (capacity, ...) array over the segment, out an (E, stop-start, ...) array
 * that receives ages[:, start:stop].  The copies run without the GIL.
 * Then one acquire fence and a relaxed load of each key's count: key e is
 * stale (stale[e] = 1) if a writer may have overwritten the oldest entry it
 * copied, i.e. oldest < after - (ring_len - 1).  Returns how many are stale.
 * Every row is bounds-checked before any copy: a corrupt base, count or age
 * raises ValueError, never reads outside src.
 *
 * Memory orders: the copies are plain loads; then one acquire fence orders
 * them before the relaxed loads of the counts that judge staleness.
 */
#include "atomic_module.h"

typedef struct {
    Py_buffer src, out;
    Py_ssize_t start, stop, row_bytes, capacity;
} TakeColumn;

PyObject *
keyed_take(PyObject *self, PyObject *args)
{
    Py_buffer mm, offs, base, count, lengths, ages, stale;
    Py_ssize_t ring_len;
    PyObject *columns;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*y*nO!w*", &mm, &offs, &base, &count, &lengths,
                          &ages, &ring_len, &PyTuple_Type, &columns, &stale))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t ncols = PyTuple_GET_SIZE(columns), ready = 0;
    TakeColumn *cols = PyMem_Calloc(ncols ? ncols : 1, sizeof(TakeColumn));
    if (cols == NULL) {
        PyErr_NoMemory();
        goto release;
    }
    Py_ssize_t n = offs.len / 8, m = 0;
    if (offs.len % 8 || base.len != offs.len || count.len != offs.len
            || lengths.len != offs.len || stale.len != n || ring_len < 1) {
        PyErr_SetString(PyExc_ValueError, "keyed_take: inconsistent key arrays");
        goto release;
    }
    if (n) {
        if (ages.len % (8 * n)) {
            PyErr_SetString(PyExc_ValueError, "keyed_take: ages is not (E, m) int64");
            goto release;
        }
        m = ages.len / (8 * n);
    }
    const int64_t *off = offs.buf, *b = base.buf, *c = count.buf, *len = lengths.buf;
    const int64_t *age = ages.buf;
    for (Py_ssize_t e = 0; e < n; e++)
        if (!word_at(&mm, off[e]))
            goto release;
    for (; ready < ncols; ready++) {
        TakeColumn *col = &cols[ready];
        PyObject *item = PyTuple_GET_ITEM(columns, ready), *src, *out;
        if (!PyArg_ParseTuple(item, "OnnO", &src, &col->start, &col->stop, &out))
            goto release;
        if (PyObject_GetBuffer(src, &col->src, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0)
            goto release;
        if (PyObject_GetBuffer(out, &col->out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            PyBuffer_Release(&col->src);
            goto release;
        }
        Py_ssize_t cap = col->src.ndim ? col->src.shape[0] : 0;
        col->capacity = cap;
        col->row_bytes = cap ? col->src.len / cap : 0;
        if (col->start < 0 || col->stop < col->start || col->stop > m
                || col->out.len != n * (col->stop - col->start) * col->row_bytes) {
            ready++;
            PyErr_SetString(PyExc_ValueError, "keyed_take: a column's ages or output do not fit");
            goto release;
        }
    }
    /* Every row the copies will read, checked before any copy. */
    for (Py_ssize_t e = 0; e < n; e++) {
        for (Py_ssize_t k = 0; k < m; k++) {
            int64_t a = age[e * m + k];
            if (a < 0 || a >= len[e])
                continue;
            int64_t pos = c[e] - 1 - a, row = b[e] + (pos % ring_len);
            for (Py_ssize_t j = 0; j < ncols; j++) {
                if (pos < 0 || row < 0 || row >= cols[j].capacity) {
                    PyErr_Format(PyExc_ValueError, "keyed_take: key %zd's age %lld maps to "
                                 "row %lld, outside the column", e, (long long)a,
                                 (long long)row);
                    goto release;
                }
            }
        }
    }
    uint8_t *st = stale.buf;
    Py_ssize_t n_stale = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < ncols; j++) {
        TakeColumn *col = &cols[j];
        Py_ssize_t rb = col->row_bytes;
        char *dst = col->out.buf;
        const char *src = col->src.buf;
        for (Py_ssize_t e = 0; e < n; e++) {
            for (Py_ssize_t k = col->start; k < col->stop; k++, dst += rb) {
                int64_t a = age[e * m + k];
                if (a < 0 || a >= len[e]) {
                    memset(dst, 0, rb);
                    continue;
                }
                memcpy(dst, src + (b[e] + (c[e] - 1 - a) % ring_len) * rb, rb);
            }
        }
    }
    atomic_thread_fence(memory_order_acquire);  /* the copies before the loads below */
    for (Py_ssize_t e = 0; e < n; e++) {
        int64_t oldest = INT64_MAX;
        for (Py_ssize_t k = 0; k < m; k++) {
            int64_t a = age[e * m + k];
            if (a >= 0 && a < len[e] && c[e] - 1 - a < oldest)
                oldest = c[e] - 1 - a;
        }
        int64_t after = (int64_t)atomic_load_explicit(
            (atomic_u64 *)((char *)mm.buf + off[e]), memory_order_relaxed);
        st[e] = oldest != INT64_MAX && oldest < after - (ring_len - 1);
        n_stale += st[e];
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(n_stale);
release:
    for (Py_ssize_t j = 0; j < ready && cols; j++) {
        PyBuffer_Release(&cols[j].src);
        PyBuffer_Release(&cols[j].out);
    }
    PyMem_Free(cols);
    PyBuffer_Release(&mm);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&base);
    PyBuffer_Release(&count);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&ages);
    PyBuffer_Release(&stale);
    return result;
}

