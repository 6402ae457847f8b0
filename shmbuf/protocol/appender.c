/*
 * appender.c: the writer's fast path (Appender) and stream_copy, the copy of
 * Writer.extend's runs.
 *
 * Memory orders: the header's closed and writers_stopped words and the clock are read relaxed
 * before the copy (the checks are repeated where they matter: the rate gate's
 * CAS); the copy itself is plain or streaming stores, then a store fence
 * (stream_fence) where it streamed; the clock is a relaxed fetch-add (or the
 * rate gate's acq_rel CAS); the slot's step count is a release store; the new
 * chunk counts are a release store (one stream) or one release fence and
 * relaxed stores (many streams), in protocol.streams.Streams.publish's order.
 */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#define NO_IMPORT_ARRAY
#include "atomic_module.h"
#include <float.h>
#include <limits.h>
#include <math.h>
#include <numpy/arrayobject.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/*
 * Copy n bytes of step data into the segment.  Rows of 1 KiB or more go
 * with non-temporal stores where the CPU has them (x86 SSE2): a writer
 * fills memory that it will not read again, and streaming stores skip
 * reading each destination line first, which doubles the copy rate into
 * cold memory on this project's VM (12 KiB rows: 2.1 -> 1.1 us).  They are
 * weakly ordered: every caller issues stream_fence() before the release
 * store that publishes the rows.  Returns 1 if it streamed.
 */
#define STREAM_MIN 1024
static inline int
copy_row(char *dst, const char *src, size_t n)
{
#if defined(__SSE2__)
    if (n >= STREAM_MIN && ((uintptr_t)dst & 15) == 0) {
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + i, src + i, n - i);
        return 1;
    }
#endif
    memcpy(dst, src, n);
    return 0;
}

/* Orders streaming stores before later stores (the publishing release store). */
static inline void
stream_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/*
 * Appender: the writer's fast path for `add` and `add_batch`.
 *
 * protocol.streams.Streams.appender builds one per Streams object (a writer's stream,
 * or its n_envs streams) from the column views and the Streams' cursor
 * arrays, which it shares: fill, base, rows, count_off, ep and left are
 * read and advanced here and in protocol.streams alike.  A call takes the keyword
 * dict of `add` / `add_batch` and either
 *   - returns -1 having published nothing: a column is missing or unknown, a
 *     value is not an exact ndarray (or numpy scalar) of its column's dtype
 *     and shape, nor a Python bool/int/float that the column holds exactly
 *     (writing/cast.py: scalar_fast_path's rules), a float done value is not exactly 0
 *     or 1, a stream's chunk is full, the
 *     buffer's closed word or its writers_stopped word is set (the Python
 *     path decides what that means),
 *     or the rate limiter (`gate`) does not admit the first step now (checked
 *     before the copy, and again by the reserving CAS after it; only a lost
 *     race leaves written, unpublished rows, which the Python path rewrites).  The
 *     caller then takes the Python path, which makes every check and raises
 *     its errors, or claims the next chunk;
 *   - or copies every value into the stream's next row, stores the row's
 *     episode number in _ep, numbers the steps (a fetch-add on the header's
 *     clock, then each row's _t), counts the steps in the slot (release), and
 *     publishes the new counts (release; for many streams one release fence
 *     and relaxed stores), in protocol.streams.Streams.publish's order.  It returns 1
 *     if the done column is true in a row (the caller ends those episodes),
 *     else 0.
 * It holds the mapping's buffer, so the memory stays mapped while it lives.
 */
typedef struct {
    PyObject *name;          /* the column's name */
    PyArray_Descr *descr;    /* its dtype */
    int ndim;                /* per-step ndim and shape */
    npy_intp dims[NPY_MAXDIMS];
    char *data;              /* row 0 of the column */
    npy_intp row_bytes, itemsize;
    char kind;               /* 'b', 'i', 'u', 'f': Python scalars are converted; 0: never */
} Col;

