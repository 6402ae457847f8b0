/*
 * A sampled batch's rows, in C: the copy of windows' rows from a column into
 * the batch (`copy_rows`), and the ids of the steps at rows (`step_ids`).
 *
 * sampling/gather.py calls `copy_rows` once per batch, for every raw column
 * going to a host array; protocol.ring.Ring.step_ids calls `step_ids`.  Both read rows or
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

/* One column of the gather: its buffers and strides (see copy_rows). */
typedef struct {
    Py_buffer src, dst;
    Py_ssize_t rb, ws, rs;
    int held;   /* how many of src, dst are held (released in column_release) */
} Column;

static void
column_release(Column *c)
{
    if (c->held > 0)
        PyBuffer_Release(&c->src);
    if (c->held > 1)
        PyBuffer_Release(&c->dst);
    c->held = 0;
}

/* Parse one (src, dst, row_bytes, window_stride, row_stride) and check that
 * every window of `n` (each `length` rows at r) lands inside dst and reads
 * inside src.  0, or -1 with an exception set. */
static int
column_get(PyObject *item, Column *c, const int64_t *r, const int64_t *a, Py_ssize_t n,
           Py_ssize_t length)
{
    c->held = 0;
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "copy_rows: each column is (src, dst, row_bytes, window_stride, row_stride)");
        return -1;
    }
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 0), &c->src, PyBUF_SIMPLE) < 0)
        return -1;
    c->held = 1;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(item, 1), &c->dst, PyBUF_WRITABLE) < 0)
        return -1;
    c->held = 2;
    c->rb = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 2));
    c->ws = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 3));
    c->rs = PyLong_AsSsize_t(PyTuple_GET_ITEM(item, 4));
    if (PyErr_Occurred())
        return -1;
    if (c->rb < 1 || c->ws < 0 || c->rs < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: arguments do not fit");
        return -1;
    }
    Py_ssize_t span = length ? (length - 1) * c->rs + c->rb : 0;   /* a window's reach in dst */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (a[i] < 0 || c->dst.len < span || (a[i] > 0 && (c->dst.len - span) / a[i] < c->ws)) {
            PyErr_SetString(PyExc_ValueError, "copy_rows: a window lies outside dst");
            return -1;
        }
    }
    Py_ssize_t nrows = c->src.len / c->rb;
    for (Py_ssize_t i = 0; i < n * length; i++) {
        if (r[i] < 0 || r[i] >= nrows) {
            PyErr_SetString(PyExc_ValueError, "copy_rows: a row lies outside src");
            return -1;
        }
    }
    return 0;
}

/* Copy one column's windows (checked by column_get). */
static void
column_copy(const Column *c, const int64_t *r, const int64_t *a, Py_ssize_t n,
            Py_ssize_t length)
{
    const char *from = c->src.buf;
    char *to = c->dst.buf;
    Py_ssize_t rb = c->rb, rs = c->rs;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *w = r + i * length;
        char *d = to + a[i] * c->ws;
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
}

#define MAX_COLUMNS 256

/*
 * copy_rows(columns, rows, at)
 *
 * The gather of a batch's windows from every raw column, in one call.
 * columns: a sequence of (src, dst, row_bytes, window_stride, row_stride):
 * src a column, rows of `row_bytes` bytes one after the other.  rows: (n, L)
 * int64, window i's physical rows, copied to dst + at[i] * window_stride,
 * its row t at + t * row_stride.  Consecutive rows are copied together: a
 * window that lies in one chunk is one memcpy per column where its rows are
 * adjacent in dst too (batch-major), one per row otherwise (time-major),
 * never an index per byte run.  Like the fancy-index gather it replaces, it
 * reads rows a writer may be recycling: the caller re-checks the windows'
 * chunks after (`unchanged`).  Every row and destination of every column is
 * checked before anything is copied; the first byte of each window of each
 * column is loaded before any copy, so their cache misses overlap.
 */
