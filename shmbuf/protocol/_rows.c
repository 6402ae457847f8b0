/*
 * A sampled batch's rows, in C: the copy of windows' rows from a column into
 * the batch (`copy_rows`), and the ids of the steps at rows (`step_ids`).
 *
 * sampling/gather.py calls `copy_rows` for every raw column going to a host
 * array; protocol.ring.Ring.step_ids calls `step_ids`.  Both read rows or
 * chunk words that a writer may be changing: the caller re-checks the
 * windows' chunks after (the seqlock, `_window_check.unchanged`), as for any
 * read of the store.  Both check every index against the buffers they were
 * given before reading anything, so a bad row is an error, never a read
 * outside the mapping.  The chunk geometry arrives packed by protocol.geometry
 * and is read by shmbuf_words.h's one parser.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "shmbuf_words.h"

/* One row of `n` bytes: the common small sizes by a fixed-size copy, which the
 * compiler inlines (a call to memcpy per row costs more than a small row's copy). */
static inline void
copy_row(char *d, const char *f, Py_ssize_t n)
{
    switch (n) {
    case 1: *d = *f; return;
    case 2: memcpy(d, f, 2); return;
    case 4: memcpy(d, f, 4); return;
    case 8: memcpy(d, f, 8); return;
    case 16: memcpy(d, f, 16); return;
    default: memcpy(d, f, (size_t)n);
    }
}

/*
 * copy_rows(src, dst, rows, at, row_bytes, window_stride, row_stride)
 *
 * The gather of a batch's windows from one column.  src: the column, rows of
 * `row_bytes` bytes one after the other; rows: (n, L) int64, window i's
 * physical rows, copied to dst + at[i] * window_stride, its row t at
 * + t * row_stride.  Consecutive rows are copied together: a window that lies
 * in one chunk is one memcpy where its rows are adjacent in dst too
 * (batch-major), one per row otherwise (time-major), never an index per byte
 * run.  Like the fancy-index gather it replaces, it reads rows a writer may be
 * recycling: the caller re-checks the windows' chunks after (`unchanged`).
 * Every row and destination is checked against the buffers' lengths before
 * anything is copied.
 */
static PyObject *
copy_rows(PyObject *self, PyObject *args)
{
    Py_buffer src, dst, rw, at;
    Py_ssize_t rb, ws, rs;
    if (!PyArg_ParseTuple(args, "y*w*y*y*nnn", &src, &dst, &rw, &at, &rb, &ws, &rs))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = at.len / 8;
    const int64_t *r = rw.buf, *a = at.buf;
    if (at.len % 8 || rb < 1 || ws < 0 || rs < 0 || (n == 0 && rw.len)
        || (n > 0 && (rw.len % (8 * n) || rw.len == 0))) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: arguments do not fit");
        goto done;
    }
    Py_ssize_t length = n ? rw.len / 8 / n : 0, nrows = src.len / rb;
    Py_ssize_t span = length ? (length - 1) * rs + rb : 0;   /* one window's reach in dst */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (a[i] < 0 || dst.len < span || (a[i] > 0 && (dst.len - span) / a[i] < ws)) {
            PyErr_SetString(PyExc_ValueError, "copy_rows: a window lies outside dst");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n * length; i++) {
        if (r[i] < 0 || r[i] >= nrows) {
            PyErr_SetString(PyExc_ValueError, "copy_rows: a row lies outside src");
            goto done;
        }
    }
    const char *from = src.buf;
    char *to = dst.buf;
    Py_BEGIN_ALLOW_THREADS
    /* Load each window's first byte before copying any: the cache misses of the
     * windows then overlap instead of coming one window at a time. */
    unsigned char sink = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        sink ^= (unsigned char)from[r[i * length] * rb];
    __asm__ volatile("" : : "r"(sink));
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *w = r + i * length;
        char *d = to + a[i] * ws;
        for (Py_ssize_t t = 0; t < length;) {
            Py_ssize_t run = 1;
            while (t + run < length && w[t + run] == w[t] + run)
                run++;
            const char *f = from + w[t] * rb;
            if (rs == rb)
                memcpy(d + t * rs, f, (size_t)(run * rb));
            else
                for (Py_ssize_t j = 0; j < run; j++)
                    copy_row(d + (t + j) * rs, f + j * rb, rb);
            t += run;
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&rw);
    PyBuffer_Release(&at);
    return result;
}

/*
 * step_ids(buffer, geometry, rows, out)
 *
 * out[i] (int64) = the id of the step at physical rows[i] (int64, same
 * length): its chunk's ticket (loaded with acquire) * chunk_size + its offset
 * in the chunk.  Like the rows read with them, the ids are judged by the
 * windows' seqlock re-check after (`unchanged`).
 */
static PyObject *
step_ids(PyObject *self, PyObject *args)
{
    Py_buffer mm, rw, out;
    PyObject *geo;
    if (!PyArg_ParseTuple(args, "w*Oy*w*", &mm, &geo, &rw, &out))
        return NULL;
    PyObject *result = NULL;
    ShmGeometry g;
    if (shm_geometry_get(geo, mm.len, &g) < 0)
        goto done;
    Py_ssize_t n = rw.len / 8;
    if (rw.len % 8 || out.len != rw.len) {
        PyErr_SetString(PyExc_ValueError, "step_ids: rows and out must be int64 of one length");
        goto done;
    }
    const int64_t *r = rw.buf;
    int64_t *o = out.buf, k = g.chunk_size;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r[i] < 0 || r[i] >= g.capacity) {
            PyErr_SetString(PyExc_ValueError, "step_ids: row out of range");
            goto done;
        }
        int64_t chunk = r[i] / k;
        uint64_t ticket = shm_load(mm.buf, g.chunks_at + chunk * g.entry_bytes + g.entry_ticket,
                                   memory_order_acquire);
        o[i] = (int64_t)ticket * k + (r[i] - chunk * k);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&rw);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"step_ids", step_ids, METH_VARARGS, "step_ids(buffer, geometry, rows, out)"},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(src, dst, rows, at, row_bytes, window_stride, row_stride)"},
    SHM_READ_GEOMETRY_METHOD,
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "shmbuf.protocol._rows",
    "A sampled batch's rows: copied from the columns, and their step ids.", -1, methods,
};

PyMODINIT_FUNC
PyInit__rows(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (shm_geometry_export(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