typedef struct {
    PyObject_HEAD
    Py_buffer mm;
    PyObject *keep;          /* the views and cursor arrays, kept alive */
    Py_ssize_t ncols, n;     /* columns; streams */
    Col *cols;
    int done;                /* index of the done column, -1 if none */
    char *ep_col;            /* the int64 _ep column */
    char *t_col;             /* the int64 _t column: each row's clock number */
    npy_intp capacity;
    int64_t *fill, *base, *rows, *count_off, *ep, *left;
    Py_ssize_t steps_off;    /* the slot's step counter */
    Py_ssize_t clock_off;    /* the header's clock */
    Py_ssize_t closed_off;   /* the header's closed word */
    Py_ssize_t stopped_off;  /* the header's writers_stopped word (Buffer.stop_writers) */
    const RateOffs *rate;    /* the rate limiter's words (the gate's), NULL: not limited */
} Appender;

static void
appender_dealloc(Appender *self)
{
    if (self->cols) {
        for (Py_ssize_t i = 0; i < self->ncols; i++) {
            Py_XDECREF(self->cols[i].name);
            Py_XDECREF(self->cols[i].descr);
        }
        PyMem_Free(self->cols);
    }
    if (self->mm.obj)
        PyBuffer_Release(&self->mm);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A C-contiguous int64 (or uint8 for ep column) array's data, or NULL with an error. */
static char *
array_data(PyObject *o, int type, npy_intp min_len, const char *what)
{
    if (!PyArray_Check(o) || PyArray_TYPE((PyArrayObject *)o) != type
        || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o)
        || PyArray_SIZE((PyArrayObject *)o) < min_len) {
        PyErr_Format(PyExc_ValueError, "Appender: %s must be a contiguous array of "
                     "at least %zd items of the expected dtype", what, (Py_ssize_t)min_len);
        return NULL;
    }
    return PyArray_BYTES((PyArrayObject *)o);
}

/* Which Python scalars a column of `d` converts: its kind, or 0 for none. */
static char
scalar_kind(PyArray_Descr *d)
{
    if (!PyArray_ISNBO(d->byteorder))
        return 0;
    switch (d->type_num) {
    case NPY_BOOL: return 'b';
    case NPY_BYTE: case NPY_SHORT: case NPY_INT: case NPY_LONG: case NPY_LONGLONG:
        return 'i';
    case NPY_UBYTE: case NPY_USHORT: case NPY_UINT: case NPY_ULONG: case NPY_ULONGLONG:
        return 'u';
    case NPY_FLOAT: case NPY_DOUBLE: return 'f';
    default: return 0;
    }
}

/*
 * Appender(mm, geometry, *, names, views, ep_view, t_view, done, fill, base, rows,
 *          count_off, ep, left, steps_off, gate=None)
 * Every argument after the geometry is named (keyword-only, all but gate required);
 * the header's clock and closed words are the geometry's.
 * gate: the writer's RateGate (kept alive in `keep`), or None.
 */