static PyObject *
copy_rows(PyObject *self, PyObject *args)
{
    PyObject *columns;
    Py_buffer rw, at;
    if (!PyArg_ParseTuple(args, "Oy*y*", &columns, &rw, &at))
        return NULL;
    PyObject *result = NULL, *seq = PySequence_Fast(columns, "copy_rows: columns must be a sequence");
    Column cols[MAX_COLUMNS];
    Py_ssize_t m = 0, got = 0;
    if (seq == NULL)
        goto done;
    m = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t n = at.len / 8;
    const int64_t *r = rw.buf, *a = at.buf;
    if (m > MAX_COLUMNS || at.len % 8 || (n == 0 && rw.len)
        || (n > 0 && (rw.len % (8 * n) || rw.len == 0))) {
        PyErr_SetString(PyExc_ValueError, "copy_rows: arguments do not fit");
        goto done;
    }
    Py_ssize_t length = n ? rw.len / 8 / n : 0;
    for (; got < m; got++) {
        if (column_get(PySequence_Fast_GET_ITEM(seq, got), &cols[got], r, a, n, length) < 0) {
            column_release(&cols[got]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    unsigned char sink = 0;
    for (Py_ssize_t c = 0; c < m; c++)
        for (Py_ssize_t i = 0; i < n; i++)
            sink ^= (unsigned char)((const char *)cols[c].src.buf)[r[i * length] * cols[c].rb];
    __asm__ volatile("" : : "r"(sink));
    for (Py_ssize_t c = 0; c < m; c++)
        column_copy(&cols[c], r, a, n, length);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    for (Py_ssize_t c = 0; c < got; c++)
        column_release(&cols[c]);
    Py_XDECREF(seq);
    PyBuffer_Release(&rw);
    PyBuffer_Release(&at);
    return result;
}

/*
 * step_ids(buffer, geometry, rows, out, first=0, tag=0) -> top
 *
 * The id of the step at each physical row of rows (int64): its chunk's
 * ticket (loaded with acquire) * chunk_size + its offset in the chunk, plus
 * `first`, with the bits of `tag` set (protocol.stepids says what they mean).
 * Id i goes to the 8 bytes at out + i * stride, where stride = out's size /
 * the rows' count (8 for an int64 array; more for a caller's record layout,
 * whose other bytes are left as they are).  Returns the largest id before
 * the tag is set, for the caller's overflow check.  Every row is checked
 * before anything is written.  Like the rows read with them, the ids are
 * judged by the windows' seqlock re-check after (`unchanged`).
 */
static PyObject *
step_ids(PyObject *self, PyObject *args)
{
    Py_buffer mm, rw, out;
    PyObject *geo;
    long long first = 0;
    unsigned long long tag = 0;
    if (!PyArg_ParseTuple(args, "w*Oy*w*|LK", &mm, &geo, &rw, &out, &first, &tag))
        return NULL;
    PyObject *result = NULL;
    ShmGeometry g;
    if (shm_geometry_get(geo, mm.len, &g) < 0)
        goto done;
    Py_ssize_t n = rw.len / 8;
    Py_ssize_t stride = n ? out.len / n : 8;
    if (rw.len % 8 || stride < 8 || out.len != n * stride) {
        PyErr_SetString(PyExc_ValueError,
                        "step_ids: rows must be int64, and out 8 or more bytes per row");
        goto done;
    }
    const int64_t *r = rw.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (r[i] < 0 || r[i] >= g.capacity) {
            PyErr_SetString(PyExc_ValueError, "step_ids: row out of range");
            goto done;
        }
    }
    char *o = out.buf;
    int64_t k = g.chunk_size, top = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t chunk = r[i] / k;
        uint64_t ticket = shm_load(mm.buf, g.chunks_at + chunk * g.entry_bytes + g.entry_ticket,
                                   memory_order_acquire);
        int64_t id = (int64_t)ticket * k + (r[i] - chunk * k) + first;
        if (id > top)
            top = id;
        uint64_t word = (uint64_t)id | tag;
        memcpy(o + i * stride, &word, 8);
    }
    result = PyLong_FromLongLong(top);
done:
    PyBuffer_Release(&mm);
    PyBuffer_Release(&rw);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"step_ids", step_ids, METH_VARARGS,
     "step_ids(buffer, geometry, rows, out, first=0, tag=0) -> top"},
    {"copy_rows", copy_rows, METH_VARARGS,
     "copy_rows(columns, rows, at): columns of (src, dst, row_bytes, window_stride, row_stride)"},
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