static PyObject *
appender_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"", "", "names", "views", "ep_view", "t_view", "done", "fill",
                             "base", "rows", "count_off", "ep", "left", "steps_off", "gate",
                             NULL};
    PyObject *names = NULL, *views = NULL, *ep_view = NULL, *t_view = NULL, *fill = NULL,
             *base = NULL, *rows = NULL, *count_off = NULL, *ep = NULL, *left = NULL, *mm, *geo;
    PyObject *gate = Py_None, *done_o = NULL, *steps_o = NULL;
    int done;
    Py_ssize_t steps_off, clock_off, closed_off;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|$O!O!OOOOOOOOOOO", kwlist, &mm, &geo,
                                     &PyTuple_Type, &names, &PyTuple_Type, &views, &ep_view,
                                     &t_view, &done_o, &fill, &base, &rows, &count_off, &ep,
                                     &left, &steps_o, &gate))
        return NULL;
    PyObject *required[] = {names, views, ep_view, t_view, done_o, fill, base, rows, count_off,
                            ep, left, steps_o};
    for (int i = 0; i < 12; i++) {
        if (required[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "Appender: missing keyword argument '%s'",
                         kwlist[i + 2]);
            return NULL;
        }
    }
    long done_l = PyLong_AsLong(done_o);
    if (done_l == -1 && PyErr_Occurred())
        return NULL;
    if (done_l < INT_MIN || done_l > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "Appender: done is out of range");
        return NULL;
    }
    done = (int)done_l;
    steps_off = PyLong_AsSsize_t(steps_o);
    if (steps_off == -1 && PyErr_Occurred())
        return NULL;
    if (gate != Py_None && !PyObject_TypeCheck(gate, &RateGateType)) {
        PyErr_SetString(PyExc_TypeError, "Appender: gate must be a RateGate or None");
        return NULL;
    }
    Appender *self = (Appender *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    ShmGeometry g;
    if (PyObject_GetBuffer(mm, &self->mm, PyBUF_WRITABLE) < 0
        || shm_geometry_get(geo, self->mm.len, &g) < 0)
        goto fail;
    clock_off = g.clock;
    closed_off = g.closed;
    self->stopped_off = g.stopped;
    self->keep = Py_BuildValue("(OOOOOOOOOOO)", views, ep_view, t_view, fill, base, rows,
                               count_off, ep, left, names, gate);
    if (!self->keep)
        goto fail;
    if (gate != Py_None) {
        if (((RateGate *)gate)->mm.buf != self->mm.buf) {
            PyErr_SetString(PyExc_ValueError, "Appender: the gate is over another mapping");
            goto fail;
        }
        self->rate = &((RateGate *)gate)->o;
    }
    Py_ssize_t ncols = PyTuple_GET_SIZE(names);
    if (ncols != PyTuple_GET_SIZE(views) || done < -1 || done >= ncols) {
        PyErr_SetString(PyExc_ValueError, "Appender: names, views and done do not fit");
        goto fail;
    }
    self->n = PyArray_Check(fill) ? PyArray_SIZE((PyArrayObject *)fill) : 0;
    if (self->n < 1 || !(self->fill = (int64_t *)array_data(fill, NPY_INT64, self->n, "fill"))
        || !(self->base = (int64_t *)array_data(base, NPY_INT64, self->n, "base"))
        || !(self->rows = (int64_t *)array_data(rows, NPY_INT64, self->n, "rows"))
        || !(self->count_off = (int64_t *)array_data(count_off, NPY_INT64, self->n, "count_off"))
        || !(self->ep = (int64_t *)array_data(ep, NPY_INT64, self->n, "ep"))
        || !(self->left = (int64_t *)array_data(left, NPY_INT64, 1, "left"))
        || !(self->ep_col = array_data(ep_view, NPY_INT64, 1, "ep_view"))
        || !(self->t_col = array_data(t_view, NPY_INT64, 1, "t_view")))
        goto fail;
    self->capacity = PyArray_DIM((PyArrayObject *)ep_view, 0);
    if (PyArray_DIM((PyArrayObject *)t_view, 0) != self->capacity) {
        PyErr_SetString(PyExc_ValueError, "Appender: the _t view does not fit");
        goto fail;
    }
    if (!shm_is_word(steps_off, self->mm.len)) {
        PyErr_SetString(PyExc_ValueError, "Appender: an offset is not a word of the mapping");
        goto fail;
    }
    self->steps_off = steps_off;
    self->clock_off = clock_off;
    self->closed_off = closed_off;
    self->done = done;
    self->cols = PyMem_Calloc(ncols ? ncols : 1, sizeof(Col));
    if (!self->cols) {
        PyErr_NoMemory();
        goto fail;
    }
    self->ncols = ncols;
    for (Py_ssize_t i = 0; i < ncols; i++) {
        Col *c = &self->cols[i];
        PyObject *name = PyTuple_GET_ITEM(names, i), *view = PyTuple_GET_ITEM(views, i);
        if (!PyUnicode_Check(name) || !PyArray_Check(view)
            || !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)view)
            || PyArray_NDIM((PyArrayObject *)view) < 1
            || PyArray_DIM((PyArrayObject *)view, 0) != self->capacity) {
            PyErr_SetString(PyExc_ValueError, "Appender: a column view does not fit");
            goto fail;
        }
        PyArrayObject *a = (PyArrayObject *)view;
        Py_INCREF(name);
        c->name = name;
        c->descr = PyArray_DESCR(a);
        Py_INCREF(c->descr);
        c->ndim = PyArray_NDIM(a) - 1;
        c->row_bytes = c->itemsize = PyArray_ITEMSIZE(a);
        for (int d = 0; d < c->ndim; d++) {
            c->dims[d] = PyArray_DIM(a, d + 1);
            c->row_bytes *= c->dims[d];
        }
        c->data = PyArray_BYTES(a);
        c->kind = scalar_kind(c->descr);
    }
    if (done >= 0 && (self->cols[done].kind == 0 || self->cols[done].ndim != 0)) {
        PyErr_SetString(PyExc_ValueError, "Appender: the done column must be a numeric scalar");
        goto fail;
    }
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* Store the Python scalar v into out as column c's type; 0 if it does not fit exactly. */
static int
convert_scalar(const Col *c, PyObject *v, char *out, int *truth)
{
    int size = (int)c->itemsize;
    double x;
    long long i = 0;
    unsigned long long u = 0;
    int is_float = 0, negative = 0;
    if (PyBool_Check(v)) {
        i = u = v == Py_True;
    } else if (PyFloat_CheckExact(v)) {
        x = PyFloat_AS_DOUBLE(v);
        is_float = 1;
    } else if (PyLong_CheckExact(v)) {
        int overflow;
        i = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow < 0 || (i == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return 0;
        }
        if (overflow > 0) {
            u = PyLong_AsUnsignedLongLong(v);
            if (u == (unsigned long long)-1 && PyErr_Occurred()) {
                PyErr_Clear();
                return 0;
            }
            if (c->kind != 'u')
                return 0;
        } else {
            negative = i < 0;
            u = (unsigned long long)i;
        }
        if (c->kind == 'b')
            return 0;                       /* ints into bool take the Python path */
        if (c->kind == 'f') {               /* exact below 2**nmant */
            unsigned long long lim = size == 4 ? 1ULL << 23 : 1ULL << 52;
            if (overflow > 0 || (negative ? -(unsigned long long)i : u) > lim)
                return 0;
        }
    } else {
        return 0;
    }
    if (is_float) {
        *truth = x != 0.0;
        if (c->kind == 'b') {
            if (x != 0.0 && x != 1.0)
                return 0;
            *(npy_bool *)out = x != 0.0;
            return 1;
        }
        if (c->kind != 'f')
            return 0;
        if (size == 4) {
            if (fabs(x) > FLT_MAX && isfinite(x))
                return 0;
            float f = (float)x;
            memcpy(out, &f, 4);
        } else {
            memcpy(out, &x, 8);
        }
        return 1;
    }
    *truth = negative || u != 0;
    switch (c->kind) {
    case 'b':
        *(npy_bool *)out = u != 0;
        return 1;
    case 'f':
        if (size == 4) {
            float f = negative ? (float)i : (float)u;
            memcpy(out, &f, 4);
        } else {
            double d = negative ? (double)i : (double)u;
            memcpy(out, &d, 8);
        }
        return 1;
    case 'i': {
        long long lo = size == 8 ? LLONG_MIN : -(1LL << (8 * size - 1));
        long long hi = size == 8 ? LLONG_MAX : (1LL << (8 * size - 1)) - 1;
        if (!negative && u > (unsigned long long)hi)
            return 0;
        if (negative && i < lo)
            return 0;
        break;
    }
    case 'u':
        if (negative || (size < 8 && u >> (8 * size)))
            return 0;
        break;
    default:
        return 0;
    }
    /* little-endian host (checked at import): the low bytes are the value */
    memcpy(out, &u, size);
    return 1;
}

/* Is the stored scalar at p (column c's type) true? */
static int
truth_of(const Col *c, const char *p)
{
    if (c->kind == 'f') {
        float f;
        double d;
        if (c->itemsize == 4)
            return memcpy(&f, p, 4), f != 0.0f;
        return memcpy(&d, p, 8), d != 0.0;
    }
    for (npy_intp b = 0; b < c->itemsize; b++)
        if (p[b])
            return 1;
    return 0;
}

/* 1 if each of the n values of float column c at p is exactly 0 or 1 (a float done
 * column holds flags only: 0.5 or -3.0 must not end an episode; NaN is neither). */
static int
float_flags(const Col *c, const char *p, npy_intp n)
{
    for (npy_intp j = 0; j < n; j++, p += c->itemsize) {
        double x;
        if (c->itemsize == 4) {
            float f;
            memcpy(&f, p, 4);
            x = f;
        } else {
            memcpy(&x, p, 8);
        }
        if (x != 0.0 && x != 1.0)
            return 0;
    }
    return 1;
}

/*
 * Check value v of column c for `lead` rows (0: a single step) without
 * writing: 1 and *src = its bytes if it goes as it is, 0 if not.  Python
 * scalars are converted into `scratch` (16 bytes).
 */
static int
value_fits(const Col *c, PyObject *v, npy_intp lead, const char **src, char *scratch,
           int *truth)
{
    if (PyArray_CheckExact(v)) {
        PyArrayObject *a = (PyArrayObject *)v;
        int off = lead > 0;
        if (PyArray_NDIM(a) != c->ndim + off || !PyArray_IS_C_CONTIGUOUS(a))
            return 0;
        if (off && PyArray_DIM(a, 0) != lead)
            return 0;
        for (int d = 0; d < c->ndim; d++)
            if (PyArray_DIM(a, d + off) != c->dims[d])
                return 0;
        if (PyArray_DESCR(a) != c->descr && !PyArray_EquivTypes(PyArray_DESCR(a), c->descr))
            return 0;
        *src = PyArray_BYTES(a);
        *truth = -1;                                 /* read from the bytes */
        return 1;
    }
    if (lead > 0 || c->ndim != 0 || c->kind == 0)
        return 0;
    if (PyArray_IsScalar(v, Generic)) {
        PyArray_Descr *d = PyArray_DescrFromScalar(v);
        if (!d) {
            PyErr_Clear();
            return 0;
        }
        int same = d == c->descr || PyArray_EquivTypes(d, c->descr);
        Py_DECREF(d);
        if (!same)
            return 0;
        PyArray_ScalarAsCtype(v, scratch);
        *src = scratch;
        *truth = -1;
        return 1;
    }
    *src = scratch;
    return convert_scalar(c, v, scratch, truth);
}

#define MAX_FAST_COLUMNS 64

static PyObject *
append(Appender *self, PyObject *columns, int batch)
{
    if (!PyDict_CheckExact(columns) || PyDict_GET_SIZE(columns) != self->ncols
        || self->ncols > MAX_FAST_COLUMNS
        || atomic_load_explicit((atomic_u64 *)((char *)self->mm.buf + self->closed_off),
                                memory_order_relaxed)
        || atomic_load_explicit((atomic_u64 *)((char *)self->mm.buf + self->stopped_off),
                                memory_order_relaxed))
        return PyLong_FromLong(-1);
    /* A step the rate limiter would make wait: the Python path waits (copying nothing here). */
    if (self->rate && !insert_fits((char *)self->mm.buf, self->rate, atomic_load_explicit(
            (atomic_u64 *)((char *)self->mm.buf + self->clock_off), memory_order_relaxed)))
        return PyLong_FromLong(-1);
    npy_intp n = batch ? self->n : 1;
    const char *src[MAX_FAST_COLUMNS];
    char scratch[MAX_FAST_COLUMNS][16];
    int truth = 0;
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        Col *c = &self->cols[i];
        PyObject *v = PyDict_GetItemWithError(columns, c->name);
        int t = 0;
        if (!v) {
            if (PyErr_Occurred())
                return NULL;
            return PyLong_FromLong(-1);
        }
        if (!value_fits(c, v, batch ? n : 0, &src[i], scratch[i], &t))
            return PyLong_FromLong(-1);
        if (i == self->done) {
            if (c->kind == 'f' && !float_flags(c, src[i], n))
                return PyLong_FromLong(-1);   /* the Python path names the value */
            truth = t;
        }
    }
    /* Room in every stream's chunk, and rows and count words inside the mapping. */
    if (batch && *self->left <= 0)
        return PyLong_FromLong(-1);
    for (npy_intp j = 0; j < n; j++) {
        int64_t row = self->base[j] + self->fill[j];
        if (self->fill[j] < 0 || self->fill[j] >= self->rows[j] || self->base[j] < 0
            || row >= self->capacity || self->count_off[j] < 0 || self->count_off[j] % 8
            || self->count_off[j] > self->mm.len - 8)
            return PyLong_FromLong(-1);
    }
    int streamed = 0;
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        const Col *c = &self->cols[i];
        for (npy_intp j = 0; j < n; j++)
            streamed |= copy_row(c->data + (self->base[j] + self->fill[j]) * c->row_bytes,
                                 src[i] + j * c->row_bytes, (size_t)c->row_bytes);
    }
    if (streamed)
        stream_fence();
    int terminal = 0;
    if (self->done >= 0) {
        const Col *c = &self->cols[self->done];
        if (truth >= 0)
            terminal = truth;
        else
            for (npy_intp j = 0; j < n && !terminal; j++)
                terminal = truth_of(c, src[self->done] + j * c->row_bytes);
    }
    char *mm = (char *)self->mm.buf;
    /* Numbered in the buffer's publish order before the counts publish the rows.  Rate
     * limited, the numbers are reserved by the gate's CAS; if another writer took the
     * room since the check above, nothing is published (the rows written stay
     * unpublished) and the Python path waits and writes them again. */
    uint64_t t;
    if (self->rate) {
        int64_t got = rate_take_insert(mm, self->rate, (uint64_t)n);
        if (got < 0)
            return PyLong_FromLong(-1);
        t = (uint64_t)got;
    } else {
        t = atomic_fetch_add_explicit((atomic_u64 *)(mm + self->clock_off), (uint64_t)n,
                                      memory_order_relaxed);
    }
    for (npy_intp j = 0; j < n; j++) {
        ((int64_t *)self->ep_col)[self->base[j] + self->fill[j]] = self->ep[j];
        ((int64_t *)self->t_col)[self->base[j] + self->fill[j]] = (int64_t)(t + (uint64_t)j);
    }
    /* Counted before published: steps_written is never behind what readers see. */
    atomic_u64 *steps = (atomic_u64 *)(mm + self->steps_off);
    atomic_store_explicit(steps, atomic_load_explicit(steps, memory_order_relaxed)
                          + (uint64_t)n, memory_order_release);
    if (!batch) {
        self->fill[0] += 1;
        atomic_store_explicit((atomic_u64 *)(mm + self->count_off[0]), (uint64_t)self->fill[0],
                              memory_order_release);
    } else {
        *self->left -= 1;
        atomic_thread_fence(memory_order_release);
        for (npy_intp j = 0; j < n; j++) {
            self->fill[j] += 1;
            atomic_store_explicit((atomic_u64 *)(mm + self->count_off[j]),
                                  (uint64_t)self->fill[j], memory_order_relaxed);
        }
    }
    return PyLong_FromLong(terminal);
}

static PyObject *
appender_add(Appender *self, PyObject *columns)
{
    return append(self, columns, 0);
}

static PyObject *
appender_add_batch(Appender *self, PyObject *columns)
{
    return append(self, columns, 1);
}

/*
 * stream_copy(dst, src): copy the bytes of src into dst (equal sizes, both
 * C-contiguous), streaming rows of STREAM_MIN bytes or more, then
 * stream_fence(): the copy is ordered before any later store, so a run
 * copied with it can be published by a release store (Writer.extend).
 */
PyObject *
stream_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len || !PyBuffer_IsContiguous(&dst, 'C')
        || !PyBuffer_IsContiguous(&src, 'C')) {
        PyErr_SetString(PyExc_ValueError, "stream_copy: dst and src must be contiguous and "
                        "of one size");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    if (copy_row((char *)dst.buf, (const char *)src.buf, (size_t)dst.len))
        stream_fence();
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef appender_methods[] = {
    {"add", (PyCFunction)appender_add, METH_O,
     "add(columns) -> -1 (take the Python path; nothing written), 0, or 1 (terminal): "
     "one step of stream 0."},
    {"add_batch", (PyCFunction)appender_add_batch, METH_O,
     "add_batch(columns) -> -1, 0, or 1 (some row terminal): one step of every stream."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject AppenderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmbuf.protocol._atomic.Appender",
    .tp_basicsize = sizeof(Appender),
    .tp_dealloc = (destructor)appender_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The writer's fast path: see appender.c.",
    .tp_methods = appender_methods,
    .tp_new = appender_new,
};

